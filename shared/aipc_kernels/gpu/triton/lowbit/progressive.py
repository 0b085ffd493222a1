"""``progressive``: the int8 matrix-unit kernel of the progressive two-level form, every M.

The form (:mod:`aipc_kernels.lowbit.progressive`): ``W = s0[n] * w8``, ``w8 = s1[g, n] * c + m[g, n]`` an
int8 for every code. Per 32-byte weight chunk: one [BLOCK_N, 32] byte load; each bit-plane is turned in
registers into the int8 levels ``w8`` of its 32 k (four codes per 32-bit register through inline PTX on
CUDA: shift, mask, one multiply by ``s1`` and one byte-wise add of ``m + 128``, which cannot carry since
every level is in [-128, 127], then the sign flip), one K=32 int8 ``tl.dot`` per plane (weights as the
A operand: wgmma on Hopper), all chained in one int32 accumulator over the program's whole K range. No
per-group work touches the accumulators: the only float arithmetic is ``acc * s0[n] * sx[m]`` at the end
(|acc| <= K * 128 * 127 < 2**31 for K < 132000), so the cost of the groups no longer grows with the tile's
token rows, which is what bounded the ``group`` kernel at M >= 64 (its per-group rescale of the whole
[BLOCK_N, BLOCK_M] accumulator). Every M: M <= 16 takes 16 token columns and a split of K, as the
``group`` kernel's GEMV path; M > 16 GEMM tiles, optionally split. Unsplit, a row's outputs are one
exact int32 sum whatever the tile, so they do not depend on the batch.

Config: ``BLOCK_N``, ``BLOCK_M``, ``num_warps``, ``num_stages``, ``SPLIT_K`` (default 1), ``WA`` (default 1:
the levels as the dot's A operand, from registers; 0: as B, staged in shared memory), ``GROUP_M``
(default 8), ``ATOMIC`` (split-K partials by fp32 atomics, :func:`~.common.split_plan`), ``SPRE`` (default 0:
each chunk's group scales and mins loaded where used; 1: a chunk ahead, carried in registers), ``MAXNREG``
(CUDA: the registers a thread may use; the 8-warp 128 x 128 tile with ``SPRE`` takes 128, so that two
programs share an SM as without it).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from aipc_kernels.lowbit.packing import PackedLowBit, triton_chunk
from aipc_kernels.gpu.triton.lowbit.activation import quantize_rows
from aipc_kernels.gpu.triton.lowbit.common import (GEMV_MAX_M, grouped_tile, k_splits, path, pick, sm_count,
                                                  split_plan, store_or_reduce)
from aipc_kernels.gpu.triton.lowbit.interpret import INTERPRETED

NAME = "progressive"
FORMS = ("progressive",)  # the kernel of the progressive two-level form (registry.takes), and only of it
FIELDS = ("BLOCK_N", "BLOCK_M", "num_warps", "num_stages")
MAX_K = (2**31 - 1) // (128 * 127)  # the int32 accumulator of the whole K range cannot overflow
# M > 16: (BLOCK_N, BLOCK_M, num_warps, num_stages)
_GEMM_TILES = [(64, 64, 4, 3), (128, 64, 4, 3), (128, 128, 8, 3), (128, 256, 8, 3), (256, 128, 8, 3)]
# (WA, KCAT): the levels from registers per plane; joined per chunk as A or as B (2-bit codes)
GEMM_SPACE = [{"KERNEL": NAME, "BLOCK_N": bn, "BLOCK_M": bm, "num_warps": nw, "num_stages": ns, "WA": wa, "KCAT": kcat,
               "SPRE": spre, **({"MAXNREG": 128} if spre and (bn, bm, nw) == (128, 128, 8) else {})}
              for bn, bm, nw, ns in _GEMM_TILES for wa, kcat in ((1, 0), (1, 1), (0, 1)) for spre in (0, 1)]  # fmt: skip
SPLIT_GEMM_MAX_M = 512  # GEMM tiles split over K too up to this M (too few output tiles otherwise)
GEMM_SPLIT_SPACE = [dict(KERNEL=NAME, BLOCK_N=bn, BLOCK_M=bm, num_warps=4, num_stages=3, SPLIT_K=sk, KCAT=kcat, WA=wa,
                         SPRE=spre)
                    for bn, bm in ((128, 64), (64, 64)) for sk in (2, 4, 8) for kcat, wa in ((0, 1), (1, 0))
                    for spre in (0, 1)]  # fmt: skip
GEMV_SPACE = [
    {"KERNEL": NAME, "BLOCK_N": bn, "BLOCK_M": GEMV_MAX_M, "SPLIT_K": sk, "num_warps": nw, "num_stages": ns, "SPRE": spre}
    for bn in (32, 64, 128, 256)
    for sk in (2, 4, 8, 16)
    for nw, ns in ((2, 3), (4, 3), (8, 3), (4, 4))
    for spre in (0, 1)
    if (nw == 2 and bn <= 64) or (nw == 4 and 64 <= bn <= 128) or (nw == 8 and bn >= 128)
]


@triton.jit
def _levels(wb, s1, mb, q: tl.constexpr, BITS: tl.constexpr, HW_ASM: tl.constexpr, ASM: tl.constexpr):
    """int8 levels ``s1 * c + m`` of bit-plane ``q`` of the bytes ``wb`` (``s1`` and ``mb = m + 128`` as
    uint8, broadcast like ``wb``). With ``HW_ASM`` four codes per 32-bit register (the four are 4
    consecutive k of one row, so one group: one ``s1``)."""
    if HW_ASM:
        return tl.inline_asm_elementwise(ASM, "=r,r,r,r", [wb, s1, mb], dtype=tl.int8, is_pure=True, pack=4)
    else:
        c = ((wb >> (BITS * q)) & ((1 << BITS) - 1)).to(tl.int32)
        return (c * s1.to(tl.int32) + mb.to(tl.int32) - 128).to(tl.int8)


@triton.jit
def group_scales(s_ptr, m_ptr, rn, c, q: tl.constexpr, N, NG, BITS: tl.constexpr, G: tl.constexpr):
    """``s1`` and ``m`` (int8 ``[BLOCK_N]``, from the ``[K/G, N]`` tensors) of the rows ``rn`` in the group of
    bit-plane ``q`` of chunk ``c`` (past K, in the padded chunk: the last group)."""
    KC: tl.constexpr = 256 // BITS
    g = tl.minimum((c * KC + q * 32) // G, NG - 1)
    return tl.load(s_ptr + g * N + rn), tl.load(m_ptr + g * N + rn)


@triton.jit
def chunk_scales(s_ptr, m_ptr, rn, c, N, NG, BITS: tl.constexpr, G: tl.constexpr):
    """``s1`` and ``m`` of each bit-plane of chunk ``c`` (4 pairs; past a 4-bit chunk's two planes, copies):
    one load per group, a plane reusing the previous plane's pair where its 32 k lie in the same group
    (groups dividing the chunk or a multiple of it; any other group size loads per plane)."""
    KC: tl.constexpr = 256 // BITS
    ALIGNED: tl.constexpr = KC % G == 0 or G % KC == 0
    s1_0, m_0 = group_scales(s_ptr, m_ptr, rn, c, 0, N, NG, BITS, G)
    s1_1, m_1 = s1_0, m_0
    if not ALIGNED or (G < KC and 32 % G == 0):
        s1_1, m_1 = group_scales(s_ptr, m_ptr, rn, c, 1, N, NG, BITS, G)
    s1_2, m_2 = s1_1, m_1
    s1_3, m_3 = s1_1, m_1
    if KC == 128:
        if not ALIGNED or (G < KC and 64 % G == 0):
            s1_2, m_2 = group_scales(s_ptr, m_ptr, rn, c, 2, N, NG, BITS, G)
        s1_3, m_3 = s1_2, m_2
        if not ALIGNED or (G < KC and 96 % G == 0):
            s1_3, m_3 = group_scales(s_ptr, m_ptr, rn, c, 3, N, NG, BITS, G)
    return s1_0, m_0, s1_1, m_1, s1_2, m_2, s1_3, m_3


@triton.jit
def plane_levels(wb, s1, m, q: tl.constexpr, BITS: tl.constexpr, BLOCK_N: tl.constexpr, HW_ASM: tl.constexpr,
                 ASM0: tl.constexpr, ASM1: tl.constexpr, ASM2: tl.constexpr, ASM3: tl.constexpr):  # fmt: skip
    """The [BLOCK_N, 32] int8 levels of bit-plane ``q`` of the chunk bytes ``wb`` (``s1``, ``m``: the plane's
    group scale and min per row, :func:`group_scales`; ``ASMq``: plane q's PTX)."""
    zero32 = tl.zeros([BLOCK_N, 32], dtype=tl.uint8)
    s1b = s1.to(tl.uint8)[:, None] + zero32
    mb = (m.to(tl.int32) + 128).to(tl.uint8)[:, None] + zero32
    if q == 0:
        return _levels(wb, s1b, mb, 0, BITS, HW_ASM, ASM0)
    elif q == 1:
        return _levels(wb, s1b, mb, 1, BITS, HW_ASM, ASM1)
    elif q == 2:
        return _levels(wb, s1b, mb, 2, BITS, HW_ASM, ASM2)
    else:
        return _levels(wb, s1b, mb, 3, BITS, HW_ASM, ASM3)


@triton.jit
def _progressive_kernel(
    xq_ptr, sx_ptr, w_ptr, s_ptr, m_ptr, s0_ptr, b_ptr, y_ptr, ws_ptr, lock_ptr,
    M, N, Kp, KB, NG, CHUNKS_PER_SPLIT,
    BITS: tl.constexpr, G: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr, HW_ASM: tl.constexpr,
    ASM0: tl.constexpr, ASM1: tl.constexpr, ASM2: tl.constexpr, ASM3: tl.constexpr,
    SPLIT_K: tl.constexpr, ATOMIC: tl.constexpr, WA: tl.constexpr, KCAT: tl.constexpr = False,
    SPRE: tl.constexpr = False,
):
    """One [BLOCK_N, BLOCK_M] output tile (``WA``; else [BLOCK_M, BLOCK_N]) over program_id(1)'s K range
    (CHUNKS_PER_SPLIT chunks): an int32 accumulator from 0, one K=32 dot per bit-plane of each chunk against
    the plane's int8 levels (``KCAT``: one dot of the chunk's joined planes; ``s_ptr`` / ``m_ptr``: int8
    ``[K/G, N]`` group scales and mins), then ``acc * s0 * sx`` (+ bias)."""
    P: tl.constexpr = 8 // BITS
    KC: tl.constexpr = 32 * P
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m, offs_n, m_mask, n_mask, rm, rn = grouped_tile(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    j = tl.arange(0, 32)
    x_rows = xq_ptr + rm[:, None].to(tl.int64) * Kp + j[None, :]
    w_rows = w_ptr + rn[:, None].to(tl.int64) * KB + j[None, :]
    n_chunks = Kp // KC
    c_begin = pid_k * CHUNKS_PER_SPLIT
    c_end = tl.minimum(c_begin + CHUNKS_PER_SPLIT, n_chunks)
    if SPLIT_K == 1:
        c_begin = 0
        c_end = n_chunks
    if WA:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.int32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    kc = tl.arange(0, KC)
    x_chunk = xq_ptr + rm[:, None].to(tl.int64) * Kp + kc[None, :]
    # SPRE: a chunk's group scales and mins loaded a chunk ahead (the pipeline loads the weight bytes so; loaded
    # where used, their latency stalls every chunk), at the cost of registers (MAXNREG)
    if SPRE:
        c0 = tl.minimum(c_begin, n_chunks - 1)
        s1_0, m_0, s1_1, m_1, s1_2, m_2, s1_3, m_3 = chunk_scales(s_ptr, m_ptr, rn, c0, N, NG, BITS, G)
    for c in range(c_begin, c_end):
        wb = tl.load(w_rows + c * 32)  # [BLOCK_N, 32] bytes, P planes
        cs = tl.minimum(c + 1, n_chunks - 1) if SPRE else c  # the chunk whose scales this step loads
        n1_0, nm_0, n1_1, nm_1, n1_2, nm_2, n1_3, nm_3 = chunk_scales(s_ptr, m_ptr, rn, cs, N, NG, BITS, G)
        if not SPRE:
            s1_0, m_0, s1_1, m_1, s1_2, m_2, s1_3, m_3 = n1_0, nm_0, n1_1, nm_1, n1_2, nm_2, n1_3, nm_3
        l0 = plane_levels(wb, s1_0, m_0, 0, BITS, BLOCK_N, HW_ASM, ASM0, ASM1, ASM2, ASM3)
        l1 = plane_levels(wb, s1_1, m_1, 1, BITS, BLOCK_N, HW_ASM, ASM0, ASM1, ASM2, ASM3)
        l2 = l0
        l3 = l1
        if P == 4:
            l2 = plane_levels(wb, s1_2, m_2, 2, BITS, BLOCK_N, HW_ASM, ASM0, ASM1, ASM2, ASM3)
            l3 = plane_levels(wb, s1_3, m_3, 3, BITS, BLOCK_N, HW_ASM, ASM0, ASM1, ASM2, ASM3)
        if KCAT:  # the planes' levels joined into one [BLOCK_N, KC] operand (k = 32 q + j): one dot of K = KC
            four = tl.join(tl.join(l0, l1), tl.join(l2, l3))  # [BLOCK_N, 32, b, a]: plane q = 2 a + b
            lv = tl.reshape(tl.permute(four, (0, 3, 2, 1)), (BLOCK_N, 128))
            xt = tl.load(x_chunk + c * KC)  # [BLOCK_M, KC] int8
            if WA:
                acc = tl.dot(lv, tl.trans(xt), acc, out_dtype=tl.int32)
            else:
                acc = tl.dot(xt, tl.trans(lv), acc, out_dtype=tl.int32)
        else:
            for q in tl.static_range(P):
                lv = pick(q, l0, l1, l2, l3)
                xt = tl.load(x_rows + (c * KC + q * 32))  # [BLOCK_M, 32] int8
                if WA:
                    acc = tl.dot(lv, tl.trans(xt), acc, out_dtype=tl.int32)
                else:  # the levels as the B operand: staged in shared memory, both wgmma operands from there
                    acc = tl.dot(xt, tl.trans(lv), acc, out_dtype=tl.int32)
        if SPRE:
            s1_0, m_0, s1_1, m_1, s1_2, m_2, s1_3, m_3 = n1_0, nm_0, n1_1, nm_1, n1_2, nm_2, n1_3, nm_3
    s0 = tl.load(s0_ptr + rn)
    sx = tl.load(sx_ptr + rm)
    if WA:
        out = acc.to(tl.float32) * s0[:, None] * sx[None, :]
        bias = tl.load(b_ptr + rn).to(tl.float32)[:, None] if HAS_BIAS else 0.0
        out_offs = offs_m[None, :].to(tl.int64) * N + offs_n[:, None]
        omask = n_mask[:, None] & m_mask[None, :]
    else:
        out = acc.to(tl.float32) * sx[:, None] * s0[None, :]
        bias = tl.load(b_ptr + rn).to(tl.float32)[None, :] if HAS_BIAS else 0.0
        out_offs = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
        omask = m_mask[:, None] & n_mask[None, :]
    store_or_reduce(out, bias, y_ptr, ws_ptr, lock_ptr, out_offs, omask, M * N, pid_k, pid, SPLIT_K, HAS_BIAS, ATOMIC, HW_ASM)


def levels_asm(bits: int, q: int) -> str:
    """PTX of :func:`_levels` for four packed codes: ((b >> bits*q) & mask) * s1 + (m + 128), sign flipped.
    Neither the product (c * s1 <= 255) nor the add (the level + 128 <= 255) carries across bytes."""
    s = [f"shr.u32 t, $1, {bits * q};" if q else "mov.b32 t, $1;",
         f"and.b32 t, t, {0x01010101 * ((1 << bits) - 1):#010x};",
         "and.b32 s, $2, 0xff;", "mul.lo.u32 t, t, s;", "add.u32 t, t, $3;", "xor.b32 $0, t, 0x80808080;"]  # fmt: skip
    return "{ .reg .b32 t, s; " + " ".join(s) + " }"


def check(x2: torch.Tensor, weight: PackedLowBit, cfg: dict) -> None:
    """ValueError unless ``weight`` is a progressive two-level weight (int8 scales and mins with one ``s0``
    per row, :func:`aipc_kernels.lowbit.packing.pack_for_triton` of a progressive weight)."""
    if weight.supers is None or weight.scales.dtype != torch.int8 or weight.bits not in (2, 4):
        raise ValueError(f"config KERNEL={NAME!r} takes the progressive two-level form (2- or 4-bit codes, int8 "
                         f"scales and mins, one s0 per row); this weight has {weight.codebook!r} with "
                         f"{weight.scales.dtype} scales")  # fmt: skip
    if cfg.get("KCAT") and weight.bits != 2:
        raise ValueError(f"{NAME}: KCAT=1 (a chunk's planes joined into one dot) takes 2-bit codes; Triton 3.6 does "
                         f"not compile the 4-bit join: use KCAT=0")  # fmt: skip
    if x2.shape[1] > MAX_K:
        raise ValueError(f"{NAME}: K={x2.shape[1]} over {MAX_K}: the whole-K int32 accumulator could overflow")


def space(M: int) -> list[dict]:
    """The configs the tuner times for ``M`` tokens."""
    if path(M) == "gemm":
        return GEMM_SPACE + (GEMM_SPLIT_SPACE if M <= SPLIT_GEMM_MAX_M else [])
    return GEMV_SPACE


def heuristic(M: int, N: int, K: int, bits: int, device: torch.device) -> dict:
    """The untuned default: the ``group`` kernel's tiles and split rule (M > 16: 128 x 64, split over K
    up to 8 until every SM has a program at M <= 512, 2-bit chunks joined as the B operand, scales a chunk
    ahead; M <= 16: 16 token columns, split up to 16)."""
    chunks = -(-K // triton_chunk(bits))
    if path(M) == "gemm":
        split = k_splits(-(-M // 64) * -(-N // 128), chunks, 8, sm_count(device)) if M <= SPLIT_GEMM_MAX_M else 1
        return {"KERNEL": NAME, "BLOCK_N": 128, "BLOCK_M": 64, "num_warps": 4, "num_stages": 3, "SPLIT_K": split,
                "KCAT": int(bits == 2), "WA": int(bits != 2), "SPRE": 1}
    bn = 128 if N >= 2048 else 64
    split = k_splits(-(-N // bn), chunks, 16, 2 * sm_count(device))
    return {"KERNEL": NAME, "BLOCK_N": bn, "BLOCK_M": GEMV_MAX_M, "SPLIT_K": split, "num_warps": 4, "num_stages": 3}


def launch(x2: torch.Tensor, weight: PackedLowBit, bias: Optional[torch.Tensor], y: torch.Tensor, cfg: dict,
           act_amax: Optional[torch.Tensor] = None) -> None:  # fmt: skip
    """The activation pass and the progressive kernel for ``x2 [M, K]``, writing ``y [M, N]``."""
    check(x2, weight, cfg)
    M, K = x2.shape
    N, bits = weight.out_features, weight.bits
    chunk = triton_chunk(bits)
    Kp = weight.qweight.shape[1] * (8 // bits)
    xq, sx, _ = quantize_rows(x2, Kp, sums=False, act_amax=act_amax)
    bn, bm = cfg["BLOCK_N"], cfg.get("BLOCK_M", GEMV_MAX_M)
    tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
    split, per_split, ws, locks, atomic = split_plan(Kp // chunk, cfg.get("SPLIT_K", 1), tiles, M, N, y,
                                                     atomic=bool(cfg.get("ATOMIC", 0)))  # fmt: skip
    hw = x2.device.type == "cuda" and not INTERPRETED
    asm = {f"ASM{q}": levels_asm(bits, q) if hw and q < 8 // bits else "" for q in range(4)}
    _progressive_kernel[(tiles, split)](
        xq_ptr=xq, sx_ptr=sx, w_ptr=weight.qweight, s_ptr=weight.scales, m_ptr=weight.zeros, s0_ptr=weight.supers,
        b_ptr=weight.supers if bias is None else bias, y_ptr=y, ws_ptr=ws, lock_ptr=locks,
        M=M, N=N, Kp=Kp, KB=weight.qweight.shape[1], NG=weight.scales.shape[0], CHUNKS_PER_SPLIT=per_split,
        BITS=bits, G=weight.group_size, HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn,
        GROUP_M=cfg.get("GROUP_M", 8), HW_ASM=hw, SPLIT_K=split, ATOMIC=atomic, WA=bool(cfg.get("WA", 1)),
        KCAT=bool(cfg.get("KCAT", 0)), SPRE=bool(cfg.get("SPRE", 0)),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **asm,
        **({"maxnreg": cfg["MAXNREG"]} if hw and cfg.get("MAXNREG") else {}),
    )  # fmt: skip
