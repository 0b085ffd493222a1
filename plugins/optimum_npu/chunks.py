"""PyTorch chunks of a decoder LM with static shapes, ready for ``openvino.convert_model``.

The model is built as a skeleton on the meta device; each chunk materialises only its own weights
from the checkpoint's safetensors, so peak memory follows a chunk, not the model. The chunks reuse
the architecture's own transformers modules (decoder layers, norms, rotary embedding) and replace
the cache by :class:`StaticKV`, a fixed-capacity buffer written with ``index_copy`` at positions
computed from the ``position`` input; the rotary angles and the -inf attention mask are computed
in the graph from that same input. Nothing depends on a Python value of the position, so tracing
cannot freeze it into a constant.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

# model types whose transformers decoder layers the chunks wrap (embedding scale and sliding
# windows handled below)
SUPPORTED_ARCHS = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma")


class UnsupportedArchitectureError(ValueError):
    pass


def check_architecture(config) -> None:
    """Raises a clear error for model types the exporter does not handle."""
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_ARCHS:
        raise UnsupportedArchitectureError(
            f"model_type={model_type!r} is not supported by export_npu; supported: "
            f"{', '.join(SUPPORTED_ARCHS)}")


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
    if window is not None and window < capacity:
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


class LayersChunk(nn.Module):
    """Decoder layers ``[first, last)``: ``(x [1,T,H], position [1], cache_k_i, cache_v_i, ...)
    -> (x_out, cache_k_i_out, cache_v_i_out, ...)`` with in-graph rotary and mask."""

    def __init__(self, layers: list[nn.Module], first: int, rotary: nn.Module,
                 windows: list[int | None]):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.first = first
        self.rotary = rotary
        self.windows = windows

    def forward(self, x: torch.Tensor, position: torch.Tensor, *caches: torch.Tensor):
        tokens, capacity = x.shape[1], caches[0].shape[2]
        pos = position + torch.arange(tokens, dtype=torch.int64)  # [T]
        position_ids = pos[None]
        cos, sin = self.rotary(x, position_ids)
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


class CheckpointReader:
    """Reads named tensors from a checkpoint directory's safetensors files on demand."""

    def __init__(self, directory: str | os.PathLike):
        from safetensors import safe_open

        self.directory = Path(directory)
        index = self.directory / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
        elif (self.directory / "model.safetensors").is_file():
            with safe_open(self.directory / "model.safetensors", "pt") as f:
                weight_map = {k: "model.safetensors" for k in f.keys()}
        else:
            raise FileNotFoundError(
                f"{self.directory} holds no model.safetensors(.index.json); export_npu reads "
                "safetensors checkpoints (save the model with save_pretrained(safe_serialization=True))")
        self.weight_map = weight_map
        self._open = safe_open

    def get(self, name: str) -> torch.Tensor:
        with self._open(self.directory / self.weight_map[name], "pt") as f:
            return f.get_tensor(name)

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map


def build_skeleton(config) -> nn.Module:
    """The ``AutoModelForCausalLM`` for ``config`` on the meta device (no memory), in float32,
    with SDPA attention (converted by OpenVINO to its ScaledDotProductAttention op)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                 attn_implementation="sdpa")
    return model.eval()


def materialize(model: nn.Module, module: nn.Module, reader: CheckpointReader) -> None:
    """Allocates ``module`` (a submodule of the meta ``model``) on the CPU and fills its parameters
    and persistent buffers from the checkpoint; tied output embeddings read the input embedding."""
    prefix = {id(m): n for n, m in model.named_modules()}[id(module)]
    prefix = prefix + "." if prefix else ""
    tied = {}
    out_emb, in_emb = model.get_output_embeddings(), model.get_input_embeddings()
    if out_emb is not None and in_emb is not None:
        in_name = {id(m): n for n, m in model.named_modules()}[id(in_emb)]
        out_name = {id(m): n for n, m in model.named_modules()}[id(out_emb)]
        tied[f"{out_name}.weight"] = f"{in_name}.weight"
    module.to_empty(device="cpu")
    with torch.no_grad():
        for name, tensor in module.state_dict(keep_vars=True).items():
            full = prefix + name
            key = full if full in reader else tied.get(full)
            if key is None or key not in reader:
                raise KeyError(f"checkpoint has no tensor {full!r}; cannot export this model")
            tensor.copy_(reader.get(key).to(tensor.dtype))
        for sub in module.modules():  # non-persistent buffers that have no checkpoint entry
            if hasattr(sub, "scalar_embed_scale"):
                sub.embed_scale.fill_(sub.scalar_embed_scale)


def release(module: nn.Module) -> None:
    """Frees a materialised chunk's storage (back to the meta device)."""
    module.to("meta")


def rotary_module(model: nn.Module, config) -> nn.Module:
    """The architecture's rotary embedding, built on the CPU (its buffers are computed, not read)."""
    rotary = model.model.rotary_emb
    return type(rotary)(config=config).eval()


def parts(model: nn.Module) -> dict[str, Any]:
    """The architecture's building blocks of the meta skeleton."""
    inner = model.model
    return dict(embed=inner.embed_tokens, layers=list(inner.layers), norm=inner.norm,
                lm_head=model.lm_head,
                softcap=getattr(model.config, "final_logit_softcapping", None))
