"""Triton kernels of aipc_kernels (CUDA and Intel XPU; tested on CPU with ``TRITON_INTERPRET=1``).

One module or package per kernel family (``lowbit/``: ``aipc::lowbit_linear``). Importing this
package does not import triton; each kernel module does, so ``aipc_kernels`` stays importable
where triton is absent.
"""
