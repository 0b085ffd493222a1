"""Kernel-layer test options shared by the files of this folder."""
from __future__ import annotations

import os

import pytest

# Set by scripts/run_tests.py in a venv whose torch, triton and numpy are the versions another venv of
# the same run already ran the whole Triton interpreter suite with (its value: that venv's name).
TRITON_SUITE_RAN_IN = "AIPC_TRITON_SUITE_RAN_IN"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """With ``AIPC_TRITON_SUITE_RAN_IN`` set, each test function of the ``test_triton_*`` files runs its
    first case only (it still imports, compiles and runs the kernels against this venv's packages); the
    other cases are skipped with the venv that ran them, since under ``TRITON_INTERPRET=1`` their outcome
    depends only on the kernel code and the torch/triton/numpy versions, which are the same."""
    ran_in = os.environ.get(TRITON_SUITE_RAN_IN)
    if not ran_in:
        return
    skip = pytest.mark.skip(reason=f"every case ran in the {ran_in} venv (same torch, triton and numpy)")
    first: set[tuple[str, str]] = set()
    for item in items:
        if not item.path.name.startswith("test_triton_"):
            continue
        key = (item.path.name, getattr(item, "originalname", item.name))
        if key in first:
            item.add_marker(skip)
        else:
            first.add(key)
