"""``check_npu_ready(dir)``: fails fast, naming the node, on what the NPU compiler rejects.

Checked in every chunk IR of an exported directory: a dynamic dimension on any node output
(including the KV state variables), an op with data-dependent output shapes or control flow, a
double-precision tensor, and INT4 asymmetric weights (unsigned 4-bit, which crash the NPU
compiler: openvino#34450).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from .manifest import NPUExportManifest, check_export_complete, is_npu_export

#: op types the NPU plugin cannot compile statically (data-dependent shapes or control flow)
REJECTED_OPS = frozenset({"NonZero", "Loop", "TensorIterator", "If", "Unique", "NonMaxSuppression",
                          "MatrixNms", "MulticlassNms", "ExperimentalDetectronTopKROIs"})
REJECTED_TYPES = {"f64": "double precision", "u4": "INT4 asymmetric (unsigned 4-bit) weights"}


class NPUReadinessError(ValueError):
    """An exported IR holds something the NPU compiler rejects; the message names the node."""


@dataclass
class ReadinessReport:
    files: int
    nodes: int
    states: int


def check_ir(ov_model, label: str) -> tuple[int, int]:
    """Checks one ``openvino.Model``; returns (nodes, state variables)."""
    nodes = 0
    for op in ov_model.get_ordered_ops():
        nodes += 1
        kind = op.get_type_name()
        where = f"{label}: node {op.get_friendly_name()!r} ({kind})"
        if kind in REJECTED_OPS:
            raise NPUReadinessError(f"{where} is not supported by the NPU compiler (data-dependent "
                                    "shape or control flow); re-export without it")
        for i, out in enumerate(op.outputs()):
            shape = out.get_partial_shape()
            if shape.is_dynamic:
                raise NPUReadinessError(f"{where} output {i} has dynamic shape {shape}; the NPU "
                                        "needs every dimension static (re-export with export_npu)")
            t = out.get_element_type().get_type_name()
            if t in REJECTED_TYPES:
                raise NPUReadinessError(f"{where} output {i} is {t} ({REJECTED_TYPES[t]}), which "
                                        "the NPU rejects; re-export with weight_format='int4', "
                                        "sym=True or 'int8'")
    for var in ov_model.get_variables() if hasattr(ov_model, "get_variables") else ():
        info = var.get_info()
        if info.data_shape.is_dynamic:
            raise NPUReadinessError(f"{label}: state {info.variable_id!r} has dynamic shape "
                                    f"{info.data_shape}")
    return nodes, len(ov_model.get_sinks())


def check_npu_ready(directory: str | os.PathLike) -> ReadinessReport:
    """Reads every IR listed in ``directory``'s ``npu_export.json`` and raises
    :class:`NPUReadinessError` naming the file and node of the first problem; returns counts."""
    import openvino as ov

    path = Path(directory)
    check_export_complete(path)
    if not is_npu_export(path):
        raise NPUReadinessError(f"{path} is not an export_npu directory (no npu_export.json)")
    manifest = NPUExportManifest.read(path)
    core = ov.Core()
    files = nodes = states = 0
    seen = set()
    for chunk in manifest.all_files():
        if chunk.xml in seen:
            continue
        seen.add(chunk.xml)
        model = core.read_model(path / chunk.xml, path / chunk.weights)
        n, s = check_ir(model, chunk.xml)
        files, nodes, states = files + 1, nodes + n, states + s
    return ReadinessReport(files=files, nodes=nodes, states=states)
