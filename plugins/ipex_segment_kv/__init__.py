"""ipex_segment_kv: segment KV cache and fused index-select SDPA for transformers beam search.

Used as ``attn_implementation="segment_kv"`` with stock ``model.generate``. Importing this package
imports neither transformers nor torch.
"""
from __future__ import annotations


def register() -> bool:
    """Discovery hook (``aipc_plugins`` entry point). Registers the ``segment_kv`` attention with
    transformers (``ipex_segment_kv.integration``) once it exists; returns whether it did."""
    from aipc_kernels.plugin_hooks import import_integration

    return import_integration(__name__, "integration")
