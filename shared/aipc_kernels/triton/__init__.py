"""Triton kernels of aipc_kernels (CUDA and Intel XPU; tested on CPU with ``TRITON_INTERPRET=1``).

One module per kernel family. Importing this package does not import triton; each kernel module
does, so ``aipc_kernels`` stays importable where triton is absent.
"""
