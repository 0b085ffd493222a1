"""Fixtures shared by every test folder."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model() -> Callable[..., Path]:
    """Factory ``tiny_model(arch="llama", **kw) -> Path``: a tiny random model with its tokenizer.

    The keywords are those of ``aipc_kernels.testing.tiny_model.build_tiny_model``; models come
    from the per-machine cache (``$AIPC_CACHE_DIR``), built on first use. Skips the test when
    transformers or tokenizers is not installed.
    """
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    from aipc_kernels.testing.tiny_model import build_tiny_model

    built: dict[tuple, Path] = {}

    def make(arch: str = "llama", **kw) -> Path:
        key = (arch, tuple(sorted(kw.items())))
        if key not in built:
            built[key] = build_tiny_model(arch, **kw)
        return built[key]

    return make
