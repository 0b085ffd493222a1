"""``attn_implementation="segment_kv"``: the attention function and mask registered with transformers.

With a :class:`~ipex_segment_kv.cache.SegmentKVCache`, attention runs ``torch.ops.aipc.segment_sdpa``
over the layer's prompt and response segments (the prefill is the prompt-only case). Without one
(no cache, or a cache passed explicitly by the caller) it is transformers' own SDPA attention, so
the model stays usable for plain forward passes.
"""
from __future__ import annotations

from typing import Optional

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from aipc_kernels.decoder.segment_attention import segment_sdpa

from .cache import take_pending

ATTN_NAME = "segment_kv"


def segment_kv_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    is_causal: Optional[bool] = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention interface: ``query [N, Hq, Lq, D]`` -> ``([N, Lq, Hq, D], None)``."""
    layer = take_pending(key)
    if layer is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    if dropout and module.training:
        raise ValueError("segment_kv: attention dropout is not supported (it is an inference path); call model.eval()")
    for name in ("softcap", "position_bias", "s_aux"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"segment_kv: attention with {name} is not supported; load the model with "
                                      "attn_implementation='eager'")
    if attention_mask is not None and attention_mask.dim() != 4:
        raise ValueError(f"segment_kv: expected a 4-D attention mask, got shape {tuple(attention_mask.shape)}")
    Lq = query.shape[2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(causal) and attention_mask is None and Lq > 1
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = segment_sdpa(query, *layer.segments(), attn_mask=attention_mask, scale=scale, is_causal=causal)
    return out, None
