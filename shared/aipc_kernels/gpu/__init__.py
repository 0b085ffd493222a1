"""GPU kernels: Triton (``triton/``: CUDA and Intel XPU, tested on CPU under ``TRITON_INTERPRET=1``)
and CUDA C compiled at first use through torch (``cuda/``). Importing this package imports neither
triton nor CUDA."""
