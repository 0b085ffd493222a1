"""ipex_segment_kv: segment KV cache and fused index-select SDPA for transformers beam search.

Used as ``attn_implementation="segment_kv"`` with stock ``model.generate`` (registered by an import
hook when transformers is imported), or explicitly with ``ipex_segment_kv.optimize(model)`` /
``ipex_segment_kv.undo(model)``. Both also run supported decoder layers (Llama, Mistral, Qwen2, Qwen3,
Phi-3) in the fused form (:mod:`ipex_segment_kv.fused_layers`); ``optimize(model, weights="int8" | "int4" |
"lowbit2")`` also quantizes the linears (:mod:`ipex_segment_kv.weights`). Importing this package imports neither
transformers nor torch.
"""
from __future__ import annotations

from typing import Any

__all__ = ["optimize", "undo", "SegmentKVCache"]


def __getattr__(name: str) -> Any:
    # lazy: optimize/undo/SegmentKVCache import torch and transformers
    if name in ("optimize", "undo"):
        from . import explicit

        return getattr(explicit, name)
    if name == "SegmentKVCache":
        from .cache import SegmentKVCache

        return SegmentKVCache
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
