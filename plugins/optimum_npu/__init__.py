"""optimum_npu: chunked, stateful, static-shape OpenVINO export for Intel NPUs (NITRO technique).

Reached through Optimum-Intel (``OVModelForCausalLM.from_pretrained(..., export_npu=True)``).
Importing this package imports neither optimum nor OpenVINO.
"""
from __future__ import annotations

from typing import Any

__all__ = ["OVNPUModelForCausalLM", "export_npu_model", "check_npu_ready", "NPUReadinessError"]

_LAZY = {
    "OVNPUModelForCausalLM": "optimum_npu.modeling",
    "SequenceTooLongError": "optimum_npu.modeling",
    "export_npu_model": "optimum_npu.export",
    "check_npu_ready": "optimum_npu.check",
    "NPUReadinessError": "optimum_npu.check",
}


def __getattr__(name: str) -> Any:
    """Public classes and functions, imported on first access (the package itself stays light)."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'optimum_npu' has no attribute {name!r}")
