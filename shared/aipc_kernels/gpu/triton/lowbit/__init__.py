"""Triton W2A8 ``lowbit_linear`` for CUDA and Intel XPU (the Xe2 design of Georganas et al., III-E).

``y = x @ W^T + bias`` for a low-bit ``W`` in the ``triton_k32`` layout (:mod:`aipc_kernels.lowbit.packing`):
activations quantized to int8 per token (the rounding of
:func:`aipc_kernels.lowbit.quantizers.quantize_activations`), exact int32 dots of int8 activations and
codes, one fp32 rescale per weight group::

    y[m, n] = sx[m] * sum_g s[g, n] * (cmul * sum_{k in g} xq[m, k] c[n, k] - z[g, n] * sum_{k in g} xq[m, k])

GGUF's forms run on the same kernels: the min form (``min2``/``min4``/``min8``: a fixed z and a stored min
``m``) adds ``m[g, n] * sum_{k in g} xq[m, k]`` inside the sum, float32 scales load like 16-bit ones, and
groups of 16 (the K-quants' sub-blocks) split each 32-k plane into two dots (``stream``: two halves of its
words). The CUDA C kernels (``cuda_*``) take neither the min form nor float32 scales; a cached config of
one meeting such a weight runs the heuristic's Triton kernel instead (:func:`.registry.runs`).

Modules: :mod:`.common` (path rule, rounding, split-K), :mod:`.activation` (the activation pass),
one module per kernel (:mod:`.stream`: M == 1; :mod:`.group`: M > 1 and the batch-invariant mode),
:mod:`.registry` (kernels by name, heuristic and batch-invariant choice), :mod:`.tuning` (shipped
configs, tuning cache, tuner), :mod:`.interpret` (the CPU interpreter for tests), :mod:`.linear`
(the entry). Design and measurements: docs/triton.md.

:mod:`.a16` is the activation-exact W4A16 kernel of ``aipc::lowbit_linear_a16`` (x unquantized, 4-bit
codes dequantized to bf16/fp16/fp32 by E0M4's bit operations or an int conversion, float dots).
"""
from aipc_kernels.gpu.triton.lowbit.a16 import lowbit_linear_a16_triton
from aipc_kernels.gpu.triton.lowbit.common import GEMV_MAX_M
from aipc_kernels.gpu.triton.lowbit.linear import lowbit_linear_triton
from aipc_kernels.gpu.triton.lowbit.registry import KERNELS, batch_invariant, heuristic_config, invariant_config
from aipc_kernels.gpu.triton.lowbit.tuning import SHIPPED_CONFIGS, cache_file, cached_configs, config_key, device_name, select_config, tune

__all__ = [
    "GEMV_MAX_M",
    "KERNELS",
    "SHIPPED_CONFIGS",
    "lowbit_linear_triton",
    "lowbit_linear_a16_triton",
    "select_config",
    "heuristic_config",
    "batch_invariant",
    "invariant_config",
    "config_key",
    "cache_file",
    "cached_configs",
    "device_name",
    "tune",
]
