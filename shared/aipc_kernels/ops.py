"""``torch.library`` custom ops of aipc_kernels, with fake kernels (usable under torch.compile).

``torch.ops.aipc.lowbit_linear(x, qweight, scales, zeros, bias, layout, codebook, group_size,
out_features, act_group) -> y``: ``y[..., N] = x[..., K] @ W^T + bias`` for a low-bit ``W`` in a
device layout (:mod:`aipc_kernels.packing`), ``y`` in ``x``'s dtype.

Dispatch: CPU + ``cpu_vnni16`` layout -> the native kernel (activations quantized to int8 inside it,
per token, or per K-group when ``act_group > 0``); every other case -> the reference (dequantize,
float32 matmul, activations unquantized). CUDA/XPU + ``triton_k32`` layout -> the Triton kernels
(:mod:`aipc_kernels.triton.lowbit`, int8 activations per token; triton imported lazily).
Every path first checks all operands against each other (:func:`check_operands`): a bad one is a
ValueError naming it, before any kernel runs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

import torch

from . import native
from .formats import CODEBOOKS, GROUP_SIZES, SCALE_DTYPES, LowBitWeight
from .packing import CPU_LAYOUT, LAYOUTS, TRITON_LAYOUT, PackedLowBit, packed_shapes, to_canonical
from .quantizers import quantize_activations

NATIVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # x (and y) dtypes of every path


@dataclass(frozen=True, slots=True)
class OperandPlan:
    """What the tensors of a ``lowbit_linear`` call must be, derived from its scalar arguments."""

    bits: int
    cmul: float
    zero: float  # the code book's fixed zero point; NaN when zero points are stored per group (zeros)
    per_group_zeros: bool
    qweight_shape: tuple[int, ...]
    group_shape: tuple[int, ...]  # scales (and zeros)
    act_span: int  # activation-scale span for the native kernel: act_group, or K for per-token scales


@lru_cache(maxsize=512)
def operand_plan(layout: str, codebook: str, group_size: int, out_features: int, K: int, act_group: int) -> OperandPlan:
    """Validates the scalar arguments against x's ``K`` (ValueError naming the argument) and returns the
    shapes the tensors must have. Cached: a model has a handful of distinct (layout, shape) keys."""
    if layout not in LAYOUTS:
        raise ValueError(f"lowbit_linear: layout={layout!r} is unknown; use one of {LAYOUTS}")
    cb = CODEBOOKS.get(codebook)
    if cb is None:
        raise ValueError(f"lowbit_linear: codebook={codebook!r} is unknown; use one of {sorted(CODEBOOKS)}")
    if out_features < 1:
        raise ValueError(f"lowbit_linear: out_features={out_features} must be positive")
    if K < 32 or K % 32:
        raise ValueError(f"lowbit_linear: x has K={K} features (last dim); low-bit weights need a positive multiple of 32")
    G = group_size
    if not (G == K or G in GROUP_SIZES) or K % G:
        raise ValueError(
            f"lowbit_linear: group_size={G} must be one of {GROUP_SIZES} dividing x's K={K}, or K itself (one "
            f"group per row)"
        )
    if act_group < 0 or (act_group and (act_group % G or K % act_group)):
        raise ValueError(
            f"lowbit_linear: act_group={act_group} must be 0 (per-token activation scales) or a multiple of "
            f"group_size={G} that divides x's K={K}"
        )
    qshape, gshape = packed_shapes(layout, cb.bits, out_features, K, G)
    zero = math.nan if cb.zero is None else float(cb.zero)
    return OperandPlan(cb.bits, float(cb.cmul), zero, cb.zero is None, qshape, gshape, act_group or K)


def check_operands(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    layout: str,
    codebook: str,
    group_size: int,
    out_features: int,
    act_group: int,
    check_devices: bool = True,
) -> OperandPlan:
    """Validates every operand of ``aipc::lowbit_linear`` against the others before any kernel runs: x's
    dtype and K, qweight's dtype and full shape for the layout, scales/zeros shape and dtype (zeros exactly
    when the code book stores per-group zero points), bias, group_size, act_group and devices. Raises a
    ValueError naming the operand and what was expected. Cheap (the decode hot path runs it each call):
    a cached plan and a few shape/dtype comparisons. Strided operands are allowed (each path makes them dense).
    ``check_devices=False``: for the CPU kernel, which the dispatcher calls only when every tensor is on the CPU."""
    if x.dim() == 0 or x.dtype not in NATIVE_DTYPES:
        raise ValueError(
            f"lowbit_linear: x has dtype {x.dtype} and shape {tuple(x.shape)}; expected [..., K] in one of {NATIVE_DTYPES}"
        )
    plan = operand_plan(layout, codebook, group_size, out_features, x.shape[-1], act_group)
    if qweight.dtype != torch.uint8 or qweight.shape != plan.qweight_shape:
        raise ValueError(
            f"lowbit_linear: qweight of shape {tuple(qweight.shape)} and dtype {qweight.dtype} does not match x's "
            f"K={x.shape[-1]} and out_features={out_features}: expected torch.uint8 {plan.qweight_shape} ({layout}, "
            f"{plan.bits}-bit codebook {codebook!r})"
        )
    if scales.dtype not in SCALE_DTYPES.values() or scales.shape != plan.group_shape:
        raise ValueError(
            f"lowbit_linear: scales of shape {tuple(scales.shape)} and dtype {scales.dtype}: expected {plan.group_shape} "
            f"({layout}, out_features={out_features}, K={x.shape[-1]}, group_size={group_size}) in one of {tuple(SCALE_DTYPES.values())}"
        )
    if plan.per_group_zeros:
        if zeros is None or zeros.dtype != scales.dtype or zeros.shape != plan.group_shape:
            got = "None" if zeros is None else f"{zeros.dtype} {tuple(zeros.shape)}"
            raise ValueError(
                f"lowbit_linear: zeros is {got}; codebook {codebook!r} stores a zero point per group: expected "
                f"{scales.dtype} {plan.group_shape} like scales"
            )
    elif zeros is not None:
        raise ValueError(
            f"lowbit_linear: zeros given for codebook {codebook!r}, whose zero point is fixed ({plan.zero}); pass None"
        )
    if bias is not None and (not bias.dtype.is_floating_point or bias.shape != (out_features,)):
        raise ValueError(
            f"lowbit_linear: bias of shape {tuple(bias.shape)} and dtype {bias.dtype}: expected a floating "
            f"[out_features={out_features}] vector"
        )
    if not check_devices:
        return plan
    device = x.device
    for name, t in (("qweight", qweight), ("scales", scales), ("zeros", zeros), ("bias", bias)):
        if t is not None and t.device != device:
            raise ValueError(f"lowbit_linear: {name} is on {t.device} but x is on {device}; move them to one device")
    return plan


def _as_packed(qweight, scales, zeros, layout, codebook, group_size, out_features, K) -> PackedLowBit:
    return PackedLowBit(layout, qweight, scales, zeros, codebook, group_size, out_features, K)


def reference_linear(x: torch.Tensor, weight: LowBitWeight, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Weight-only reference: dequantize, float32 matmul, cast back to ``x``'s dtype."""
    y = x.float() @ weight.dequantize(torch.float32).to(x.device).T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def reference_linear_w8(
    x: torch.Tensor, weight: LowBitWeight, bias: Optional[torch.Tensor] = None, act_group: int = 0
) -> torch.Tensor:
    """The native kernel's exact math in float64: int8 activations (same rounding), integer group
    dot products, per-group scales and zero correction. Returns float64."""
    K = x.shape[-1]
    G = weight.group_size
    xq, sx = quantize_activations(x.reshape(-1, K), act_group if act_group > 0 else None)
    sx = sx.double().repeat_interleave((act_group if act_group > 0 else K) // G, dim=-1)  # [M, K/G]
    v = weight.values().double().reshape(weight.out_features, K // G, G)  # cmul*c - z
    xg = xq.double().reshape(-1, K // G, G)
    dots = torch.einsum("mgk,ngk->mng", xg, v)  # exact: small integers times z in float64
    y = (dots * weight.scales.double().unsqueeze(0) * sx.unsqueeze(1)).sum(-1)
    if bias is not None:
        y = y + bias.double()
    return y.reshape(*x.shape[:-1], weight.out_features)


# Registered through torch.library.Library (define + impl) rather than torch.library.custom_op:
# the latter's Python wrapper costs ~20 us more per call, which decode pays per linear layer.
_LIB = torch.library.Library("aipc", "DEF")
_LIB.define(
    "lowbit_linear(Tensor x, Tensor qweight, Tensor scales, Tensor? zeros, Tensor? bias, str layout, "
    "str codebook, int group_size, int out_features, int act_group) -> Tensor"
)


def _reference_checked(x, qweight, scales, zeros, bias, layout, codebook, group_size, out_features) -> torch.Tensor:
    """The weight-only reference for operands that passed :func:`check_operands`."""
    w = to_canonical(_as_packed(qweight, scales, zeros, layout, codebook, group_size, out_features, x.shape[-1]))
    return reference_linear(x, w, bias)


def _lowbit_linear_reference(x, qweight, scales, zeros, bias, layout, codebook, group_size, out_features, act_group):
    """Any device: the weight-only reference (dequantize, float32 matmul)."""
    check_operands(x, qweight, scales, zeros, bias, layout, codebook, group_size, out_features, act_group)
    return _reference_checked(x, qweight, scales, zeros, bias, layout, codebook, group_size, out_features)


def _lowbit_linear_cpu(x, qweight, scales, zeros, bias, layout, codebook, group_size, out_features, act_group):
    """CPU: the native kernel for the ``cpu_vnni16`` layout, else the reference.

    Decode calls this once per linear layer per token, and it runs right after a kernel that streamed
    megabytes of weights through the caches, so every Python step here costs several times its hot
    price: the operands are checked once (:func:`check_operands`), then the body makes every operand
    dense itself and skips the per-operand checks of ``native.lowbit_linear_into``."""
    plan = check_operands(
        x, qweight, scales, zeros, bias, layout, codebook, group_size, out_features, act_group, check_devices=False
    )
    if layout != CPU_LAYOUT or not native.available():
        return _reference_checked(x, qweight, scales, zeros, bias, layout, codebook, group_size, out_features)
    if not x.is_contiguous():  # the kernel reads x as dense [M, K] rows
        x = x.contiguous()
    y = torch.empty((*x.shape[:-1], out_features), dtype=x.dtype)  # written densely as [M, N]
    # weights are module parameters, dense already
    if not (qweight.is_contiguous() and scales.is_contiguous() and (zeros is None or zeros.is_contiguous())):
        qweight, scales = qweight.contiguous(), scales.contiguous()
        zeros = None if zeros is None else zeros.contiguous()
    if bias is not None and (bias.dtype != x.dtype or not bias.is_contiguous()):
        bias = bias.to(x.dtype).contiguous()
    native.lowbit_linear_into(
        y, x, qweight, scales, zeros, bias, plan.bits, group_size, plan.cmul, plan.zero, plan.act_span,
        check_dense=False,
    )  # fmt: skip
    return y


def _lowbit_linear_gpu(x, qweight, scales, zeros, bias, layout, codebook, group_size, out_features, act_group):
    """CUDA / XPU: the Triton kernels for the ``triton_k32`` layout (which check the operands with
    :func:`check_operands`), else the reference."""
    if layout != TRITON_LAYOUT:
        return _lowbit_linear_reference(x, qweight, scales, zeros, bias, layout, codebook, group_size, out_features, act_group)
    from .triton.lowbit import lowbit_linear_triton  # lazy: triton is imported only here

    K = x.shape[-1] if x.dim() else 0
    w = _as_packed(qweight, scales, zeros, layout, codebook, group_size, out_features, K)
    return lowbit_linear_triton(x, w, bias, act_group)


_LIB.impl("lowbit_linear", _lowbit_linear_reference, "CompositeExplicitAutograd")
_LIB.impl("lowbit_linear", _lowbit_linear_cpu, "CPU")
_LIB.impl("lowbit_linear", _lowbit_linear_gpu, "CUDA")
_LIB.impl("lowbit_linear", _lowbit_linear_gpu, "XPU")


@torch.library.register_fake("aipc::lowbit_linear")
def _lowbit_linear_fake(x, qweight, scales, zeros, bias, layout, codebook, group_size, out_features, act_group):
    return x.new_empty(*x.shape[:-1], out_features)


def lowbit_linear(
    x: torch.Tensor, weight: PackedLowBit, bias: Optional[torch.Tensor] = None, act_group: int = 0
) -> torch.Tensor:
    """``x @ W^T + bias`` for a packed low-bit weight (see the module docstring)."""
    return torch.ops.aipc.lowbit_linear(
        x, weight.qweight, weight.scales, weight.zeros, bias, weight.layout, weight.codebook,
        weight.group_size, weight.out_features, act_group,
    )  # fmt: skip
