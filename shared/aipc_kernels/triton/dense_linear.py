"""Triton small-M dense linear (CUDA, Intel XPU; ``TRITON_INTERPRET=1`` on CPU for tests).

``y[M, N] = x[M, K] @ w[N, K]^T + bias`` for the few rows of a decode step (beams x batch), the weight
in the model's own layout and dtype, read once: one program per ``BLOCK_N`` output columns and
``BLOCK_M`` rows (one row block for M <= 16), ``tl.dot`` over ``BLOCK_K`` slices (16 rows is the matrix
units' smallest tile; the padding rows are masked). fp32: exact fp32 products (``ieee``); fp16 / bf16:
matrix-unit products, fp32 accumulation. Same contract as ``aipc::dense_linear``'s CPU kernel.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .lowbit.interpret import INTERPRETED, interpreter_scope  # decorated in the same import as this kernel

BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 128


@triton.jit
def _dense_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, HAS_BIAS: tl.constexpr, IS_FP32: tl.constexpr, UPCAST: tl.constexpr,
                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):  # fmt: skip
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    rm = tl.program_id(1) * BM + tl.arange(0, BM)
    rk = tl.arange(0, BK)
    acc = tl.full((BM, BN), 0.0, tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + rk
        x = tl.load(x_ptr + rm[:, None] * K + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        w = tl.load(w_ptr + rn[:, None] * K + kk[None, :], mask=(rn[:, None] < N) & (kk[None, :] < K), other=0.0)
        if IS_FP32:
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        elif UPCAST:  # the interpreter multiplies bf16 operands as their raw bits: through fp32 (exact)
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm[:, None] * N + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x[..., K] @ weight[N, K]^T + bias`` with x, weight and bias in one dtype (the op checks them)."""
    N, K = weight.shape
    x2 = x.reshape(-1, K).contiguous()
    M = x2.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M:
        w = weight.contiguous()
        b = bias.contiguous() if bias is not None else w  # any pointer: not read without HAS_BIAS
        grid = (triton.cdiv(N, BLOCK_N), triton.cdiv(M, BLOCK_M))
        with interpreter_scope():
            _dense_kernel[grid](x2, w, b, y, M, N, K, HAS_BIAS=bias is not None, IS_FP32=x.dtype == torch.float32,
                                UPCAST=INTERPRETED and x.dtype == torch.bfloat16,
                                BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K)  # fmt: skip
    return y.reshape(*x.shape[:-1], N)
