"""Segment-KV attention: ``torch.ops.aipc.segment_sdpa``, the fused index-select SDPA of beam search.

The KV cache of ``E`` beams (or samples) of ``B`` prompts is held in two segments:

* prompt ``[B, Np, Hkv, D]`` (batch-first), computed once per prompt and shared by its ``E`` rows;
* response ``[cap, N, Hkv, D]`` (sequence-first, ``N = B*E`` rows, ``cap >= Nr``), written in place;
  ``path[t, n]`` (int32 ``[Nr, N]``) is the response row that holds token ``t`` of row ``n``'s
  current beam, so reordering beams rewrites the small path table instead of copying K/V.

``segment_sdpa(query [N, Hq, Lq, D], ...) -> [N, Lq, Hq, D]`` is the attention of each query over
the ``Np + Nr`` logical positions of its row, one softmax over both segments, ``Hq / Hkv`` query
heads per KV head (GQA). ``attn_mask`` (bool, True = attend, or additive float) broadcasts to
``[N, Hq, Lq, Np + Nr]`` and is indexed by logical position; ``is_causal`` lets query ``l`` see
positions ``<= Np + Nr - Lq + l``. Fully masked queries give zeros. NaN in the query, keys, values,
scale or mask gives NaN where :func:`reference_segment_sdpa` does (a NaN value even at a masked position:
``0 * NaN``). Math in float32, output in the query's dtype (float32, bfloat16 or float16).

The argument checks and the reference that define the result are in
:mod:`aipc_kernels.decoder.segment_contract`, below this module and every backend.

Backends (one op, dispatched by device): CPU -> the native C kernel (``csrc/segment_sdpa*.c``;
prompt-only prefill goes to PyTorch's fused SDPA); CUDA / XPU -> the Triton kernel
(:mod:`aipc_kernels.gpu.triton.segment_sdpa`); anything else, or no kernel built / triton absent ->
:func:`~aipc_kernels.decoder.segment_contract.reference_segment_sdpa` (plain torch).
"""
from __future__ import annotations

import ctypes
from functools import lru_cache
from typing import Optional

import torch

from aipc_kernels.core import native
from aipc_kernels.decoder.segment_contract import SegmentDims, additive_mask, check_args, kernel_mask, reference_segment_sdpa

# Rows (beams or samples) sharing one prompt that each backend handles; the cache checks it early.
MAX_GROUP = {"native": 256, "reference": 1 << 30, "triton": 64}


# ---------------------------------------------------------------------------------------- CPU native


def bind_native(lib: Optional[ctypes.CDLL]):
    """``lib``'s C entry point ``aipc_segment_sdpa`` with its ctypes signature, or None when ``lib``
    lacks it (bench/ab_native.py binds another build's library with it)."""
    fn = getattr(lib, "aipc_segment_sdpa", None) if lib is not None else None
    if fn is None:
        return None
    i64, vp, f32, ci = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
    fn.restype = ci
    fn.argtypes = [vp, i64, i64, i64, vp, vp, vp, vp, vp, vp, i64, i64, i64, vp, ci,
                   i64, i64, i64, i64, i64, i64, i64, i64, f32, ci, ci]  # fmt: skip
    return fn


@lru_cache(maxsize=1)
def _native_fn():
    """This package's library's entry point (:func:`bind_native`), or None."""
    return bind_native(native.library())


def native_available() -> bool:
    """Whether the native CPU segment kernel is built and loads."""
    return _native_fn() is not None


def native_isa() -> str:
    """The instruction set whose code the native kernel runs under the library's current choice
    (:func:`aipc_kernels.core.native.set_isa`): ``scalar``, ``avx2`` or ``avx512_vnni`` (its AVX-512 code)."""
    if _native_fn() is None:
        raise RuntimeError("the native segment_sdpa kernel is not built; rebuild aipc-plugins (setup.py build_ext)")
    query = native.library().aipc_segment_isa
    query.restype = ctypes.c_int
    return native.ISA_NAMES[query()]


def native_segment_sdpa(
    query: torch.Tensor,
    prompt_key: torch.Tensor,
    prompt_value: torch.Tensor,
    response_key: torch.Tensor,
    response_value: torch.Tensor,
    path: torch.Tensor,
    attn_mask: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    is_causal: bool = False,
    out: Optional[torch.Tensor] = None,
    dims: Optional[SegmentDims] = None,
    fn=None,
) -> torch.Tensor:
    """The native CPU kernel for any shape (prefill included). ``out``: optional float32
    ``[N, Lq, Hq, D]`` to write into (tests poison it). ``dims``: what :func:`check_args` returned for
    these arguments, from a caller that validated them already. ``fn``: another build's entry point
    (:func:`bind_native`; default this package's). Returns the output in the query's dtype."""
    fn = fn or _native_fn()
    if fn is None:
        raise RuntimeError("the native segment_sdpa kernel is not built; rebuild aipc-plugins (setup.py build_ext)")
    d = dims or check_args(query, prompt_key, prompt_value, response_key, response_value, path, attn_mask)
    if query.device.type != "cpu":
        raise ValueError(f"native_segment_sdpa runs on CPU tensors, query is on {query.device}")
    scale = d.D**-0.5 if scale is None else scale
    if query.stride(-1) != 1:
        query = query.contiguous()
    pk, pv, rk, rv = (t.contiguous() for t in (prompt_key, prompt_value, response_key, response_value))
    path = path.contiguous()
    m_ptr, ms = None, (0, 0, 0)
    if attn_mask is not None:
        mask, ms = kernel_mask(attn_mask, d)
        m_ptr = mask.data_ptr()
    if out is None:
        out = torch.empty(d.N, d.Lq, d.Hq, d.D, dtype=torch.float32)
    elif out.shape != (d.N, d.Lq, d.Hq, d.D) or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"native_segment_sdpa: out must be a contiguous float32 [{d.N}, {d.Lq}, {d.Hq}, {d.D}]")
    status = fn(
        query.data_ptr(), query.stride(0), query.stride(1), query.stride(2),
        pk.data_ptr(), pv.data_ptr(), rk.data_ptr(), rv.data_ptr(), path.data_ptr(),
        m_ptr, *ms, out.data_ptr(), native.DTYPE_CODES[query.dtype],
        d.N, d.B, d.Hq, d.Hkv, d.Lq, d.D, d.Np, d.Nr, float(scale), int(bool(is_causal)), torch.get_num_threads(),
    )  # fmt: skip
    if status != 0:
        raise RuntimeError(f"aipc_segment_sdpa failed: {native.status_message(status)} ({d})")
    return out if query.dtype == torch.float32 else out.to(query.dtype)


def _prompt_only_sdpa(query, prompt_key, prompt_value, attn_mask, scale, is_causal, d: SegmentDims) -> torch.Tensor:
    """Prefill (no response yet, E = 1): PyTorch's fused SDPA on the prompt segment."""
    k = prompt_key.transpose(1, 2)  # [B, Hkv, Np, D] view
    v = prompt_value.transpose(1, 2)
    if d.Hq != d.Hkv:
        k = k.repeat_interleave(d.Hq // d.Hkv, dim=1)
        v = v.repeat_interleave(d.Hq // d.Hkv, dim=1)
    mask = None if attn_mask is None else additive_mask(attn_mask, query.dtype)
    causal = bool(is_causal) and mask is None and d.Lq == d.Np
    if is_causal and not causal:  # causal with a mask or a query shorter than the keys: fold into the mask
        pos = torch.arange(d.Np, device=query.device)
        limit = d.Np - d.Lq + torch.arange(d.Lq, device=query.device)
        causal_mask = torch.zeros(d.Lq, d.Np, dtype=query.dtype, device=query.device)
        causal_mask.masked_fill_(pos[None, :] > limit[:, None], float("-inf"))
        mask = causal_mask[None, None] if mask is None else mask + causal_mask
    if mask is not None:  # fully masked rows: zeros (as the kernels), not NaN
        dead = torch.isinf(mask).all(dim=-1, keepdim=True) & (mask.amax(dim=-1, keepdim=True) < 0)
        mask = mask.masked_fill(dead, 0.0)
    out = torch.nn.functional.scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=scale, is_causal=causal)
    if mask is not None and bool(dead.any()):
        out = out.masked_fill(dead.expand(out.shape[0], out.shape[1], d.Lq, 1), 0.0)
    return out.transpose(1, 2).contiguous()


# ---------------------------------------------------------------------------------------- the op

_LIB = torch.library.Library("aipc", "FRAGMENT")
_LIB.define(
    "segment_sdpa(Tensor query, Tensor prompt_key, Tensor prompt_value, Tensor response_key, "
    "Tensor response_value, Tensor path, Tensor? attn_mask, float? scale, bool is_causal) -> Tensor"
)


def _op_reference(query, prompt_key, prompt_value, response_key, response_value, path, attn_mask, scale, is_causal):
    return reference_segment_sdpa(query, prompt_key, prompt_value, response_key, response_value, path, attn_mask,
                                  scale, is_causal)  # fmt: skip


def _op_cpu(query, prompt_key, prompt_value, response_key, response_value, path, attn_mask, scale, is_causal):
    d = check_args(query, prompt_key, prompt_value, response_key, response_value, path, attn_mask)
    if d.Nr == 0 and d.E == 1 and d.Lq > 1:
        return _prompt_only_sdpa(query, prompt_key, prompt_value, attn_mask, scale, is_causal, d)
    if _native_fn() is None:
        return _op_reference(query, prompt_key, prompt_value, response_key, response_value, path, attn_mask, scale,
                             is_causal)  # fmt: skip
    return native_segment_sdpa(query, prompt_key, prompt_value, response_key, response_value, path, attn_mask, scale,
                               is_causal, dims=d)  # fmt: skip


def _op_gpu(query, prompt_key, prompt_value, response_key, response_value, path, attn_mask, scale, is_causal):
    d = check_args(query, prompt_key, prompt_value, response_key, response_value, path, attn_mask)
    if d.Nr == 0 and d.E == 1 and d.Lq > 1:
        return _prompt_only_sdpa(query, prompt_key, prompt_value, attn_mask, scale, is_causal, d)
    try:
        from aipc_kernels.gpu.triton import segment_sdpa as triton_kernel
    except ImportError:  # triton not installed: plain torch
        return _op_reference(query, prompt_key, prompt_value, response_key, response_value, path, attn_mask, scale,
                             is_causal)  # fmt: skip
    return triton_kernel.segment_sdpa(query, prompt_key, prompt_value, response_key, response_value, path, attn_mask,
                                      scale, is_causal)  # fmt: skip


_LIB.impl("segment_sdpa", _op_reference, "CompositeExplicitAutograd")
_LIB.impl("segment_sdpa", _op_cpu, "CPU")
_LIB.impl("segment_sdpa", _op_gpu, "CUDA")
_LIB.impl("segment_sdpa", _op_gpu, "XPU")


@torch.library.register_fake("aipc::segment_sdpa")
def _segment_sdpa_fake(query, prompt_key, prompt_value, response_key, response_value, path, attn_mask, scale, is_causal):
    N, Hq, Lq, D = query.shape
    return query.new_empty(N, Lq, Hq, D)


def segment_sdpa(
    query: torch.Tensor,
    prompt_key: torch.Tensor,
    prompt_value: torch.Tensor,
    response_key: torch.Tensor,
    response_value: torch.Tensor,
    path: torch.Tensor,
    attn_mask: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    is_causal: bool = False,
) -> torch.Tensor:
    """Segment attention ``[N, Lq, Hq, D]`` (see the module docstring), through the custom op. ``scale``
    defaults to ``D ** -0.5``, computed by the backend once the arguments are checked."""
    scale = None if scale is None else float(scale)
    return torch.ops.aipc.segment_sdpa(
        query, prompt_key, prompt_value, response_key, response_value, path, attn_mask, scale, is_causal
    )


def max_group(device: torch.device) -> int:
    """Most rows per prompt (beams x return sequences) that the backend for ``device`` supports."""
    if device.type == "cpu":
        return MAX_GROUP["native"] if native_available() else MAX_GROUP["reference"]
    if device.type in ("cuda", "xpu"):
        return MAX_GROUP["triton"]
    return MAX_GROUP["reference"]
