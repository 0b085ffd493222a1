"""Import hook target: ``install(transformers.modeling_utils)`` registers ``attn_implementation="segment_kv"``.

Called by ``aipc_kernels._autoload`` right after ``transformers.modeling_utils`` finishes importing
(so ``AutoModelForCausalLM.from_pretrained(path, attn_implementation="segment_kv")`` works with no
import of this package) and by ``ipex_segment_kv.optimize``. Idempotent.
"""
from __future__ import annotations

import types
from typing import Optional

_installed = False


def install(module: Optional[types.ModuleType] = None) -> None:
    """Registers the segment_kv attention and mask with transformers and wraps generate's cache and
    prefill steps (see ``ipex_segment_kv.generation``). ``module`` is the transformers module whose
    import triggered the call (unused: everything is looked up by name)."""
    global _installed
    if _installed:
        return
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
    from transformers.modeling_utils import AttentionInterface

    from .attention import ATTN_NAME, segment_kv_attention_forward
    from .generation import install_generation_hooks

    AttentionInterface.register(ATTN_NAME, segment_kv_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_NAME, sdpa_mask)  # boolean masks, None when only causal
    install_generation_hooks()
    _installed = True


def uninstall() -> None:
    """Restores transformers' generate methods (the attention name stays registered)."""
    global _installed
    from .generation import uninstall_generation_hooks

    uninstall_generation_hooks()
    _installed = False
