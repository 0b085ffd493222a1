"""The ``segment_sdpa`` contract that every backend shares: argument checks, sizes, mask form, and
the plain-torch reference that defines the result. Registers nothing, imports no backend.

Shapes (see :mod:`aipc_kernels.decoder.segment_attention` for the cache layout they describe): query
``[N, Hq, Lq, D]``; prompt K/V ``[B, Np, Hkv, D]``; response K/V ``[cap, N, Hkv, D]`` with the int32
path table ``[Nr, N]``; ``attn_mask`` (bool, True = attend, or additive float) broadcasting to
``[N, Hq, Lq, Np + Nr]``; output ``[N, Lq, Hq, D]`` in the query's dtype.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


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


def kernel_mask(attn_mask: torch.Tensor, d: SegmentDims) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """``attn_mask`` as the kernels read it: additive float32 ``[N, Hq|1, Lq, Np + Nr]``, unit stride over
    positions, and its (row, head, query) element strides (head stride 0 when it broadcasts over heads)."""
    mask = additive_mask(attn_mask).expand(d.N, attn_mask.shape[1], d.Lq, d.L)
    if mask.stride(-1) != 1:
        mask = mask.contiguous()
    return mask, (mask.stride(0), mask.stride(1) if mask.shape[1] == d.Hq else 0, mask.stride(2))


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
