"""The segment KV cache: a transformers ``Cache`` whose prompt K/V is shared by all beams.

Per layer:

* ``prompt_key`` / ``prompt_value`` ``[B, Np, Hkv, D]`` (batch-first), written once by the prefill of
  the ``B`` prompts (not ``B * num_beams`` rows);
* ``response_key`` / ``response_value`` ``[cap, N, Hkv, D]`` (sequence-first, ``N = B * num_beams``),
  pre-allocated and grown by ``response_step`` tokens (the old buffer is freed);

and per cache, one resolved beam-path table ``path [cap, N]`` (int32): ``path[t, n]`` is the response
row holding token ``t`` of row ``n``'s current beam. ``reorder_cache(beam_idx)`` gathers the columns
of the table once per step for all layers, so beam search never copies K/V (stock transformers
copies the whole cache twice per layer per step: ``index_select`` on reorder and ``torch.cat`` on
append). Attention reads both segments through ``torch.ops.aipc.segment_sdpa``.
"""
from __future__ import annotations

import math
import threading
from typing import Any, Optional

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from aipc_kernels.decoder.segment_attention import max_group
from aipc_kernels.decoder.segment_contract import SUPPORTED_DTYPES

DEFAULT_RESPONSE_STEP = 16
_PENDING = threading.local()  # the layer whose update() ran last on this thread, for the attention function


def take_pending(key: torch.Tensor) -> Optional["SegmentKVLayer"]:
    """The segment layer that just returned ``key`` from ``update()`` (and forget it), or None when
    ``key`` did not come from a segment cache (no cache, or another cache class)."""
    pending = getattr(_PENDING, "value", None)
    if pending is None or pending[1] is not key:
        return None
    _PENDING.value = None
    return pending[0]


def standard_kv_bytes(batch: int, beams: int, prompt: int, response: int, bytes_per_token: int) -> int:
    """KV bytes of a per-beam cache (stock transformers): ``BS * BW * (Np + Nr) * c``."""
    return batch * beams * (prompt + response) * bytes_per_token


def segment_kv_bytes(
    batch: int, beams: int, prompt: int, response: int, bytes_per_token: int, step: int = DEFAULT_RESPONSE_STEP
) -> int:
    """KV bytes of the segment cache (the paper's formula): ``BS * (Np + BW * ceil(Nr / step) * step) * c``."""
    return batch * (prompt + beams * math.ceil(response / step) * step) * bytes_per_token


def kv_bytes_per_token(config: Any, dtype: torch.dtype) -> int:
    """``c``: bytes of K and V of one token over all layers for a transformers config."""
    cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return 2 * cfg.num_hidden_layers * kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()


class SegmentKVLayer(CacheLayerMixin):
    """One decoder layer's segments (see the module docstring); created by :class:`SegmentKVCache`."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, owner: "SegmentKVCache", layer_idx: int):
        super().__init__()
        self.owner = owner
        self.layer_idx = layer_idx
        self.prompt_key: Optional[torch.Tensor] = None
        self.prompt_value: Optional[torch.Tensor] = None
        self.response_key: Optional[torch.Tensor] = None
        self.response_value: Optional[torch.Tensor] = None
        self.response_len = 0
        self._empty: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None

    # -- CacheLayerMixin
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        if key_states.dtype not in SUPPORTED_DTYPES:
            raise ValueError(
                f"segment_kv: KV dtype {key_states.dtype} is not supported; load the model in one of "
                f"{[str(d).removeprefix('torch.') for d in SUPPORTED_DTYPES]} (dtype=...)"
            )
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Stores the new ``[M, Hkv, q, D]`` K/V (prompt rows before the first response token, response rows
        after) and returns them unchanged; attention then reads the segments through the cache."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        elif key_states.dtype != self.dtype or key_states.device != self.device:
            raise ValueError(
                f"segment_kv: this cache holds {self.dtype} K/V on {self.device}, got {key_states.dtype} on "
                f"{key_states.device}; use a new cache (one per generate call)"
            )
        self.owner._store(self, key_states, value_states)
        _PENDING.value = (self, key_states)
        return key_states, value_states

    def get_seq_length(self) -> int:
        prompt = 0 if self.prompt_key is None else self.prompt_key.shape[1]
        return prompt + self.response_len

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """No per-layer work: the cache reorders its one path table (see SegmentKVCache.reorder_cache)."""

    def reset(self) -> None:
        self.prompt_key = self.prompt_value = self.response_key = self.response_value = None
        self.response_len = 0
        self._empty = None
        self.is_initialized = False

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("segment_kv: the segment cache cannot be cropped (assisted/speculative decoding "
                                  "is not supported); use attn_implementation='sdpa' for those")  # fmt: skip

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("segment_kv: batch_repeat_interleave is not supported by the segment cache")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("segment_kv: batch_select_indices is not supported by the segment cache")

    # -- what the attention function reads
    def segments(self) -> tuple[torch.Tensor, ...]:
        """``(prompt_key, prompt_value, response_key, response_value, path)`` for ``segment_sdpa``."""
        if self.response_len == 0:
            if self._empty is None:
                B, _, H, D = self.prompt_key.shape
                e = self.prompt_key.new_empty(0, B, H, D)
                self._empty = (e, e, torch.empty(0, B, dtype=torch.int32, device=self.device))
            return (self.prompt_key, self.prompt_value, *self._empty)
        path = self.owner.path[: self.response_len]
        return self.prompt_key, self.prompt_value, self.response_key, self.response_value, path

    def kv_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in
                   (self.prompt_key, self.prompt_value, self.response_key, self.response_value) if t is not None)  # fmt: skip


class SegmentKVCache(Cache):
    """Segment KV cache for ``num_beams`` rows per prompt (beam search, or samples of one prompt).

    ``generate`` creates it (``attn_implementation="segment_kv"``); build one yourself only to pass it as
    ``past_key_values`` to a fresh ``generate`` call. ``max_new_tokens`` (or ``max_length``, prompt
    included) pre-sizes the response buffers, rounded up to ``response_step``; without either they grow
    by ``response_step`` tokens.
    A cache serves one generate call: reusing a filled one raises.
    """

    def __init__(
        self,
        config: Any,
        num_beams: int = 1,
        max_new_tokens: Optional[int] = None,
        response_step: int = DEFAULT_RESPONSE_STEP,
        max_length: Optional[int] = None,
    ):
        if not isinstance(num_beams, int) or num_beams < 1:
            raise ValueError(f"segment_kv: num_beams must be a positive integer, got {num_beams!r}")
        if not isinstance(response_step, int) or response_step < 1:
            raise ValueError(f"segment_kv: response_step must be a positive integer, got {response_step!r}")
        text = config.get_text_config(decoder=True)
        layers = [SegmentKVLayer(self, i) for i in range(text.num_hidden_layers)]
        super().__init__(layers=layers)
        self.num_beams = num_beams
        self.max_new_tokens = max_new_tokens
        self.max_length = max_length  # prompt + new tokens, used when max_new_tokens is not given
        self.response_step = response_step
        self.num_prompts: Optional[int] = None  # B, set by the first prefill
        self.rows: Optional[int] = None  # N = B * beams, set by the first response token
        self.path: Optional[torch.Tensor] = None  # [cap, N] int32
        self.path_len = 0
        self.peak_kv_bytes = 0
        self.prompt_done = False

    # -- bookkeeping
    @property
    def is_empty(self) -> bool:
        return self.num_prompts is None

    def end_prompt(self) -> None:
        """Marks the prefill as finished: the next update of any layer is a response token."""
        self.prompt_done = True

    def kv_bytes(self) -> int:
        """Bytes of K/V allocated now (both segments, all layers; capacity, not only the filled part)."""
        return sum(layer.kv_bytes() for layer in self.layers)

    def _capacity_for(self, needed: int) -> int:
        step = self.response_step
        planned = self.max_new_tokens
        if planned is None and self.max_length is not None:
            planned = self.max_length - self.layers[0].get_seq_length() + self.layers[0].response_len
        if planned is not None and needed <= planned:
            return max(step, math.ceil(planned / step) * step)
        return math.ceil(needed / step) * step

    # -- update
    def _store(self, layer: SegmentKVLayer, key: torch.Tensor, value: torch.Tensor) -> None:
        M, H, q, D = key.shape
        in_prompt = not self.prompt_done and (layer.response_len == 0) and (
            self.num_prompts is None or M == self.num_prompts
        )
        if in_prompt:
            k, v = key.transpose(1, 2), value.transpose(1, 2)  # [M, q, H, D]
            if layer.prompt_key is None:
                if self.num_prompts is None:
                    self.num_prompts = M
                layer.prompt_key, layer.prompt_value = k.contiguous(), v.contiguous()
            else:  # chunked prefill
                layer.prompt_key = torch.cat([layer.prompt_key, k], dim=1)
                layer.prompt_value = torch.cat([layer.prompt_value, v], dim=1)
            self._note_bytes()
            return
        if layer.prompt_key is None:
            raise RuntimeError(f"segment_kv: layer {layer.layer_idx} got a response token before its prompt")
        B = self.num_prompts
        if self.rows is None:
            if M % B:
                raise ValueError(
                    f"segment_kv: the cache holds {B} prompts but the step has {M} rows (not a multiple); a cache "
                    "serves one generate call, use a new one"
                )
            limit = max_group(key.device)
            if M // B > limit:
                raise ValueError(f"segment_kv: {M // B} rows per prompt (num_beams x num_return_sequences) exceed the "
                                 f"{limit} that the {key.device.type} kernel supports")  # fmt: skip
            self.rows = M
        elif M != self.rows:
            raise ValueError(
                f"segment_kv: the cache holds {self.rows} rows ({B} prompts x {self.rows // B}) but the step has {M}; "
                "a cache serves one generate call, use a new one"
            )
        t0 = layer.response_len
        if t0 == self.path_len:  # first layer to reach this step: extend the path table with fresh rows
            self._extend_path(q, key.device)
        elif t0 + q > self.path_len:
            raise RuntimeError(f"segment_kv: layer {layer.layer_idx} is out of step with the path table "
                               f"({t0} + {q} > {self.path_len})")  # fmt: skip
        cap = 0 if layer.response_key is None else layer.response_key.shape[0]
        if t0 + q > cap:
            new_cap = self._capacity_for(t0 + q)
            rk = key.new_empty(new_cap, M, H, D)
            rv = value.new_empty(new_cap, M, H, D)
            if t0:
                rk[:t0].copy_(layer.response_key[:t0])
                rv[:t0].copy_(layer.response_value[:t0])
            self._note_bytes(extra=rk.numel() * rk.element_size() * 2)  # old and new alive during the copy
            layer.response_key, layer.response_value = rk, rv  # the old buffers are freed here
        layer.response_key[t0 : t0 + q].copy_(key.permute(2, 0, 1, 3))
        layer.response_value[t0 : t0 + q].copy_(value.permute(2, 0, 1, 3))
        layer.response_len = t0 + q

    def _extend_path(self, q: int, device: torch.device) -> None:
        N, t0 = self.rows, self.path_len
        cap = 0 if self.path is None else self.path.shape[0]
        if t0 + q > cap:
            new = torch.empty(self._capacity_for(t0 + q), N, dtype=torch.int32, device=device)
            if t0:
                new[:t0].copy_(self.path[:t0])
            self.path = new
        self.path[t0 : t0 + q] = torch.arange(N, dtype=torch.int32, device=device)
        self.path_len = t0 + q

    def adopt(self, other: Cache) -> bool:
        """Takes over the K/V of ``other``, a transformers cache that the model built instead of this one;
        returns False (and changes nothing) when ``other`` does not hold this cache's whole sequence.

        Some models drop the cache in ``prepare_inputs_for_generation`` and recompute the whole sequence
        (Phi-3 with LongRoPE, when the sequence passes ``original_max_position_embeddings``: every token's
        rotary changes); the forward then returns a new ``DynamicCache``. Its rows are re-split here: the
        prompt once per prompt (the first row of each), the rest as each row's response with a fresh path
        table (row ``n``'s tokens are its own beam's: the recompute ran on the reordered sequences). Before
        the first response token the whole of ``other`` is the prompt. (transformers before 5.24 drops
        the cache without recomputing: ``other`` then holds the new token only.)"""
        kv = [(layer.keys, layer.values) for layer in other.layers]
        if len(kv) != len(self.layers) or any(not isinstance(k, torch.Tensor) or k.dim() != 4 for k, _ in kv):
            return False
        M, _, total, _ = kv[0][0].shape
        prompt_len = total if self.is_empty else self.layers[0].prompt_key.shape[1]
        prompts = M if self.is_empty else self.num_prompts
        expected = total if self.is_empty else prompt_len + self.path_len + 1
        if M % prompts or total != expected or any(k.shape[2] != total for k, _ in kv):
            return False
        per_prompt = M // prompts
        self.reset()
        self.num_prompts = prompts
        for layer, (k, v) in zip(self.layers, kv, strict=True):
            layer.lazy_initialization(k, v)
            layer.prompt_key = k[::per_prompt, :, :prompt_len].transpose(1, 2).contiguous()
            layer.prompt_value = v[::per_prompt, :, :prompt_len].transpose(1, 2).contiguous()
        self.end_prompt()
        if total > prompt_len:
            for layer, (k, v) in zip(self.layers, kv):
                self._store(layer, k[:, :, prompt_len:], v[:, :, prompt_len:])
        self._note_bytes()
        return True

    def _note_bytes(self, extra: int = 0) -> None:
        self.peak_kv_bytes = max(self.peak_kv_bytes, self.kv_bytes() + extra)

    # -- beam search
    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Row ``n`` continues the beam of row ``beam_idx[n]``: one gather of the path table for all
        layers, no K/V copy."""
        if self.path_len == 0:
            return  # only the shared prompt so far: every beam of a prompt reads the same rows
        idx = beam_idx.to(device=self.path.device, dtype=torch.long)
        self.path[: self.path_len] = self.path[: self.path_len].index_select(1, idx)

    def reset(self) -> None:
        super().reset()
        self.num_prompts = self.rows = self.path = None
        self.path_len = 0
        self.prompt_done = False

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("segment_kv: batch_repeat_interleave is not supported by the segment cache")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("segment_kv: batch_select_indices is not supported by the segment cache")

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("segment_kv: the segment cache cannot be cropped (assisted/speculative decoding "
                                  "is not supported); use attn_implementation='sdpa' for those")  # fmt: skip

    @property
    def batch_size(self) -> int:
        return self.rows or self.num_prompts or -1

    def __repr__(self) -> str:
        return (f"SegmentKVCache(layers={len(self.layers)}, prompts={self.num_prompts}, rows={self.rows}, "
                f"response={self.path_len}, kv_bytes={self.kv_bytes()})")  # fmt: skip
