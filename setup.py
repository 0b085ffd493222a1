"""Build of the native CPU kernels: plain C with intrinsics, no torch headers.

The library is loaded with ctypes by ``aipc_kernels.native``; ISA selection (AVX-512 VNNI,
AVX-VNNI, AVX2, portable C) happens at run time inside the library, so one build serves
every x86-64 CPU. Set ``AIPC_NO_NATIVE=1`` to skip the build (ops then use the reference).
"""
import glob
import os

from setuptools import Extension, setup

ext_modules = []
if os.environ.get("AIPC_NO_NATIVE") != "1":
    sources = sorted(glob.glob("shared/aipc_kernels/csrc/*.c"))
    ext_modules.append(
        Extension(
            "aipc_kernels._aipc_native",
            sources=sources,
            include_dirs=["shared/aipc_kernels/csrc"],
            extra_compile_args=["-O3", "-std=gnu11", "-fopenmp", "-fvisibility=hidden", "-ffp-contract=off"],
            extra_link_args=["-fopenmp"],
        )
    )

setup(ext_modules=ext_modules)
