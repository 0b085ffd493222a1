"""Generation-side hooks: stock ``model.generate`` builds a segment cache and prefills each prompt once.

transformers has no extension point for the cache class of ``generate`` nor for its prefill, so two
``GenerationMixin`` methods are wrapped (once, reversibly); the wrappers change nothing unless the
model's ``attn_implementation`` is ``"segment_kv"``:

* ``_prepare_cache_for_generation`` puts a :class:`SegmentKVCache` in ``past_key_values`` (sized from
  ``num_beams`` / ``num_return_sequences`` and ``max_length``), after checking the architecture;
* ``_prefill`` runs the forward on one row per prompt (stock generate has already repeated each
  prompt ``num_beams`` times) and repeats the outputs (logits, ...) back to every row.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from transformers.generation.utils import GenerationMixin

from aipc_kernels.segment_attention import max_group

from .attention import ATTN_NAME
from .cache import DEFAULT_RESPONSE_STEP, SegmentKVCache

_WRAPPED = "__aipc_segment_kv_original__"
# Model types whose attention goes through transformers' AttentionInterface, verified by the tests.
TESTED_MODEL_TYPES = ("llama", "qwen2", "mistral", "phi3", "gpt_neox", "opt")
# Architectures with their own attention code in transformers 5.x: the cache would be misread.
UNSUPPORTED_MODEL_TYPES = ("gptj", "falcon", "bloom", "mamba", "rwkv", "xlnet", "reformer")


def uses_segment_kv(model: Any) -> bool:
    """Whether ``model`` runs with ``attn_implementation="segment_kv"``."""
    config = getattr(model, "config", None)
    return getattr(config, "_attn_implementation", None) == ATTN_NAME


def check_architecture(model: Any) -> None:
    """Raises ValueError when ``model``'s attention does not go through transformers' AttentionInterface
    (its own attention would ignore the segment cache) or it is an encoder-decoder."""
    config = model.config
    model_type = getattr(config, "model_type", type(model).__name__)
    supported = ", ".join(TESTED_MODEL_TYPES)
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"segment_kv: encoder-decoder models ({model_type}) are not supported; decoder-only "
                         f"architectures using transformers' AttentionInterface are (tested: {supported})")  # fmt: skip
    if model_type in UNSUPPORTED_MODEL_TYPES or not getattr(model, "_supports_attention_backend", False):
        raise ValueError(
            f"segment_kv: {type(model).__name__} (model_type={model_type!r}) has its own attention code, not "
            f"transformers' AttentionInterface, so it cannot use the segment KV cache. Supported: decoder-only "
            f"models using the AttentionInterface (tested: {supported}); use attn_implementation='sdpa' here."
        )


def _prepare_cache_for_generation(original: Callable, self, generation_config, model_kwargs: dict, *args, **kwargs):
    if not uses_segment_kv(self):
        return original(self, generation_config, model_kwargs, *args, **kwargs)
    check_architecture(self)
    user_cache = model_kwargs.get("past_key_values")
    if isinstance(user_cache, SegmentKVCache) and not user_cache.is_empty:
        raise ValueError(
            "segment_kv: the SegmentKVCache passed as past_key_values was already used by an earlier generate call "
            f"({user_cache!r}); its prompt segment and beam paths belong to that call. Pass a new cache, or none."
        )
    if user_cache is not None or generation_config.use_cache is False:
        return original(self, generation_config, model_kwargs, *args, **kwargs)
    if generation_config.cache_implementation not in (None, "dynamic"):
        raise ValueError(
            f"segment_kv: cache_implementation={generation_config.cache_implementation!r} cannot be combined with "
            "attn_implementation='segment_kv', which brings its own cache; leave cache_implementation unset"
        )
    if getattr(generation_config, "is_assistant", False):
        raise ValueError("segment_kv: assisted generation is not supported; use attn_implementation='sdpa'")
    rows = max(generation_config.num_beams or 1, generation_config.num_return_sequences or 1)
    limit = max_group(self.device)
    if rows > limit:
        raise ValueError(
            f"segment_kv: num_beams={generation_config.num_beams} / num_return_sequences="
            f"{generation_config.num_return_sequences} puts {rows} rows on one prompt, more than the {limit} that "
            f"the {self.device.type} segment kernel supports; lower num_beams or use attn_implementation='sdpa'"
        )
    max_new = generation_config.max_new_tokens
    step = getattr(self, "_aipc_segment_kv_step", DEFAULT_RESPONSE_STEP)
    model_kwargs["past_key_values"] = SegmentKVCache(
        self.config, num_beams=rows, max_new_tokens=max_new, response_step=step,
        max_length=None if max_new is not None else generation_config.max_length,
    )  # fmt: skip
    return None


def _expand_rows(value: Any, batch: int, repeats: int) -> Any:
    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == batch:
        return value.repeat_interleave(repeats, dim=0)
    if isinstance(value, tuple):
        return tuple(_expand_rows(v, batch, repeats) for v in value)
    return value


def _prefill(original: Callable, self, input_ids: torch.Tensor, generation_config, model_kwargs: dict, *args, **kwargs):
    cache = model_kwargs.get("past_key_values")
    if not isinstance(cache, SegmentKVCache) or not uses_segment_kv(self):
        return original(self, input_ids, generation_config, model_kwargs, *args, **kwargs)
    E, N = cache.num_beams, input_ids.shape[0]
    if E == 1 or N % E or not cache.is_empty or model_kwargs.get("inputs_embeds") is not None:
        out = original(self, input_ids, generation_config, model_kwargs, *args, **kwargs)
        cache.end_prompt()
        return out
    B = N // E
    one = slice(None, None, E)  # row b*E of every prompt: generate repeated each prompt E times
    if not torch.equal(input_ids[one].repeat_interleave(E, dim=0), input_ids):
        raise ValueError("segment_kv: the rows of a prompt differ; the segment cache shares one prompt per "
                         f"{E} rows (num_beams / num_return_sequences)")  # fmt: skip
    sliced = {}
    for key, value in model_kwargs.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            if key == "position_ids" and value.dim() == 3:  # multimodal rope: batch in dim 1
                value = value[:, one]
            elif value.shape[0] == N:
                value = value[one]
        sliced[key] = value
    out = original(self, input_ids[one], generation_config, sliced, *args, **kwargs)
    cache.end_prompt()
    for key in list(out.keys()):
        if key != "past_key_values":
            out[key] = _expand_rows(out[key], B, E)
    return out


_TARGETS = {"_prepare_cache_for_generation": _prepare_cache_for_generation, "_prefill": _prefill}


def install_generation_hooks() -> None:
    """Wraps the GenerationMixin methods (idempotent). A transformers without one of them keeps it
    unwrapped: the segment cache then stores a prompt per row, still correct, without the sharing."""
    for name, hook in _TARGETS.items():
        current = getattr(GenerationMixin, name, None)
        if current is None or getattr(current, _WRAPPED, None) is not None:
            continue

        @functools.wraps(current)
        def wrapper(self, *args, __hook=hook, __original=current, **kwargs):
            return __hook(__original, self, *args, **kwargs)

        setattr(wrapper, _WRAPPED, current)
        setattr(GenerationMixin, name, wrapper)


def uninstall_generation_hooks() -> None:
    """Restores the original GenerationMixin methods."""
    for name in _TARGETS:
        current = getattr(GenerationMixin, name, None)
        original = getattr(current, _WRAPPED, None)
        if original is not None:
            setattr(GenerationMixin, name, original)
