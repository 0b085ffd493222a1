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

Backends (one op, dispatched by device): CPU -> the native C kernel (``csrc/segment_sdpa*.c``;
prompt-only prefill goes to PyTorch's fused SDPA); CUDA / XPU -> the Triton kernel
(:mod:`aipc_kernels.triton.segment_sdpa`), or IPEX's fused index kernel on XPU when an IPEX built
for this torch is installed; anything else -> :func:`reference_segment_sdpa` (plain torch).
"""
from __future__ import annotations

import ctypes
import importlib.metadata
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

import torch

from . import native

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Rows (beams or samples) sharing one prompt that each backend handles; the cache checks it early.
MAX_GROUP = {"native": 256, "reference": 1 << 30, "triton": 64}


@dataclass(frozen=True)
class SegmentDims:
    """Sizes of one segment_sdpa call."""

    N: int  # rows (B * E)
    B: int  # prompts
    E: int  # rows per prompt (beams)
    Hq: int
    Hkv: int
    Lq: int
    D: int
    Np: int  # prompt length
    Nr: int  # response length (path rows)

    @property
    def L(self) -> int:
        return self.Np + self.Nr


def check_args(
    query: torch.Tensor,
    prompt_key: torch.Tensor,
    prompt_value: torch.Tensor,
    response_key: torch.Tensor,
    response_value: torch.Tensor,
    path: torch.Tensor,
    attn_mask: Optional[torch.Tensor],
) -> SegmentDims:
    """Validates every argument against the others (shapes, dtypes, devices) before any kernel runs; raises
    ValueError naming the offending argument. Every backend and the reference call it first."""
    if query.dim() != 4:
        raise ValueError(f"segment_sdpa: query must be [N, Hq, Lq, D], got shape {tuple(query.shape)}")
    N, Hq, Lq, D = query.shape
    for dim, size in (("rows N", N), ("heads Hq", Hq), ("length Lq", Lq), ("head dim D", D)):
        if size == 0:
            raise ValueError(f"segment_sdpa: query {dim} is 0 (query shape {tuple(query.shape)} = [N, Hq, Lq, D]); it must be positive")
    if query.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"segment_sdpa: query dtype {query.dtype} is not supported; use one of {SUPPORTED_DTYPES}")
    if prompt_key.dim() != 4 or prompt_key.shape != prompt_value.shape:
        raise ValueError(
            f"segment_sdpa: prompt_key/prompt_value must both be [B, Np, Hkv, D], got {tuple(prompt_key.shape)} "
            f"and {tuple(prompt_value.shape)}"
        )
    B, Np, Hkv, Dk = prompt_key.shape
    if Dk != D:
        raise ValueError(f"segment_sdpa: prompt_key head dim {Dk} != query head dim {D}")
    if B == 0 or N % B:
        raise ValueError(f"segment_sdpa: query rows N={N} must be a multiple of the prompts B={B} (N = B * beams)")
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"segment_sdpa: query heads {Hq} must be a multiple of the KV heads {Hkv}")
    if response_key.dim() != 4 or response_key.shape != response_value.shape:
        raise ValueError(
            f"segment_sdpa: response_key/response_value must both be [cap, N, Hkv, D], got "
            f"{tuple(response_key.shape)} and {tuple(response_value.shape)}"
        )
    if path.dim() != 2 or path.dtype != torch.int32:
        raise ValueError(f"segment_sdpa: path must be an int32 [Nr, N] table, got {path.dtype} {tuple(path.shape)}")
    for name, t in (("path", path), ("attn_mask", attn_mask)):
        if t is not None and t.device != query.device:
            raise ValueError(f"segment_sdpa: {name} is on {t.device}, query on {query.device}")
    Nr = path.shape[0]
    if Nr and (path.shape[1] != N or tuple(response_key.shape[1:]) != (N, Hkv, D) or response_key.shape[0] < Nr):
        raise ValueError(
            f"segment_sdpa: response_key {tuple(response_key.shape)} / path {tuple(path.shape)} do not match "
            f"N={N}, Hkv={Hkv}, D={D} (need response [cap >= Nr, N, Hkv, D] and path [Nr, N])"
        )
    for name, t in (("prompt_key", prompt_key), ("prompt_value", prompt_value), ("response_key", response_key),
                    ("response_value", response_value)):  # fmt: skip
        if t.dtype != query.dtype:
            raise ValueError(f"segment_sdpa: {name} dtype {t.dtype} != query dtype {query.dtype}")
        if t.device != query.device:
            raise ValueError(f"segment_sdpa: {name} is on {t.device}, query on {query.device}")
    if Np + Nr == 0:
        raise ValueError("segment_sdpa: no key positions (prompt and response are both empty)")
    if attn_mask is not None:
        if attn_mask.dim() != 4 or attn_mask.shape[-1] != Np + Nr or attn_mask.shape[-2] != Lq:
            raise ValueError(
                f"segment_sdpa: attn_mask must be 4-D [N|1, Hq|1, Lq, Np+Nr] = [.., .., {Lq}, {Np + Nr}], got "
                f"{tuple(attn_mask.shape)}"
            )
        if attn_mask.shape[0] not in (1, N) or attn_mask.shape[1] not in (1, Hq):
            raise ValueError(f"segment_sdpa: attn_mask shape {tuple(attn_mask.shape)} does not broadcast to N={N}, Hq={Hq}")
        if attn_mask.dtype != torch.bool and not attn_mask.dtype.is_floating_point:
            raise ValueError(f"segment_sdpa: attn_mask must be bool (True = attend) or float (additive), got {attn_mask.dtype}")
    return SegmentDims(N, B, N // B, Hq, Hkv, Lq, D, Np, Nr)


def additive_mask(attn_mask: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A bool (True = attend) or float mask as an additive mask of ``dtype``."""
    if attn_mask.dtype == torch.bool:
        return torch.zeros(attn_mask.shape, dtype=dtype, device=attn_mask.device).masked_fill_(~attn_mask, float("-inf"))
    return attn_mask.to(dtype)


def gather_segments(
    prompt: torch.Tensor, response: torch.Tensor, path: torch.Tensor, rows_per_prompt: int
) -> torch.Tensor:
    """The logical ``[N, Np + Nr, Hkv, D]`` keys (or values) of every row: what a per-beam cache holds."""
    full = prompt.repeat_interleave(rows_per_prompt, dim=0)
    Nr = path.shape[0]
    if Nr:
        t = torch.arange(Nr, device=path.device)[:, None]
        resp = response[t, path.long()]  # [Nr, N, Hkv, D]
        full = torch.cat([full, resp.transpose(0, 1)], dim=1)
    return full


def reference_segment_sdpa(
    query: torch.Tensor,
    prompt_key: torch.Tensor,
    prompt_value: torch.Tensor,
    response_key: torch.Tensor,
    response_value: torch.Tensor,
    path: torch.Tensor,
    attn_mask: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    is_causal: bool = False,
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Plain-torch segment attention (gathers the logical K/V, then softmax in ``compute_dtype``)."""
    d = check_args(query, prompt_key, prompt_value, response_key, response_value, path, attn_mask)
    scale = d.D**-0.5 if scale is None else scale
    G = d.Hq // d.Hkv
    k = gather_segments(prompt_key, response_key, path, d.E).to(compute_dtype).permute(0, 2, 1, 3)
    v = gather_segments(prompt_value, response_value, path, d.E).to(compute_dtype).permute(0, 2, 1, 3)
    k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)  # [N, Hq, L, D]
    s = (query.to(compute_dtype) @ k.transpose(-1, -2)) * scale
    if attn_mask is not None:
        s = s + additive_mask(attn_mask, compute_dtype)
    if is_causal:
        pos = torch.arange(d.L, device=query.device)
        limit = d.L - d.Lq + torch.arange(d.Lq, device=query.device)
        s = s.masked_fill(pos[None, :] > limit[:, None], float("-inf"))
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isinf(m) & (m < 0), torch.zeros_like(m), m)  # fully masked rows -> zeros below
    p = torch.exp(s - m)
    denom = p.sum(dim=-1, keepdim=True)
    out = (p @ v) / torch.where(denom > 0, denom, torch.ones_like(denom))
    return out.transpose(1, 2).contiguous().to(query.dtype)


# ---------------------------------------------------------------------------------------- CPU native


@lru_cache(maxsize=1)
def _native_fn():
    """The C entry point with its ctypes signature, or None when the library lacks it."""
    lib = native.library()
    fn = getattr(lib, "aipc_segment_sdpa", None) if lib is not None else None
    if fn is None:
        return None
    i64, vp, f32, ci = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
    fn.restype = ci
    fn.argtypes = [vp, i64, i64, i64, vp, vp, vp, vp, vp, vp, i64, i64, i64, vp, ci,
                   i64, i64, i64, i64, i64, i64, i64, i64, f32, ci, ci]  # fmt: skip
    lib.aipc_segment_isa.restype = ci
    return fn


def native_available() -> bool:
    """Whether the native CPU segment kernel is built and loads."""
    return _native_fn() is not None


def native_isa() -> str:
    """The instruction set whose code the native kernel runs under the library's current choice
    (:func:`aipc_kernels.native.set_isa`): ``scalar``, ``avx2`` or ``avx512_vnni`` (its AVX-512 code)."""
    if _native_fn() is None:
        raise RuntimeError("the native segment_sdpa kernel is not built; rebuild aipc-plugins (setup.py build_ext)")
    return native.ISA_NAMES[native.library().aipc_segment_isa()]


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
) -> torch.Tensor:
    """The native CPU kernel for any shape (prefill included). ``out``: optional float32
    ``[N, Lq, Hq, D]`` to write into (tests poison it). ``dims``: what :func:`check_args` returned for
    these arguments, from a caller that validated them already. Returns the output in the query's dtype."""
    fn = _native_fn()
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
        mask = additive_mask(attn_mask).expand(d.N, attn_mask.shape[1], d.Lq, d.L)
        if mask.stride(-1) != 1:
            mask = mask.contiguous()
        m_ptr = mask.data_ptr()
        ms = (mask.stride(0), mask.stride(1) if mask.shape[1] == d.Hq else 0, mask.stride(2))
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


# ---------------------------------------------------------------------------------------- IPEX (XPU)


@lru_cache(maxsize=1)
def ipex_index_kernel():
    """IPEX's fused index SDPA (``torch.xpu.IpexSDP_Index``) when an IPEX built for this torch's
    major.minor imports cleanly; None otherwise. The version is probed through package metadata
    first, and the import is guarded, so a broken or mismatched IPEX never breaks anything."""
    try:
        version = importlib.metadata.version("intel_extension_for_pytorch")
    except importlib.metadata.PackageNotFoundError:
        return None
    if version.split(".")[:2] != torch.__version__.split("+")[0].split(".")[:2]:
        return None
    try:
        import intel_extension_for_pytorch  # noqa: F401
    except BaseException:  # noqa: BLE001 - IPEX can raise anything (even SystemExit) on a mismatched torch
        return None
    return getattr(getattr(torch, "xpu", None), "IpexSDP_Index", None)


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
        from .triton import segment_sdpa as triton_kernel
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
