"""``expand``: prompts (M > 16) on the progressive two-level form as one pass that writes the weight's int8
levels, then an int8 GEMM.

The form's levels ``w8 = s1 * c + m`` are exact int8 (:mod:`aipc_kernels.lowbit.progressive`), so the
weight can be expanded once per call into a dense int8 ``[N, Kp]`` (K-contiguous: ``(s1 * c + m)`` of each
code, four codes per 32-bit register, :func:`~.progressive._levels`), and the product is a plain int8 GEMM
``xq [M, Kp] @ w8^T`` with both operands K-major (on Hopper ``tl.dot`` lowers to wgmma from shared
memory), int32 accumulation over the whole K and one ``acc * sx[m] * s0[n]`` per output. The expansion
reads the 2- or 4-bit codes once and writes 1 byte a weight (8B gate/up: 59 MB); it pays where the GEMM's
time hides it, a long prompt. Same values as the fused ``progressive`` kernel: each output is the same
exact int32 sum, one float conversion and two products.

Config: ``BLOCK_M``, ``BLOCK_N``, ``BLOCK_K``, ``num_warps``, ``num_stages``, ``GROUP_M`` (default 8).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from aipc_kernels.lowbit.packing import PackedLowBit, triton_chunk
from aipc_kernels.gpu.triton.lowbit.activation import quantize_rows
from aipc_kernels.gpu.triton.lowbit.common import grouped_tile, path
from aipc_kernels.gpu.triton.lowbit.interpret import INTERPRETED
from aipc_kernels.gpu.triton.lowbit.progressive import check, group_scales, levels_asm, plane_levels

NAME = "expand"
FORMS = ("progressive",)  # a kernel of the progressive two-level form (registry.takes), and only of it
FIELDS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages")
_TILES = [(128, 128, 128, 8, 3), (128, 256, 128, 8, 3), (256, 128, 128, 8, 3), (64, 128, 128, 4, 4),
          (128, 128, 128, 4, 3), (128, 128, 128, 8, 4), (128, 256, 128, 8, 4), (128, 128, 256, 8, 3)]  # fmt: skip
SPACE = [{"KERNEL": NAME, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": nw, "num_stages": ns}
         for bm, bn, bk, nw, ns in _TILES]  # fmt: skip
EXPAND_ROWS = 32  # weight rows per program of the expansion pass
MIN_M = 1024  # the untuned heuristic's threshold (it won every M >= 1024 case of the H200 probes)


@triton.jit
def _expand_kernel(w_ptr, s_ptr, m_ptr, w8_ptr, N, KB, Kp, NG, BITS: tl.constexpr, G: tl.constexpr,
                   BLOCK_N: tl.constexpr, HW_ASM: tl.constexpr, ASM0: tl.constexpr, ASM1: tl.constexpr,
                   ASM2: tl.constexpr, ASM3: tl.constexpr):  # fmt: skip
    """Program (n, c): rows [n * BLOCK_N, +BLOCK_N) of chunk c: ``w8[row, c * KC + 32 q + j]`` = the int8
    level of bit-plane q of byte j (past K, in the padded chunk: the last group's ``m``, against zero
    activations)."""
    P: tl.constexpr = 8 // BITS
    KC: tl.constexpr = 32 * P
    pid_n = tl.program_id(0)
    c = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    rn = tl.where(n_mask, offs_n, 0)
    j = tl.arange(0, 32)
    wb = tl.load(w_ptr + rn[:, None].to(tl.int64) * KB + c * 32 + j[None, :])
    out = w8_ptr + rn[:, None].to(tl.int64) * Kp + c * KC + j[None, :]
    for q in tl.static_range(P):
        s1, m = group_scales(s_ptr, m_ptr, rn, c, q, N, NG, BITS, G)
        lv = plane_levels(wb, s1, m, q, BITS, BLOCK_N, HW_ASM, ASM0, ASM1, ASM2, ASM3)
        tl.store(out + q * 32, lv, mask=n_mask[:, None])


@triton.jit
def _int8_gemm_kernel(xq_ptr, sx_ptr, w8_ptr, s0_ptr, b_ptr, y_ptr, M, N, Kp, HAS_BIAS: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):  # fmt: skip
    """One [BLOCK_M, BLOCK_N] tile of ``y = (xq @ w8^T) * sx * s0 (+ bias)``, int32 over the whole K
    (``Kp`` a multiple of BLOCK_K; both operands K-contiguous)."""
    pid = tl.program_id(0)
    offs_m, offs_n, m_mask, n_mask, rm, rn = grouped_tile(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    k = tl.arange(0, BLOCK_K)
    a_ptrs = xq_ptr + rm[:, None].to(tl.int64) * Kp + k[None, :]
    b_ptrs = w8_ptr + rn[:, None].to(tl.int64) * Kp + k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    for _ in range(0, Kp, BLOCK_K):
        a = tl.load(a_ptrs)
        b = tl.load(b_ptrs)
        acc = tl.dot(a, tl.trans(b), acc, out_dtype=tl.int32)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    out = acc.to(tl.float32) * tl.load(sx_ptr + rm)[:, None] * tl.load(s0_ptr + rn)[None, :]
    if HAS_BIAS:
        out += tl.load(b_ptr + rn).to(tl.float32)[None, :]
    offs = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    tl.store(y_ptr + offs, out.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def space(M: int) -> list[dict]:
    """The configs the tuner times for ``M`` tokens (prompts only)."""
    return SPACE if path(M) == "gemm" else []


def heuristic(M: int, N: int, K: int, bits: int, device: torch.device) -> dict:
    """The untuned default: 128 x 128 x 128 tiles of 8 warps."""
    return dict(SPACE[0])


def expand_levels(weight: PackedLowBit) -> torch.Tensor:
    """The weight's int8 levels ``[N, Kp]`` (K-contiguous; the padded k past K hold the last group's ``m``)."""
    N, bits = weight.out_features, weight.bits
    Kp = weight.qweight.shape[1] * (8 // bits)
    w8 = torch.empty(N, Kp, dtype=torch.int8, device=weight.qweight.device)
    hw = weight.qweight.device.type == "cuda" and not INTERPRETED
    asm = {f"ASM{q}": levels_asm(bits, q) if hw and q < 8 // bits else "" for q in range(4)}
    _expand_kernel[(triton.cdiv(N, EXPAND_ROWS), Kp // triton_chunk(bits))](
        weight.qweight, weight.scales, weight.zeros, w8, N, weight.qweight.shape[1], Kp, weight.scales.shape[0],
        BITS=bits, G=weight.group_size, BLOCK_N=EXPAND_ROWS, HW_ASM=hw, num_warps=4, **asm,
    )  # fmt: skip
    return w8


def launch(x2: torch.Tensor, weight: PackedLowBit, bias: Optional[torch.Tensor], y: torch.Tensor, cfg: dict,
           act_amax: Optional[torch.Tensor] = None) -> None:  # fmt: skip
    """The activation pass, the expansion and the int8 GEMM for ``x2 [M, K]``, writing ``y [M, N]``."""
    check(x2, weight, cfg)
    M = x2.shape[0]
    N = weight.out_features
    Kp = weight.qweight.shape[1] * (8 // weight.bits)
    bk = cfg["BLOCK_K"]
    if Kp % bk:
        raise ValueError(f"{NAME}: BLOCK_K={bk} does not divide the padded K={Kp}; use 64")
    xq, sx, _ = quantize_rows(x2, Kp, sums=False, act_amax=act_amax)
    w8 = expand_levels(weight)
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    _int8_gemm_kernel[(triton.cdiv(M, bm) * triton.cdiv(N, bn),)](
        xq, sx, w8, weight.supers, weight.supers if bias is None else bias, y, M, N, Kp, HAS_BIAS=bias is not None,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg.get("GROUP_M", 8), num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )  # fmt: skip
