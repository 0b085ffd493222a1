"""vllm_lowbit: 2-bit weight quantization (``--quantization lowbit2``), 4-bit weights and GPTQ / AWQ
checkpoints on the same kernels (``--quantization lowbit4``), BitNet b1.58 checkpoints
(``quant_method: bitnet``, served as published) and llama.cpp GGUF files (``vllm serve ./X.gguf``,
quantization method ``gguf_cpu``) for vLLM, and the model classes vLLM lacks for the low-bit checkpoints it
serves (``BitNetForCausalLM``).

One module per quantization method, as vLLM's own (config and linear methods together):
:mod:`~vllm_lowbit.lowbit2`, :mod:`~vllm_lowbit.lowbit4`, :mod:`~vllm_lowbit.bitnet`,
:mod:`~vllm_lowbit.gguf` (with :mod:`~vllm_lowbit.gguf_source`, the file reader); over
:mod:`~vllm_lowbit.layers` (what they share: layer helpers, the output projection method, config bases)
and :mod:`~vllm_lowbit.options` (the lowbit2 / lowbit4 options, one frozen object); :mod:`~vllm_lowbit.cpu_compile`:
inductor's C++ wrapper for vLLM-CPU's compiled graph of their models. The converter:
:mod:`~vllm_lowbit.quantize` (``python -m vllm_lowbit.quantize``), :mod:`~vllm_lowbit.checkpoint`,
:mod:`~vllm_lowbit.grid_linears`, :mod:`~vllm_lowbit.gguf_convert`. :mod:`~vllm_lowbit.bitnet_model`:
``BitNetForCausalLM``.

Loaded by vLLM through the ``vllm.general_plugins`` entry point (in the API server, the engine core
and every worker). Importing this package imports neither vLLM nor torch.
"""
from __future__ import annotations

PLUGIN_NAME = "lowbit2"

#: architectures (config.json ``architectures``) registered with vLLM when it has none of that name,
#: as lazy ``module:class`` references (imported only when a checkpoint names them)
MODELS = {"BitNetForCausalLM": "vllm_lowbit.bitnet_model:BitNetForCausalLM"}
#: the modules whose import registers a quantization method (one each: lowbit2, lowbit4, bitnet, gguf_cpu)
METHOD_MODULES = ("lowbit2", "lowbit4", "bitnet", "gguf")


def register() -> bool:
    """vLLM plugin hook: imports :data:`METHOD_MODULES` (``vllm_lowbit.lowbit2``, ``.lowbit4``, ``.bitnet``,
    ``.gguf``), whose imports register the ``lowbit2``, ``lowbit4``, ``bitnet`` and
    ``gguf_cpu`` quantization methods with vLLM (``register_quantization_config``; ``gguf_cpu`` also its
    model loader and the routing of ``.gguf`` models), and registers ``MODELS`` that vLLM does not know
    with its ``ModelRegistry``; returns True once registered.
    """
    from aipc_kernels.core.plugin_hooks import import_integration

    registered = all(import_integration(__name__, m) for m in METHOD_MODULES)
    import_integration(__name__, "cpu_compile")  # the C++ wrapper of vLLM-CPU's compiled graph for their models
    register_models()
    return registered


def register_models() -> list[str]:
    """Registers each of ``MODELS`` that vLLM's ``ModelRegistry`` lacks (a vLLM with its own class
    keeps it); returns the architectures registered now."""
    from vllm import ModelRegistry

    known = set(ModelRegistry.get_supported_archs())
    added = [arch for arch in MODELS if arch not in known]
    for arch in added:
        ModelRegistry.register_model(arch, MODELS[arch])
    return added
