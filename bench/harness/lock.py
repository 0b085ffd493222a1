"""The bench lock: no two benchmarks run at once on the shared machine."""
from __future__ import annotations

import fcntl
from contextlib import contextmanager
from typing import Iterator

BENCH_LOCK = "/tmp/aipc-bench.lock"


@contextmanager
def bench_lock(path: str = BENCH_LOCK, enabled: bool = True) -> Iterator[None]:
    """Holds an exclusive ``flock`` on ``path`` for the block (waiting, with a message, while another
    benchmark holds it). ``enabled=False`` (``--no-lock``) takes nothing: for smoke runs that already
    hold another lock, such as the test lock."""
    if not enabled:
        yield
        return
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"[bench] waiting for {path} (another benchmark runs)", flush=True)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
