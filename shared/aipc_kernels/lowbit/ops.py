"""``torch.library`` custom ops of aipc_kernels, with fake kernels (usable under torch.compile).

``torch.ops.aipc.lowbit_linear(x, qweight, scales, zeros, bias, layout, codebook, group_size,
out_features, act_group, act_amax=None, supers=None) -> y``: ``y[..., N] = x[..., K] @ W^T + bias`` for a
low-bit ``W`` in a device layout (:mod:`aipc_kernels.lowbit.packing`), ``y`` in ``x``'s dtype. ``supers``: the
two-level form's float32 super-block scales (``scales`` and mins int8; :mod:`aipc_kernels.lowbit.formats`). ``act_amax`` (float32,
one value per token, only with ``act_group == 0``): the absmax the int8 activations are scaled by
instead of each token's own, so a tensor-parallel rank holding a slice of x's K quantizes it with the
whole row's absmax (``xq = round(x * 127 / act_amax)`` clamped to [-127, 127]).

Dispatch: CPU + ``cpu_vnni16`` layout -> the native kernel (activations quantized to int8 inside it,
per token, or per K-group when ``act_group > 0``); every other case -> the reference (dequantize,
float32 matmul, activations unquantized). CUDA/XPU + ``triton_k32`` layout -> the Triton kernels
(:mod:`aipc_kernels.gpu.triton.lowbit`, int8 activations per token; triton imported lazily).
Every path first checks all operands against each other
(:func:`aipc_kernels.lowbit.contract.check_operands`): a bad one is a ValueError naming it, before any
kernel runs.

``torch.ops.aipc.lowbit_linear_a16(x, qweight, scales, zeros, bias, layout, codebook, group_size,
out_features, dequant) -> y``: the activation-exact W4A16 linear for a 4-bit code book (``int4``,
``affine4``, ``e0m4``): the same ``y``, x never quantized, float32 accumulation. ``dequant``: ``e0m4``
(Transformer-Lite's two bit operations: the code into the fraction of ``1.0``) or ``int`` (an
int-to-float conversion), the two strategies of the paper's comparison; both exact. CPU +
``cpu_vnni16`` -> ``csrc/generic/lowbit_a16.c`` (bf16 x through AVX512-BF16 dot products where the CPU has them,
else float32 FMAs); CUDA/XPU + ``triton_k32`` -> :mod:`aipc_kernels.gpu.triton.lowbit.a16` (bf16 matrix
units); anything else -> the reference (dequantize, float32 matmul).
"""
from __future__ import annotations

from typing import Optional

import torch

from aipc_kernels.core import native
from aipc_kernels.lowbit.formats import LowBitWeight
from aipc_kernels.lowbit.contract import check_operands, check_operands_a16
from aipc_kernels.lowbit.packing import CPU_LAYOUT, TRITON_LAYOUT, PackedLowBit, to_canonical
from aipc_kernels.lowbit.quantizers import quantize_activations


def _as_packed(qweight, scales, zeros, layout, codebook, group_size, out_features, K, supers=None) -> PackedLowBit:
    return PackedLowBit(layout, qweight, scales, zeros, codebook, group_size, out_features, K, supers)


def reference_linear(x: torch.Tensor, weight: LowBitWeight, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Weight-only reference: dequantize, float32 matmul, cast back to ``x``'s dtype."""
    y = x.float() @ weight.dequantize(torch.float32).to(x.device).T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def reference_linear_w8(
    x: torch.Tensor,
    weight: LowBitWeight,
    bias: Optional[torch.Tensor] = None,
    act_group: int = 0,
    act_amax: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The native kernel's exact math in float64: int8 activations (same rounding; scaled by ``act_amax``
    when given), integer group dot products, per-group scales and zero correction (and the min form's
    min times the group sum). Returns float64."""
    K = x.shape[-1]
    G = weight.group_size
    xq, sx = quantize_activations(x.reshape(-1, K), act_group if act_group > 0 else None, act_amax)
    sx = sx.double().repeat_interleave((act_group if act_group > 0 else K) // G, dim=-1)  # [M, K/G]
    v = weight.values().double().reshape(weight.out_features, K // G, G)  # cmul*c - z
    xg = xq.double().reshape(-1, K // G, G)
    dots = torch.einsum("mgk,ngk->mng", xg, v)  # exact: small integers times z in float64
    terms = dots * weight.group_scales().double().unsqueeze(0)
    if weight.cb.mins:  # the min form: + m * (group sum of the int8 activations)
        terms = terms + xg.sum(-1).unsqueeze(1) * weight.group_mins().double().unsqueeze(0)
    y = (terms * sx.unsqueeze(1)).sum(-1)
    if bias is not None:
        y = y + bias.double()
    return y.reshape(*x.shape[:-1], weight.out_features)


# Registered through torch.library.Library (define + impl) rather than torch.library.custom_op:
# the latter's Python wrapper costs ~20 us more per call, which decode pays per linear layer.
_LIB = torch.library.Library("aipc", "DEF")
_LIB.define(
    "lowbit_linear(Tensor x, Tensor qweight, Tensor scales, Tensor? zeros, Tensor? bias, str layout, "
    "str codebook, int group_size, int out_features, int act_group, Tensor? act_amax=None, "
    "Tensor? supers=None) -> Tensor"
)


def _reference_checked(x, qweight, scales, zeros, bias, layout, codebook, group_size, out_features,
                       supers=None) -> torch.Tensor:  # fmt: skip
    """The weight-only reference for operands that passed :func:`check_operands` (which reads no values:
    what only the values can break, e0m4's integer zero points, the canonical weight checks here)."""
    try:
        w = to_canonical(_as_packed(qweight, scales, zeros, layout, codebook, group_size, out_features, x.shape[-1],
                                    supers))  # fmt: skip
    except ValueError as e:
        raise ValueError(f"lowbit_linear: zeros do not fit codebook {codebook!r}: {e}") from None
    return reference_linear(x, w, bias)


def _lowbit_linear_reference(
    x, qweight, scales, zeros, bias, layout, codebook, group_size, out_features, act_group, act_amax=None, supers=None
):
    """Any device: the weight-only reference (dequantize, float32 matmul; activations unquantized, so
    ``act_amax`` is checked, then has nothing to scale)."""
    check_operands(x, qweight, scales, zeros, bias, layout, codebook, group_size, out_features, act_group, act_amax,
                   supers=supers)  # fmt: skip
    return _reference_checked(x, qweight, scales, zeros, bias, layout, codebook, group_size, out_features, supers)


def _lowbit_linear_cpu(x, qweight, scales, zeros, bias, layout, codebook, group_size, out_features, act_group,
                       act_amax=None, supers=None):  # fmt: skip
    """CPU: the native kernel for the ``cpu_vnni16`` layout, else the reference.

    Decode calls this once per linear layer per token, and it runs right after a kernel that streamed
    megabytes of weights through the caches, so every Python step here costs several times its hot
    price: the operands are checked once (:func:`check_operands`), then the body makes every operand
    dense itself and skips the per-operand checks of ``native.lowbit_linear_into``."""
    plan = check_operands(
        x, qweight, scales, zeros, bias, layout, codebook, group_size, out_features, act_group, act_amax,
        check_devices=False, supers=supers,
    )  # fmt: skip
    if layout != CPU_LAYOUT or not native.available():
        return _reference_checked(x, qweight, scales, zeros, bias, layout, codebook, group_size, out_features, supers)
    if not x.is_contiguous():  # the kernel reads x as dense [M, K] rows
        x = x.contiguous()
    y = torch.empty((*x.shape[:-1], out_features), dtype=x.dtype)  # written densely as [M, N]
    # weights are module parameters, dense already
    if not all(t is None or t.is_contiguous() for t in (qweight, scales, zeros, supers)):
        qweight, scales = qweight.contiguous(), scales.contiguous()
        zeros = None if zeros is None else zeros.contiguous()
        supers = None if supers is None else supers.contiguous()
    if bias is not None and (bias.dtype != x.dtype or not bias.is_contiguous()):
        bias = bias.to(x.dtype).contiguous()
    if act_amax is not None and not act_amax.is_contiguous():
        act_amax = act_amax.contiguous()
    native.lowbit_linear_into(
        y, x, qweight, scales, zeros, bias, plan.bits, group_size, plan.cmul, plan.zero, plan.act_span, act_amax,
        check_dense=False, supers=supers,
    )  # fmt: skip
    return y


def _lowbit_linear_gpu(x, qweight, scales, zeros, bias, layout, codebook, group_size, out_features, act_group,
                       act_amax=None, supers=None):  # fmt: skip
    """CUDA / XPU: the Triton kernels for the ``triton_k32`` layout (which check the operands with
    :func:`check_operands`; single-level scales, or the progressive form's), else the reference."""
    if layout != TRITON_LAYOUT:
        return _lowbit_linear_reference(
            x, qweight, scales, zeros, bias, layout, codebook, group_size, out_features, act_group, act_amax, supers
        )
    from aipc_kernels.gpu.triton.lowbit import lowbit_linear_triton  # lazy: triton is imported only here

    K = x.shape[-1] if x.dim() else 0
    w = _as_packed(qweight, scales, zeros, layout, codebook, group_size, out_features, K, supers)
    return lowbit_linear_triton(x, w, bias, act_group, act_amax=act_amax)


_LIB.impl("lowbit_linear", _lowbit_linear_reference, "CompositeExplicitAutograd")
_LIB.impl("lowbit_linear", _lowbit_linear_cpu, "CPU")
_LIB.impl("lowbit_linear", _lowbit_linear_gpu, "CUDA")
_LIB.impl("lowbit_linear", _lowbit_linear_gpu, "XPU")


@torch.library.register_fake("aipc::lowbit_linear")
def _lowbit_linear_fake(x, qweight, scales, zeros, bias, layout, codebook, group_size, out_features, act_group,
                        act_amax=None, supers=None):  # fmt: skip
    return x.new_empty(*x.shape[:-1], out_features)


def lowbit_linear(
    x: torch.Tensor,
    weight: PackedLowBit,
    bias: Optional[torch.Tensor] = None,
    act_group: int = 0,
    act_amax: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``x @ W^T + bias`` for a packed low-bit weight (see the module docstring)."""
    return torch.ops.aipc.lowbit_linear(
        x, weight.qweight, weight.scales, weight.zeros, bias, weight.layout, weight.codebook,
        weight.group_size, weight.out_features, act_group, act_amax, weight.supers,
    )  # fmt: skip


# ------------------------------------------------------------------ the activation-exact W4A16 op

_LIB.define(
    "lowbit_linear_a16(Tensor x, Tensor qweight, Tensor scales, Tensor? zeros, Tensor? bias, str layout, "
    "str codebook, int group_size, int out_features, str dequant) -> Tensor"
)


def _a16_reference(x, qweight, scales, zeros, bias, layout, codebook, group_size, out_features, dequant):
    """Any device: the reference (dequantize, float32 matmul): activation-exact like the kernels."""
    check_operands_a16(x, qweight, scales, zeros, bias, layout, codebook, group_size, out_features, dequant)
    return _reference_checked(x, qweight, scales, zeros, bias, layout, codebook, group_size, out_features)


def _a16_cpu(x, qweight, scales, zeros, bias, layout, codebook, group_size, out_features, dequant):
    """CPU: ``csrc/generic/lowbit_a16.c`` for the ``cpu_vnni16`` layout, else the reference."""
    plan = check_operands_a16(
        x, qweight, scales, zeros, bias, layout, codebook, group_size, out_features, dequant, check_devices=False
    )
    if layout != CPU_LAYOUT or not native.available():
        return _reference_checked(x, qweight, scales, zeros, bias, layout, codebook, group_size, out_features)
    x = x.contiguous()
    qweight, scales = qweight.contiguous(), scales.contiguous()
    zeros = None if zeros is None else zeros.contiguous()
    if bias is not None:
        bias = bias.to(x.dtype).contiguous()
    y = torch.empty((*x.shape[:-1], out_features), dtype=x.dtype)
    native.lowbit_linear_a16_into(y, x, qweight, scales, zeros, bias, group_size, plan.zero, dequant, check_dense=False)
    return y


def _a16_gpu(x, qweight, scales, zeros, bias, layout, codebook, group_size, out_features, dequant):
    """CUDA / XPU: the Triton W4A16 kernel for the ``triton_k32`` layout, else the reference."""
    if layout != TRITON_LAYOUT:
        return _a16_reference(x, qweight, scales, zeros, bias, layout, codebook, group_size, out_features, dequant)
    from aipc_kernels.gpu.triton.lowbit.a16 import lowbit_linear_a16_triton  # lazy: triton is imported only here

    K = x.shape[-1] if x.dim() else 0
    w = _as_packed(qweight, scales, zeros, layout, codebook, group_size, out_features, K)
    return lowbit_linear_a16_triton(x, w, bias, dequant)


_LIB.impl("lowbit_linear_a16", _a16_reference, "CompositeExplicitAutograd")
_LIB.impl("lowbit_linear_a16", _a16_cpu, "CPU")
_LIB.impl("lowbit_linear_a16", _a16_gpu, "CUDA")
_LIB.impl("lowbit_linear_a16", _a16_gpu, "XPU")


@torch.library.register_fake("aipc::lowbit_linear_a16")
def _a16_fake(x, qweight, scales, zeros, bias, layout, codebook, group_size, out_features, dequant):
    return x.new_empty(*x.shape[:-1], out_features)


def a16_dequant(layout: str = CPU_LAYOUT) -> str:
    """The dequantization W4A16 layers take: for the CPU layout the fastest one of the kernel the
    ISA in use runs (:func:`aipc_kernels.core.native.fastest_a16_dequant`: ``int`` on AVX2, ``e0m4`` on
    AVX-512), else ``e0m4``. Both are exact; they differ in float32 rounding only."""
    return native.fastest_a16_dequant() if layout == CPU_LAYOUT and native.available() else "e0m4"


def lowbit_linear_a16(
    x: torch.Tensor, weight: PackedLowBit, bias: Optional[torch.Tensor] = None, dequant: str = "e0m4"
) -> torch.Tensor:
    """``x @ W^T + bias`` for a packed 4-bit weight with unquantized activations (see the module docstring);
    ``dequant``: ``e0m4`` or ``int`` (:func:`a16_dequant` says which runs fastest; decide it outside a
    compiled region, it asks the native library)."""
    return torch.ops.aipc.lowbit_linear_a16(
        x, weight.qweight, weight.scales, weight.zeros, bias, weight.layout, weight.codebook,
        weight.group_size, weight.out_features, dequant,
    )  # fmt: skip
