"""``lean``: the M == 1 GEMV (decode) with no reduction across threads until its end.

Beside ``stream`` (same activation pre-pass, same launch plan, :func:`~.stream.plan`): a thread holds
a 16-byte half of a 32-byte chunk of a row, so per group slot of a chunk the raw codes (unsigned bytes,
no shift to signed levels) meet the int8 activations in ``dp4a.u32.s32``, the thread's 4 words are
summed in registers, and the partial dot is scaled in the thread: the group scale distributes over the
halves and chunks of a group, so one formula serves every code book and group size,
``acc += s * (dot - zero / cmul * xsum)`` with the activation sum counted in the first half only. One
reduction over chunks and halves at the end (``stream`` reduces and converts per step). Whole tiles
(``EVEN``) run with no masks, and the scales are loaded by inline PTX in the weights' own layout (a
``tl.load`` takes a coalesced layout and a shared-memory conversion with two barriers per group slot).

Config: ``BLOCK_N``, ``BLOCK_C`` (chunks per step), ``SPLIT_K``, ``num_warps``, ``num_stages``, ``PDL``.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ...packing import PackedLowBit, triton_chunk
from .common import k_splits, sm_count, store_or_reduce
from .interpret import INTERPRETED
from .stream import plan

NAME = "lean"
# the tuning space: 4-64 int32 words per thread and step
SPACE = [
    {"KERNEL": NAME, "BLOCK_N": bn, "SPLIT_K": sk, "num_warps": nw, "num_stages": 1, "BLOCK_C": bc, "PDL": 1}
    for bn in (16, 32, 64)
    for sk in (1, 2, 4)
    for bc in (4, 8, 16, 32)
    for nw in (4, 8)
    if 4 * 32 * nw <= bn * bc * 8 <= 64 * 32 * nw
]


@triton.jit
def _dp4a_us(a, b, c, HW: tl.constexpr):
    """c + sum of the 4 products of a's unsigned bytes and b's signed bytes: ``dp4a.u32.s32`` on
    NVIDIA (``HW``), a shift/mask emulation elsewhere."""
    if HW:
        return tl.inline_asm_elementwise(
            "dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32, is_pure=True, pack=1
        )
    else:
        r = c
        for i in tl.static_range(4):
            r += ((a >> (8 * i)) & 0xFF) * ((b << (24 - 8 * i)) >> 24)
        return r


@triton.jit
def _load_in_place(ptr):
    """fp32 of the fp16/bf16 at ``ptr``, loaded by inline PTX in the pointers' own layout."""
    if ptr.dtype.element_ty == tl.float16:
        return tl.inline_asm_elementwise(
            "{ .reg .b16 h; ld.global.nc.b16 h, [$1]; cvt.f32.f16 $0, h; }", "=r,l", [ptr], dtype=tl.float32, is_pure=True, pack=1
        )
    elif ptr.dtype.element_ty == tl.bfloat16:
        return tl.inline_asm_elementwise(
            "{ .reg .b16 h, z; mov.b16 z, 0; ld.global.nc.b16 h, [$1]; mov.b32 $0, {z, h}; }", "=r,l", [ptr], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        return tl.load(ptr).to(tl.float32)


@triton.jit
def _lean_kernel(
    xw_ptr, xs_ptr, sx_ptr, w_ptr, s_ptr, z_ptr, b_ptr, y_ptr, ws_ptr, lock_ptr,
    N, NG, KW, CHUNKS_PER_SPLIT,
    BITS: tl.constexpr, ZC: tl.constexpr, G: tl.constexpr, WHOLE_ROW: tl.constexpr,
    CMUL: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr, HW_DP4A: tl.constexpr, PDL: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, SPLIT_K: tl.constexpr, EVEN: tl.constexpr,
):
    """The GEMV with no reduction across threads until the end. A thread holds a 16-byte
    half of a 32-byte chunk of a row ([BLOCK_N, BLOCK_C, 2 halves, 4 words]); per group slot of the
    chunk its raw codes (unsigned bytes) meet the int8 activations in ``dp4a.u32.s32``, the 4 words'
    int32 sums (+ 1.5 * 2**23, read as fp32: the conversion is one subtract) are scaled in the thread:
    the group scale distributes over the halves and chunks of a group, so every group size and code
    book is one formula, ``acc += s * (dot - zero / cmul * xsum)``, the activation sum counted in the
    first half only. One reduction over chunks and halves at the end. ``EVEN``: whole tiles everywhere
    (N, every split's chunks and K a multiple of the tile, the chunk and the group), no masks."""
    P: tl.constexpr = 8 // BITS
    KC: tl.constexpr = 32 * P
    PPG: tl.constexpr = P if WHOLE_ROW else (G // 32 if G < KC else P)  # planes per group slot
    GPC: tl.constexpr = P // PPG
    MASK: tl.constexpr = (1 << BITS) - 1
    PMASK: tl.constexpr = (MASK | (MASK << 8) | (MASK << 16) | (MASK << 24)) if BITS < 8 else -1
    MAGIC: tl.constexpr = 0x4B400000  # the bits of 1.5 * 2**23: MAGIC + d read as fp32 is 12582912 + d
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    oc = tl.arange(0, BLOCK_C)
    oh = tl.arange(0, 2)
    oj = tl.arange(0, 4)
    c_begin = pid_k * CHUNKS_PER_SPLIT
    c_end = tl.minimum(c_begin + CHUNKS_PER_SPLIT, KW // 8)
    w_rows = w_ptr + offs_n[:, None, None, None].to(tl.int64) * KW + (oh * 4)[None, None, :, None] + oj[None, None, None, :]
    c = c_begin + oc
    if EVEN:
        wv = tl.load(w_rows + c[None, :, None, None] * 8)
    else:
        wv = tl.load(w_rows + c[None, :, None, None] * 8, mask=n_mask[:, None, None, None] & (c < c_end)[None, :, None, None], other=0)
    if PDL:
        tl.extra.cuda.gdc_wait()
    sx = tl.load(sx_ptr)
    acc = tl.zeros([BLOCK_N, BLOCK_C, 2], dtype=tl.float32)
    first = (oh == 0)[None, :]
    xrow = (offs_n * 0)[:, None, None, None]  # the activation words loaded in the weights' layout
    for c0 in range(c_begin, c_end, BLOCK_C):
        c = c0 + oc
        c_mask = c < c_end
        cn = c + BLOCK_C
        if EVEN:  # the prefetch past the range re-reads its last step (no mask, no zero-fill)
            wn = tl.load(w_rows + tl.minimum(cn, c_end - BLOCK_C + oc)[None, :, None, None] * 8)
        else:
            wn = tl.load(w_rows + cn[None, :, None, None] * 8, mask=n_mask[:, None, None, None] & (cn < c_end)[None, :, None, None], other=0)
        for gi in tl.static_range(GPC):
            d = tl.zeros([BLOCK_N, BLOCK_C, 2, 4], dtype=tl.int32)
            xsum = tl.zeros([BLOCK_C, 2], dtype=tl.int32)
            for qq in tl.static_range(PPG):
                q = gi * PPG + qq
                xoff = (c * P + q)[None, :, None, None] * 8 + (oh * 4)[None, None, :, None] + oj[None, None, None, :] + xrow
                if EVEN:
                    xv = tl.load(xw_ptr + xoff)
                else:
                    xv = tl.load(xw_ptr + xoff, mask=c_mask[None, :, None, None], other=0)
                d = _dp4a_us(wv if BITS == 8 else (wv >> (BITS * q)) & PMASK, xv, d, HW_DP4A)
                if ZC != 0.0 or HAS_ZEROS:
                    xsum += tl.load(xs_ptr + (c * P + q)[:, None] + oh[None, :] * 0, mask=first if EVEN else c_mask[:, None] & first, other=0)
            dotf = (tl.sum(d, axis=3) + MAGIC).to(tl.float32, bitcast=True)  # [BLOCK_N, BLOCK_C, 2]
            if WHOLE_ROW:
                g = c * 0
            else:
                g = (c * KC + gi * PPG * 32) // G
            if EVEN and HW_DP4A:  # an inline-asm load keeps the scales in the weights' own layout (tl.load's
                # coalesced layout costs a shared-memory conversion with two barriers per group slot)
                sc = _load_in_place(s_ptr + g[None, :] * N + offs_n[:, None])
            elif EVEN:
                sc = tl.load(s_ptr + g[None, :] * N + offs_n[:, None]).to(tl.float32)
            else:
                gmask = n_mask[:, None] & (c_mask & (g < NG))[None, :]
                sc = tl.load(s_ptr + g[None, :] * N + offs_n[:, None], mask=gmask, other=0.0).to(tl.float32)
            if HAS_ZEROS:
                if EVEN:
                    zp = tl.load(z_ptr + g[None, :] * N + offs_n[:, None]).to(tl.float32)
                else:
                    zp = tl.load(z_ptr + g[None, :] * N + offs_n[:, None], mask=gmask, other=0.0).to(tl.float32)
                t = (dotf - 12582912.0) - (zp * ZC)[:, :, None] * xsum.to(tl.float32)[None, :, :]
            elif ZC == ZC // 1:  # an integer zero: 12582912 + ZC * xsum is exact in fp32, one add per element
                t = dotf + (-12582912.0 - ZC * xsum.to(tl.float32))[None, :, :]
            else:  # sym's 1.5, binary's 0.5: the halves are not representable next to 2**23
                t = (dotf - 12582912.0) + (-ZC * xsum.to(tl.float32))[None, :, :]
            acc += sc[:, :, None] * t
        wv = wn
    res = tl.sum(tl.sum(acc, axis=2), axis=1) * (sx * CMUL)
    bias = tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32) if HAS_BIAS else 0.0
    store_or_reduce(res, bias, y_ptr, ws_ptr, lock_ptr, offs_n, n_mask, N, pid_k, pid_n, SPLIT_K, HAS_BIAS)


def space(M: int) -> list[dict]:
    """The configs the tuner times for ``M`` tokens (M == 1 only)."""
    return list(SPACE) if M == 1 else []


def heuristic(M: int, N: int, K: int, bits: int, device: torch.device) -> dict:
    """An untuned default (the registry's untuned M == 1 choice is ``stream``): 32 rows, 8 chunks per
    step, split over K (at most 4) while fewer than two programs per SM would run."""
    chunks = -(-K // triton_chunk(bits))
    bc = min(8, max(1, chunks))
    split = k_splits(-(-N // 32), chunks // bc, 4, 2 * sm_count(device))
    return {"KERNEL": NAME, "PDL": 1, "BLOCK_N": 32, "BLOCK_C": bc, "SPLIT_K": split, "num_warps": 4, "num_stages": 1}


def launch(x2: torch.Tensor, weight: PackedLowBit, bias: Optional[torch.Tensor], y: torch.Tensor, cfg: dict,
           act_amax: Optional[torch.Tensor] = None) -> None:  # fmt: skip
    """The pre-pass (absmax from ``act_amax`` when given) and the lean GEMV for ``x2 [1, K]``, writing ``y [1, N]``."""
    g = plan(x2, weight, y, cfg, act_amax)
    N, bn, bc = weight.out_features, cfg["BLOCK_N"], cfg.get("BLOCK_C", 8)
    zc = (1.0 if weight.zeros is not None else float(g.cb.zero or 0.0)) / g.cb.cmul
    even = N % bn == 0 and g.Kp == g.K and g.chunks_per_split % bc == 0 and (g.Kp // triton_chunk(g.cb.bits)) % g.chunks_per_split == 0
    _lean_kernel[(g.tiles, g.split)](
        xw_ptr=g.xq.view(torch.int32), xs_ptr=g.xs, sx_ptr=g.sx, w_ptr=weight.qweight.view(torch.int32),
        s_ptr=weight.scales, z_ptr=weight.scales if weight.zeros is None else weight.zeros,
        b_ptr=weight.scales if bias is None else bias, y_ptr=y, ws_ptr=g.ws, lock_ptr=g.locks,
        N=N, NG=weight.scales.shape[0], KW=weight.qweight.shape[1] // 4, CHUNKS_PER_SPLIT=g.chunks_per_split,
        BITS=g.cb.bits, ZC=zc, G=g.K if g.whole else weight.group_size, WHOLE_ROW=g.whole, CMUL=float(g.cb.cmul),
        HAS_ZEROS=weight.zeros is not None, HAS_BIAS=bias is not None, HW_DP4A=x2.device.type == "cuda" and not INTERPRETED,
        PDL=g.pdl, BLOCK_N=bn, BLOCK_C=bc, SPLIT_K=g.split, EVEN=even,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **({"launch_pdl": True} if g.pdl else {}),
        **({"maxnreg": cfg["maxnreg"]} if cfg.get("maxnreg") else {}),
    )  # fmt: skip
