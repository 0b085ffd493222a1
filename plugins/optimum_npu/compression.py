"""NNCF weight compression of the chunk IRs: the settings (:class:`WeightCompression`, checked for
NPU safety) and their application to a converted graph (:func:`compress`).

The vocabulary matrices are not compressed here: :mod:`optimum_npu.vocab` streams them through
NNCF's quantizer with the same settings.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class WeightCompression:
    """NNCF weight compression of every chunk. ``int4`` defaults to the NPU-safe settings:
    symmetric, group 128, ``ratio=1.0, all_layers=True`` (no layer silently kept in INT8)."""

    weight_format: str = "fp16"
    sym: bool | None = None
    group_size: int | None = None
    ratio: float | None = None
    all_layers: bool | None = None

    def resolved(self, target: str) -> dict[str, Any] | None:
        """The settings actually used (None: no compression); raises on NPU-unsafe or contradictory
        ones (each value's type and range: :class:`~optimum_npu.options.ExportOptions`)."""
        fmt = self.weight_format
        if fmt in ("fp32", "fp16"):
            given = {k: v for k, v in (("sym", self.sym), ("group_size", self.group_size),
                                        ("ratio", self.ratio), ("all_layers", self.all_layers))
                     if v is not None}
            if given:
                raise ValueError(f"{', '.join(given)} only apply to weight_format='int8'/'int4', "
                                 f"not {fmt!r}; drop them or choose an integer weight format")
            return None
        sym = True if self.sym is None else self.sym
        if fmt == "int4":
            if not sym and target == "NPU":
                raise ValueError(
                    "weight_format='int4' with sym=False (INT4 asymmetric) crashes the NPU compiler "
                    "(openvino#34450); use sym=True (the default), or weight_format='int8'")
            group = 128 if self.group_size is None else self.group_size
            if group != -1 and group <= 0:
                raise ValueError(f"group_size={group} must be positive or -1 (per channel)")
            ratio = 1.0 if self.ratio is None else self.ratio
            all_layers = True if self.all_layers is None else self.all_layers
            return dict(weight_format="int4", mode="int4_sym" if sym else "int4_asym",
                        group_size=group, ratio=ratio, all_layers=all_layers)
        if self.group_size not in (None, -1) or self.ratio not in (None, 1.0):
            raise ValueError("weight_format='int8' is per channel with ratio 1.0; drop group_size "
                             "and ratio (or use weight_format='int4')")
        return dict(weight_format="int8", mode="int8_sym" if sym else "int8_asym",
                    group_size=-1, ratio=1.0, all_layers=True)


def compress(ov_model, quant: dict[str, Any] | None):
    """``ov_model`` with its weights compressed by ``nncf.compress_weights`` as ``quant`` (the
    :meth:`WeightCompression.resolved` settings) says; unchanged for ``quant=None``."""
    if quant is None:
        return ov_model
    import nncf

    mode = {"int8_sym": nncf.CompressWeightsMode.INT8_SYM,
            "int8_asym": nncf.CompressWeightsMode.INT8_ASYM,
            "int4_sym": nncf.CompressWeightsMode.INT4_SYM,
            "int4_asym": nncf.CompressWeightsMode.INT4_ASYM}[quant["mode"]]
    kw: dict[str, Any] = dict(mode=mode)
    if quant["weight_format"] == "int4":
        kw.update(group_size=quant["group_size"], ratio=quant["ratio"],
                  all_layers=quant["all_layers"])
    return nncf.compress_weights(ov_model, **kw)
