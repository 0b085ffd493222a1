"""Activation of the plugin through the ``aipc_plugins`` entry point (``ipex_segment_kv.register()``):
importing this module registers ``attn_implementation="segment_kv"`` with transformers."""
from __future__ import annotations

import transformers.modeling_utils

from .hook import install

install(transformers.modeling_utils)
