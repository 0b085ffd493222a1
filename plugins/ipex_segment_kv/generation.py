"""Generation-side hooks: stock ``model.generate`` builds a segment cache and prefills each prompt once.

transformers has no extension point for the cache class of ``generate`` nor for its prefill, so a few
methods are wrapped (once, reversibly); the wrappers change nothing unless the model's
``attn_implementation`` is ``"segment_kv"``:

* ``PreTrainedModel._check_and_adjust_attn_implementation`` refuses, when the model is built, an
  architecture the segment cache cannot serve (:func:`check_architecture`), naming an
  ``attn_implementation`` that works for it;

* ``_prepare_cache_for_generation`` puts a :class:`SegmentKVCache` in ``past_key_values`` (sized from
  ``num_beams`` / ``num_return_sequences`` and ``max_length``), after checking the architecture, and
  rewrites the supported decoder layers into the fused form the first time (``fused_layers.fuse_for_generate``;
  ``AIPC_SEGMENT_KV_FUSED_LAYERS=0`` or ``optimize(model, fuse_layers=False)`` opts out), after quantizing
  its linears when ``AIPC_SEGMENT_KV_WEIGHTS`` names a scheme (``weights.weights_for_generate``);
* ``_prefill`` runs the forward on one row per prompt (stock generate has already repeated each
  prompt ``num_beams`` times) and repeats the outputs (logits, ...) back to every row;
* ``_update_model_kwargs_for_generation`` folds a cache that the model built instead of the segment
  cache back into it (:meth:`SegmentKVCache.adopt`): Phi-3's ``prepare_inputs_for_generation`` drops
  the cache when a sequence passes ``original_max_position_embeddings`` (LongRoPE) and recomputes it.
"""
from __future__ import annotations

import functools
import inspect
import warnings
from typing import Any, Callable

import torch
from transformers.generation.utils import GenerationMixin
from transformers.modeling_utils import PreTrainedModel

from aipc_kernels.decoder.segment_attention import max_group

from .attention import ATTN_NAME
from .cache import DEFAULT_RESPONSE_STEP, SegmentKVCache
from .fused_layers import fuse_for_generate
from .weights import weights_for_generate

_WRAPPED = "__aipc_segment_kv_original__"
# generate's name for the cache in model_kwargs and model outputs: "cache" from transformers 5.24
CACHE_KWARG = ("cache" if "cache" in inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
               else "past_key_values")  # fmt: skip
# Model types whose attention goes through transformers' AttentionInterface, verified by the tests.
TESTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "phi3", "gpt_neox", "opt")
# Architectures with their own attention code in transformers 5.x: the cache would be misread.
UNSUPPORTED_MODEL_TYPES = ("gptj", "falcon", "bloom", "mamba", "rwkv", "xlnet", "reformer")


def uses_segment_kv(model: Any) -> bool:
    """Whether ``model`` runs with ``attn_implementation="segment_kv"``."""
    config = getattr(model, "config", None)
    return getattr(config, "_attn_implementation", None) == ATTN_NAME


def working_attn_implementation(model: Any) -> str:
    """An ``attn_implementation`` that transformers accepts for ``model`` (a model or its class) and that
    computes its attention exactly: ``"sdpa"`` where the class supports it, else ``"eager"``; ``"eager"``
    for attention logit soft-capping (transformers' sdpa path ignores the cap where it accepts it)."""
    config = getattr(model, "config", None)
    if config is not None and _softcap(config):
        return "eager"
    return "sdpa" if getattr(model, "_supports_sdpa", False) else "eager"


def _softcap(config: Any) -> Any:
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    return getattr(text, "attn_logit_softcapping", None)


def check_architecture(model: Any) -> None:
    """Raises ValueError naming the cause and an ``attn_implementation`` that works for ``model`` when the
    segment cache cannot serve it: an encoder-decoder, attention that does not go through transformers'
    AttentionInterface (it would ignore the segment cache), or attention logit soft-capping (Gemma-2)."""
    config = model.config
    name = type(model).__name__
    model_type = getattr(config, "model_type", name)
    supported = ", ".join(TESTED_MODEL_TYPES)
    fix = f"load it with attn_implementation={working_attn_implementation(model)!r} instead"
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"segment_kv: encoder-decoder models ({name}, model_type={model_type!r}) are not supported; "
                         f"{fix}. segment_kv serves decoder-only architectures using transformers' "
                         f"AttentionInterface (tested: {supported})")  # fmt: skip
    if not getattr(model, "_supports_attention_backend", False) or model_type in UNSUPPORTED_MODEL_TYPES:
        why = ("has its own attention code, not transformers' AttentionInterface"
               if not getattr(model, "_supports_attention_backend", False) else
               "is not supported by segment_kv (its attention was its own code, outside transformers' "
               "AttentionInterface, in earlier transformers 5.x releases, and is not verified with the segment "
               "cache)")  # fmt: skip
        raise ValueError(
            f"segment_kv: {name} (model_type={model_type!r}) {why}, so it cannot use the segment KV cache; {fix}. "
            f"Supported: decoder-only models using the AttentionInterface (tested: {supported})."
        )
    softcap = _softcap(config)
    if softcap:
        raise ValueError(
            f"segment_kv: {name} (model_type={model_type!r}) caps its attention logits (attn_logit_softcapping="
            f"{softcap}), which the segment kernel does not implement; {fix}."
        )


def _prepare_cache_for_generation(original: Callable, self, generation_config, model_kwargs: dict, *args, **kwargs):
    if not uses_segment_kv(self):
        return original(self, generation_config, model_kwargs, *args, **kwargs)
    check_architecture(self)
    weights_for_generate(self)
    fuse_for_generate(self)
    user_cache = model_kwargs.get(CACHE_KWARG)
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
        raise ValueError("segment_kv: assisted generation is not supported; use "
                         f"attn_implementation={working_attn_implementation(self)!r}")
    rows = max(generation_config.num_beams or 1, generation_config.num_return_sequences or 1)
    limit = max_group(self.device)
    if rows > limit:
        raise ValueError(
            f"segment_kv: num_beams={generation_config.num_beams} / num_return_sequences="
            f"{generation_config.num_return_sequences} puts {rows} rows on one prompt, more than the {limit} that "
            f"the {self.device.type} segment kernel supports; lower num_beams or use "
            f"attn_implementation={working_attn_implementation(self)!r}"
        )
    max_new = generation_config.max_new_tokens
    step = getattr(self, "_aipc_segment_kv_step", DEFAULT_RESPONSE_STEP)
    model_kwargs[CACHE_KWARG] = SegmentKVCache(
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
    cache = model_kwargs.get(CACHE_KWARG)
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
        if key != CACHE_KWARG:
            out[key] = _expand_rows(out[key], B, E)
    return out


def _update_model_kwargs_for_generation(original: Callable, self, outputs, model_kwargs: dict, *args, **kwargs):
    cache = model_kwargs.get(CACHE_KWARG)
    returned = outputs.get(CACHE_KWARG) if hasattr(outputs, "get") else None
    if isinstance(cache, SegmentKVCache) and returned is not None and returned is not cache and uses_segment_kv(self):
        # the model dropped the segment cache (e.g. Phi-3 at its LongRoPE switch) and built its own
        if cache.adopt(returned):
            outputs[CACHE_KWARG] = cache
        else:  # it did not recompute the whole sequence: continue with its cache, as stock transformers does
            warnings.warn(
                f"segment_kv: {type(self).__name__}.prepare_inputs_for_generation dropped the cache at "
                f"{cache.get_seq_length()} tokens and the model built a {type(returned).__name__} that does not hold "
                "the whole sequence; the rest of this generate call runs on that cache (as stock transformers does), "
                "without the segment cache",
                RuntimeWarning,
                stacklevel=2,
            )
    return original(self, outputs, model_kwargs, *args, **kwargs)


def _check_and_adjust_attn_implementation(original: Callable, self, attn_implementation, *args, **kwargs):
    if attn_implementation == ATTN_NAME:  # at model init (from_pretrained) and set_attn_implementation
        check_architecture(self)
    return original(self, attn_implementation, *args, **kwargs)


_TARGETS = {
    (GenerationMixin, "_prepare_cache_for_generation"): _prepare_cache_for_generation,
    (GenerationMixin, "_prefill"): _prefill,
    (GenerationMixin, "_update_model_kwargs_for_generation"): _update_model_kwargs_for_generation,
    (PreTrainedModel, "_check_and_adjust_attn_implementation"): _check_and_adjust_attn_implementation,
}


def install_generation_hooks() -> None:
    """Wraps the transformers methods of ``_TARGETS`` (idempotent). A transformers without one of them keeps
    it unwrapped: without ``_prefill`` the segment cache stores a prompt per row, still correct, without the
    sharing; without ``_check_and_adjust_attn_implementation`` an unsupported model is refused at generate."""
    for (owner, name), hook in _TARGETS.items():
        current = vars(owner).get(name)  # a plain method of that class (not a classmethod, not inherited)
        if not inspect.isfunction(current) or getattr(current, _WRAPPED, None) is not None:
            continue

        @functools.wraps(current)
        def wrapper(self, *args, __hook=hook, __original=current, **kwargs):
            return __hook(__original, self, *args, **kwargs)

        setattr(wrapper, _WRAPPED, current)
        setattr(owner, name, wrapper)


def uninstall_generation_hooks() -> None:
    """Restores the original transformers methods."""
    for owner, name in _TARGETS:
        current = getattr(owner, name, None)
        original = getattr(current, _WRAPPED, None)
        if original is not None:
            setattr(owner, name, original)
