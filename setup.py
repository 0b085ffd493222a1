"""Build of the native CPU kernels: plain C with intrinsics, no torch headers; and the C++ unit that
registers the planned CPU ops against PyTorch's stable ABI (built when torch is importable).

The kernel library ``_aipc_native`` (``csrc/*.c``, C API in ``csrc/aipc_native.h``) is loaded with
ctypes by ``aipc_kernels.core.native``; ISA selection (AMX-INT8, AVX-512 VNNI, AVX-VNNI, AVX2, portable C)
happens at run time inside the library, so one build serves every x86-64 CPU. ``_aipc_probes``
(``csrc/probes/``) holds the benchmarks' measurement probes; only ``bench/native_probes.py`` loads it.
Set ``AIPC_NO_NATIVE=1`` to skip the build (ops then use the reference).

The build also ships ``aipc_plugins.pth`` at the top of site-packages: one line that installs
the post-import hooks of :mod:`aipc_kernels._autoload` (optimum-intel and transformers have no
plugin entry points). Both the wheel and editable installs get it.
"""
from __future__ import annotations

import glob
import os
import shutil

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH = "aipc_plugins.pth"
PTH_SOURCE = os.path.join("shared", PTH)


class build_py_with_pth(build_py):
    """build_py that also places the .pth file at the root of the wheel."""

    def run(self):
        super().run()
        target = os.path.join(self.build_lib, PTH)
        self.mkpath(self.build_lib)
        shutil.copyfile(PTH_SOURCE, target)

    def get_outputs(self, include_bytecode=True):
        return super().get_outputs(include_bytecode) + [os.path.join(self.build_lib, PTH)]


class build_ext_replacing(build_ext):
    """In-place builds replace the library file (new inode) instead of rewriting it, so processes
    that have the old one mapped keep running."""

    def copy_extensions_to_source(self):
        for ext in self.extensions:
            target = os.path.join("shared", *self.get_ext_filename(ext.name).split(os.sep))
            if os.path.exists(target):
                os.unlink(target)
        super().copy_extensions_to_source()


class editable_wheel_with_pth(editable_wheel):
    """Editable installs map packages to the source tree; the .pth is added to the wheel itself."""

    def _create_wheel_file(self, bdist_wheel):
        from wheel.wheelfile import WheelFile

        path = super()._create_wheel_file(bdist_wheel)
        with WheelFile(path, "a") as wf:
            wf.write(PTH_SOURCE, PTH)
        return path


CSRC = "shared/aipc_kernels/csrc"
# -fno-wrapv undoes the -fwrapv of Python's own compile flags (setuptools puts those first), under which GCC
# may not treat the kernels' index arithmetic as non-wrapping; dropping it, the AVX2 16-token tiles take
# 0.90-0.92x the time on 6-bit codes, 0.96-0.97x on 2-bit (Zen 4, bench/results/cpu/ab_native_prefetch_decode_*.md)
C_FLAGS = ["-O3", "-std=gnu11", "-fopenmp", "-fvisibility=hidden", "-ffp-contract=off", "-fno-wrapv"]


def c_library(name: str, sources: list[str]) -> Extension:
    """One of the plain-C libraries (loaded with ctypes, no Python headers used); every unit picks its
    ISA per function (target attributes), so no -m flags."""
    headers = sorted(glob.glob(f"{CSRC}/*.h") + glob.glob(f"{CSRC}/x86/*.h") + glob.glob(f"{CSRC}/x86/*.inc"))
    # libm linked explicitly: an unversioned expf / sqrtf reference would bind to glibc's oldest (compat)
    # version, measured 40x slower than the current one in the SwiGLU prologue
    return Extension(name, sources=sources, depends=headers, include_dirs=[CSRC], extra_compile_args=C_FLAGS,
                     extra_link_args=["-fopenmp"], libraries=["m"])


def torch_ops_library(name: str, sources: list[str]) -> Extension | None:
    """The C++ unit that registers the planned CPU ops with PyTorch's dispatcher through its stable ABI
    (``torch/csrc/stable``, targeting torch 2.13, the oldest this package supports), or None when torch is
    not importable by this build (pip's build isolation without ``--no-build-isolation``): the ops then
    run a Python kernel over the same C library (``aipc_kernels.lowbit.ops``), and ``native.ops_library()`` says
    which. It does not link ``_aipc_native``: the loader hands it that library's entry points."""
    try:
        from torch.utils.cpp_extension import include_paths, library_paths
    except ImportError:
        print("aipc-plugins: torch is not importable by this build, so the planned CPU ops are not built "
              "(they run a Python kernel, ~20-80 us more per call); build with torch installed and "
              "`pip install --no-build-isolation` for them")
        return None
    flags = ["-O2", "-std=c++17", "-fvisibility=hidden", "-DTORCH_TARGET_VERSION=0x020d000000000000"]
    return Extension(name, sources=sources, language="c++", include_dirs=[CSRC, *include_paths()],
                     depends=[f"{CSRC}/aipc_native.h", *glob.glob(f"{CSRC}/ops/*.h")], extra_compile_args=flags,
                     library_dirs=library_paths(), libraries=["torch_cpu", "c10"])


ext_modules = []
if os.environ.get("AIPC_NO_NATIVE") != "1":
    # the kernels (aipc_kernels.core.native), and the benchmarks' measurement probes (bench/native_probes.py)
    # the dispatch table and CPU features (csrc/), every kernel family's entry point and portable kernels
    # (generic/), their x86 SIMD units (x86/: each function carries its target attribute)
    units = glob.glob(f"{CSRC}/*.c") + glob.glob(f"{CSRC}/generic/*.c") + glob.glob(f"{CSRC}/x86/*.c")
    ext_modules.append(c_library("aipc_kernels._aipc_native", sorted(units)))
    ext_modules.append(c_library("aipc_kernels._aipc_probes", sorted(glob.glob(f"{CSRC}/probes/*.c"))))
    ops_ext = torch_ops_library("aipc_kernels._aipc_ops", sorted(glob.glob(f"{CSRC}/ops/*.cpp")))
    if ops_ext is not None:
        ext_modules.append(ops_ext)

setup(
    ext_modules=ext_modules,
    cmdclass={"build_py": build_py_with_pth, "build_ext": build_ext_replacing, "editable_wheel": editable_wheel_with_pth},
)
