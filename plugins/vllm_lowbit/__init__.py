"""vllm_lowbit: 2-bit weight quantization (``--quantization lowbit2``) and BitNet b1.58 checkpoints
(``quant_method: bitnet``, served as published) for vLLM.

Loaded by vLLM through the ``vllm.general_plugins`` entry point (in the API server, the engine core
and every worker). Importing this package imports neither vLLM nor torch.
"""
from __future__ import annotations

PLUGIN_NAME = "lowbit2"


def register() -> bool:
    """vLLM plugin hook: imports ``vllm_lowbit.config`` and ``vllm_lowbit.bitnet``, whose imports
    register the ``lowbit2`` and ``bitnet`` quantization methods with vLLM
    (``register_quantization_config``); returns True once registered.
    """
    from aipc_kernels.plugin_hooks import import_integration

    return import_integration(__name__, "config") and import_integration(__name__, "bitnet")
