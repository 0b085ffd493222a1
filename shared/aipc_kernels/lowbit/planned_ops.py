"""The planned CPU ops: ``aipc::lowbit_linear`` and ``aipc::lowbit_linear_a16`` for a weight whose
operands were checked once, at load, so that a decode step's call is the C kernel and little else.

``torch.ops.aipc.lowbit_linear_cpu(x, qweight, scales, zeros, bias, bits, group_size, out_features,
cmul, zero, act_group, act_amax=None, mins=False, supers=None)`` and ``torch.ops.aipc.lowbit_linear_a16_cpu(x, qweight, scales,
zeros, bias, group_size, out_features, zero, dequant)`` compute what the general ops compute for a
``cpu_vnni16`` weight; their scalars come from :func:`plan_cpu_call`, which runs the general op's
:func:`~aipc_kernels.lowbit.contract.check_operands` on the weight. Their CPU kernels are C++ against
PyTorch's stable ABI (``csrc/ops/lowbit_ops.cpp``), registered when :func:`aipc_kernels.core.native.ops_library`
loads; each call still checks what can change per call (x's dtype and K against the weight, densities,
``act_amax``); ``zero`` is the code book's fixed zero point, ignored when ``zeros`` holds one per
group (no NaN constant in a compiled graph); ``mins=True``: ``zeros`` holds the min form's per-group
mins (code books ``min4`` / ``min8``, W*A8 only). Measured per-call cost: ``bench/gemv_cpu.py`` (``us`` against ``kernel_us``).

A build without the C++ unit (no torch at build time) has the schemas and fake kernels but no CPU kernel:
:func:`plan_cpu_call` then returns None and callers use the general ops; so does ``AIPC_PLANNED_OPS=0``
(an A/B switch for benchmarks: the same kernels through the general op).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch

from aipc_kernels.core import native
from aipc_kernels.lowbit.contract import check_operands, check_operands_a16
from aipc_kernels.lowbit.packing import CPU_LAYOUT, PackedLowBit

_LIB = torch.library.Library("aipc", "FRAGMENT")
_LIB.define(
    "lowbit_linear_cpu(Tensor x, Tensor qweight, Tensor scales, Tensor? zeros, Tensor? bias, int bits, "
    "int group_size, int out_features, float cmul, float zero, int act_group, Tensor? act_amax=None, "
    "bool mins=False, Tensor? supers=None) -> Tensor"
)
_LIB.define(
    "lowbit_linear_a16_cpu(Tensor x, Tensor qweight, Tensor scales, Tensor? zeros, Tensor? bias, int group_size, "
    "int out_features, float zero, int dequant) -> Tensor"
)


@torch.library.register_fake("aipc::lowbit_linear_cpu")
def _lowbit_linear_cpu_fake(x, qweight, scales, zeros, bias, bits, group_size, out_features, cmul, zero, act_group,
                            act_amax=None, mins=False, supers=None):  # fmt: skip
    return x.new_empty(*x.shape[:-1], out_features)


@torch.library.register_fake("aipc::lowbit_linear_a16_cpu")
def _lowbit_linear_a16_cpu_fake(x, qweight, scales, zeros, bias, group_size, out_features, zero, dequant):
    return x.new_empty(*x.shape[:-1], out_features)


def available() -> bool:
    """Whether the planned ops have their CPU kernels (the C++ unit and the C library were built)."""
    return native.ops_library() is not None


@dataclass(frozen=True, slots=True)
class CpuCall:
    """The scalar arguments of one weight's planned op (after ``x, qweight, scales, zeros, bias``)."""

    a16: bool
    args: tuple  # lowbit_linear_cpu: bits, group_size, out_features, cmul, zero, act_group (then act_amax, mins)
    #              lowbit_linear_a16_cpu: group_size, out_features, zero, dequant code
    mins: bool = False  # W*A8: zeros holds the min form's mins

    def __call__(self, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor],
                 bias: Optional[torch.Tensor] = None, act_amax: Optional[torch.Tensor] = None,
                 supers: Optional[torch.Tensor] = None) -> torch.Tensor:  # fmt: skip
        """``x @ W^T + bias`` through the planned op, with the tensors of the weight it was planned for
        (``act_amax``, ``supers``: W*A8 only, see ``aipc::lowbit_linear``)."""
        if self.a16:
            return torch.ops.aipc.lowbit_linear_a16_cpu(x, qweight, scales, zeros, bias, *self.args)
        return torch.ops.aipc.lowbit_linear_cpu(x, qweight, scales, zeros, bias, *self.args, act_amax, self.mins,
                                                supers)  # fmt: skip


def plan_cpu_call(weight: PackedLowBit, act_group: int = 0, dequant: Optional[str] = None) -> Optional[CpuCall]:
    """Checks ``weight``'s operands as the general op does on every call (ValueError naming the operand)
    and returns its planned call, or None where the planned ops do not apply: another layout, or a build
    without their CPU kernels. ``dequant`` (``e0m4`` / ``int``): the W4A16 op instead of W*A8."""
    x = torch.empty(1, weight.in_features)  # K and a native dtype: what check_operands reads of x
    w = weight
    if dequant is not None:
        plan = check_operands_a16(x, w.qweight, w.scales, w.zeros, None, w.layout, w.codebook, w.group_size,
                                  w.out_features, dequant, check_devices=False)  # fmt: skip
    else:
        plan = check_operands(x, w.qweight, w.scales, w.zeros, None, w.layout, w.codebook, w.group_size,
                              w.out_features, act_group, check_devices=False, supers=w.supers)  # fmt: skip
    if w.layout != CPU_LAYOUT or not available() or os.environ.get("AIPC_PLANNED_OPS") == "0" or not all(
        t is None or t.is_contiguous() for t in w.tensors()
    ):
        return None
    G = w.group_size if w.group_size > 0 else w.in_features
    zero = 0.0 if plan.per_group_zeros else plan.zero  # the op takes the zero points from zeros when given
    if dequant is not None:
        return CpuCall(True, (G, w.out_features, zero, native.DEQUANT_CODES[dequant]))
    return CpuCall(False, (plan.bits, G, w.out_features, plan.cmul, zero, act_group), plan.mins)


native.ops_library()  # loading the C++ unit registers the CPU kernels of the schemas above
