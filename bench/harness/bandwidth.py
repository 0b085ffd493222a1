"""The bandwidth the benchmarks divide by: the CPU's read bandwidth (the physical bound of a
weight-streaming decode step) and, on a GPU, the device-to-device copy bandwidth.

Every committed CPU figure was made with the native read probe (``aipc_stream_read``: the low-bit
kernels' prefetching read loop over a 1 GB buffer, all of torch's threads unless told, best of reps;
from 2026-11-30 on, the buffer on transparent huge pages where the packed weights are too:
``aipc_kernels.core.huge_pages``);
the GPU figures with a device copy (bytes read + written / time)."""
from __future__ import annotations

import time
from types import ModuleType
from typing import Optional


def native_probes() -> ModuleType:
    """The native measurement probes (``bench/native_probes.py``, the ``_aipc_probes`` library:
    ``stream_read``, ``time_calls``, ``time_stream_read``, ``time_lowbit_linear``): the one place the
    benches get them from."""
    import native_probes as probes  # bench/ is on sys.path when a bench runs

    return probes


def read_bandwidth(threads: Optional[int] = None, gb: float = 1.0, reps: int = 3) -> float:
    """Best-of-``reps`` CPU read bandwidth (GB/s) of a ``gb`` buffer with ``threads`` threads (None:
    torch's thread count), through the native probe that prefetches like the low-bit kernels."""
    import torch  # here, so that benches which start vLLM in a subprocess import this module cheaply

    if gb <= 0 or reps < 1:
        raise ValueError(f"read_bandwidth: gb={gb} must be > 0 and reps={reps} >= 1")
    probes = native_probes()
    from aipc_kernels.core.huge_pages import on_huge_pages  # the pages the packed weights stream from

    buf = on_huge_pages(torch.ones(int(gb * 1e9) // 64 * 64, dtype=torch.uint8))
    best = 0.0
    for _ in range(reps):
        t = time.perf_counter()
        probes.stream_read(buf, threads)
        best = max(best, buf.numel() / (time.perf_counter() - t) / 1e9)
    return best


def gpu_copy_bandwidth(gb: float = 2.0, reps: int = 10) -> float:
    """Device-to-device copy on the current CUDA device, (bytes read + bytes written) / time, GB/s
    (median of ``reps`` after two warm-up copies, timed with CUDA events)."""
    import torch

    n = int(gb * 1e9) // 2
    a = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
    b = torch.empty_like(a)
    ts = []
    for _ in range(reps + 2):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e) / 1e3)
    t = sorted(ts[2:])[len(ts[2:]) // 2]
    del a, b
    return 2 * n / t / 1e9
