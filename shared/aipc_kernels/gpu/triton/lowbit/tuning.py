"""Config selection: the shipped configs, the per-device tuning cache, and the tuner that fills it.

A problem's key is (path, M bucket, N, K, group, bits) (:func:`config_key`). Lookup order: the
in-process cache, which starts as the shipped ``lowbit_linear_configs.json`` (per device name)
overlaid with ``$AIPC_CACHE_DIR/triton/lowbit_linear-<device>.json``; on a miss, the tuner times every
config of the registered kernels' spaces (CUDA-graph replays; for M > 16 over copies of the weight that
outsize the L2, so each call reads its weight from HBM as a model's layers do) and writes the winner to that file
(atomically: written aside, then renamed; a lock serialises threads), or, with tuning off
(``AIPC_TRITON_AUTOTUNE=0``, the interpreter, a graph capture), the heuristic.
"""
from __future__ import annotations

import json
import math
import os
import re
import threading
from pathlib import Path
from typing import Optional

import torch
import triton

from aipc_kernels.lowbit.packing import PackedLowBit, triton_chunk
from aipc_kernels.gpu.triton.lowbit.common import GEMV_MAX_M, path
from aipc_kernels.gpu.triton.lowbit.registry import KERNELS, heuristic_config, launch, takes, usable

SHIPPED_CONFIGS = Path(__file__).with_name("lowbit_linear_configs.json")
#: Where M > 16 the tuner times a config over copies of the weight totalling this many L2 sizes (bench/gemv_gpu.py's
#: rotation), at most MAX_WEIGHT_COPIES of them and a quarter of the free memory: one weight timed L2-warm ranked
#: configs apart from their times in a model, whose other layers evict it (docs/triton.md, "The tuner's weights").
ROTATE_L2 = 4
MAX_WEIGHT_COPIES = 256
_mem_cache: dict[str, dict[str, dict]] = {}
_cache_lock = threading.Lock()


def _m_bucket(M: int) -> int:
    if M <= 1:
        return 1
    if M <= GEMV_MAX_M:
        return GEMV_MAX_M
    return min(1 << (M - 1).bit_length(), 4096)


def config_key(M: int, N: int, K: int, group_size: int, bits: int, progressive: bool = False) -> str:
    """The autotune cache key of a problem (path, M bucket, N, K, group, bits; ``:p``: the progressive
    two-level form, whose kernels are others)."""
    g = "row" if group_size == K else group_size
    return f"{path(M)}:m{_m_bucket(M)}:n{N}:k{K}:g{g}:b{bits}" + (":p" if progressive else "")


def device_name(device: torch.device) -> str:
    """The name configs are cached under (``torch.cuda/xpu.get_device_name``)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "xpu":
        return torch.xpu.get_device_name(device)
    return f"{device.type}-interpreter"


def cache_file(name: str) -> Path:
    """Where tuned configs of device ``name`` are cached (``$AIPC_CACHE_DIR/triton/``)."""
    root = Path(os.environ.get("AIPC_CACHE_DIR", Path.home() / ".cache" / "aipc-plugins"))
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_")
    return root / "triton" / f"lowbit_linear-{slug}.json"


def cached_configs(name: str, kernels: Optional[tuple[str, ...]] = None) -> dict[str, dict]:
    """Every known config of device ``name`` by key: shipped, overlaid with the tuning cache. Cached
    configs of kernels no longer shipped (an older version's tuning) are skipped: re-tuned on use.
    ``kernels``: the kernel names kept from the cache (default: :data:`~.registry.KERNELS`; the W4A16
    kernel caches its own under another name)."""
    with _cache_lock:
        if name not in _mem_cache:
            cfgs: dict[str, dict] = {}
            if SHIPPED_CONFIGS.exists():
                cfgs.update(json.loads(SHIPPED_CONFIGS.read_text()).get(name, {}))
            f = cache_file(name)
            if f.exists():
                try:
                    known = KERNELS if kernels is None else kernels
                    cfgs.update({k: c for k, c in json.loads(f.read_text()).items() if c.get("KERNEL") in known})
                except json.JSONDecodeError:
                    pass  # a torn write from a crashed process: re-tune
            _mem_cache[name] = cfgs
        return _mem_cache[name]


def save_config(name: str, key: str, cfg: dict) -> None:
    """Adds ``cfg`` under ``key`` to device ``name``'s cache, in memory and on disk."""
    with _cache_lock:
        _mem_cache.setdefault(name, {})[key] = cfg
        f = cache_file(name)
        f.parent.mkdir(parents=True, exist_ok=True)
        on_disk = json.loads(f.read_text()) if f.exists() else {}
        on_disk[key] = cfg
        tmp = f.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(on_disk, indent=1, sort_keys=True))
        tmp.replace(f)


def autotune_enabled(device: torch.device) -> bool:
    """``AIPC_TRITON_AUTOTUNE`` (default: on for GPUs, off in the interpreter)."""
    default = "0" if device.type == "cpu" else "1"
    return os.environ.get("AIPC_TRITON_AUTOTUNE", default) not in ("0", "", "false", "False")


def _time(fn, device: torch.device) -> float:
    """Median ms of ``fn``'s GPU work. On CUDA through graph replays: a plain timing loop would
    measure the Python launch path (~10 us), not kernels of a few us."""
    if device.type == "cuda":
        fn()  # compile and allocate outside the capture
        return triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median")
    return triton.testing.do_bench(fn, warmup=5, rep=20, return_mode="median")


def weight_copies(weight: PackedLowBit, device: torch.device, M: int) -> list[PackedLowBit]:
    """``weight`` and clones of it for :func:`time_per_call` on the GEMM path (M > 16) on CUDA; else ``weight``
    alone (at M <= 16 the rotation changed no pick by more than 1.5% and took the tuning past 100 s a key)."""
    if device.type != "cuda" or path(M) != "gemm":
        return [weight]
    b = max(1, weight.nbytes())
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    free = torch.cuda.mem_get_info(device)[0]
    n = max(1, min(MAX_WEIGHT_COPIES, math.ceil(ROTATE_L2 * l2 / b), free // 4 // b))
    return [weight] + [weight.clone() for _ in range(n - 1)]


def time_per_call(call, weights: list[PackedLowBit], device: torch.device) -> float:
    """Median ms per ``call(w)``, each of ``weights`` in turn (:func:`weight_copies`), timed as :func:`_time`."""
    return _time(lambda: [call(w) for w in weights], device) / len(weights)


def candidates(M: int, weight: PackedLowBit) -> list[dict]:
    """The configs :func:`tune` times for ``M`` tokens on ``weight``: every registered kernel's space,
    less K splits longer than the weight's chunks and row tiles far wider than N."""
    chunks = weight.qweight.shape[1] * 8 // weight.bits // triton_chunk(weight.bits)
    return [c for kernel in KERNELS.values() if takes(kernel, weight) for c in kernel.space(M)
            if c.get("SPLIT_K", 1) <= chunks and c["BLOCK_N"] <= max(16, 2 * weight.out_features)]


def tune(x2: torch.Tensor, weight: PackedLowBit, bias: Optional[torch.Tensor], y: torch.Tensor) -> dict:
    """Times every configuration of every registered kernel for this M on these operands (for M > 16 the
    weight from HBM: :func:`weight_copies`); returns the
    fastest (with its time, ``us``, and each kernel's best time, ``by_kernel``: fused or dequantize-then-GEMM)."""
    M, K = x2.shape
    best, best_t = None, float("inf")
    by_kernel: dict[str, float] = {}
    weights = weight_copies(weight, x2.device, M)
    for cfg in candidates(M, weight):
        try:
            t = time_per_call(lambda w: launch(x2, w, bias, y, cfg), weights, x2.device)
        except Exception:  # noqa: BLE001 - a config the device cannot compile (shared memory, registers)
            continue
        name = cfg["KERNEL"]
        by_kernel[name] = min(by_kernel.get(name, float("inf")), round(t * 1e3, 2))
        if t < best_t:
            best, best_t = cfg, t
    if best is None:
        raise RuntimeError(f"lowbit_linear: no Triton configuration ran for "
                           f"{config_key(M, weight.out_features, K, weight.group_size, weight.bits, weight.supers is not None)}")
    return dict(best, us=round(best_t * 1e3, 2), by_kernel=by_kernel)


def select_config(x2: torch.Tensor, weight: PackedLowBit, bias: Optional[torch.Tensor], y: torch.Tensor) -> dict:
    """Cached config for this device and problem; tunes (and caches) on a miss when enabled."""
    M, K = x2.shape
    dev = x2.device
    name = device_name(dev)
    two_level = weight.supers is not None
    key = config_key(M, weight.out_features, K, weight.group_size, weight.bits, two_level)
    cfgs = cached_configs(name)
    if key in cfgs and usable(cfgs[key], dev):
        return cfgs[key]
    capturing = dev.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if not autotune_enabled(dev) or capturing:
        return heuristic_config(M, weight.out_features, K, weight.bits, dev, two_level)
    cfg = tune(x2, weight, bias, y)
    save_config(name, key, cfg)
    return cfg
