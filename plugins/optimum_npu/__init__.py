"""optimum_npu: chunked, stateful, static-shape OpenVINO export for Intel NPUs (NITRO technique).

Reached through Optimum-Intel (``OVModelForCausalLM.from_pretrained(..., export_npu=True)``).
Importing this package imports neither optimum nor OpenVINO.
"""
from __future__ import annotations


def register() -> bool:
    """Discovery hook (``aipc_plugins`` entry point). Activates the Optimum-Intel integration
    (``optimum_npu.integration``) once it exists; returns whether anything was activated."""
    from aipc_kernels.plugin_hooks import import_integration

    return import_integration(__name__, "integration")
