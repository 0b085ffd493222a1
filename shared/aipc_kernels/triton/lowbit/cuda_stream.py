"""``cuda_stream``: the M == 1 W2A8 GEMV in CUDA C (NVIDIA only), beside the portable Triton ``stream``.

Issue 20 allows a vendor kernel behind the same op. ``PRE=0``: a single launch, every block quantizes
the activation row into shared memory itself (the pre-pass's codes, bit for bit); ``PRE=1``: the Triton
pre-pass (:func:`~.activation.quantize_row_packed`) runs first and this kernel is launched after it by
programmatic dependent launch (``cuLaunchKernelEx``, sm_90+), loading its first weights before it waits
for the codes. Then its warps stream
blocks of RW rows, each lane one row and every (32 / RW)-th 16-byte unit of it, D units of loads ahead of
the ``dp4a``s (``cuda_stream.cu`` says how). 2-bit code books with groups of 32, 64 or 128 (fixed or
stored zeros); anything else raises a ValueError naming the Triton ``stream`` kernel. The source is
compiled at first use by NVRTC through ``torch.cuda._compile_kernel`` (no CUDA toolkit needed, one
compile per variant and process) and never runs in the Triton interpreter: its tests need a GPU.

Config: ``RW`` (rows per warp, 1-32), ``D`` (units in flight per lane), ``PRE`` (0/1), ``num_warps`` (per block),
``BPS`` (blocks per SM of the grid), ``BLOCK_N`` (= RW) and ``SPLIT_K`` (1): the GEMV path's fields.
"""
from __future__ import annotations

import ctypes
import threading
from pathlib import Path
from typing import Optional

import torch

from ...formats import get_codebook
from ...packing import PackedLowBit
from .activation import quantize_row_packed
from .common import sm_count
from .interpret import INTERPRETED, pdl_ok

NAME = "cuda_stream"
SOURCE = Path(__file__).with_name("cuda_stream.cu")
MAX_KP = 32768  # codes and 16-k sums in static shared memory: 1.25 Kp bytes, below 48 KiB
SPACE = [
    {"KERNEL": NAME, "BLOCK_N": rw, "SPLIT_K": 1, "RW": rw, "D": d, "num_warps": nw, "num_stages": 1, "BPS": bps, "PRE": pre}
    for rw in (1, 2, 4, 8, 16)
    for d in (2, 4, 8)
    for nw in (4, 8)
    for bps in (1, 2)
    for pre in (0, 1)
]
_KINDS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_compiled: dict[tuple, object] = {}
_lock = threading.Lock()


def available(device: torch.device) -> bool:
    """Compiled CUDA (not the interpreter) with torch's NVRTC entry (``torch.cuda._compile_kernel``)."""
    return device.type == "cuda" and not INTERPRETED and torch.version.cuda is not None and hasattr(torch.cuda, "_compile_kernel")


def usable(device: torch.device) -> bool:
    """Whether a cached or shipped config of this kernel may run on ``device`` (else the op takes the
    heuristic's config: an older torch without NVRTC's entry must not fail on the shipped H100 configs)."""
    return available(device)


def space(M: int) -> list[dict]:
    """The configs the tuner times for ``M`` tokens: M == 1 on CUDA (the tuner skips the ones a weight refuses)."""
    return list(SPACE) if M == 1 and torch.cuda.is_available() and available(torch.device("cuda")) else []


def heuristic(M: int, N: int, K: int, bits: int, device: torch.device) -> Optional[dict]:
    """No untuned default: the Triton ``stream`` kernel serves untuned M == 1 problems."""
    return None


def check(x2: torch.Tensor, weight: PackedLowBit, cfg: dict) -> None:
    """A ValueError naming the fix when this kernel cannot run ``weight`` (or ``cfg``)."""
    cb = get_codebook(weight.codebook)
    K, G = x2.shape[1], weight.group_size
    Kp = weight.qweight.shape[1] * 4
    if x2.shape[0] != 1:
        raise ValueError(f"config {cfg}: the cuda_stream kernel takes M == 1 only (M={x2.shape[0]})")
    if not available(x2.device):
        raise ValueError(f"config {cfg}: cuda_stream needs compiled CUDA with torch.cuda._compile_kernel; use KERNEL='stream'")
    if cb.bits != 2 or G not in (32, 64, 128) or G == K:
        raise ValueError(f"config {cfg}: cuda_stream takes 2-bit codes in groups of 32, 64 or 128 "
                         f"({weight.codebook}, {cb.bits} bits, group {G}); use KERNEL='stream'")
    if Kp > MAX_KP:
        raise ValueError(f"config {cfg}: cuda_stream keeps the activation codes in shared memory, K <= {MAX_KP} (K={K}); use KERNEL='stream'")
    if weight.qweight.data_ptr() % 16 or x2.dtype not in _KINDS or weight.scales.dtype not in _KINDS:
        raise ValueError(f"config {cfg}: cuda_stream needs 16-byte aligned codes and fp32/fp16/bf16 x and scales; use KERNEL='stream'")
    if cfg.get("PRE", 0) and not hasattr(torch.cuda._utils, "_get_gpu_runtime_library"):
        raise ValueError(f"config {cfg}: PRE=1 needs torch's CUDA driver handle (torch.cuda._utils); use PRE=0")
    if cfg.get("RW", 8) not in (1, 2, 4, 8, 16, 32) or cfg.get("D", 4) not in (1, 2, 4, 8) or cfg.get("SPLIT_K", 1) != 1:
        raise ValueError(f"config {cfg}: cuda_stream takes RW in (1, 2, 4, 8, 16, 32), D in (1, 2, 4, 8) and SPLIT_K=1")


def _kernel(key: tuple):
    """The compiled variant of ``key`` (macros), compiled once per process."""
    with _lock:
        if key not in _compiled:
            names = ("IN_KIND", "SCALE_KIND", "G", "RW", "D", "U", "NWARPS", "XV", "PRE", "HAS_ZEROS", "HAS_BIAS", "HAS_AMAX", "VEC", "CMUL", "ZERO")
            defines = "".join(f"#define {n} {v}\n" for n, v in zip(names, key))
            _compiled[key] = torch.cuda._compile_kernel(defines + SOURCE.read_text(), "lowbit_gemv_w2", nvcc_options=["-std=c++17"])
        return _compiled[key]


class _LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: an id, padding, a 64-byte value union
    _fields_ = [("id", ctypes.c_uint), ("pad", ctypes.c_char * 4), ("value", ctypes.c_char * 64)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION (cuda.h)


def _launch_dependent(kern, grid: tuple[int, int, int], block: tuple[int, int, int], args: list) -> None:
    """``kern`` on the current stream as the secondary of a programmatic dependent launch (it may start
    while the kernel before it runs; its ``griddepcontrol.wait`` waits for that kernel's writes)."""
    from torch.cuda import _utils

    keep, ptrs = [], []
    for a in args:
        keep.append(ctypes.c_void_p(a.data_ptr()) if isinstance(a, torch.Tensor) else ctypes.c_int(a))
        ptrs.append(ctypes.cast(ctypes.byref(keep[-1]), ctypes.c_void_p))
    params = (ctypes.c_void_p * len(ptrs))(*ptrs)
    attr = _LaunchAttribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION)
    ctypes.memmove(attr.value, ctypes.byref(ctypes.c_int(1)), 4)
    cfg = _LaunchConfig((ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(*block), 0,
                        ctypes.c_void_p(torch.cuda.current_stream().cuda_stream), ctypes.pointer(attr), 1)
    lib = _utils._get_gpu_runtime_library()
    _utils._check_cuda(lib.cuLaunchKernelEx(ctypes.byref(cfg), kern.func, params, None))


def launch(x2: torch.Tensor, weight: PackedLowBit, bias: Optional[torch.Tensor], y: torch.Tensor, cfg: dict,
           act_amax: Optional[torch.Tensor] = None) -> None:  # fmt: skip
    """The op for ``x2 [1, K]`` (its own activation pass, or the Triton pre-pass first: ``PRE``), writing ``y [1, N]``."""
    check(x2, weight, cfg)
    cb = get_codebook(weight.codebook)
    K, N = x2.shape[1], weight.out_features
    Kp = weight.qweight.shape[1] * 4
    rw, d, nw, pre = cfg.get("RW", 8), cfg.get("D", 4), cfg["num_warps"], int(cfg.get("PRE", 0))
    if pre and not pdl_ok(x2.device):
        raise ValueError(f"config {cfg}: PRE=1 chains the Triton pre-pass by programmatic dependent launch (sm_90+); use PRE=0")
    vec = int(x2.data_ptr() % 16 == 0 and K % 8 == 0)
    key = (_KINDS[x2.dtype], _KINDS[weight.scales.dtype], weight.group_size, rw, d, Kp // 64, nw, -(-Kp // (8 * 32 * nw)), pre,
           int(weight.zeros is not None), int(bias is not None), int(act_amax is not None and not pre), vec,
           f"((float){float(cb.cmul).hex()})", f"((float){float(cb.zero or 0.0).hex()})")  # fmt: skip
    row_blocks = -(-N // rw)
    blocks = max(1, min(-(-row_blocks // nw), cfg.get("BPS", 1) * sm_count(x2.device)))
    kern = _kernel(key)
    xq = sx = weight.scales  # unused by PRE=0
    if pre:
        xq, _, sx = quantize_row_packed(x2, Kp, True, act_amax)
    args = [x2, weight.scales if act_amax is None else act_amax, weight.qweight, weight.scales,
            weight.scales if weight.zeros is None else weight.zeros, weight.scales if bias is None else bias, y,
            xq, sx, N, K, weight.scales.shape[0]]  # fmt: skip
    with torch.cuda.device(x2.device):
        if pre:
            _launch_dependent(kern, (blocks, 1, 1), (32 * nw, 1, 1), args)
        else:
            kern(grid=(blocks, 1, 1), block=(32 * nw, 1, 1), args=args)
