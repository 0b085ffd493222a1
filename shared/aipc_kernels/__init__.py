"""aipc_kernels: the common kernel and packing layer of aipc-plugins.

Sub-packages by concern: ``core`` (the native library's loader, option schema, atomic output, the
Hugging Face checkpoint reader, the real-model fetcher), ``lowbit`` (the low-bit weight format, packing,
quantizers, ``aipc::lowbit_linear``), ``decoder`` (segment attention, the dense and fused decoder layer),
``checkpoints`` (GGUF, GPTQ, BitNet readers), ``gpu`` (Triton and CUDA kernels), ``tools`` (the tiny model
builder). Importing this package is cheap: torch is imported by the submodules that need it, never vLLM,
OpenVINO or transformers. The modules' names before this split still import, with a
``DeprecationWarning`` (:mod:`aipc_kernels._moved`).
"""
from ._moved import install as _install_moved

__version__ = "0.1.0"
_install_moved()
