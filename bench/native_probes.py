"""Loader of the benchmarks' measurement probes (``_aipc_probes``, built by setup.py from
``shared/aipc_kernels/csrc/probes/``; the shipped kernels never load it).

* :func:`stream_read`: a read-bandwidth probe that streams memory with the low-bit kernels' prefetch;
* :func:`fma_peak`: the float32 multiply-add peak of 256- or 512-bit FMAs (the float kernels' compute bound);
* :func:`dequant_fma_peak`: the same with the AVX2 W4A16 kernel's int dequantization before each FMA (its bound
  at M=1, where each weight is used once);
* :func:`int8_dot_peak`: the int8 dot product instruction of an ISA on register operands (the W*A8 kernels'
  compute bound at M > 1);
* :func:`time_calls` / :func:`time_lowbit_linear` / :func:`time_stream_read`: loops timed in C (best
  round over operand sets called in turn), so no interpreter runs between the calls.
"""
from __future__ import annotations

import ctypes
import glob
import os
from array import array
from functools import lru_cache
from typing import Optional

import torch

import aipc_kernels
from aipc_kernels.core import native


@lru_cache(maxsize=1)
def library() -> ctypes.CDLL:
    """The probe library next to the installed ``aipc_kernels`` package."""
    found = sorted(glob.glob(os.path.join(os.path.dirname(aipc_kernels.__file__), "_aipc_probes*.so")))
    if not found:
        raise RuntimeError("the probe library _aipc_probes is not built; run `python setup.py build_ext --inplace`")
    lib = ctypes.CDLL(found[0])
    i64, vp = ctypes.c_int64, ctypes.c_void_p
    lib.aipc_stream_read.restype = ctypes.c_uint64
    lib.aipc_stream_read.argtypes = [vp, i64, ctypes.c_int]
    lib.aipc_time_vector_calls.restype = ctypes.c_double
    lib.aipc_time_vector_calls.argtypes = [vp, vp, i64, i64, ctypes.c_double]
    lib.aipc_fma_peak.restype = ctypes.c_double
    lib.aipc_fma_peak.argtypes = [ctypes.c_int, ctypes.c_int, i64]
    lib.aipc_dequant_fma_peak.restype = ctypes.c_double
    lib.aipc_dequant_fma_peak.argtypes = [ctypes.c_int, i64]
    lib.aipc_int8_dot_peak.restype = ctypes.c_double
    lib.aipc_int8_dot_peak.argtypes = [ctypes.c_int, ctypes.c_int, i64]
    lib.aipc_time_stream_read.restype = ctypes.c_double
    lib.aipc_time_stream_read.argtypes = [vp, i64, i64, ctypes.c_int, i64, ctypes.c_double]
    return lib


def _addresses(addresses: list[int]) -> ctypes.Array:
    return (ctypes.c_void_p * len(addresses))(*addresses)


def stream_read(buf: torch.Tensor, threads: Optional[int] = None) -> int:
    """Reads every byte of a contiguous CPU tensor with ``threads`` threads (bandwidth probe)."""
    return library().aipc_stream_read(buf.data_ptr(), buf.numel() * buf.element_size(), threads or torch.get_num_threads())


def fma_peak(bits: int = 256, threads: Optional[int] = None, iters: int = 20_000_000) -> float:
    """Float32 multiply-adds per second (MAC/s) of ``threads`` threads running independent chains of
    ``bits``-wide FMAs (256: AVX2 + FMA, 512: AVX-512F), best of three rounds of ``iters`` iterations."""
    if bits not in (256, 512):
        raise ValueError(f"fma_peak: bits={bits}; use 256 (AVX2 + FMA) or 512 (AVX-512F)")
    if iters <= 0:
        raise ValueError(f"fma_peak: iters={iters} must be > 0 (default 20_000_000)")
    r = library().aipc_fma_peak(bits, threads or torch.get_num_threads(), iters)
    if r < 0:
        raise RuntimeError(f"fma_peak: {native.status_message(int(r))} (no {bits}-bit FMA on this CPU or build)")
    return r


def dequant_fma_peak(threads: Optional[int] = None, iters: int = 20_000_000) -> float:
    """Float32 multiply-adds per second of ``threads`` threads running the AVX2 W4A16 kernel's int
    dequantization mix per 8 weights (mask the code in place, convert, FMA), best of three rounds."""
    if iters <= 0:
        raise ValueError(f"dequant_fma_peak: iters={iters} must be > 0 (default 20_000_000)")
    r = library().aipc_dequant_fma_peak(threads or torch.get_num_threads(), iters)
    if r < 0:
        raise RuntimeError(f"dequant_fma_peak: {native.status_message(int(r))} (needs AVX2 + FMA)")
    return r


#: :func:`int8_dot_peak`'s ISAs: the dot product instruction each runs (the W*A8 kernels' inner loop there)
DOT_ISAS = {"avx2": 0, "avx_vnni": 1, "avx512_vnni": 2}


def int8_dot_peak(isa: str, threads: Optional[int] = None, iters: int = 20_000_000) -> float:
    """u8 x s8 multiply-adds per second of ``threads`` threads running ``isa``'s int8 dot product on register
    operands (``avx2``: vpmaddubsw with the 16-bit adds its tiles sum in; ``avx_vnni`` / ``avx512_vnni``:
    vpdpbusd on 256 / 512 bits), best of three rounds."""
    if isa not in DOT_ISAS:
        raise ValueError(f"int8_dot_peak: isa={isa!r}; use one of {sorted(DOT_ISAS)}")
    if iters <= 0:
        raise ValueError(f"int8_dot_peak: iters={iters} must be > 0 (default 20_000_000)")
    r = library().aipc_int8_dot_peak(DOT_ISAS[isa], threads or torch.get_num_threads(), iters)
    if r < 0:
        raise RuntimeError(f"int8_dot_peak: {native.status_message(int(r))} (this CPU has no {isa} dot product)")
    return r


def time_calls(entry: ctypes._CFuncPtr, vectors: list[array], calls: int, min_seconds: float = 0.3) -> float:
    """Seconds per call of ``entry`` (an entry point taking one int64 argument vector, such as
    ``aipc_lowbit_linear_v`` of this or another build of the kernel library) over the vectors called in
    turn (e.g. one per rotating weight copy), best round. The caller keeps the vectors' tensors alive."""
    if not vectors:
        raise ValueError("time_calls: vectors is empty; pass one lowbit_linear_args vector per weight set")
    t = library().aipc_time_vector_calls(ctypes.cast(entry, ctypes.c_void_p), _addresses([v.buffer_info()[0] for v in vectors]),
                                         len(vectors), calls, min_seconds)  # fmt: skip
    if t < 0:
        raise RuntimeError(f"aipc_lowbit_linear failed: {native.status_message(int(t))}")
    return t


def time_lowbit_linear(vectors: list[array], calls: int, min_seconds: float = 0.3) -> float:
    """:func:`time_calls` of the installed kernel library's ``aipc_lowbit_linear_v`` (vectors from
    ``native.lowbit_linear_args``)."""
    return time_calls(native.library().aipc_lowbit_linear_v, vectors, calls, min_seconds)


def time_stream_read(bufs: list[torch.Tensor], calls: int, min_seconds: float = 0.3, threads: Optional[int] = None) -> float:
    """Seconds per :func:`stream_read` of each contiguous buffer in turn (all of ``bufs[0]``'s size), best
    round, timed in C like :func:`time_calls`."""
    if not bufs:
        raise ValueError("time_stream_read: bufs is empty; pass one buffer per rotating copy")
    nbytes = bufs[0].numel() * bufs[0].element_size()
    if any(b.numel() * b.element_size() != nbytes or not b.is_contiguous() for b in bufs):
        raise ValueError("time_stream_read: bufs must be contiguous and of one size")
    return library().aipc_time_stream_read(
        _addresses([b.data_ptr() for b in bufs]), len(bufs), nbytes, threads or torch.get_num_threads(), calls, min_seconds
    )
