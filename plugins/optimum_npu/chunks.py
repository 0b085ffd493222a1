"""PyTorch chunks of a decoder LM with static shapes, ready for ``openvino.convert_model``.

The model is built as a skeleton on the meta device; each chunk materialises only its own weights
from the checkpoint's safetensors in the dtype the IR will store (:func:`weight_dtype`: the
checkpoint's bf16/f16 for NNCF-compressed exports, never an f32 copy of them), so peak memory
follows a chunk, not the model; activations stay float32 (:func:`cast_linears`). The chunks reuse
the architecture's own transformers modules (decoder layers, norms, rotary embedding) and replace
the cache by :class:`StaticKV`, a fixed-capacity buffer written with ``index_copy`` at positions
computed from the ``position`` input; the rotary angles and the -inf attention mask are computed
in the graph from that same input. Nothing depends on a Python value of the position, so tracing
cannot freeze it into a constant; the token count and KV capacity are read from the input shapes,
so one trace serves every static variant (reshaped afterwards).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from aipc_kernels.core.hf_checkpoint import HFCheckpoint

# model types whose transformers decoder layers the chunks wrap (embedding scale and sliding
# windows handled below)
SUPPORTED_ARCHS = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma")


class UnsupportedArchitectureError(ValueError):
    pass


def check_architecture(config) -> None:
    """Raises a clear error for model types (and rotary scalings) the exporter does not handle."""
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_ARCHS:
        raise UnsupportedArchitectureError(
            f"model_type={model_type!r} is not supported by export_npu; supported: "
            f"{', '.join(SUPPORTED_ARCHS)}")
    if longrope_switch(config) is not None and model_type != "phi3":
        raise UnsupportedArchitectureError(
            f"rope_scaling type 'longrope' is exported for model_type='phi3' only (its generate recomputes "
            f"the cache at the switch, which the export reproduces), not {model_type!r}; use a phi3 "
            "checkpoint or a rope_scaling other than longrope")


def longrope_switch(config) -> int | None:
    """``original_max_position_embeddings`` of a LongRoPE model (the sequence length past which
    transformers uses the long factors), None for every other rotary embedding."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if rope.get("rope_type", rope.get("type")) != "longrope":
        return None
    return int(rope.get("original_max_position_embeddings")
               or config.original_max_position_embeddings)


GROUPED_ATTENTION = "npu_grouped_sdpa"


def grouped_sdpa_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                           value: torch.Tensor, attention_mask: torch.Tensor | None,
                           dropout: float = 0.0, scaling: float | None = None,
                           **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Attention for grouped K/V heads without repeating K/V: the ``g = heads // kv_heads`` query
    heads that share a K/V head become ``g * T`` query rows of that head (a view), the mask rows
    are tiled to match. Exact, and each step reads the KV cache once instead of ``g`` copies of it
    (transformers' ``sdpa`` repeats K/V whenever a mask is given)."""
    b, heads, tokens, dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    q = query.reshape(b, kv_heads, groups * tokens, dim)
    mask = attention_mask.repeat(1, 1, groups, 1) if attention_mask is not None else None
    out = torch.nn.functional.scaled_dot_product_attention(q, key, value, attn_mask=mask,
                                                           scale=scaling)
    return out.reshape(b, heads, tokens, dim).transpose(1, 2).contiguous(), None


def _register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(GROUPED_ATTENTION, grouped_sdpa_attention)


class StaticKV:
    """The ``past_key_values`` handed to transformers' attention: fixed-capacity K/V buffers
    ``[1, kv_heads, capacity, head_dim]`` per layer, the new rows written at ``index``."""

    def __init__(self, caches: dict[int, tuple[torch.Tensor, torch.Tensor]], index: torch.Tensor):
        self.caches = caches
        self.index = index
        self.updated: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int,
               cache_kwargs: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.caches[layer_idx]
        k = k.index_copy(2, self.index, key.to(k.dtype))
        v = v.index_copy(2, self.index, value.to(v.dtype))
        self.updated[layer_idx] = (k, v)
        return k, v

    # transformers queries these on some paths; the buffer is always "full length"
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    @property
    def is_compileable(self) -> bool:
        return False


def sliding_windows(config) -> list[int | None]:
    """Per layer: the sliding attention window, or None for full attention."""
    window = getattr(config, "sliding_window", None)
    n = config.num_hidden_layers
    if config.model_type in ("qwen2", "qwen3"):
        types = getattr(config, "layer_types", None) or ["full_attention"] * n
        use = getattr(config, "use_sliding_window", False)
        return [window if (use and window and t == "sliding_attention") else None for t in types]
    if config.model_type in ("mistral", "phi3"):
        return [window] * n
    return [None] * n


def attention_mask(position: torch.Tensor, tokens: int, capacity: int,
                   window: int | None) -> torch.Tensor:
    """``[1, 1, tokens, capacity]`` float mask from the scalar ``position`` (the first new token's
    slot): 0 where key slot j may be seen by query i (j <= position + i, within the window), -inf
    elsewhere (unused and future slots)."""
    q = position + torch.arange(tokens, dtype=torch.int64)
    k = torch.arange(capacity, dtype=torch.int64)
    allowed = k[None, :] <= q[:, None]
    if window is not None:  # not decided on ``capacity``: the traced graph serves every capacity
        allowed = allowed & (k[None, :] > q[:, None] - window)
    zero = torch.zeros((), dtype=torch.float32)
    ninf = torch.full((), float("-inf"), dtype=torch.float32)
    return torch.where(allowed, zero, ninf)[None, None]


class EmbeddingChunk(nn.Module):
    """``token [1, T] int64 -> x [1, T, hidden]`` (the architecture's embedding, scale included)."""

    def __init__(self, embed: nn.Module):
        super().__init__()
        self.embed = embed

    def forward(self, token: torch.Tensor) -> torch.Tensor:
        return self.embed(token).to(torch.float32)


class LongRopeRotary(nn.Module):
    """LongRoPE (Phi-3.5) with both factor sets in the graph: the long inverse frequencies where the
    sequence is longer than ``original_max_position_embeddings``, the short ones elsewhere, chosen
    by a ``Select`` on the ``sequence_length`` input. transformers' rotary makes that choice with a
    Python branch that re-registers ``inv_freq`` (a trace would freeze it, and the shared buffer
    breaks TorchScript); the frequencies and the attention scaling come from transformers' own
    ``longrope`` initialiser, the cos/sin computation is its forward's."""

    def __init__(self, config):
        super().__init__()
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        init = ROPE_INIT_FUNCTIONS["longrope"]
        self.switch = longrope_switch(config)
        short, self.attention_scaling = init(config, None)
        long, _ = init(config, None, seq_len=self.switch + 1)
        self.register_buffer("short_inv_freq", short.float(), persistent=False)
        self.register_buffer("long_inv_freq", long.float(), persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor,
                sequence_length: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = torch.where(sequence_length > self.switch, self.long_inv_freq,
                               self.short_inv_freq)
        inv_freq = inv_freq[None, :, None].expand(position_ids.shape[0], -1, 1)
        freqs = (inv_freq @ position_ids[:, None, :].float()).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(x.dtype), sin.to(x.dtype)


class LayersChunk(nn.Module):
    """Decoder layers ``[first, last)``: ``(x [1,T,H], position [1], cache_k_i, cache_v_i, ...)
    -> (x_out, cache_k_i_out, cache_v_i_out, ...)`` with in-graph rotary and mask. With a
    :class:`LongRopeRotary`, ``sequence_length [1]`` follows ``position``: the length of the
    sequence this call belongs to (the whole prompt while prefilling it), which picks the factors."""

    def __init__(self, layers: list[nn.Module], first: int, rotary: nn.Module,
                 windows: list[int | None]):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.first = first
        self.rotary = rotary
        self.windows = windows
        self.longrope = isinstance(rotary, LongRopeRotary)

    def forward(self, x: torch.Tensor, position: torch.Tensor, *inputs: torch.Tensor):
        tokens = x.shape[1]
        pos = position + torch.arange(tokens, dtype=torch.int64)  # [T]
        position_ids = pos[None]
        if self.longrope:
            # not position + tokens: the last prefill block is padded past the prompt's end
            cos, sin = self.rotary(x, position_ids, inputs[0])
            caches = inputs[1:]
        else:
            caches = inputs
            cos, sin = self.rotary(x, position_ids)
        capacity = caches[0].shape[2]
        kv = StaticKV({self.first + i: (caches[2 * i], caches[2 * i + 1])
                       for i in range(len(self.layers))}, pos)
        masks: dict[int | None, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            window = self.windows[self.first + i]
            if window not in masks:
                masks[window] = attention_mask(position, tokens, capacity, window)
            out = layer(x, attention_mask=masks[window], position_ids=position_ids,
                        past_key_values=kv, use_cache=True, position_embeddings=(cos, sin))
            x = out[0] if isinstance(out, tuple) else out
        outs = [x]
        for i in range(len(self.layers)):
            outs.extend(kv.updated[self.first + i])
        return tuple(outs)


class NormChunk(nn.Module):
    """``x [1, 1, H] -> final-norm(x)``: the head without its LM matrix (appended in OpenVINO
    from streamed, quantized rows by :mod:`optimum_npu.vocab`)."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.norm = norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x).to(torch.float32)


class HeadChunk(nn.Module):
    """``x [1, 1, H] -> logits [1, 1, vocab]``: final norm and LM head (and any logit soft cap)."""

    def __init__(self, norm: nn.Module, lm_head: nn.Module, softcap: float | None):
        super().__init__()
        self.norm = norm
        self.lm_head = lm_head
        self.softcap = softcap

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.norm(x)).to(torch.float32)
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


def weight_dtype(weight_format: str, checkpoint_dtype: torch.dtype) -> torch.dtype:
    """The dtype in which a chunk's weights are materialised and traced: float32 for ``fp32``,
    float16 for ``fp16``; for NNCF formats the checkpoint's own (16-bit) dtype, which NNCF
    quantizes from without an f32 copy of the chunk."""
    if weight_format == "fp32":
        return torch.float32
    if weight_format == "fp16":
        return torch.float16
    return checkpoint_dtype


def build_skeleton(config, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The ``AutoModelForCausalLM`` for ``config`` on the meta device (no memory), parameters in
    ``dtype``, with :func:`grouped_sdpa_attention` (converted by OpenVINO to its
    ScaledDotProductAttention op over the un-repeated KV cache)."""
    from transformers import AutoModelForCausalLM

    _register_attention()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype,
                                                 attn_implementation=GROUPED_ATTENTION)
    return model.eval()


def cast_linears(module: nn.Module) -> nn.Module:
    """Makes every ``nn.Linear`` in ``module`` cast its (16-bit) weight to the input's dtype, so
    float32 activations meet 16-bit weights as ``Constant -> Convert -> MatMul`` in the IR (the
    decompression pattern NNCF and the OpenVINO plugins expect) instead of f32 weight copies."""
    def forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return torch.nn.functional.linear(x, self.weight.to(x.dtype), bias)

    for sub in module.modules():
        if isinstance(sub, nn.Linear) and sub.weight.dtype != torch.float32:
            sub.forward = forward.__get__(sub)
    return module


def checkpoint_key(model: nn.Module, module: nn.Module, name: str,
                   reader: HFCheckpoint) -> str:
    """The checkpoint tensor holding ``module``'s (a submodule of ``model``) tensor ``name``;
    tied output embeddings read the input embedding."""
    names = {id(m): n for n, m in model.named_modules()}
    prefix = names[id(module)]
    full = f"{prefix}.{name}" if prefix else name
    if full in reader:
        return full
    out_emb, in_emb = model.get_output_embeddings(), model.get_input_embeddings()
    if out_emb is not None and in_emb is not None and full == f"{names[id(out_emb)]}.weight":
        tied = f"{names[id(in_emb)]}.weight"
        if tied in reader:
            return tied
    raise KeyError(f"checkpoint has no tensor {full!r}; cannot export this model")


def materialize(model: nn.Module, module: nn.Module, reader: HFCheckpoint) -> None:
    """Allocates ``module`` (a submodule of the meta ``model``) on the CPU and fills its parameters
    and persistent buffers from the checkpoint; tied output embeddings read the input embedding."""
    keys = {name: checkpoint_key(model, module, name, reader)
            for name in module.state_dict(keep_vars=True)}
    module.to_empty(device="cpu")
    with torch.no_grad():
        for name, tensor in module.state_dict(keep_vars=True).items():
            tensor.copy_(reader.get(keys[name]).to(tensor.dtype))
        for sub in module.modules():  # non-persistent buffers that have no checkpoint entry
            if hasattr(sub, "scalar_embed_scale"):
                sub.embed_scale.fill_(sub.scalar_embed_scale)


def release(module: nn.Module) -> None:
    """Frees a materialised chunk's storage (back to the meta device)."""
    module.to("meta")


def release_linears(module: nn.Module) -> None:
    """Frees the weights of every ``nn.Linear`` in ``module`` (once NNCF has replaced them in the
    converted graph, which otherwise shares their memory); norms and other tensors stay."""
    for sub in module.modules():
        if isinstance(sub, nn.Linear):
            sub.to("meta")


def rotary_module(model: nn.Module, config) -> nn.Module:
    """The architecture's rotary embedding, built on the CPU (its buffers are computed, not read);
    :class:`LongRopeRotary` for LongRoPE."""
    if longrope_switch(config) is not None:
        return LongRopeRotary(config).eval()
    rotary = model.model.rotary_emb
    return type(rotary)(config=config).eval()


def parts(model: nn.Module) -> dict[str, Any]:
    """The architecture's building blocks of the meta skeleton."""
    inner = model.model
    return dict(embed=inner.embed_tokens, layers=list(inner.layers), norm=inner.norm,
                lm_head=model.lm_head,
                softcap=getattr(model.config, "final_logit_softcapping", None))
