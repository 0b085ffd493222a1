"""One projection of a fused decoder layer on low-bit weights: :func:`aipc_kernels.decoder.fused_linear.fused_linear`'s
contract (prologue, several weights read as one, residual epilogue) for :class:`~aipc_kernels.lowbit.modules.LowBitLinear`
modules, run by ``aipc::lowbit_linear`` (int8 activations inside the kernel).

    y = lowbit_linear(prologue(x), [W_1; ...; W_s]) + cat(biases)  (+ residual)

* The modules' packed weights are concatenated along the output rows once (:func:`share_storage`) and each
  module's buffers become views of the merged tensors: one kernel call reads q, k and v (or gate and up)
  with no second copy, and the modules still run alone (the stock forward, ``undo``). The ``cpu_vnni16``
  layout keeps rows in blocks of 16, so this needs every module but the last to have a multiple of 16
  outputs; otherwise each module is called and the outputs concatenated.
* The prologue is ``aipc::prologue`` (:func:`~aipc_kernels.decoder.prologue.apply_prologue`: one native pass on
  the CPU, at transformers' rounding points) and the residual is added to the fresh output in place, so a fused
  layer gives what the model's stock layer gives with the same modules: activations are quantized per token, one
  scale per row, the same rows either way (up to the prologue's float32 sum order, see its module).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from aipc_kernels.decoder.prologue import apply_prologue
from aipc_kernels.lowbit.modules import LowBitLinear
from aipc_kernels.lowbit.packing import BLOCK_N, CPU_LAYOUT, PackedLowBit
from aipc_kernels.lowbit.planned_ops import CpuCall, plan_cpu_call

_BUFFERS = ("qweight", "scales", "zeros")


def _mergeable(modules: Sequence[LowBitLinear]) -> bool:
    first = modules[0]
    return len(modules) > 1 and all(
        m.layout == CPU_LAYOUT and m.activations == "int8" and (m.codebook, m.group_size, m.act_group, m.in_features)
        == (first.codebook, first.group_size, first.act_group, first.in_features)
        and (m.zeros is None) == (first.zeros is None) and m.scales.dtype == first.scales.dtype
        for m in modules
    ) and all(m.out_features % BLOCK_N == 0 for m in modules[:-1])  # fmt: skip


def share_storage(modules: Sequence[LowBitLinear]) -> Optional[PackedLowBit]:
    """The modules' weights as one packed weight whose tensors the modules' buffers are views of (the
    modules keep computing what they computed), or None when they cannot be merged (see the module
    docstring). Memory: the merged tensors replace the modules' own, nothing is kept twice."""
    if len(modules) == 1 and modules[0].layout == CPU_LAYOUT and modules[0].activations == "int8":
        return modules[0].packed  # the module's own tensors
    if not _mergeable(modules):
        return None
    merged = {}
    for name in _BUFFERS:
        parts = [getattr(m, name) for m in modules]
        merged[name] = None if parts[0] is None else torch.cat(parts, dim=0)
    start = 0
    for m in modules:
        blocks = -(-m.out_features // BLOCK_N)
        for name in _BUFFERS:
            if merged[name] is not None:
                setattr(m, name, merged[name][start : start + blocks])  # a registered buffer: stays one
        start += blocks
    first = modules[0]
    return PackedLowBit(CPU_LAYOUT, merged["qweight"], merged["scales"], merged["zeros"], first.codebook,
                        first.group_size, sum(m.out_features for m in modules), first.in_features)  # fmt: skip


class LowBitProjection:
    """A fused layer's projection over its own :class:`LowBitLinear` modules (see the module docstring)."""

    def __init__(self, modules: Sequence[LowBitLinear]):
        self.modules = tuple(modules)
        self.merged = share_storage(self.modules)
        self._versions = self._tensor_versions()
        biases = [m.bias for m in self.modules]
        if self.merged is not None and len(biases) == 1:
            self.bias = biases[0]
        elif self.merged is not None and any(b is not None for b in biases):
            ref = next(b for b in biases if b is not None)
            biases = [torch.zeros(m.out_features, dtype=ref.dtype) if b is None else b.to(ref.dtype)
                      for m, b in zip(self.modules, biases)]  # fmt: skip
            self.bias: Optional[torch.Tensor] = torch.cat(biases)
        else:
            self.bias = None
        self.call: Optional[CpuCall] = None
        if self.merged is not None:
            self.call = plan_cpu_call(self.merged, self.modules[0].act_group)

    def _tensor_versions(self) -> tuple[int, ...]:
        return tuple(m.tensors_version for m in self.modules)

    def valid(self) -> bool:
        """Whether the modules still hold the tensors this projection was built over (``model.to(...)`` or
        assigning a tensor replaces them, which :attr:`LowBitLinear.tensors_version` counts: then build a
        new one)."""
        return self._tensor_versions() == self._versions

    @property
    def in_features(self) -> int:
        return self.modules[0].in_features

    def __call__(self, x: torch.Tensor, prologue: str = "none", gamma: Optional[torch.Tensor] = None,
                 eps: float = 0.0, residual: Optional[torch.Tensor] = None) -> torch.Tensor:  # fmt: skip
        x = apply_prologue(x, prologue, gamma, eps, self.in_features)
        if self.merged is None:
            outs = [m(x) for m in self.modules]
            y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        elif self.call is not None and x.device.type == "cpu":
            w = self.merged
            y = self.call(x if x.is_contiguous() else x.contiguous(), w.qweight, w.scales, w.zeros, self.bias)
        else:
            from aipc_kernels.lowbit.ops import lowbit_linear

            y = lowbit_linear(x, self.merged, self.bias, self.modules[0].act_group)
        if residual is None:
            return y
        same = residual.dtype == y.dtype and residual.shape == y.shape
        return y.add_(residual) if same else residual + y  # in place on this call's own output


__all__ = ["LowBitProjection", "share_storage"]
