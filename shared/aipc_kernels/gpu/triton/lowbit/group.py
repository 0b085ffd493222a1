"""``group``: the int8 matrix-unit kernel for M > 1 (and every M in the batch-invariant mode).

The activation pass (:func:`~.activation.quantize_rows`) writes int8 codes and per-token scales
(32-k sums only for affine code books). Per 32-byte weight chunk: one [BLOCK_N, 32] byte load, each
bit-plane unpacked in registers to the int8 operand ``CA * c - CB`` (the fixed zero point folded in;
four codes per 32-bit register through inline PTX on CUDA), one K=32 ``tl.dot`` per plane chained in
int32 over the group, then one fp32 rescale per group; the int32 -> fp32 conversion is a subtract
(the accumulator starts at the bits of 1.5 * 2**23). At M <= 16 (BLOCK_M 16 token columns) the K
range is split over ``SPLIT_K`` programs per tile (too few output tiles to fill the GPU). 8-bit codes
(one plane: the operand is the byte XOR 0x80, ``c - 128``) and 4-bit codes (two planes, a 64-k chunk:
``int4``'s operand is ``c - 8``, ``affine4``'s the raw code): a group wider than a chunk (8 bits:
64/128, 4 bits: 128) spans several chunks and its int32 dot is carried over them; one group per row
is one int32 dot over the whole K range (past 2**22, converted by an exact I2F), so u is the exact
integer of the native kernels (``affine4``: ``u = dot - z * (group sum of the int8 activations)``
in fp32 before the scale, exact for integer zeros like the native float epilogue).

Config: ``BLOCK_N``, ``num_warps``, ``num_stages`` and the path's fields (M > 16: ``BLOCK_M``, ``SPLIT_K``
optional; M <= 16: ``SPLIT_K``, BLOCK_M defaulting to 16), ``WA`` (0/1: weights as the dot's A operand), ``GROUP_M``
(default 8: tiles of GROUP_M row blocks share their weight columns in L2), ``ATOMIC`` (0/1: split-K
partials added by fp32 atomics instead of a workspace; see :func:`~.common.split_plan`), ``PDL`` (0/1,
default 0: on sm_90+ the kernel launches as a programmatic dependent of the activation pass, its launch
and first scale loads overlapping the pass; an A/B on an H100 measured 0.93-1.08x the time without it
on the 8B shapes at M=16/64, bench/results/gpu/triton_pdl_ab_h100.md: the H100 configs, tuned and
benchmarked with it, keep it).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from aipc_kernels.lowbit.formats import get_codebook
from aipc_kernels.lowbit.packing import PackedLowBit, triton_chunk
from aipc_kernels.gpu.triton.lowbit.activation import quantize_rows
from aipc_kernels.gpu.triton.lowbit.common import GEMV_MAX_M, k_splits, path, sm_count, split_plan, store_or_reduce
from aipc_kernels.gpu.triton.lowbit.interpret import INTERPRETED, pdl_ok

NAME = "group"
FORMS = ("single", "progressive")  # registry.takes: the progressive form's int8 scales and mins too, times s0
# M > 16: (BLOCK_N, BLOCK_M, num_warps, num_stages, WA)
_GEMM_TILES = [(128, 64, 4, 3, 1), (128, 64, 4, 4, 1), (64, 128, 4, 3, 1), (256, 64, 8, 3, 1), (128, 128, 8, 3, 1),
               (128, 64, 8, 3, 1), (128, 64, 4, 3, 0)]
GEMM_SPACE = [
    {"BLOCK_N": bn, "BLOCK_M": bm, "num_warps": nw, "num_stages": ns, "KERNEL": NAME, "WA": wa} for bn, bm, nw, ns, wa in _GEMM_TILES
]
# 16 < M <= SPLIT_GEMM_MAX_M: GEMM tiles split over K too (1B qkv/o at M=64 has 16 output tiles of 128 x 64)
SPLIT_GEMM_MAX_M = 512
GEMM_SPLIT_SPACE = [
    {"BLOCK_N": bn, "BLOCK_M": bm, "num_warps": 4, "num_stages": 3, "KERNEL": NAME, "WA": 1, "SPLIT_K": sk}
    for bn, bm in ((128, 64), (64, 64), (128, 32))
    for sk in (2, 4, 8)
]
# 1 < M <= 16: 16 token columns, split over K; the same tiles again with atomic split-K at ATOMIC_SPLITS
GEMV_SPACE = [
    {"KERNEL": NAME, "BLOCK_N": bn, "SPLIT_K": sk, "num_warps": nw, "num_stages": ns, "BLOCK_M": GEMV_MAX_M, "WA": 1}
    for bn in (32, 64, 128, 256)
    for sk in (2, 4, 8, 16)
    for nw, ns in ((2, 3), (4, 3), (8, 3), (4, 4))
    if (nw == 2 and bn <= 64) or (nw == 4 and 64 <= bn <= 128) or (nw == 8 and bn >= 128)
]
ATOMIC_SPLITS = (4, 8, 16, 32)


@triton.jit
def _plane_codes(wb, q: tl.constexpr, BITS: tl.constexpr, CA: tl.constexpr, CB: tl.constexpr, HW_ASM: tl.constexpr, ASM: tl.constexpr):
    """int8 weight operand of bit-plane ``q`` of the bytes ``wb``: ``CA * c - CB`` (an integer form of
    the code book's ``cmul * c - zero``). With ``HW_ASM`` four codes per 32-bit register (shift, mask,
    byte-wise bias and sign flip: 3-4 instructions per 4 codes); else one code per element."""
    if HW_ASM:
        return tl.inline_asm_elementwise(ASM, "=r,r", [wb], dtype=tl.int8, is_pure=True, pack=4)
    else:
        return (((wb >> (BITS * q)) & ((1 << BITS) - 1)).to(tl.int32) * CA - CB).to(tl.int8)


@triton.jit
def _half_term(acc, dh, xt, hm, sc_cur, z_cur, og, gi, HAS_ZEROS: tl.constexpr,
               ZFIRST: tl.constexpr, MINS: tl.constexpr, WA: tl.constexpr):
    """``acc`` plus one 16-k group's term (groups of 16, two per plane): ``dh`` the int32 dot of the half
    ``hm`` (started at the magic 0x4B400000: its bits less 1.5 * 2**23 are the dot), ``xt`` the [BLOCK_M, 32] int8 activations (their
    half's sum: the zero or min term), ``gi`` the group's column in the chunk's scale (zero / min) tiles."""
    df = dh.to(tl.float32, bitcast=True) - 12582912.0
    sc = tl.sum(tl.where(og[None, :] == gi, sc_cur, 0.0), axis=1)
    if HAS_ZEROS or MINS:
        gxs = tl.sum(tl.where(hm[None, :], xt, 0).to(tl.int32), axis=1).to(tl.float32)
        zg = tl.sum(tl.where(og[None, :] == gi, z_cur, 0.0), axis=1)
        if ZFIRST:  # u = dot - z * sum, then the scale (4-bit stored zeros)
            if WA:
                return acc + (df - zg[:, None] * gxs[None, :]) * sc[:, None]
            else:
                return acc + (df - gxs[:, None] * zg[None, :]) * sc[None, :]
        elif HAS_ZEROS:  # s * dot - s * z * sum
            if WA:
                return acc + df * sc[:, None] - (sc * zg)[:, None] * gxs[None, :]
            else:
                return acc + df * sc[None, :] - gxs[:, None] * (sc * zg)[None, :]
        else:  # the min form: s * dot + m * sum
            if WA:
                return acc + df * sc[:, None] + zg[:, None] * gxs[None, :]
            else:
                return acc + df * sc[None, :] + gxs[:, None] * zg[None, :]
    elif WA:
        return acc + df * sc[:, None]
    else:
        return acc + df * sc[None, :]


@triton.jit
def _group_kernel(
    xq_ptr, sx_ptr, xsum_ptr, w_ptr, s_ptr, z_ptr, s0_ptr, b_ptr, y_ptr, ws_ptr, lock_ptr,
    M, N, Kp, NG, KB, CHUNKS_PER_SPLIT,
    BITS: tl.constexpr, CA: tl.constexpr, CB: tl.constexpr, FMUL: tl.constexpr, G: tl.constexpr,
    WHOLE_ROW: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr, WA: tl.constexpr, HW_ASM: tl.constexpr,
    ASM0: tl.constexpr, ASM1: tl.constexpr, ASM2: tl.constexpr, ASM3: tl.constexpr,
    ASM4: tl.constexpr, ASM5: tl.constexpr, ASM6: tl.constexpr, ASM7: tl.constexpr,
    SPLIT_K: tl.constexpr, ATOMIC: tl.constexpr, PDL: tl.constexpr, MINS: tl.constexpr = False,
    ROW_SCALE: tl.constexpr = False,
):
    """One [BLOCK_N, BLOCK_M] output tile (weights as the dot's A operand with ``WA``, else
    [BLOCK_M, BLOCK_N]): the int32 accumulator starts at 0x4B400000, so its bits read as fp32 are
    exactly 12582912 + dot (|dot| < 2**22) and each group's conversion is one fp32 subtract instead of
    a slow I2F. ``SPLIT_K``: program_id(1) takes CHUNKS_PER_SPLIT chunks (a whole number of groups),
    the partials reduced by the last program of the tile. The group scales (zeros, activation sums) of
    chunk c + 1 are loaded during chunk c. 4 and 8 bits: ``CPG`` chunks per group, the dot (and the
    activation sums, stored zeros) carried over them (``ROW_DOT``, one group per row: over the
    program's whole K range, from 0, converted once at the end); stored zeros of 4-bit codes are
    taken off the converted dot before the scale (``ZFIRST``, the native kernels' ``u``). ``PDL``: a
    programmatic dependent launch after the activation pass; nothing the pass writes (nor the split-K
    buffers) is touched before ``gdc_wait``. ``MINS`` (the min form, GGUF's Q4_1 / K-quants): ``z`` holds
    the mins, each group adds ``m * (its int8 activation sum)`` after the scaled dot (the reference's
    and the native kernels' term). ``G == 16`` (``HALF``, the K-quants' sub-blocks): each 32-k plane is
    two groups, two dots against the codes of one half each (the other half's operand zeroed), their
    activation sums taken from the loaded int8 tile. Neither changes the code of the other forms."""
    P: tl.constexpr = 8 // BITS
    KC: tl.constexpr = 32 * P
    HALF: tl.constexpr = G == 16 and not WHOLE_ROW  # two groups per plane
    RP: tl.constexpr = P if WHOLE_ROW or G >= KC else (1 if HALF else G // 32)  # planes per rescale (the whole row: per chunk)
    CPG: tl.constexpr = G // KC if not WHOLE_ROW and G > KC else 1  # chunks per group (8 bits: G // 32, 4 bits: G // 64)
    ROW_DOT: tl.constexpr = WHOLE_ROW and BITS >= 4
    ZFIRST: tl.constexpr = HAS_ZEROS and BITS == 4  # u = dot - z * group sum, then the scale
    XRUN: tl.constexpr = (ZFIRST or MINS) and (CPG > 1 or ROW_DOT)  # activation sums carried over chunks
    ZT: tl.constexpr = HAS_ZEROS or MINS  # a second per-group tensor (zero points or mins) at z_ptr
    XS: tl.constexpr = ZT and not HALF  # the activation pass's 32-k sums are read
    tl.static_assert(not HAS_ZEROS or ZFIRST or (CPG == 1 and not ROW_DOT))
    tl.static_assert(not (MINS and HAS_ZEROS))
    MAGIC: tl.constexpr = 0 if ROW_DOT else 0x4B400000
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    gsz = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % gsz
    pid_n = (pid % width) // gsz
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    rm = tl.where(m_mask, offs_m, 0)  # clamped rows: unmasked (vector) loads, results dropped at the store
    rn = tl.where(n_mask, offs_n, 0)
    j = tl.arange(0, 32)
    x_rows = xq_ptr + rm[:, None].to(tl.int64) * Kp + j[None, :]
    w_rows = w_ptr + rn[:, None].to(tl.int64) * KB + j[None, :]
    if WA:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        d0 = tl.full([BLOCK_N, BLOCK_M], MAGIC, tl.int32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        d0 = tl.full([BLOCK_M, BLOCK_N], MAGIC, tl.int32)
    NGC: tl.constexpr = 2 * P if HALF else P // RP  # rescales per chunk: [BLOCK_N, NGC] scale tiles, [BLOCK_M, P] sum tiles
    og = tl.arange(0, NGC)
    op = tl.arange(0, P)
    last_g = NG - 1
    s_tile = s_ptr + rn[:, None]
    z_tile = z_ptr + rn[:, None]
    xs_tile = xsum_ptr + rm[:, None] * (Kp // 32) + op[None, :]
    n_chunks = Kp // KC
    if SPLIT_K == 1:  # the whole K from 0: the loop the pipeliner saw before split-K existed
        c_begin = 0
        c_end = n_chunks
    else:
        c_begin = pid_k * CHUNKS_PER_SPLIT
        c_end = tl.minimum(c_begin + CHUNKS_PER_SPLIT, n_chunks)
    if WHOLE_ROW:
        sc_row = tl.load(s_ptr + rn).to(tl.float32) * FMUL
        if ZFIRST:
            z_row = tl.load(z_ptr + rn).to(tl.float32)
        elif HAS_ZEROS:
            zs_row = sc_row * tl.load(z_ptr + rn).to(tl.float32)
        if MINS:
            m_row = tl.load(z_ptr + rn).to(tl.float32)
    else:
        sc_nxt = tl.load(s_tile + tl.minimum(c_begin // CPG * NGC + og, last_g)[None, :] * N)
        if ZT:
            z_nxt = tl.load(z_tile + tl.minimum(c_begin // CPG * NGC + og, last_g)[None, :] * N)
    if PDL:  # launched before the activation pass ended: the weights' first scales above, then wait
        tl.extra.cuda.gdc_wait()
    if XS:
        xs_nxt = tl.load(xs_tile + c_begin * P)
    else:  # never read (HALF takes its sums from the int8 tile), but the compiler must see the name
        xs_cur = tl.zeros([BLOCK_M, P], dtype=tl.float32)
    d = d0
    gx_run = tl.zeros([BLOCK_M], dtype=tl.int32)  # XRUN: the int8 activation sum of the group (row) so far
    for c in range(c_begin, c_end):
        wb = tl.load(w_rows + c * 32)  # [BLOCK_N, 32] bytes, P planes
        cn = tl.minimum(c + 1, n_chunks - 1)
        if not WHOLE_ROW:
            sc_cur = sc_nxt.to(tl.float32) * FMUL
            sc_nxt = tl.load(s_tile + tl.minimum(cn // CPG * NGC + og, last_g)[None, :] * N)
            if ZT:
                z_cur = z_nxt.to(tl.float32)
                z_nxt = tl.load(z_tile + tl.minimum(cn // CPG * NGC + og, last_g)[None, :] * N)
        if XRUN:
            gx_run += tl.sum(xs_nxt, axis=1)
            xs_nxt = tl.load(xs_tile + cn * P)
        elif XS:
            xs_cur = xs_nxt.to(tl.float32)
            xs_nxt = tl.load(xs_tile + cn * P)
        if CPG == 1 and not ROW_DOT:
            d = d0
        for q in tl.static_range(P):
            if q == 0:
                code = _plane_codes(wb, 0, BITS, CA, CB, HW_ASM, ASM0)
            elif q == 1:
                code = _plane_codes(wb, 1, BITS, CA, CB, HW_ASM, ASM1)
            elif q == 2:
                code = _plane_codes(wb, 2, BITS, CA, CB, HW_ASM, ASM2)
            elif q == 3:
                code = _plane_codes(wb, 3, BITS, CA, CB, HW_ASM, ASM3)
            elif q == 4:
                code = _plane_codes(wb, 4, BITS, CA, CB, HW_ASM, ASM4)
            elif q == 5:
                code = _plane_codes(wb, 5, BITS, CA, CB, HW_ASM, ASM5)
            elif q == 6:
                code = _plane_codes(wb, 6, BITS, CA, CB, HW_ASM, ASM6)
            else:
                code = _plane_codes(wb, 7, BITS, CA, CB, HW_ASM, ASM7)
            xt = tl.load(x_rows + (c * KC + q * 32))  # [BLOCK_M, 32] int8
            if HALF:  # groups of 16: one dot, scale (and zero / min term) per half of the plane
                for h in tl.static_range(2):
                    hm = (j >= 16) if h == 1 else (j < 16)
                    ch = tl.where(hm[None, :], code, 0).to(tl.int8)
                    if WA:
                        dh = tl.dot(ch, tl.trans(xt), d0, out_dtype=tl.int32)
                    else:
                        dh = tl.dot(xt, tl.trans(ch), d0, out_dtype=tl.int32)
                    acc = _half_term(acc, dh, xt, hm, sc_cur, z_cur if ZT else sc_cur, og, q * 2 + h,
                                     HAS_ZEROS=HAS_ZEROS, ZFIRST=ZFIRST, MINS=MINS, WA=WA)
            elif WA:
                d = tl.dot(code, tl.trans(xt), d, out_dtype=tl.int32)
            else:
                d = tl.dot(xt, tl.trans(code), d, out_dtype=tl.int32)
            if HALF:
                flush = False
            elif CPG == 1:  # end of a group (whole row: of a chunk; ROW_DOT: after the loop)
                flush = (q + 1) % RP == 0 and not ROW_DOT
            else:
                flush = (c + 1) % CPG == 0  # the group's last chunk (8 bits)
            if flush:
                gi = q // RP
                df = d.to(tl.float32, bitcast=True) - 12582912.0  # exact: the int32 dot as fp32
                if WHOLE_ROW:
                    sc = sc_row
                else:
                    sc = tl.sum(tl.where(og[None, :] == gi, sc_cur, 0.0), axis=1)
                if ZFIRST:  # affine4: u = dot - z * (the group's int8 activation sum), exact for integer z
                    if XRUN:
                        gxs = gx_run.to(tl.float32)
                        gx_run = tl.zeros([BLOCK_M], dtype=tl.int32)
                    else:
                        gxs = tl.sum(tl.where((op[None, :] // RP) == gi, xs_cur, 0.0), axis=1)
                    if WHOLE_ROW:
                        zg = z_row
                    else:
                        zg = tl.sum(tl.where(og[None, :] == gi, z_cur, 0.0), axis=1)
                    if WA:
                        acc += (df - zg[:, None] * gxs[None, :]) * sc[:, None]
                    else:
                        acc += (df - gxs[:, None] * zg[None, :]) * sc[None, :]
                elif WA:
                    acc += df * sc[:, None]
                else:
                    acc += df * sc[None, :]
                if HAS_ZEROS and not ZFIRST:  # affine: - s * z * (sum of the group's int8 activations)
                    gxs = tl.sum(tl.where((op[None, :] // RP) == gi, xs_cur, 0.0), axis=1)
                    if WHOLE_ROW:
                        zs = zs_row
                    else:
                        zs = sc * tl.sum(tl.where(og[None, :] == gi, z_cur, 0.0), axis=1)
                    if WA:
                        acc -= zs[:, None] * gxs[None, :]
                    else:
                        acc -= gxs[:, None] * zs[None, :]
                if MINS:  # the min form: + m * (sum of the group's int8 activations)
                    if XRUN:
                        gxs = gx_run.to(tl.float32)
                        gx_run = tl.zeros([BLOCK_M], dtype=tl.int32)
                    else:
                        gxs = tl.sum(tl.where((op[None, :] // RP) == gi, xs_cur, 0.0), axis=1)
                    if WHOLE_ROW:
                        mg = m_row
                    else:
                        mg = tl.sum(tl.where(og[None, :] == gi, z_cur, 0.0), axis=1)
                    if WA:
                        acc += mg[:, None] * gxs[None, :]
                    else:
                        acc += gxs[:, None] * mg[None, :]
                d = d0
    if ROW_DOT:  # the exact int32 dot of the whole K range (|dot| < 2**31), one conversion
        df = d.to(tl.float32)
        if ZFIRST:
            if WA:
                df = df - z_row[:, None] * gx_run.to(tl.float32)[None, :]
            else:
                df = df - gx_run.to(tl.float32)[:, None] * z_row[None, :]
        if WA:
            acc += df * sc_row[:, None]
        else:
            acc += df * sc_row[None, :]
        if MINS:
            if WA:
                acc += m_row[:, None] * gx_run.to(tl.float32)[None, :]
            else:
                acc += gx_run.to(tl.float32)[:, None] * m_row[None, :]
    sx = tl.load(sx_ptr + rm)
    if ROW_SCALE:  # the progressive form: int8 group scales and mins, one float scale per row
        s0 = tl.load(s0_ptr + rn)
        if WA:
            acc = acc * s0[:, None]
        else:
            acc = acc * s0[None, :]
    if WA:
        acc = acc * sx[None, :]
        bias = tl.load(b_ptr + rn).to(tl.float32)[:, None] if HAS_BIAS else 0.0
        out_offs = offs_m[None, :].to(tl.int64) * N + offs_n[:, None]
        omask = n_mask[:, None] & m_mask[None, :]
    else:
        acc = acc * sx[:, None]
        bias = tl.load(b_ptr + rn).to(tl.float32)[None, :] if HAS_BIAS else 0.0
        out_offs = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
        omask = m_mask[:, None] & n_mask[None, :]
    store_or_reduce(acc, bias, y_ptr, ws_ptr, lock_ptr, out_offs, omask, M * N, pid_k, pid, SPLIT_K, HAS_BIAS, ATOMIC, HW_ASM)


def _plane_asm(bits: int, q: int, ca: int, cb: int) -> str:
    """PTX of :func:`_plane_codes` for four packed bytes: ((b >> bits*q) & mask) * CA - CB per byte.
    The bias add cannot carry across bytes (CA * c + 128 - CB stays in [125, 134]; 8 bits: CB = 128,
    no add, the byte's sign flip alone)."""
    s = [f"shr.u32 t, $1, {bits * q};" if q else "mov.b32 t, $1;"]
    if bits < 8:
        s.append(f"and.b32 t, t, {0x01010101 * ((1 << bits) - 1):#010x};")
    if ca != 1:
        s.append(f"mul.lo.u32 t, t, {ca};")
    if cb not in (0, 128):
        s.append(f"add.u32 t, t, {0x01010101 * (128 - cb):#010x};")
    s.append("xor.b32 $0, t, 0x80808080;" if cb else "mov.b32 $0, t;")
    return "{ .reg .b32 t; " + " ".join(s) + " }"


def space(M: int) -> list[dict]:
    """The configs the tuner times for ``M`` tokens (none at M == 1: the stream kernel's)."""
    if path(M) == "gemm":
        return GEMM_SPACE + (GEMM_SPLIT_SPACE if M <= SPLIT_GEMM_MAX_M else [])
    if M == 1:
        return []
    tiles = {(c["BLOCK_N"], c["num_warps"], c["num_stages"]): c for c in GEMV_SPACE}
    return GEMV_SPACE + [dict(c, SPLIT_K=sk, ATOMIC=1) for c in tiles.values() for sk in ATOMIC_SPLITS]


def heuristic(M: int, N: int, K: int, bits: int, device: torch.device) -> dict:
    """The untuned default. M > 16: the H200 GEMM tile, split over K (at most 8, M <= 512) until the
    device has a program per SM; M <= 16: 16 token columns, split over K (at most 16) until the device
    has two programs per SM (the H200 winners: 128 rows, split 4-8)."""
    chunks = -(-K // triton_chunk(bits))
    if path(M) == "gemm":
        split = k_splits(-(-M // 64) * -(-N // 128), chunks, 8, sm_count(device)) if M <= SPLIT_GEMM_MAX_M else 1
        return {"KERNEL": NAME, "BLOCK_N": 128, "BLOCK_M": 64, "num_warps": 4, "num_stages": 3, "WA": 1, "SPLIT_K": split}
    bn = 128 if N >= 2048 else 64
    split = k_splits(-(-N // bn), chunks, 16, 2 * sm_count(device))
    return {"KERNEL": NAME, "BLOCK_N": bn, "BLOCK_M": GEMV_MAX_M, "WA": 1, "SPLIT_K": split, "num_warps": 4, "num_stages": 3}


def launch(x2: torch.Tensor, weight: PackedLowBit, bias: Optional[torch.Tensor], y: torch.Tensor, cfg: dict,
           act_amax: Optional[torch.Tensor] = None) -> None:  # fmt: skip
    """The activation pass (per-token absmax from ``act_amax`` when given) and the group kernel for
    ``x2 [M, K]``, writing ``y [M, N]``."""
    M, K = x2.shape
    N = weight.out_features
    cb = get_codebook(weight.codebook)
    Kp = weight.qweight.shape[1] * (8 // cb.bits)
    whole = weight.group_size == K
    pdl = bool(cfg.get("PDL", 0)) and pdl_ok(x2.device)
    half = weight.group_size == 16 and not whole  # groups of 16: the kernel sums its own activation halves
    xq, sx, xsum = quantize_rows(x2, Kp, sums=weight.zeros is not None and not half, act_amax=act_amax, pdl=pdl)
    bn, bm = cfg["BLOCK_N"], cfg.get("BLOCK_M", GEMV_MAX_M)  # M > 16: check_config asked for BLOCK_M
    tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
    chunk = triton_chunk(cb.bits)
    cpg = weight.group_size // chunk if not whole and weight.group_size > chunk else 1  # 8 bits: splits of whole groups
    split, per_split, ws, locks, atomic = split_plan(
        Kp // chunk // cpg, cfg.get("SPLIT_K", 1), tiles, M, N, y, atomic=bool(cfg.get("ATOMIC", 0))
    )
    ca, cbias, fmul = cb.integer_form()
    hw = x2.device.type == "cuda" and not INTERPRETED
    asm = {f"ASM{q}": _plane_asm(cb.bits, q, ca, cbias) if hw and q < 8 // cb.bits else "" for q in range(8)}
    _group_kernel[(tiles, split)](
        xq_ptr=xq, sx_ptr=sx, xsum_ptr=sx if xsum is None else xsum, w_ptr=weight.qweight,
        s_ptr=weight.scales, z_ptr=weight.scales if weight.zeros is None else weight.zeros,
        s0_ptr=weight.scales if weight.supers is None else weight.supers, b_ptr=weight.scales if bias is None else bias, y_ptr=y, ws_ptr=ws, lock_ptr=locks,
        M=M, N=N, Kp=Kp, NG=weight.scales.shape[0], KB=weight.qweight.shape[1], CHUNKS_PER_SPLIT=per_split * cpg,
        BITS=cb.bits, CA=ca, CB=cbias, FMUL=fmul, G=K if whole else weight.group_size, WHOLE_ROW=whole,
        HAS_ZEROS=weight.zeros is not None and not cb.mins, HAS_BIAS=bias is not None,
        BLOCK_M=bm, BLOCK_N=bn, GROUP_M=cfg.get("GROUP_M", 8), WA=bool(cfg.get("WA", 0)), HW_ASM=hw,
        SPLIT_K=split, ATOMIC=atomic, PDL=pdl, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **asm,
        **({"MINS": True} if cb.mins else {}), **({"ROW_SCALE": True} if weight.supers is not None else {}),
        **({"launch_pdl": True} if pdl else {}),
    )  # fmt: skip
