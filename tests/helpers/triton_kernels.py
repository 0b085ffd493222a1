"""Importing the Triton kernel modules for tests: compiled on a CUDA GPU, else interpreted on CPU tensors.

``TRITON_INTERPRET`` is read when a kernel is decorated, i.e. when its module is imported, so without a
GPU the variable is set only around that import and restored afterwards (the rest of the process, and
triton's own helpers, keep their setting; ``aipc_kernels.gpu.triton.lowbit.interpret`` bridges the two).
"""
from __future__ import annotations

import importlib
import os
from types import ModuleType

import torch


def import_kernels(*names: str) -> list[ModuleType]:
    """The modules ``names``, imported under ``TRITON_INTERPRET=1`` when no CUDA device is present."""
    if torch.cuda.is_available():
        return [importlib.import_module(n) for n in names]
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        return [importlib.import_module(n) for n in names]
    finally:
        if saved is None:
            os.environ.pop("TRITON_INTERPRET")
        else:
            os.environ["TRITON_INTERPRET"] = saved
