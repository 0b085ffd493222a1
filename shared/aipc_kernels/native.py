"""Loader for the native CPU kernel library (``_aipc_native``, plain C built by setup.py).

The library is called through ctypes (it has no Python or torch headers); ctypes releases the GIL
during the call. The linear kernel is called through ``aipc_lowbit_linear_v``, its arguments packed in
one int64 vector: ctypes converts one pointer instead of 17 arguments (0.2 us instead of 2 us a call).
Threads: every call passes ``torch.get_num_threads()``, so the kernels follow the size PyTorch (and
vLLM's CPU worker, which sets it) chose, instead of OpenMP's own default.
"""
from __future__ import annotations

import ctypes
import glob
import os
import struct
from array import array
from functools import lru_cache
from typing import Optional

import torch

ISAS = {"scalar": 0, "avx2": 1, "avx_vnni": 2, "avx512_vnni": 3, "amx_int8": 4}
ISA_NAMES = {v: k for k, v in ISAS.items()}
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
ERRORS = {
    -1: "bits must be 1 or 2",
    -2: "bad shape (K must be a multiple of the chunk: 16 for 2 bits, 32 for 1 bit)",
    -3: "bad group size (must divide K and be a multiple of the chunk)",
    -4: "unsupported dtype",
    -5: "ISA not supported by this CPU",
    -6: "out of memory",
    -7: "bad code book constants (cmul must be finite and positive, zero finite, or NaN for per-group zeros)",
    -8: "zeros missing: the code book stores a zero point per group (zero=NaN) but zeros is None",
    -9: "a tensor pointer is NULL",
    -10: "nthreads out of range (0 for OpenMP's default, up to 4096)",
}


@lru_cache(maxsize=1)
def library() -> Optional[ctypes.CDLL]:
    """The loaded native library, or None when it was not built (``AIPC_NO_NATIVE=1``).
    ``AIPC_NATIVE_LIB=/path/to/lib.so`` loads another build of it (experiments, benchmarks)."""
    here = os.path.dirname(os.path.abspath(__file__))
    override = os.environ.get("AIPC_NATIVE_LIB")
    found = [override] if override else sorted(glob.glob(os.path.join(here, "_aipc_native*.so")))
    if not found:
        return None
    lib = ctypes.CDLL(found[0])
    i64, vp = ctypes.c_int64, ctypes.c_void_p
    lib.aipc_lowbit_linear_v.restype = ctypes.c_int
    lib.aipc_lowbit_linear_v.argtypes = [vp]
    lib.aipc_stream_read.restype = ctypes.c_uint64
    lib.aipc_stream_read.argtypes = [vp, i64, ctypes.c_int]
    lib.aipc_time_lowbit_linear_v.restype = ctypes.c_double
    lib.aipc_time_lowbit_linear_v.argtypes = [vp, i64, i64, ctypes.c_double]
    lib.aipc_time_stream_read.restype = ctypes.c_double
    lib.aipc_time_stream_read.argtypes = [vp, i64, i64, ctypes.c_int, i64, ctypes.c_double]
    for fn in ("aipc_best_isa", "aipc_get_isa"):
        getattr(lib, fn).restype = ctypes.c_int
    lib.aipc_set_isa.argtypes = [ctypes.c_int]
    isa = os.environ.get("AIPC_ISA")
    if isa:
        set_isa(isa, lib)
    return lib


def available() -> bool:
    """Whether the native kernels were built and load."""
    return library() is not None


def _lib() -> ctypes.CDLL:
    lib = library()
    if lib is None:
        raise RuntimeError("aipc_kernels native library is not built; reinstall aipc-plugins without AIPC_NO_NATIVE=1")
    return lib


def best_isa() -> str:
    """Best instruction set the CPU offers the kernels."""
    return ISA_NAMES[_lib().aipc_best_isa()]


def get_isa() -> str:
    """Instruction set the kernels use now."""
    return ISA_NAMES[_lib().aipc_get_isa()]


def set_isa(name: str, lib: Optional[ctypes.CDLL] = None) -> None:
    """Forces an instruction set (``AIPC_ISA`` does the same at load); errors if the CPU lacks it."""
    if name not in ISAS:
        raise ValueError(f"AIPC_ISA / isa={name!r} is unknown; use one of {list(ISAS)}")
    if (lib or _lib()).aipc_set_isa(ISAS[name]) != 0:
        raise ValueError(f"isa={name!r} is not supported by this CPU (best: {best_isa()})")


def _require_dense(t: Optional[torch.Tensor]) -> None:
    """Refuses a strided view the C code would misread as dense."""
    if t is not None and not t.is_contiguous():
        raise ValueError(f"native kernel operand of shape {tuple(t.shape)} must be contiguous (call .contiguous())")


@lru_cache(maxsize=64)
def _f32_bits(v: float) -> int:
    """The float32 bit pattern of ``v`` as a signed int (how ``aipc_lowbit_linear_v`` takes floats)."""
    return struct.unpack("<i", struct.pack("<f", v))[0]


def lowbit_linear_args(
    y: torch.Tensor,
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    bits: int,
    group_size: int,
    cmul: float,
    zero: float,
    act_group: int,
) -> array:
    """The argument vector of the C entry point ``aipc_lowbit_linear_v`` for dense operands (x and y with
    their leading dimensions flattened to M rows); pass ``vector.buffer_info()[0]``. ``zero``: the code
    book's fixed zero point, or NaN when it stores one per group (the C entry then requires ``zeros``).
    The caller keeps the tensors alive while the kernel runs."""
    K = x.shape[-1]
    return array("q", (
        x.data_ptr(), DTYPE_CODES[x.dtype], x.numel() // K if K else 0, K, qweight.data_ptr(), bits, y.shape[-1],
        scales.data_ptr(), 0 if zeros is None else zeros.data_ptr(), DTYPE_CODES[scales.dtype], group_size,
        _f32_bits(cmul), _f32_bits(zero), 0 if bias is None else bias.data_ptr(), y.data_ptr(), act_group,
        torch.get_num_threads(),
    ))  # fmt: skip


def lowbit_linear_into(
    y: torch.Tensor,
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    bits: int,
    group_size: int,
    cmul: float,
    zero: float,
    act_group: int,
    check_dense: bool = True,
) -> None:
    """Runs the native kernel: ``y[..., N] = x[..., K] @ W^T + bias`` with W in the ``cpu_vnni16`` layout
    (x and y dense, their leading dimensions flattened to M rows). ``check_dense=False`` skips the
    contiguity checks, for a caller (the op) that has made every operand dense itself."""
    if check_dense:
        for t in (y, x, qweight, scales, zeros, bias):
            _require_dense(t)
    args = lowbit_linear_args(y, x, qweight, scales, zeros, bias, bits, group_size, cmul, zero, act_group)
    status = _lib().aipc_lowbit_linear_v(args.buffer_info()[0])
    if status != 0:
        raise RuntimeError(
            f"aipc_lowbit_linear failed: {ERRORS.get(status, status)} (M={args[2]}, K={args[3]}, N={args[6]}, "
            f"group_size={group_size}, act_group={act_group})"
        )


def stream_read(buf: torch.Tensor, threads: Optional[int] = None) -> int:
    """Reads every byte of a contiguous CPU tensor with ``threads`` threads (bandwidth probe)."""
    return _lib().aipc_stream_read(buf.data_ptr(), buf.numel() * buf.element_size(), threads or torch.get_num_threads())


def _addresses(addresses: list[int]) -> ctypes.Array:
    return (ctypes.c_void_p * len(addresses))(*addresses)


def time_lowbit_linear(vectors: list[array], calls: int, min_seconds: float = 0.3) -> float:
    """Seconds per call of the native kernel over argument vectors (:func:`lowbit_linear_args`, e.g. one
    per rotating weight copy) called in turn, best round; timed in C, so no interpreter runs between the
    calls (as in :func:`stream_read`'s probe). The caller keeps the vectors' tensors alive."""
    if not vectors:
        raise ValueError("time_lowbit_linear: vectors is empty; pass one lowbit_linear_args vector per weight set")
    t = _lib().aipc_time_lowbit_linear_v(_addresses([v.buffer_info()[0] for v in vectors]), len(vectors), calls, min_seconds)
    if t < 0:
        raise RuntimeError(f"aipc_lowbit_linear failed: {ERRORS.get(int(t), int(t))}")
    return t


def time_stream_read(bufs: list[torch.Tensor], calls: int, min_seconds: float = 0.3, threads: Optional[int] = None) -> float:
    """Seconds per :func:`stream_read` of each contiguous buffer in turn (all of ``bufs[0]``'s size), best
    round, timed in C like :func:`time_lowbit_linear`."""
    if not bufs:
        raise ValueError("time_stream_read: bufs is empty; pass one buffer per rotating copy")
    nbytes = bufs[0].numel() * bufs[0].element_size()
    if any(b.numel() * b.element_size() != nbytes or not b.is_contiguous() for b in bufs):
        raise ValueError("time_stream_read: bufs must be contiguous and of one size")
    return _lib().aipc_time_stream_read(
        _addresses([b.data_ptr() for b in bufs]), len(bufs), nbytes, threads or torch.get_num_threads(), calls, min_seconds
    )
