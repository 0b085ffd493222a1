"""aipc_kernels: the common kernel and packing layer of aipc-plugins.

Low-bit weight formats and their packers, quantizers, reference ops, native CPU kernels,
Triton kernels and ``torch.library`` custom-op registration. Importing this package is cheap:
torch is imported by the submodules that need it, never vLLM, OpenVINO or transformers.
"""

__version__ = "0.1.0"
