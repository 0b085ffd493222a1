"""The kernel layer's names from before the split by concern still import for one release: each gives
the very module of its new name, with a DeprecationWarning that names it; the table covers every move."""
import importlib
import subprocess
import sys

import pytest

from aipc_kernels._moved import MOVED, new_name


def test_old_names_are_the_new_modules_with_a_warning():
    """Every old name, in a fresh interpreter (this one may hold the modules under their new names)."""
    code = (
        "import importlib, sys, warnings\n"
        "from aipc_kernels._moved import MOVED\n"
        "for old, new in sorted(MOVED.items()):\n"
        "    if old == 'testing': continue\n"
        "    with warnings.catch_warnings(record=True) as w:\n"
        "        warnings.simplefilter('always')\n"
        "        a = importlib.import_module('aipc_kernels.' + old)\n"
        "    b = importlib.import_module('aipc_kernels.' + new)\n"
        "    assert a is b, (old, a, b)\n"
        "    msgs = [str(x.message) for x in w if issubclass(x.category, DeprecationWarning)]\n"
        "    assert any('aipc_kernels.' + new in m for m in msgs), (old, msgs)\n"
        "copies = [n for n, m in sys.modules.items() if n.startswith('aipc_kernels.') and m is not None\n"
        "          and m.__name__ != n and not any(n == 'aipc_kernels.' + o or n.startswith('aipc_kernels.' + o + '.') for o in MOVED)]\n"
        "assert not copies, copies\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_submodule_of_a_moved_package_and_from_import():
    with pytest.warns(DeprecationWarning, match="aipc_kernels.gpu.triton.lowbit.stream"):
        old = importlib.import_module("aipc_kernels.triton.lowbit.stream")
    assert old is importlib.import_module("aipc_kernels.gpu.triton.lowbit.stream")
    with pytest.warns(DeprecationWarning, match="aipc_kernels.checkpoints.gguf"):
        from aipc_kernels import gguf_format
    assert gguf_format is importlib.import_module("aipc_kernels.checkpoints.gguf")


def test_names_that_did_not_move_and_helpers_that_left():
    assert new_name("aipc_kernels.lowbit.formats") is None and new_name("other.formats") is None
    assert new_name("aipc_kernels.triton.lowbit.cuda_mma") == "aipc_kernels.gpu.cuda.mma"
    with pytest.raises(ImportError), pytest.warns(DeprecationWarning):
        importlib.import_module("aipc_kernels.testing.references")  # a test helper: tests/helpers, not shipped


def test_every_move_points_at_a_module():
    for new in set(MOVED.values()):
        importlib.import_module(f"aipc_kernels.{new}")


def test_gpu_kernel_modules_import_first():
    """Each CUDA kernel module imported first in a fresh interpreter: they belong to the Triton low-bit
    registry, which imports them back (gpu/cuda/__init__.py orders the two)."""
    names = [f"aipc_kernels.gpu.cuda.{m}" for m in ("build", "stream", "mma", "gemm")]
    for name in names:
        subprocess.run([sys.executable, "-c", f"import {name}"], check=True)
