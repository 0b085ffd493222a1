"""The operand contract of ``aipc::lowbit_linear`` that every backend checks first: the shapes and
dtypes its tensors must have for its scalar arguments (:func:`operand_plan`) and the check of every
operand against the others (:func:`check_operands`). Registers nothing, imports no backend; the op
(:mod:`aipc_kernels.lowbit.ops`) and the Triton kernels both import it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

import torch

from aipc_kernels.lowbit.formats import CODEBOOKS, FILE_GROUP_SIZES, SCALE_DTYPES, WEIGHT_SCALE_DTYPES
from aipc_kernels.lowbit.packing import CPU_LAYOUT, LAYOUTS, TRITON_LAYOUT, packed_shapes, super_shape

NATIVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # x (and y) dtypes of every path
#: how ``aipc::lowbit_linear_a16`` turns 4-bit codes into floats: E0M4's bit operations, or a conversion
A16_DEQUANTS = ("e0m4", "int")


@dataclass(frozen=True, slots=True)
class OperandPlan:
    """What the tensors of a ``lowbit_linear`` call must be, derived from its scalar arguments."""

    bits: int
    cmul: float
    zero: float  # the code book's fixed zero point; NaN when zero points are stored per group (zeros)
    per_group_zeros: bool  # zeros holds zero points (affine code books)
    mins: bool  # zeros holds the min form's per-group mins (``min4``, ``min8``; the zero point stays fixed)
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
    if not (G == K or G in FILE_GROUP_SIZES) or K % G or (G == 16 and cb.bits == 1):
        raise ValueError(
            f"lowbit_linear: group_size={G} must be one of {FILE_GROUP_SIZES} dividing x's K={K} (16: codes of 2 "
            f"bits and more), or K itself (one group per row)"
        )
    if act_group < 0 or (act_group and (act_group % G or K % act_group)):
        raise ValueError(
            f"lowbit_linear: act_group={act_group} must be 0 (per-token activation scales) or a multiple of "
            f"group_size={G} that divides x's K={K}"
        )
    qshape, gshape = packed_shapes(layout, cb.bits, out_features, K, G)
    zero = math.nan if cb.zero is None else float(cb.zero)
    return OperandPlan(cb.bits, float(cb.cmul), zero, cb.zero is None, cb.mins, qshape, gshape, act_group or K)


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
    act_amax: Optional[torch.Tensor] = None,
    check_devices: bool = True,
    supers: Optional[torch.Tensor] = None,
) -> OperandPlan:
    """Validates every operand of ``aipc::lowbit_linear`` against the others before any kernel runs: x's
    dtype and K, qweight's dtype and full shape for the layout, scales/zeros shape and dtype (zeros exactly
    when the code book stores per-group zero points), bias, group_size, act_group, act_amax (float32, one
    value per token: ``[M]`` or ``x.shape[:-1]``, only with ``act_group == 0``), ``supers`` (the two-level
    form's float32 super-block scales, exactly with int8 scales: :func:`check_supers`) and devices. Raises a
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
    two_level = supers is not None or scales.dtype == torch.int8
    if two_level:
        check_supers(plan, scales, supers, layout, codebook, group_size, out_features, x.shape[-1])
    elif scales.dtype not in WEIGHT_SCALE_DTYPES or scales.shape != plan.group_shape:
        raise ValueError(
            f"lowbit_linear: scales of shape {tuple(scales.shape)} and dtype {scales.dtype}: expected {plan.group_shape} "
            f"({layout}, out_features={out_features}, K={x.shape[-1]}, group_size={group_size}) in one of {WEIGHT_SCALE_DTYPES}"
        )
    if plan.per_group_zeros or plan.mins:
        if zeros is None or zeros.dtype != scales.dtype or zeros.shape != plan.group_shape:
            got = "None" if zeros is None else f"{zeros.dtype} {tuple(zeros.shape)}"
            what = "a min per group (the min form)" if plan.mins else "a zero point per group"
            raise ValueError(
                f"lowbit_linear: zeros is {got}; codebook {codebook!r} stores {what}: expected "
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
    if act_amax is not None:
        _check_act_amax(x, act_amax, act_group)
    if not check_devices:
        return plan
    device = x.device
    for name, t in (("qweight", qweight), ("scales", scales), ("zeros", zeros), ("bias", bias), ("act_amax", act_amax),
                    ("supers", supers)):  # fmt: skip
        if t is not None and t.device != device:
            raise ValueError(f"lowbit_linear: {name} is on {t.device} but x is on {device}; move them to one device")
    return plan


def check_supers(plan: OperandPlan, scales: torch.Tensor, supers: Optional[torch.Tensor], layout: str, codebook: str,
                 group_size: int, out_features: int, K: int) -> None:  # fmt: skip
    """The two-level form's operands (int8 ``scales`` and float32 ``supers`` ``[S, *super_shape]``, S = 2 for
    a min form): ValueError naming what is wrong."""
    S = 2 if plan.mins else 1
    if supers is None or scales.dtype != torch.int8 or scales.shape != plan.group_shape:
        raise ValueError(
            f"lowbit_linear: scales {scales.dtype} {tuple(scales.shape)} with supers "
            f"{'None' if supers is None else tuple(supers.shape)}: the two-level form takes int8 scales "
            f"{plan.group_shape} and float32 supers [{S}, ...]; other scales ({WEIGHT_SCALE_DTYPES}) take supers=None"
        )
    if plan.per_group_zeros:
        raise ValueError(f"lowbit_linear: codebook {codebook!r} stores zero points; the two-level form (supers) takes "
                         f"fixed-zero and min-form code books")  # fmt: skip
    if layout == TRITON_LAYOUT:  # the progressive form only: one super-block a row (any number of groups)
        if not plan.mins or supers.dtype != torch.float32 or tuple(supers.shape) != (2, 1, out_features):
            raise ValueError(
                f"lowbit_linear: supers of shape {tuple(supers.shape)} and dtype {supers.dtype} with codebook {codebook!r}: "
                f"{layout} takes the two-level form as the progressive one (a min form, float32 supers [2, 1, "
                f"{out_features}]): pack the weight with aipc_kernels.lowbit.packing.pack_for_triton"
            )
        return
    if layout == CPU_LAYOUT and plan.mins and supers.dim() == 4 and supers.shape[0] == 1:  # the progressive form
        if supers.dtype != torch.float32 or tuple(supers.shape) != (1, *super_shape(layout, out_features, 1)):
            raise ValueError(
                f"lowbit_linear: supers of shape {tuple(supers.shape)} and dtype {supers.dtype}: one set of super "
                f"scales with codebook {codebook!r} is the progressive form, float32 {[1, *super_shape(layout, out_features, 1)]} "
                f"(one s0 a row): pack the weight with aipc_kernels.lowbit.packing.pack_for_cpu"
            )
        return
    nsb = supers.shape[-2] if layout == CPU_LAYOUT and supers.dim() == 4 else supers.shape[-1] if supers.dim() == 3 else 0
    SB = K // nsb if nsb and K % nsb == 0 else 0
    per = SB // group_size if SB and SB % group_size == 0 else 0
    if supers.dtype != torch.float32 or not per or per & (per - 1) or tuple(supers.shape) != (S, *super_shape(layout, out_features, nsb)):
        raise ValueError(
            f"lowbit_linear: supers of shape {tuple(supers.shape)} and dtype {supers.dtype}: expected float32 "
            f"[{S}, *{super_shape(layout, out_features, max(nsb, 1))}] ({layout}) with K={K} / super-blocks a "
            f"power-of-two multiple of group_size={group_size}"
        )


def _check_act_amax(x: torch.Tensor, act_amax: torch.Tensor, act_group: int) -> None:
    """``act_amax``: the per-token activation absmax the kernels quantize x with instead of each token's own
    (a tensor-parallel rank's slice of a row quantized with the whole row's absmax)."""
    lead = tuple(x.shape[:-1])
    M = math.prod(lead)
    if act_amax.dtype != torch.float32 or tuple(act_amax.shape) not in ((M,), lead):
        raise ValueError(
            f"lowbit_linear: act_amax of shape {tuple(act_amax.shape)} and dtype {act_amax.dtype}: expected "
            f"torch.float32 [M={M}] (one absmax per token of x, x's leading dims {lead} flattened)"
        )
    if act_group:
        raise ValueError(
            f"lowbit_linear: act_amax is given with act_group={act_group}; a given absmax is per token: use "
            f"act_group=0 or pass act_amax=None"
        )


def check_operands_a16(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    layout: str,
    codebook: str,
    group_size: int,
    out_features: int,
    dequant: str,
    check_devices: bool = True,
) -> OperandPlan:
    """:func:`check_operands` for ``aipc::lowbit_linear_a16`` (activations unquantized): the same operand
    checks, a 4-bit code book and a known ``dequant``."""
    cb = CODEBOOKS.get(codebook)
    if cb is not None and cb.bits != 4:
        four = sorted(name for name, c in CODEBOOKS.items() if c.bits == 4)
        raise ValueError(
            f"lowbit_linear_a16: codebook={codebook!r} has {cb.bits}-bit codes; the W4A16 kernels take a 4-bit code "
            f"book ({four}); use lowbit_linear (W*A8) for it"
        )
    if cb is not None and cb.mins:
        raise ValueError(
            f"lowbit_linear_a16: codebook={codebook!r} is a min form (w = s*c + m, GGUF's Q4_1); the W4A16 kernels "
            f"do not take it: use lowbit_linear (W*A8)"
        )
    if scales.dtype not in SCALE_DTYPES.values():
        raise ValueError(
            f"lowbit_linear_a16: scales have dtype {scales.dtype}; the W4A16 kernels take {tuple(SCALE_DTYPES.values())} "
            f"(float32 scales: use lowbit_linear, W*A8)"
        )
    if dequant not in A16_DEQUANTS:
        raise ValueError(f"lowbit_linear_a16: dequant={dequant!r} is unknown; use one of {A16_DEQUANTS}")
    return check_operands(x, qweight, scales, zeros, bias, layout, codebook, group_size, out_features, 0,
                          check_devices=check_devices)  # fmt: skip
