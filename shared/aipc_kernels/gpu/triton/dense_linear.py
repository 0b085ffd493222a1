"""Triton small-M dense linear (CUDA, Intel XPU; ``TRITON_INTERPRET=1`` on CPU for tests).

``y[M, N] = x[M, K] @ w[N, K]^T + bias`` for the few rows of a decode step (beams x batch), the weight
in the model's own layout and dtype, read once: one program per ``BLOCK_N`` output columns, ``BLOCK_M``
rows (one row block for M <= 16) and K split, ``tl.dot`` over ``BLOCK_K`` slices (16 rows is the matrix
units' smallest tile; the padding rows are masked). fp32: exact fp32 products (``ieee``); fp16 / bf16:
matrix-unit products, fp32 accumulation. :func:`choose_config` narrows the column blocks, then splits K,
until the grid has about two programs per multiprocessor: a split-K grid adds fp32 partial sums
atomically into a workspace, converted (and the bias added) afterwards. Same contract as
``aipc::dense_linear``'s CPU kernel.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from aipc_kernels.gpu.triton.lowbit.interpret import INTERPRETED, interpreter_scope  # decorated in the same import as this kernel

BLOCK_M, BLOCK_K = 16, 128
BLOCK_NS = (64, 32, 16)  # widest first: fewer, longer programs while the grid fills the GPU


@triton.jit
def _dense_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, K_PER_SPLIT, HAS_BIAS: tl.constexpr, IS_FP32: tl.constexpr,
                  UPCAST: tl.constexpr, SPLIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):  # fmt: skip
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    rm = tl.program_id(1) * BM + tl.arange(0, BM)
    rk = tl.arange(0, BK)
    k_lo = tl.program_id(2) * K_PER_SPLIT
    k_hi = tl.minimum(K, k_lo + K_PER_SPLIT)
    acc = tl.full((BM, BN), 0.0, tl.float32)
    for k0 in range(k_lo, k_hi, BK):
        kk = k0 + rk
        x = tl.load(x_ptr + rm[:, None] * K + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < k_hi), other=0.0)
        w = tl.load(w_ptr + rn[:, None] * K + kk[None, :], mask=(rn[:, None] < N) & (kk[None, :] < k_hi), other=0.0)
        if IS_FP32:
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        elif UPCAST:  # the interpreter multiplies bf16 operands as their raw bits: through fp32 (exact)
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    out = (rm[:, None] < M) & (rn[None, :] < N)
    if SPLIT:  # fp32 partial sums into the zeroed workspace; bias and dtype afterwards
        tl.atomic_add(y_ptr + rm[:, None] * N + rn[None, :], acc, mask=out)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + rm[:, None] * N + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=out)


def choose_config(M: int, N: int, K: int, programs_wanted: int) -> dict:
    """``BLOCK_N`` and ``SPLIT_K`` for an ``M x N x K`` product: the widest column block whose grid reaches
    ``programs_wanted`` programs, else the narrowest with K split (each split at least 4 ``BLOCK_K`` steps)."""
    m_blocks = triton.cdiv(M, BLOCK_M)
    for bn in BLOCK_NS:
        if triton.cdiv(N, bn) * m_blocks >= programs_wanted:
            return {"BLOCK_N": bn, "SPLIT_K": 1}
    bn = BLOCK_NS[-1]
    grid = triton.cdiv(N, bn) * m_blocks
    split = max(1, min(triton.cdiv(programs_wanted, grid), triton.cdiv(K, 4 * BLOCK_K)))
    return {"BLOCK_N": bn, "SPLIT_K": split}


def _programs_wanted(device: torch.device) -> int:
    if device.type == "cuda":
        return 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return 1  # the interpreter (CPU tensors) and devices without a count: no split unless asked


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                 config: Optional[dict] = None) -> torch.Tensor:  # fmt: skip
    """``x[..., K] @ weight[N, K]^T + bias`` with x, weight and bias in one dtype (the op checks them);
    ``config``: ``{"BLOCK_N": 16|32|64, "SPLIT_K": s}`` instead of :func:`choose_config`'s (tests)."""
    N, K = weight.shape
    x2 = x.reshape(-1, K).contiguous()
    M = x2.shape[0]
    if M == 0:
        return torch.empty(*x.shape[:-1], N, dtype=x.dtype, device=x.device)
    cfg = config or choose_config(M, N, K, _programs_wanted(x.device))
    bn, split = cfg["BLOCK_N"], cfg["SPLIT_K"]
    k_per = triton.cdiv(triton.cdiv(K, BLOCK_K), split) * BLOCK_K
    split = triton.cdiv(K, k_per)  # no empty split
    w = weight.contiguous()
    y = (torch.zeros if split > 1 else torch.empty)(M, N, dtype=torch.float32 if split > 1 else x.dtype, device=x.device)
    b = bias.contiguous() if bias is not None else w  # any pointer: not read without HAS_BIAS
    grid = (triton.cdiv(N, bn), triton.cdiv(M, BLOCK_M), split)
    with interpreter_scope():
        _dense_kernel[grid](x2, w, b, y, M, N, K, k_per, HAS_BIAS=bias is not None, IS_FP32=x.dtype == torch.float32,
                            UPCAST=INTERPRETED and x.dtype == torch.bfloat16, SPLIT=split > 1,
                            BM=BLOCK_M, BN=bn, BK=BLOCK_K)  # fmt: skip
    if split > 1:
        y = (y if bias is None else y + bias.float()).to(x.dtype)
    return y.reshape(*x.shape[:-1], N)
