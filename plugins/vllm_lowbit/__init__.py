"""vllm_lowbit: 2-bit weight quantization (``--quantization lowbit2``) for vLLM.

Loaded by vLLM through the ``vllm.general_plugins`` entry point (in the API server, the engine core
and every worker). Importing this package imports neither vLLM nor torch.
"""
from __future__ import annotations

PLUGIN_NAME = "lowbit2"


def register() -> bool:
    """vLLM plugin hook: imports ``vllm_lowbit.config``, whose import registers the ``lowbit2``
    quantization method with vLLM (``register_quantization_config``); returns True once registered.
    """
    from aipc_kernels.plugin_hooks import import_integration

    return import_integration(__name__, "config")
