"""Fixtures shared by every test folder."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model() -> Callable[..., Path]:
    """Factory ``tiny_model(arch="llama", **kw) -> Path``: a tiny random model with its tokenizer.

    The keywords are those of ``aipc_kernels.tools.tiny_model.build_tiny_model``; models come
    from the per-machine cache (``$AIPC_CACHE_DIR``), built on first use. Skips the test when
    transformers or tokenizers is not installed.
    """
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    from aipc_kernels.tools.tiny_model import build_tiny_model

    built: dict[tuple, Path] = {}

    def make(arch: str = "llama", **kw) -> Path:
        key = (arch, tuple(sorted(kw.items())))
        if key not in built:
            built[key] = build_tiny_model(arch, **kw)
        return built[key]

    return make


@pytest.fixture
def interrupt_while_writing(tmp_path_factory) -> Callable[..., Path]:
    """``interrupt_while_writing(cmd, dest, sig, ready=None, env=None) -> staging``: runs ``cmd``
    (a command that writes the directory ``dest``, or ``dest(pid)`` once that returns a path),
    polls until its staging directory ``DEST.partial-<pid>`` exists and ``ready(staging)`` holds,
    sends ``sig`` while the process still runs, waits for it to end and returns the staging
    directory's path. Fails when the process ends first or nothing appears within ``timeout`` s."""
    import os
    import signal
    import subprocess
    import time

    def run(cmd: list[str], dest: Path | Callable[[int], Path | None], sig: int,
            ready: Callable[[Path], bool] | None = None, env: dict[str, str] | None = None,
            timeout: float = 300) -> Path:
        log = tmp_path_factory.mktemp("interrupted") / "stderr.txt"
        with open(log, "w") as err:
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err,
                                    env={**os.environ, **(env or {})})
        deadline = time.monotonic() + timeout
        try:
            while True:
                where = dest(proc.pid) if callable(dest) else dest
                staging = where and where.with_name(f"{where.name}.partial-{proc.pid}")
                if staging and staging.is_dir() and (ready is None or ready(staging)):
                    break
                if proc.poll() is not None:
                    pytest.fail(f"{cmd[:3]} exited ({proc.returncode}) before its staging directory "
                                f"{staging or '?'} was being written: {log.read_text()[-3000:]}")
                if time.monotonic() > deadline:
                    pytest.fail(f"no staging directory of {cmd[:3]} within {timeout} s")
                time.sleep(0.01)
            proc.send_signal(sig)
            proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if sig != signal.SIGKILL:
            assert proc.returncode in (-sig, 128 + sig, 1), (proc.returncode, log.read_text()[-3000:])
        return staging

    return run
