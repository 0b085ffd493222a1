"""vllm_lowbit: 2-bit weight quantization (``--quantization lowbit2``) for vLLM.

Loaded by vLLM through the ``vllm.general_plugins`` entry point (in the API server, the engine core
and every worker). Importing this package imports neither vLLM nor torch.
"""
from __future__ import annotations

PLUGIN_NAME = "lowbit2"


def register() -> bool:
    """vLLM plugin hook. Registers the ``lowbit2`` quantization method once vLLM's integration
    module exists (``vllm_lowbit.config``); returns whether anything was registered.

    The quantization method itself is the subject of its own issue; until it lands this hook is
    discoverable but registers nothing, so ``--quantization lowbit2`` fails in vLLM's own check.
    """
    from aipc_kernels.plugin_hooks import import_integration

    return import_integration(__name__, "config")
