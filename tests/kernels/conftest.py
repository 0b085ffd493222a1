"""Fixtures shared by the kernel layer's tests."""
from __future__ import annotations

from collections.abc import Iterator

import pytest

from aipc_kernels.core import native


@pytest.fixture(params=native.supported_isas() if native.available() else [])
def isa(request) -> Iterator[str]:
    """Each instruction set this CPU runs the native kernels with, forced for the test (the best one
    restored after)."""
    native.set_isa(request.param)
    yield request.param
    native.set_isa(native.best_isa())
