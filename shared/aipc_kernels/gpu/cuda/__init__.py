"""CUDA C kernels of ``aipc::lowbit_linear`` on NVIDIA GPUs (``stream``: dp4a GEMV, ``mma``: mma.sync
for few tokens, ``gemm``: mma.sync GEMM), compiled at first use by ``build`` (NVRTC through torch)."""

# These kernels are members of the Triton low-bit kernel registry and use its activation quantizer and
# helpers: the registry's package first, so importing one of these modules first finds it initialised.
import aipc_kernels.gpu.triton.lowbit  # noqa: E402,F401
