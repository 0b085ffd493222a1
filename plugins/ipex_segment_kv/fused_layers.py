"""The decoder-layer rewrite of ``optimize(model)``: supported layers run ``aipc_kernels.decoder.decoder_layer``.

A supported layer (Llama, Mistral, Qwen2, Qwen3, Phi-3: pre-norm RMSNorm, SiLU-gated MLP, plain
``nn.Linear`` projections) keeps its modules and weights; only its class changes, to a subclass of its own
(``isinstance`` checks and transformers' output-capturing hooks still see the stock class) whose forward
runs the fused layer: merged QKV and gate-up projections read from the layer's own weights, RMSNorm and
SiLU x up in the projections' prologues, residuals in their epilogues, RoPE in one pass over q and k.
The lm_head (a plain ``nn.Linear``) runs through ``aipc::dense_linear``. :func:`unfuse_layers` puts the
stock classes back; no tensor is created or changed either way. A layer whose projections were all quantized
by ``optimize(model, weights=...)`` (:mod:`ipex_segment_kv.weights`) runs the same fused forward on
``aipc::lowbit_linear`` (:class:`aipc_kernels.decoder.fused_lowbit.LowBitProjection`, built once per layer).

The fused forward falls back to the stock one when it cannot stand in for it: training or autograd,
attention weights requested (``output_attentions``), a layer whose dtype differs from its input's.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Optional

import torch
from torch import nn

from aipc_kernels.decoder.decoder_layer import DecoderLayerWeights, decoder_layer
from aipc_kernels.decoder.dense_linear import dense_linear
from aipc_kernels.decoder.fused_lowbit import LowBitProjection
from aipc_kernels.lowbit.modules import LowBitLinear

#: model types whose decoder layers are rewritten (others keep their stock layers, without an error)
FUSED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3")
#: environment switch of the zero-code path: "0" keeps the stock layers under attn_implementation="segment_kv"
ENV_SWITCH = "AIPC_SEGMENT_KV_FUSED_LAYERS"
#: model attribute: what fuse_layers did (its return value)
FUSION_REPORT = "_aipc_segment_kv_fusion"
#: model attribute set by optimize(model, fuse_layers=False): generate leaves the layers stock
OPT_OUT = "_aipc_segment_kv_no_fusion"
_STOCK = "_aipc_stock_class"
#: layer attribute: its DecoderLayerWeights over LowBitProjection objects, when its linears are low-bit
_LOWBIT_WEIGHTS = "_aipc_lowbit_layer_weights"

try:  # the collector of output_attentions / output_hidden_states (transformers 5.x)
    from transformers.utils.output_capturing import _active_collector
except ImportError:  # pragma: no cover - older transformers: no capture hooks to respect
    _active_collector = None


def _linear(module: Any) -> bool:
    return type(module) is nn.Linear  # another quantized or replaced projection keeps the stock path


def _lowbit(module: Any) -> bool:
    """A linear quantized by ``optimize(model, weights=...)`` (int8 activations, the CPU layout)."""
    return type(module) is LowBitLinear and module.activations == "int8"


def _rms_norm(module: Any) -> bool:
    return (type(module).__name__.endswith("RMSNorm") and isinstance(getattr(module, "weight", None), torch.Tensor)
            and hasattr(module, "variance_epsilon"))  # fmt: skip


def why_not_fused(layer: nn.Module, config: Any) -> Optional[str]:
    """None when ``layer`` can run the fused forward, else why not (it then keeps its stock forward)."""
    model_type = getattr(config, "model_type", None)
    if model_type not in FUSED_MODEL_TYPES:
        return f"model_type {model_type!r} is not one of {FUSED_MODEL_TYPES}"
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if attn is None or mlp is None:
        return "no self_attn / mlp submodules"
    qkv = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj")] if hasattr(attn, "q_proj") else [
        getattr(attn, "qkv_proj", None)]  # fmt: skip
    gate_up = [getattr(mlp, n, None) for n in ("gate_proj", "up_proj")] if hasattr(mlp, "gate_proj") else [
        getattr(mlp, "gate_up_proj", None)]  # fmt: skip
    projections = [*qkv, getattr(attn, "o_proj", None), *gate_up, getattr(mlp, "down_proj", None)]
    if not (all(_linear(p) for p in projections) or all(_lowbit(p) for p in projections)):
        return "its projections are not all plain nn.Linear or all aipc LowBitLinear (quantized otherwise or replaced)"
    if not all(_rms_norm(getattr(layer, n, None)) for n in ("input_layernorm", "post_attention_layernorm")):
        return "its norms are not RMSNorm"
    if getattr(config, "hidden_act", None) not in ("silu", "swish"):
        return f"hidden_act {getattr(config, 'hidden_act', None)!r} is not silu"
    if hasattr(attn, "q_norm") and not (_rms_norm(attn.q_norm) and _rms_norm(getattr(attn, "k_norm", None))):
        return "its q_norm / k_norm are not RMSNorm"
    return None


def _groups(layer: nn.Module) -> dict[str, tuple[nn.Module, ...]]:
    """The layer's projection modules, in the order of :class:`DecoderLayerWeights`' projections."""
    attn, mlp = layer.self_attn, layer.mlp
    qkv = (attn.q_proj, attn.k_proj, attn.v_proj) if hasattr(attn, "q_proj") else (attn.qkv_proj,)
    gate_up = (mlp.gate_proj, mlp.up_proj) if hasattr(mlp, "gate_proj") else (mlp.gate_up_proj,)
    return dict(qkv=qkv, o=(attn.o_proj,), gate_up=gate_up, down=(mlp.down_proj,))


def _still_current(layer: nn.Module, w: DecoderLayerWeights, groups: dict[str, tuple[nn.Module, ...]]) -> bool:
    """Whether ``w`` (built by :func:`layer_weights` over low-bit projections) still describes ``layer``: the
    same modules holding the same tensors, the same norms."""
    attn, n1, n2 = layer.self_attn, layer.input_layernorm, layer.post_attention_layernorm
    return (all(getattr(w, k).modules == mods and getattr(w, k).valid() for k, mods in groups.items())
            and w.input_norm is n1.weight and w.input_eps == n1.variance_epsilon
            and w.post_norm is n2.weight and w.post_eps == n2.variance_epsilon
            and w.q_norm is getattr(attn, "q_norm", None) and w.k_norm is getattr(attn, "k_norm", None))  # fmt: skip


def layer_weights(layer: nn.Module) -> DecoderLayerWeights:
    """References to ``layer``'s own tensors (read at every forward, so a weight loaded later is the one used),
    or to its low-bit projections when ``optimize(model, weights=...)`` quantized it: those are built once
    (merging their modules' storage, :class:`LowBitProjection`) and again only when a module or one of its
    tensors was replaced."""
    groups = _groups(layer)
    lowbit = _lowbit(groups["o"][0])
    if lowbit:
        cached = layer.__dict__.get(_LOWBIT_WEIGHTS)
        if cached is not None and _still_current(layer, cached, groups):
            return cached
        weights: dict[str, Any] = {k: LowBitProjection(mods) for k, mods in groups.items()}
    else:
        weights = {k: tuple(p.weight for p in mods) for k, mods in groups.items()}
    biases = {f"{k}_bias": tuple(p.bias for p in mods) for k, mods in groups.items()}
    attn = layer.self_attn
    cfg = attn.config
    heads = cfg.num_attention_heads
    w = DecoderLayerWeights(
        **weights, **biases,
        input_norm=layer.input_layernorm.weight, input_eps=layer.input_layernorm.variance_epsilon,
        post_norm=layer.post_attention_layernorm.weight, post_eps=layer.post_attention_layernorm.variance_epsilon,
        heads=heads, kv_heads=getattr(cfg, "num_key_value_heads", None) or heads, head_dim=attn.head_dim,
        q_norm=getattr(attn, "q_norm", None), k_norm=getattr(attn, "k_norm", None),
    )  # fmt: skip
    if lowbit:
        setattr(layer, _LOWBIT_WEIGHTS, w)
    return w


def _attention_requested() -> bool:
    collected = None if _active_collector is None else _active_collector.get()
    return bool(collected) and "attentions" in collected


class FusedDecoderLayer:
    """Mixin put before a stock decoder layer class (see the module docstring)."""

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.LongTensor] = None, cache: Any = None, use_cache: Optional[bool] = False,
                position_embeddings: Optional[tuple[torch.Tensor, torch.Tensor]] = None, **kwargs: Any):  # fmt: skip
        if cache is None:
            cache = kwargs.pop("past_key_values", None)
        attn = self.self_attn
        if (self.training or position_embeddings is None or torch.is_grad_enabled() or _attention_requested()
                or hidden_states.dtype != self.input_layernorm.weight.dtype):  # fmt: skip
            return super().forward(hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                                   cache=cache, use_cache=use_cache, position_embeddings=position_embeddings,
                                   **kwargs)  # fmt: skip
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        interface = ALL_ATTENTION_FUNCTIONS.get_interface(
            attn.config._attn_implementation, sys.modules[type(attn).__module__].eager_attention_forward
        )
        sliding = attn.sliding_window if hasattr(attn, "sliding_window") else getattr(attn.config, "sliding_window", None)

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            if cache is not None:
                k, v = cache.update(k, v, attn.layer_idx, kwargs=kwargs)
            out, _ = interface(attn, q, k, v, attention_mask, dropout=0.0, scaling=attn.scaling,
                               sliding_window=sliding, **kwargs)  # fmt: skip
            return out

        cos, sin = position_embeddings
        return decoder_layer(hidden_states, layer_weights(self), cos, sin, attend)


class FusedLMHead(nn.Linear):
    """The lm_head: ``nn.Linear`` whose forward is ``aipc::dense_linear`` (same weight, same bias)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and self.weight.requires_grad:
            return super().forward(x)
        return dense_linear(x, self.weight, self.bias)


FusedLMHead._aipc_stock_class = nn.Linear
_FUSED: dict[type, type] = {}


def fused_class(stock: type) -> type:
    """The fused subclass of a stock decoder layer class (one per class, importable from this module by name
    so that a fused model pickles)."""
    if stock not in _FUSED:
        name = f"Fused{stock.__name__}"
        cls = type(name, (FusedDecoderLayer, stock), {_STOCK: stock, "__module__": __name__, "__qualname__": name})
        globals()[name] = _FUSED[stock] = cls
    return _FUSED[stock]


def stock_class(module: nn.Module) -> type:
    """The class ``module`` had before :func:`fuse_layers` rewrote it (its own class when it was not)."""
    cls = type(module)
    return getattr(cls, _STOCK, cls) if cls in (*_FUSED.values(), FusedLMHead) else cls


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of a transformers causal LM (``model.model.layers``), or [] when it has none."""
    base = getattr(model, "base_model", model)
    layers = getattr(base, "layers", None)
    return list(layers) if isinstance(layers, nn.ModuleList) else []


def fuse_layers(model: nn.Module) -> dict[str, Any]:
    """Rewrites ``model``'s supported decoder layers and its lm_head in place (idempotent); returns what it did:
    ``fused`` (layer count), ``kept`` ({reason: count} of the layers left stock), ``lm_head`` (bool)."""
    config = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    fused, kept = 0, {}
    for layer in decoder_layers(model):
        if isinstance(layer, FusedDecoderLayer):
            fused += 1
            continue
        why = why_not_fused(layer, config)
        if why is None:
            layer.__class__ = fused_class(type(layer))
            fused += 1
        else:
            kept[why] = kept.get(why, 0) + 1
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None and type(head) is nn.Linear and fused:
        head.__class__ = FusedLMHead
    report = dict(fused=fused, kept=kept, lm_head=isinstance(head, (FusedLMHead, LowBitLinear)))
    setattr(model, FUSION_REPORT, report)
    return report


def unfuse_layers(model: nn.Module) -> None:
    """Gives every rewritten module of ``model`` its stock class back."""
    for module in model.modules():
        module.__class__ = stock_class(module)
        if _LOWBIT_WEIGHTS in vars(module):
            delattr(module, _LOWBIT_WEIGHTS)
    if hasattr(model, FUSION_REPORT):
        delattr(model, FUSION_REPORT)


def fuse_for_generate(model: nn.Module) -> None:
    """The zero-code path (``attn_implementation="segment_kv"``): fuses ``model``'s layers at its first
    ``generate``, unless ``optimize(model, fuse_layers=False)`` or ``AIPC_SEGMENT_KV_FUSED_LAYERS=0`` opted out."""
    if getattr(model, OPT_OUT, False) or hasattr(model, FUSION_REPORT):
        return
    if os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "no", "off"):
        return
    fuse_layers(model)


def is_fused(model: nn.Module) -> bool:
    """Whether any decoder layer of ``model`` runs the fused forward."""
    return any(isinstance(layer, FusedDecoderLayer) for layer in decoder_layers(model))
