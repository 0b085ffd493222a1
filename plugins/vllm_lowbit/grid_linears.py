"""The converter's grid detection (``detect_grid``, no vLLM import): a float checkpoint's linears whose
weights already lie on a binary/ternary/2-bit grid (e.g. ParetoQ's fake-quantized bf16 weights) are
written exactly by :func:`aipc_kernels.checkpoints.grid_detect.detect_grid` instead of being quantized.

Linears that vLLM loads as one merged layer (:data:`FUSED`: q/k/v, gate/up under one parent) are
detected together, on their rows concatenated as the server's on-the-fly path sees them, so they get
one code book, group size and scale dtype (vLLM's merged layer has one of each) and the converter
decides as the server does. Each recovered layer's format goes into ``quantization_config.layer_formats``.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from aipc_kernels.lowbit.formats import SCALE_DTYPES, LowBitWeight
from aipc_kernels.checkpoints.grid_detect import detect_grid, recovered_summary, split_rows

#: sibling linears that vLLM's models merge into one layer (qkv_proj, gate_up_proj)
FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
_DTYPE_NAMES = {v: k for k, v in SCALE_DTYPES.items()}


class GridLinears:
    """Turns a checkpoint's linear weights into ``lowbit2`` weights: grid layers exactly, the rest with
    ``quantize(prefix, weight)``. :meth:`add` may hold a weight until its merged siblings arrive."""

    def __init__(self, linears: set[str], quantize: Callable[[str, torch.Tensor], LowBitWeight], detect: bool,
                 group_size: int, act_group: int, scale_dtype: torch.dtype):  # fmt: skip
        self.linears, self.quantize, self.detect = linears, quantize, detect
        # whole-row scales, unless per-group activation scales need groups (as on the server)
        self.group_size = -1 if act_group == 0 else group_size
        self.scale_dtype = scale_dtype
        self.pending: dict[str, dict[str, torch.Tensor]] = {}
        self.layer_formats: dict[str, dict[str, Any]] = {}
        self.worst = 0.0  # largest error of a recovered layer, relative to its row's largest weight
        self.inexact: list[str] = []  # recovered within the scale's rounding (2-bit SEQ rows)

    def _members(self, prefix: str) -> list[str]:
        parent, _, leaf = prefix.rpartition(".")
        for group in FUSED:
            if leaf in group:
                names = [f"{parent}.{m}" if parent else m for m in group]
                return [n for n in names if n in self.linears]
        return [prefix]

    def add(self, prefix: str, weight: torch.Tensor) -> list[tuple[str, LowBitWeight]]:
        """The weights ready to write after ``prefix``'s arrived (none while a sibling is missing)."""
        if not self.detect:
            return [(prefix, self.quantize(prefix, weight))]
        members = self._members(prefix)
        got = self.pending.setdefault(members[0], {})
        got[prefix] = weight
        if len(got) < len(members):
            return []
        del self.pending[members[0]]
        return self._convert(members, [got[m] for m in members])

    def finish(self) -> list[tuple[str, LowBitWeight]]:
        """Weights still held because a sibling never came (converted on their own)."""
        out = [lw for got in self.pending.values() for lw in self._convert(list(got), list(got.values()))]
        self.pending.clear()
        return out

    def _convert(self, names: list[str], weights: list[torch.Tensor]) -> list[tuple[str, LowBitWeight]]:
        grid = None
        if len({w.shape[1:] for w in weights}) == 1:
            grid = detect_grid(torch.cat(weights) if len(weights) > 1 else weights[0], names[0], self.group_size,
                               self.scale_dtype)  # fmt: skip
        if grid is None:
            return [(n, self.quantize(n, w)) for n, w in zip(names, weights)]
        self.worst = max(self.worst, grid.max_rel_error)
        self.inexact += [] if grid.exact else names
        lw = grid.weight
        fmt = dict(codebook=lw.codebook, group_size=self.group_size, scale_dtype=_DTYPE_NAMES[lw.scales.dtype])
        self.layer_formats.update({n: dict(fmt) for n in names})
        return list(zip(names, split_rows(lw, [w.shape[0] for w in weights], names)))

    def summary(self) -> str:
        """One line: how many linears were recovered from a grid, per code book, and how exactly."""
        if not self.layer_formats:
            return ""
        names = list(self.layer_formats)
        summary = recovered_summary([self.layer_formats[n]["codebook"] for n in names],
                                    [n not in self.inexact for n in names], self.worst)  # fmt: skip
        return (f"{len(names)} linears lie on a low-bit grid and were stored with one scale per row "
                f"(quantization_config.layer_formats): {summary}")  # fmt: skip


__all__ = ["FUSED", "GridLinears"]
