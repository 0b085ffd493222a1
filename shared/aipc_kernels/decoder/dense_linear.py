"""``torch.ops.aipc.dense_linear(x, weight, bias=None) -> y``: ``F.linear`` for the few rows of a decode
step, with a fake kernel (usable under torch.compile).

``y[..., N] = x[..., K] @ weight[N, K]^T + bias``, ``y`` in ``x``'s dtype; the weight stays the model's
own float32 / bf16 / fp16 tensor in its own layout. Beam search decodes ``beams x batch`` rows per step,
where torch's GEMM reads the weights at a fraction of the memory bandwidth; these kernels stream every
weight row once for all rows, float32 accumulation.

Dispatch: CPU with at most :func:`cpu_max_rows` rows -> ``csrc/generic/dense_linear.c`` (AVX-512 / AVX2 / portable,
OpenMP; the weight may be in another float dtype than x: it is converted in registers); XPU with at
most :data:`MAX_M` rows and one dtype -> the Triton kernel (:mod:`aipc_kernels.gpu.triton.dense_linear`);
CUDA -> ``F.linear`` (cuBLAS measured faster than the Triton kernel on an H200); more rows (a prompt),
other dtypes, or no kernel -> ``F.linear`` itself (a compute-bound GEMM is what it is good at). Operands are checked first: a bad one is a ValueError naming it.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from aipc_kernels.core import native

#: rows of x (beams x batch) up to which the Triton kernel runs; more rows go to F.linear
MAX_M = 32
#: rows up to which the CPU kernel runs, where it measured faster than F.linear on every Llama shape
#: (bench/results/cpu/gemv_cpu_dense_xeon.md, 2-core Xeon): float32 weights 1.05-1.96x at M = 4 and 8, 0.74-0.90x
#: at 16 (compute-bound in float32 FMAs); bf16 x and weights on AVX512-BF16 dot products 1.12-1.39x at 16;
#: half weights through float32 FMAs (fp16, or a CPU without AVX512-BF16): 1.3-1.6x at 4, 0.6x at 8 (the
#: bf16 rows of a run on the same Xeon before the AVX512-BF16 path existed; that file was replaced)
CPU_MAX_M_FP32, CPU_MAX_M_BF16_DOT, CPU_MAX_M_HALF = 8, 16, 4
#: float dtypes the kernels read (x, bias and y in one of them, the weight in any of them on the CPU)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_dense_operands(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
    """ValueError naming the operand that does not fit ``F.linear(x, weight, bias)``."""
    if weight.dim() != 2:
        raise ValueError(f"dense_linear: weight must be 2-D [out_features, in_features], got shape {tuple(weight.shape)}")
    if x.dim() == 0 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"dense_linear: x of shape {tuple(x.shape)} does not match weight's in_features="
                         f"{weight.shape[1]} (x[..., K] @ weight[N, K]^T)")  # fmt: skip
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"dense_linear: bias must have shape ({weight.shape[0]},) (weight's out_features), "
                         f"got {tuple(bias.shape)}")  # fmt: skip
    for name, t in (("x", x), ("weight", weight), ("bias", bias)):
        if t is not None and not t.dtype.is_floating_point:
            raise ValueError(f"dense_linear: {name} must be a float tensor, got {t.dtype}")
        if t is not None and t.device != x.device:
            raise ValueError(f"dense_linear: {name} is on {t.device}, x on {x.device}; move them to one device")


def cpu_max_rows(x_dtype: torch.dtype, weight_dtype: torch.dtype) -> int:
    """Rows of x up to which the CPU op runs the native kernel (0: never; more rows: F.linear)."""
    if x_dtype not in DTYPES or weight_dtype not in DTYPES:
        return 0
    if weight_dtype == torch.float32:
        return CPU_MAX_M_FP32
    if x_dtype == weight_dtype == torch.bfloat16 and native.available() and native.bf16_dot_products():
        return CPU_MAX_M_BF16_DOT
    return CPU_MAX_M_HALF


def _rows(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1] if x.shape[-1] else 0


def _torch_linear(x, weight, bias):
    """``F.linear`` with the weight and bias in x's dtype (the path for prompts and other dtypes)."""
    return F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))


def _dense_reference(x, weight, bias=None):
    check_dense_operands(x, weight, bias)
    return _torch_linear(x, weight, bias)


def _dense_cpu(x, weight, bias=None):
    """CPU: the native streaming kernel for 1..cpu_max_rows rows of float x, else F.linear."""
    check_dense_operands(x, weight, bias)
    M = _rows(x)
    if not (native.available() and 0 < M <= cpu_max_rows(x.dtype, weight.dtype)):
        return _torch_linear(x, weight, bias)
    x = x.contiguous()
    if not weight.is_contiguous():  # a transposed view: copied per call; optimize() keeps weights dense
        weight = weight.contiguous()
    if bias is not None and (bias.dtype != x.dtype or not bias.is_contiguous()):
        bias = bias.to(x.dtype).contiguous()
    y = torch.empty((*x.shape[:-1], weight.shape[0]), dtype=x.dtype)
    native.dense_linear_into(y, x, weight, bias, check_dense=False)
    return y


def _dense_gpu(x, weight, bias=None):
    """XPU: the Triton kernel for 1..MAX_M rows with x, weight and bias in one dtype, else F.linear. CUDA:
    F.linear (cuBLAS), which the Triton kernel did not beat on an H200 at any M (0.72-1.00x at M <= 16 on
    the Llama shapes, bench/results/gpu/gemv_gpu_dense.md); the kernel stays tested there."""
    check_dense_operands(x, weight, bias)
    if x.device.type == "cuda":
        return _torch_linear(x, weight, bias)
    M = _rows(x)
    same = x.dtype in DTYPES and weight.dtype == x.dtype and (bias is None or bias.dtype == x.dtype)
    if not (0 < M <= MAX_M and same):
        return _torch_linear(x, weight, bias)
    try:
        from aipc_kernels.gpu.triton.dense_linear import dense_linear as triton_dense_linear
    except ImportError:  # triton not installed
        return _torch_linear(x, weight, bias)
    return triton_dense_linear(x, weight, bias)


_LIB = torch.library.Library("aipc", "FRAGMENT")
_LIB.define("dense_linear(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor")
_LIB.impl("dense_linear", _dense_reference, "CompositeExplicitAutograd")
_LIB.impl("dense_linear", _dense_cpu, "CPU")
_LIB.impl("dense_linear", _dense_gpu, "CUDA")
_LIB.impl("dense_linear", _dense_gpu, "XPU")


@torch.library.register_fake("aipc::dense_linear")
def _dense_fake(x, weight, bias=None):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` through ``aipc::dense_linear`` (see the module docstring)."""
    return torch.ops.aipc.dense_linear(x, weight, bias)
