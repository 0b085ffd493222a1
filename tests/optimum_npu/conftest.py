"""Fixtures for the optimum_npu tests: tiny models of every supported architecture, exported once
per session (small shapes that still cross prefill blocks and every KV bucket)."""
from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("openvino")
pytest.importorskip("optimum.intel")

from npu_testing import EXPORT_KW, build_qwen3  # noqa: E402


@pytest.fixture(scope="session")
def source_model(tiny_model, tmp_path_factory) -> Callable[[str], Path]:
    """``source_model(arch) -> Path``: the tiny transformers checkpoint of ``arch``."""
    cache = Path(os.environ.get("AIPC_CACHE_DIR", Path.home() / ".cache" / "aipc-plugins"))

    def make(arch: str) -> Path:
        if arch == "qwen3":
            return build_qwen3(cache / "tiny-models" / "qwen3-optimum-npu-test")
        return tiny_model(arch)

    return make


@pytest.fixture(scope="session")
def exported(source_model, tmp_path_factory) -> Callable[[str], Path]:
    """``exported(arch) -> Path``: the NPU export of ``source_model(arch)`` with EXPORT_KW."""
    from optimum_npu.export import export_npu_model

    done: dict[str, Path] = {}

    def make(arch: str) -> Path:
        if arch not in done:
            out = tmp_path_factory.mktemp(f"npu-{arch}")
            done[arch] = export_npu_model(source_model(arch), out, **EXPORT_KW)
        return done[arch]

    return make
