"""``stream``: the M == 1 GEMV (decode), weight streaming on the integer units.

The activation pre-pass (:func:`~.activation.quantize_row_packed`) writes the int8 codes once; read
as int32 words they are the ``dp4a`` partners of the packed weight words (a bit-plane's 4 codes of a
word are 4 consecutive k). The GEMV owns BLOCK_N rows and (a split of) K, streams BLOCK_C 32-byte
chunks per row and step with 16-byte loads, prefetching the next step's tile; one ``dp4a`` per plane
and word, one fp32 rescale per (row, group). On sm_90+ the two kernels are chained by programmatic
dependent launch (``PDL``): the GEMV issues its first weight tile, then waits for the pre-pass.
8-bit codes: the one plane's words XOR 0x80808080 are the signed levels ``c - 128``, whose ``dp4a``
is u itself (no zero term); a group of 64/128 is summed in int32 over its chunks of a step (BLOCK_C
at least the group's chunks), one group per row over the program's whole K range, converted once.
4-bit codes (two planes, a 64-k chunk): ``int4``'s plane moved to the bytes' high nibbles with the
sign bit flipped is ``16 * (c - 8)`` as int8, so the ``dp4a`` sum shifted right by 4 is u; ``affine4``
takes the raw codes and ``u = dot - z * (group sum of the int8 activations)`` per group; groups of
128 and whole rows as for 8 bits (the activation sums carried alike).

Config: ``BLOCK_N``, ``SPLIT_K``, ``num_warps``, ``num_stages`` (the GEMV path's fields), ``BLOCK_C``
(default 8), ``PDL`` (0/1, default 0), ``FULLX`` (0/1: activation words loaded in the weights' own
[BLOCK_N, BLOCK_C, 8] layout instead of one tile broadcast over the rows), ``XPACK`` (1 if given: the
pre-pass is the only mode; the fused-quantization variant was removed, see docs/triton.md), ``RB`` (row
blocks per program, default 1; > 1: ``_stream_rows_kernel``, activations stationary, BLOCK_C set to cover
the split's chunks in one step).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from aipc_kernels.lowbit.formats import get_codebook
from aipc_kernels.lowbit.packing import PackedLowBit, triton_chunk
from aipc_kernels.gpu.triton.lowbit.activation import quantize_row_packed
from aipc_kernels.gpu.triton.lowbit.common import k_splits, pick, sm_count, split_plan, store_or_reduce
from aipc_kernels.gpu.triton.lowbit.interpret import INTERPRETED, pdl_ok

NAME = "stream"
#: the weight forms it takes (registry.takes): single-level scales, and the progressive two-level form (int8
#: group scales and mins like 16-bit ones, times the row's ``s0`` at the end)
FORMS = ("single", "progressive")
# the tuning space: every tile whose step holds 1-64 int32 words per thread, split-K only with >= 16 rows
SPACE = [
    {"KERNEL": NAME, "BLOCK_N": bn, "SPLIT_K": sk, "num_warps": nw, "num_stages": 1, "BLOCK_C": bc, "XPACK": 1, "PDL": 1}
    for bn in (8, 16, 32)
    for sk in (1, 2, 4)
    for bc in (4, 8, 16, 32)
    for nw in (2, 4, 8)
    if 32 * nw <= bn * bc * 8 <= 64 * 32 * nw and (sk == 1 or bn >= 16)
]
# activations stationary (``RB`` row blocks per program, its whole K range in one step)
SPACE += [
    {"KERNEL": NAME, "BLOCK_N": bn, "SPLIT_K": sk, "num_warps": nw, "num_stages": 1, "RB": rb, "XPACK": 1, "PDL": 1}
    for bn in (8, 16)
    for sk in (1, 2, 4)
    for rb in (2, 4, 8)
    for nw in (4, 8)
]


@triton.jit
def _dp4a(a, b, c, HW: tl.constexpr):
    """c + sum of the 4 signed byte products of int32 words a and b: one ``dp4a`` on NVIDIA
    (``HW``), a shift/multiply emulation elsewhere (the interpreter, XPU)."""
    if HW:
        return tl.inline_asm_elementwise(
            "dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32, is_pure=True, pack=1
        )
    else:
        r = c
        for i in tl.static_range(4):
            r += ((a << (24 - 8 * i)) >> 24) * ((b << (24 - 8 * i)) >> 24)
        return r


@triton.jit
def _plane_words(wv, q: tl.constexpr, BITS: tl.constexpr, PMASK: tl.constexpr, FLIP: tl.constexpr, SIGNED: tl.constexpr):
    """Bit-plane ``q`` of the packed words ``wv``, 4 codes per word; 8 bits: the signed levels
    ``c - 128``; 4 bits ``SIGNED``: ``16 * (c - 8)`` (the plane in the high nibbles, sign bit flipped)."""
    if BITS == 8:
        return wv ^ FLIP
    elif BITS == 4 and SIGNED:  # no branch on q: Triton 3.6 passes it as a run-time i32 (returns in an if fail to lower)
        return ((wv << (4 - 4 * q)) & -0x0F0F0F10) ^ FLIP  # -0x0F0F0F10: 0xF0F0F0F0 as int32
    else:
        return (wv >> (BITS * q)) & PMASK


@triton.jit
def _group_term(dot, gx, g, gmask, offs_n, s_ptr, z_ptr, N, CMUL: tl.constexpr, ZERO: tl.constexpr,
                HAS_ZEROS: tl.constexpr, SIGNED: tl.constexpr, MINS: tl.constexpr = False):
    """One group's fp32 contribution ``s * (cmul * dot - z * xsum)`` to the rows ``offs_n``: ``dot``
    [rows, groups] (fp32 of the exact int32 dots), ``gx`` [groups] the int8 activation sums, ``g`` the
    groups' indices into the [K/G, N] scales (and zeros; a fixed ``ZERO`` otherwise, none for signed codes).
    ``MINS`` (the min form): ``z_ptr`` holds the mins, ``+ m * xsum``."""
    sc = tl.load(s_ptr + g[None, :] * N + offs_n[:, None], mask=gmask, other=0.0).to(tl.float32)
    if MINS:
        mn = tl.load(z_ptr + g[None, :] * N + offs_n[:, None], mask=gmask, other=0.0).to(tl.float32)
        if SIGNED:
            return sc * (CMUL * dot) + mn * gx[None, :]
        else:
            return sc * (CMUL * dot - ZERO * gx[None, :]) + mn * gx[None, :]
    elif HAS_ZEROS:
        zp = tl.load(z_ptr + g[None, :] * N + offs_n[:, None], mask=gmask, other=0.0).to(tl.float32)
        return sc * (CMUL * dot - zp * gx[None, :])
    elif SIGNED:
        return sc * (CMUL * dot)
    else:
        return sc * (CMUL * dot - ZERO * gx[None, :])


@triton.jit
def _half_dots(d, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
    """Groups of 16: the int32 dots [BLOCK_N, BLOCK_C, 8 words] of one plane summed per half (4 words, 16
    k) -> [BLOCK_N, 2 * BLOCK_C], chunk-major."""
    return tl.reshape(tl.sum(tl.reshape(d, [BLOCK_N, BLOCK_C, 2, 4]), axis=3), [BLOCK_N, 2 * BLOCK_C])


@triton.jit
def _half_sums(xw, BLOCK_C: tl.constexpr, HW: tl.constexpr):
    """Groups of 16: the int8 activation sums of the words ``xw`` [BLOCK_C, 8] (a ``dp4a`` with ones)
    per half of the plane -> fp32 [2 * BLOCK_C], chunk-major."""
    s = _dp4a(xw, tl.full([BLOCK_C, 8], 0x01010101, tl.int32), tl.zeros([BLOCK_C, 8], tl.int32), HW)
    return tl.reshape(tl.sum(tl.reshape(s, [BLOCK_C, 2, 4]), axis=2), [2 * BLOCK_C]).to(tl.float32)


@triton.jit
def _stream_kernel(
    xw_ptr, xs_ptr, sx_ptr, w_ptr, s_ptr, z_ptr, s0_ptr, b_ptr, y_ptr, ws_ptr, lock_ptr,
    N, NG, KW, CHUNKS_PER_SPLIT,
    BITS: tl.constexpr, CMUL: tl.constexpr, ZERO: tl.constexpr, G: tl.constexpr, WHOLE_ROW: tl.constexpr,
    HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr, HW_DP4A: tl.constexpr, PDL: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, SPLIT_K: tl.constexpr, FULLX: tl.constexpr,
    MINS: tl.constexpr = False, ROW_SCALE: tl.constexpr = False,
):
    """Each program owns BLOCK_N rows and (a split of) K; per step it holds [BLOCK_N, BLOCK_C chunks,
    8 words] of packed codes (16-byte loads) and prefetches the next step's tile before using this
    one, the first tile before waiting for the pre-pass (``PDL``), so the weight stream never waits on
    the activations. A plane's 4 codes of a word meet the 4 int8 activations of the same k, read as
    one int32 word of ``xw`` (``xs``: their 32-k sums, ``sx``: the scale), in one ``dp4a`` (exact int32).
    8 bits and ``int4`` (``SIGNED``: signed levels, no zero term; ``int4``'s dot is 16 u), 4 and 8 bits:
    ``CPG`` chunks per group, BLOCK_C a multiple of it and every split's start a group's (the host
    sees to both); one group per row (``ROW_DOT``): int32 (and the activation sums) over the whole range.
    ``MINS``: the min form (``z`` the mins, ``+ m * xsum`` per group); ``G == 16`` (``HALF``): each plane's
    dots and activation sums split in halves of 4 words, one rescale each."""
    P: tl.constexpr = 8 // BITS
    KC: tl.constexpr = 32 * P
    HALF: tl.constexpr = G == 16 and not WHOLE_ROW
    GE: tl.constexpr = KC if WHOLE_ROW else (32 if HALF else (G if G < KC else KC))
    GPC: tl.constexpr = KC // GE
    PPG: tl.constexpr = P // GPC
    MASK: tl.constexpr = (1 << BITS) - 1
    PMASK: tl.constexpr = MASK | (MASK << 8) | (MASK << 16) | (MASK << 24)
    SIGNED: tl.constexpr = BITS == 8 or (BITS == 4 and not HAS_ZEROS and not MINS)
    SHIFT: tl.constexpr = 4 if BITS == 4 and SIGNED else 0  # int4: the dp4a sums are 16 u
    FLIP: tl.constexpr = -0x7F7F7F80  # 0x80808080 as int32: each byte's c ^ 0x80 is c - 128 as int8
    ROW_DOT: tl.constexpr = WHOLE_ROW and BITS >= 4
    NEED_XS: tl.constexpr = (not SIGNED or MINS) and not HALF  # the pre-pass's 32-k sums are read
    ZT: tl.constexpr = HAS_ZEROS or MINS
    CPG: tl.constexpr = G // KC if not WHOLE_ROW and G > KC else 1
    AW: tl.constexpr = 2 * BLOCK_C if HALF else BLOCK_C // CPG  # the accumulator's group columns
    tl.static_assert(BLOCK_C % CPG == 0 and (not SIGNED or not HAS_ZEROS) and not (MINS and HAS_ZEROS))
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    oc = tl.arange(0, BLOCK_C)
    ow = tl.arange(0, 8)
    c_begin = pid_k * CHUNKS_PER_SPLIT
    c_end = tl.minimum(c_begin + CHUNKS_PER_SPLIT, KW // 8)
    w_rows = w_ptr + offs_n[:, None, None].to(tl.int64) * KW + ow[None, None, :]
    c = c_begin + oc
    wv = tl.load(w_rows + c[None, :, None] * 8, mask=n_mask[:, None, None] & (c < c_end)[None, :, None], other=0)
    if PDL:
        tl.extra.cuda.gdc_wait()
    sx = tl.load(sx_ptr)

    acc = tl.zeros([BLOCK_N, AW], dtype=tl.float32)
    dacc = tl.zeros([BLOCK_N, BLOCK_C], dtype=tl.int32)  # ROW_DOT
    xacc = tl.zeros([BLOCK_C], dtype=tl.float32)  # ROW_DOT with zeros: the activation sums
    og = tl.arange(0, BLOCK_C // CPG)
    for c0 in range(c_begin, c_end, BLOCK_C):
        c = c0 + oc
        c_mask = c < c_end
        cn = c + BLOCK_C
        wn = tl.load(w_rows + cn[None, :, None] * 8, mask=n_mask[:, None, None] & (cn < c_end)[None, :, None], other=0)
        for gi in tl.static_range(GPC):
            d = tl.zeros([BLOCK_N, BLOCK_C, 8], dtype=tl.int32)
            xs = tl.zeros([BLOCK_C, 8], dtype=tl.float32)
            for qq in tl.static_range(PPG):
                q = gi * PPG + qq
                # statement order as measured (bench/results/gpu/gemv_gpu.md): the activation loads are issued
                # before the code shift; moving the shift first cost 7% on 4096x4096 at M=1 on the H200
                if FULLX:  # activation words loaded as [BLOCK_N, BLOCK_C, 8] like the weights: no layout conversion
                    xoff = (c * P + q)[None, :, None] * 8 + ow[None, None, :] + (offs_n * 0)[:, None, None]
                    xwf = tl.load(xw_ptr + xoff, mask=c_mask[None, :, None], other=0)
                    d = _dp4a(_plane_words(wv, q, BITS, PMASK, FLIP, SIGNED), xwf, d, HW_DP4A)
                    if NEED_XS:
                        xs += tl.load(xs_ptr + c * P + q, mask=c_mask, other=0).to(tl.float32)[:, None] * (ow == 0)[None, :]
                else:
                    xw = tl.load(xw_ptr + (c * P + q)[:, None] * 8 + ow[None, :], mask=c_mask[:, None], other=0)
                    if NEED_XS:
                        xs += tl.load(xs_ptr + c * P + q, mask=c_mask, other=0).to(tl.float32)[:, None] * (ow == 0)[None, :]
                    d = _dp4a(_plane_words(wv, q, BITS, PMASK, FLIP, SIGNED), xw[None, :, :], d, HW_DP4A)
            if ROW_DOT:
                if SHIFT:
                    dacc += tl.sum(d, axis=2) >> SHIFT
                else:
                    dacc += tl.sum(d, axis=2)
                if ZT:
                    xacc += tl.sum(xs, axis=1)
            elif HALF:  # groups of 16 (PPG == 1, q == gi): two rescales per plane
                dot = _half_dots(d, BLOCK_N, BLOCK_C)
                if SHIFT:
                    dot = dot >> SHIFT
                dot = dot.to(tl.float32)
                if ZT or not SIGNED:
                    gx = _half_sums(tl.load(xw_ptr + (c * P + gi)[:, None] * 8 + ow[None, :], mask=c_mask[:, None], other=0),
                                    BLOCK_C, HW_DP4A)
                else:
                    gx = tl.zeros([2 * BLOCK_C], dtype=tl.float32)
                g = tl.reshape((c * (KC // 16) + 2 * gi)[:, None] + tl.arange(0, 2)[None, :], [2 * BLOCK_C])
                c2 = tl.reshape(c[:, None] + tl.zeros([BLOCK_C, 2], tl.int32), [2 * BLOCK_C])
                gmask = n_mask[:, None] & ((c2 < c_end) & (g < NG))[None, :]
                acc += _group_term(dot, gx, g, gmask, offs_n, s_ptr, z_ptr, N, CMUL, ZERO, HAS_ZEROS, SIGNED, MINS)
            else:
                dot = tl.sum(d, axis=2)  # [BLOCK_N, BLOCK_C] int32
                if SHIFT:
                    dot = dot >> SHIFT
                gc = c
                if CPG > 1:  # a group's CPG chunks side by side: their int32 sum, then one rescale
                    dot = tl.sum(tl.reshape(dot, [BLOCK_N, BLOCK_C // CPG, CPG]), axis=2)
                    gc = c0 + og * CPG
                dot = dot.to(tl.float32)
                gx = tl.sum(xs, axis=1)  # [BLOCK_C]
                if CPG > 1 and ZT:  # and the activation sums of its chunks
                    gx = tl.sum(tl.reshape(gx, [BLOCK_C // CPG, CPG]), axis=1)
                if WHOLE_ROW:
                    g = gc * 0
                else:
                    g = (gc * KC + gi * GE) // G
                gmask = n_mask[:, None] & ((gc < c_end) & (g < NG))[None, :]
                acc += _group_term(dot, gx, g, gmask, offs_n, s_ptr, z_ptr, N, CMUL, ZERO, HAS_ZEROS, SIGNED, MINS)
        wv = wn
    if ROW_DOT:  # the exact int32 dot of the whole range (|dot| < 2**31), converted once
        sc_row = tl.load(s_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        u = tl.sum(dacc, axis=1).to(tl.float32)
        if HAS_ZEROS:  # affine4: u = dot - z * (the range's int8 activation sum)
            u = u - tl.load(z_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32) * tl.sum(xacc, axis=0)
        if MINS:  # the min form: + m * (the range's int8 activation sum)
            xr = tl.sum(xacc, axis=0)
            if not SIGNED:
                u = u - ZERO * xr
            res = (u * CMUL * sc_row + tl.load(z_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32) * xr) * sx
        else:
            res = u * CMUL * sc_row * sx
    else:
        res = tl.sum(acc, axis=1) * sx
    if ROW_SCALE:  # the progressive form: int8 group scales and mins, one float scale per row
        res = res * tl.load(s0_ptr + offs_n, mask=n_mask, other=0.0)
    bias = tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32) if HAS_BIAS else 0.0
    store_or_reduce(res, bias, y_ptr, ws_ptr, lock_ptr, offs_n, n_mask, N, pid_k, pid_n, SPLIT_K, HAS_BIAS)


@triton.jit
def _stream_rows_kernel(
    xw_ptr, xs_ptr, sx_ptr, w_ptr, s_ptr, z_ptr, s0_ptr, b_ptr, y_ptr, ws_ptr, lock_ptr,
    N, NG, KW, CHUNKS_PER_SPLIT,
    BITS: tl.constexpr, CMUL: tl.constexpr, ZERO: tl.constexpr, G: tl.constexpr, WHOLE_ROW: tl.constexpr,
    HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr, HW_DP4A: tl.constexpr, PDL: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, SPLIT_K: tl.constexpr, RB: tl.constexpr,
    MINS: tl.constexpr = False, ROW_SCALE: tl.constexpr = False,
):
    """``RB`` > 1: the GEMV with the activations stationary. A program owns RB blocks of BLOCK_N rows
    and one K range (a split), all of it in one step (BLOCK_C chunks cover it): the activation words of
    every plane (and their 32-k sums) are loaded once, in the weights' own [BLOCK_N, BLOCK_C, 8] layout,
    and stay in registers while the program walks its row blocks, each block's weights loaded while the
    one before is computed (the first before the PDL wait). Per block the same math as ``_stream_kernel``
    (one ``dp4a`` per plane and word, one rescale per row and group) and its own store or split-K
    reduction. 1-4 planes (2-8 bits) with groups of 32 to a chunk or whole rows of 2-bit codes (``MINS``: the min
    form; no groups of 16: the host refuses them)."""
    P: tl.constexpr = 8 // BITS
    KC: tl.constexpr = 32 * P
    GE: tl.constexpr = KC if WHOLE_ROW else (G if G < KC else KC)
    GPC: tl.constexpr = KC // GE
    PPG: tl.constexpr = P // GPC
    MASK: tl.constexpr = (1 << BITS) - 1
    PMASK: tl.constexpr = MASK | (MASK << 8) | (MASK << 16) | (MASK << 24)
    SIGNED: tl.constexpr = BITS == 8 or (BITS == 4 and not HAS_ZEROS and not MINS)
    SHIFT: tl.constexpr = 4 if BITS == 4 and SIGNED else 0
    FLIP: tl.constexpr = -0x7F7F7F80
    NEED_XS: tl.constexpr = not SIGNED or MINS
    tl.static_assert(P <= 4 and (G <= KC or WHOLE_ROW) and not (WHOLE_ROW and BITS >= 4) and (G >= 32 or WHOLE_ROW))
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    orow = tl.arange(0, BLOCK_N)
    oc = tl.arange(0, BLOCK_C)
    ow = tl.arange(0, 8)
    c_begin = pid_k * CHUNKS_PER_SPLIT
    c_end = tl.minimum(c_begin + CHUNKS_PER_SPLIT, KW // 8)
    c = c_begin + oc
    c_mask = c < c_end
    words = c[None, :, None] * 8 + ow[None, None, :]
    offs_n = pid_n * RB * BLOCK_N + orow
    wv = tl.load(w_ptr + offs_n[:, None, None].to(tl.int64) * KW + words, mask=(offs_n < N)[:, None, None] & c_mask[None, :, None], other=0)
    if PDL:
        tl.extra.cuda.gdc_wait()
    sx = tl.load(sx_ptr)
    xoff = c[None, :, None] * (P * 8) + ow[None, None, :] + (orow * 0)[:, None, None]
    xm = c_mask[None, :, None]
    x0 = tl.load(xw_ptr + xoff, mask=xm, other=0)
    x1 = tl.load(xw_ptr + xoff + 8, mask=xm, other=0) if P > 1 else x0
    x2 = tl.load(xw_ptr + xoff + 16, mask=xm, other=0) if P > 2 else x0
    x3 = tl.load(xw_ptr + xoff + 24, mask=xm, other=0) if P > 3 else x0
    s0 = tl.load(xs_ptr + c * P, mask=c_mask, other=0).to(tl.float32)
    s1 = tl.load(xs_ptr + c * P + 1, mask=c_mask, other=0).to(tl.float32) if P > 1 else s0
    s2 = tl.load(xs_ptr + c * P + 2, mask=c_mask, other=0).to(tl.float32) if P > 2 else s0
    s3 = tl.load(xs_ptr + c * P + 3, mask=c_mask, other=0).to(tl.float32) if P > 3 else s0
    for rb in range(RB):
        tile = pid_n * RB + rb
        offs_n = tile * BLOCK_N + orow
        n_mask = offs_n < N
        nn = offs_n + BLOCK_N
        wn = tl.load(w_ptr + nn[:, None, None].to(tl.int64) * KW + words,
                     mask=((nn < N) & (rb + 1 < RB))[:, None, None] & c_mask[None, :, None], other=0)
        acc = tl.zeros([BLOCK_N, BLOCK_C], dtype=tl.float32)
        for gi in tl.static_range(GPC):
            d = tl.zeros([BLOCK_N, BLOCK_C, 8], dtype=tl.int32)
            xs = tl.zeros([BLOCK_C], dtype=tl.float32)
            for qq in tl.static_range(PPG):
                d = _dp4a(_plane_words(wv, gi * PPG + qq, BITS, PMASK, FLIP, SIGNED), pick(gi * PPG + qq, x0, x1, x2, x3), d, HW_DP4A)
                if NEED_XS:
                    xs += pick(gi * PPG + qq, s0, s1, s2, s3)
            dot = tl.sum(d, axis=2)
            if SHIFT:
                dot = dot >> SHIFT
            dot = dot.to(tl.float32)
            if WHOLE_ROW:
                g = c * 0
            else:
                g = (c * KC + gi * GE) // G
            gmask = n_mask[:, None] & (c_mask & (g < NG))[None, :]
            acc += _group_term(dot, xs, g, gmask, offs_n, s_ptr, z_ptr, N, CMUL, ZERO, HAS_ZEROS, SIGNED, MINS)
        res = tl.sum(acc, axis=1) * sx
        if ROW_SCALE:
            res = res * tl.load(s0_ptr + offs_n, mask=n_mask, other=0.0)
        bias = tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32) if HAS_BIAS else 0.0
        store_or_reduce(res, bias, y_ptr, ws_ptr, lock_ptr, offs_n, n_mask, N, pid_k, tile, SPLIT_K, HAS_BIAS)
        wv = wn


def space(M: int) -> list[dict]:
    """The configs the tuner times for ``M`` tokens (M == 1 only)."""
    return list(SPACE) if M == 1 else []


def heuristic(M: int, N: int, K: int, bits: int, device: torch.device) -> dict:
    """The untuned M == 1 default (the H200 winners: 8 rows, wide K tiles), split over K (at most 4)
    while fewer than two programs per SM would run."""
    chunks = -(-K // triton_chunk(bits))
    bn, bc = 8, min(32, 1 << (max(1, chunks).bit_length() - 1))  # a power of two (tl.arange), at most the chunks
    split = k_splits(-(-N // bn), chunks // bc, 4, 2 * sm_count(device))  # every split keeps two steps of bc chunks
    return {"KERNEL": NAME, "XPACK": 1, "PDL": 1, "BLOCK_N": bn, "BLOCK_C": bc, "SPLIT_K": split, "num_warps": 4, "num_stages": 1}


def check(x2: torch.Tensor, weight: PackedLowBit, cfg: dict) -> None:
    """A ValueError naming the fix when this kernel cannot run ``weight`` with ``cfg``: ``RB`` > 1
    (activations stationary) takes 2-8 bit codes with groups of 32 to a chunk (or whole rows of 2-bit codes),
    not wider groups nor GGUF's 16-element ones."""
    cb = get_codebook(weight.codebook)
    K, G, chunk = x2.shape[1], weight.group_size, triton_chunk(cb.bits)
    whole = G == K
    if cfg.get("RB", 1) > 1 and (cb.bits == 1 or (not whole and (G > chunk or G < 32)) or (whole and cb.bits >= 4)):
        raise ValueError(f"config {cfg}: RB > 1 (activations stationary) takes 2-8 bit codes with groups of 32 to a "
                         f"{chunk}-k chunk (or whole rows of 2-bit codes); drop RB for {cb.bits}-bit codes, group {G}")


def launch(x2: torch.Tensor, weight: PackedLowBit, bias: Optional[torch.Tensor], y: torch.Tensor, cfg: dict,
           act_amax: Optional[torch.Tensor] = None) -> None:  # fmt: skip
    """The pre-pass (absmax from ``act_amax`` when given) and the GEMV for ``x2 [1, K]``, writing ``y [1, N]``."""
    M, K = x2.shape
    if M != 1:
        raise ValueError(f"config {cfg}: the stream GEMV kernel takes M == 1 only (M={M})")
    if not cfg.get("XPACK", 1):
        raise ValueError(f"config {cfg}: XPACK=0 (quantization fused into the stream GEMV) was removed; drop XPACK")
    N = weight.out_features
    cb = get_codebook(weight.codebook)
    Kp = weight.qweight.shape[1] * (8 // cb.bits)
    bn = cfg["BLOCK_N"]
    tiles = triton.cdiv(N, bn)
    whole, chunk = weight.group_size == K, triton_chunk(cb.bits)
    cpg = weight.group_size // chunk if not whole and weight.group_size > chunk else 1  # 8 bits: chunks per group
    split, per_split, ws, locks, _ = split_plan(Kp // chunk // cpg, cfg["SPLIT_K"], tiles, M, N, y)
    pdl = bool(cfg.get("PDL", 0)) and pdl_ok(x2.device)
    check(x2, weight, cfg)
    rb = cfg.get("RB", 1)
    xq, xs, sx = quantize_row_packed(x2, Kp, pdl, act_amax)
    args = dict(
        xw_ptr=xq.view(torch.int32), xs_ptr=xs, sx_ptr=sx, w_ptr=weight.qweight.view(torch.int32),
        s_ptr=weight.scales, z_ptr=weight.scales if weight.zeros is None else weight.zeros,
        s0_ptr=weight.scales if weight.supers is None else weight.supers, b_ptr=weight.scales if bias is None else bias, y_ptr=y, ws_ptr=ws, lock_ptr=locks,
        N=N, NG=weight.scales.shape[0], KW=weight.qweight.shape[1] // 4, CHUNKS_PER_SPLIT=per_split * cpg,
        BITS=cb.bits, CMUL=float(cb.cmul), ZERO=float(cb.zero or 0.0), G=K if whole else weight.group_size,
        WHOLE_ROW=whole, HAS_ZEROS=weight.zeros is not None and not cb.mins, HAS_BIAS=bias is not None,
        HW_DP4A=x2.device.type == "cuda" and not INTERPRETED, PDL=pdl, BLOCK_N=bn, SPLIT_K=split,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **({"MINS": True} if cb.mins else {}),
        **({"ROW_SCALE": True} if weight.supers is not None else {}), **({"launch_pdl": True} if pdl else {}),
    )  # fmt: skip
    if rb > 1:  # one step covers the split's chunks
        _stream_rows_kernel[(triton.cdiv(tiles, rb), split)](BLOCK_C=triton.next_power_of_2(per_split * cpg), RB=rb, **args)
    else:
        _stream_kernel[(tiles, split)](BLOCK_C=max(cfg.get("BLOCK_C", 8), cpg), FULLX=bool(cfg.get("FULLX", 0)), **args)
