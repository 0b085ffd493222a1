"""Running the kernels under the Triton interpreter (CPU tensors, ``TRITON_INTERPRET=1``: the tests).

Why this exists: ``TRITON_INTERPRET`` is read when a function is decorated. The tests set it only
while this package is imported, so our kernels are interpreted functions, but triton.language's own
``@jit`` helpers that the kernels call (``tl.sum``, ``tl.max``, ``tl.zeros_like``, ...) were decorated
when triton itself was first imported, usually without the variable; inside an interpreted kernel
such a helper raises ("cannot call @triton.jit'd outside of the scope of a kernel"). While our
kernels run, :func:`interpreter_scope` interprets every ``JITFunction`` call and sets the variable.
Compiled (GPU) runs never enter it. :func:`pdl_ok`: whether a launch may be a programmatic dependent
one (compiled sm_90+ only, so never here).
"""
from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from aipc_kernels.gpu.triton.lowbit.common import rne

# every kernel of the package is decorated in the same import as this one
INTERPRETED = type(rne).__name__ == "InterpretedFunction"


def pdl_ok(device: torch.device) -> bool:
    """Programmatic dependent launch (griddepcontrol): compiled CUDA on sm_90+ only (never interpreted)."""
    return device.type == "cuda" and not INTERPRETED and torch.cuda.get_device_capability(device)[0] >= 9


@contextmanager
def interpreter_scope() -> Iterator[None]:
    """Interprets triton.language's ``@jit`` helpers while the block runs (only when ours are interpreted)."""
    if not INTERPRETED:
        yield
        return
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    saved_env, saved_call = os.environ.get("TRITON_INTERPRET"), JITFunction.__call__
    os.environ["TRITON_INTERPRET"] = "1"
    JITFunction.__call__ = lambda self, *a, **kw: InterpretedFunction(self.fn)(*a, **kw)
    try:
        yield
    finally:
        JITFunction.__call__ = saved_call
        if saved_env is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved_env
