"""The weight formats a float model's linears are quantized to, by the names a user picks.

``ipex_segment_kv.optimize(model, weights=...)`` takes these names (the weight-only quantization that
``ipex.llm.optimize`` offered); every format runs on ``aipc::lowbit_linear`` with int8 activations per
token:

* ``int8``: one scale per output channel (the ``int8`` code book, round to nearest: the output
  projection's ``int8`` format, :mod:`aipc_kernels.lowbit.output_projection`);
* ``int4``: ``affine4`` (a scale and a zero point per group), groups of 128, 64 where 128 does not
  divide K (:func:`~aipc_kernels.lowbit.formats.fitting_group_size`), the optimized quantizer;
* ``lowbit2``: ``affine`` 2-bit, groups of 64, the optimized quantizer (vllm_lowbit's ``lowbit2``
  defaults). Post-training 2-bit turns a trained model into noise (:mod:`aipc_kernels.lowbit.quality_gate`):
  callers ask for an opt-in.

The output projection is ``int8`` under every scheme (the serving plugins' default head).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from aipc_kernels.lowbit.formats import LowBitWeight, fitting_group_size
from aipc_kernels.lowbit.output_projection import quantize_output_projection
from aipc_kernels.lowbit.quantizers import quantize_rows


@dataclass(frozen=True)
class WeightScheme:
    """One named weight format: code book, group size (-1: one group per row) and quantizer."""

    name: str
    codebook: str
    group_size: int
    quantizer: str

    def quantize(self, weight: torch.Tensor, name: str = "weight") -> LowBitWeight:
        """``weight [N, K]`` in this format (errors name ``name``)."""
        w = weight.detach()
        if self.codebook == "int8":
            return quantize_output_projection(w, "int8", name=name)
        return quantize_rows(w, self.codebook, fitting_group_size(self.group_size, w.shape[1]), self.quantizer,
                             torch.float16, name=name)  # fmt: skip


SCHEMES: dict[str, WeightScheme] = {
    s.name: s
    for s in (
        WeightScheme("int8", "int8", -1, "rtn"),
        WeightScheme("int4", "affine4", 128, "optimized"),
        WeightScheme("lowbit2", "affine", 64, "optimized"),
    )
}
#: the format of the output projection under every scheme
HEAD_SCHEME = SCHEMES["int8"]


def can_quantize(in_features: int) -> bool:
    """Whether a linear of ``in_features`` can be packed for the kernels (K a multiple of 32)."""
    return in_features > 0 and in_features % 32 == 0


__all__ = ["HEAD_SCHEME", "SCHEMES", "WeightScheme", "can_quantize"]
