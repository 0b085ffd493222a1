"""Build of the native CPU kernels: plain C with intrinsics, no torch headers.

The library is loaded with ctypes by ``aipc_kernels.native``; ISA selection (AVX-512 VNNI,
AVX-VNNI, AVX2, portable C) happens at run time inside the library, so one build serves
every x86-64 CPU. Set ``AIPC_NO_NATIVE=1`` to skip the build (ops then use the reference).

The build also ships ``aipc_plugins.pth`` at the top of site-packages: one line that installs
the post-import hooks of :mod:`aipc_kernels._autoload` (optimum-intel and transformers have no
plugin entry points). Both the wheel and editable installs get it.
"""
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

setup(
    ext_modules=ext_modules,
    cmdclass={"build_py": build_py_with_pth, "build_ext": build_ext_replacing, "editable_wheel": editable_wheel_with_pth},
)
