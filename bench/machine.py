"""What the CPU benchmarks record about the machine they ran on: CPU name, last-level cache, read bandwidth."""
from __future__ import annotations

import platform
import time
from pathlib import Path
from typing import Optional


def cpu_name() -> str:
    """The CPU's model name (from /proc/cpuinfo where there is one)."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()


def llc_mib() -> int:
    """Size of the last-level cache in MiB (0 when sysfs does not say)."""
    best = 0
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        v = f.read_text().strip()
        best = max(best, int(v[:-1]) // (1024 if v.endswith("K") else 1) if v[-1] in "KM" else int(v) // 2**20)
    return best


def read_bandwidth(threads: Optional[int] = None, gb: float = 1.0, reps: int = 3) -> float:
    """Best-of read bandwidth (GB/s) of a ``gb`` buffer with ``threads`` threads (None: torch's thread
    count), through the native probe that prefetches like the low-bit kernels."""
    import torch  # here, so that benches which start vLLM in a subprocess import this module cheaply

    from native_probes import stream_read

    buf = torch.ones(int(gb * 1e9) // 64 * 64, dtype=torch.uint8)
    best = 0.0
    for _ in range(reps):
        t = time.perf_counter()
        stream_read(buf, threads)
        best = max(best, buf.numel() / (time.perf_counter() - t) / 1e9)
    return best
