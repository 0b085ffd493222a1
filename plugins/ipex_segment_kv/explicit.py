"""``ipex_segment_kv.optimize(model)`` / ``undo(model)``: the explicit form, mirroring ``ipex.llm.optimize``."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from aipc_kernels.core.config_schema import Naming, option, parse
from aipc_kernels.decoder.segment_contract import SUPPORTED_DTYPES
from aipc_kernels.lowbit.weight_schemes import SCHEMES

from .cache import DEFAULT_RESPONSE_STEP
from . import fused_layers as fusion
from .hook import install
from . import weights as woq

_PREVIOUS = "_aipc_segment_kv_previous_attn"
NAMING = Naming("ipex_segment_kv.optimize", "python")


@dataclass(frozen=True)
class OptimizeOptions:
    """The keywords of :func:`optimize`."""

    response_step: int = option(DEFAULT_RESPONSE_STEP, ge=1, example=DEFAULT_RESPONSE_STEP)
    fuse_layers: bool = option(True, choices=(True, False))
    inplace: bool = option(True, choices=(True,), note="it would copy the weights; call optimize(model) "
                                                      "and undo(model) instead")  # fmt: skip
    weights: Optional[str] = option(None, choices=(None, *SCHEMES), note="None keeps the float weights")
    keep_float_weights: bool = option(False, choices=(True, False))
    allow_2bit_ptq: bool = option(False, choices=(True, False))
    act_quant: str = option(woq.PER_TOKEN, choices=woq.ACT_QUANT, note="how the int8 activations of weights=... are scaled")

    def check(self, naming: Naming) -> None:
        if self.act_quant != woq.PER_TOKEN and self.weights is None:
            raise ValueError(f"{naming.owner}: act_quant={self.act_quant!r} applies to quantized weights; pass "
                             f"weights='int4' (or 'int8', 'lowbit2') with it, or leave act_quant out")  # fmt: skip


def optimize(
    model: Any, *, response_step: int = DEFAULT_RESPONSE_STEP, fuse_layers: bool = True, inplace: bool = True,
    weights: Optional[str] = None, keep_float_weights: bool = False, allow_2bit_ptq: bool = False,
    act_quant: str = "per_token",
) -> Any:
    """Switches a loaded transformers causal LM to the segment KV cache + fused segment SDPA for
    ``generate`` (beam search, sampling, greedy) and, with ``fuse_layers`` (the default), rewrites its
    supported decoder layers into the fused form (:mod:`ipex_segment_kv.fused_layers`: Llama, Mistral,
    Qwen2, Qwen3, Phi-3; other layers keep their stock forward) and runs its lm_head through
    ``aipc::dense_linear``. What was rewritten is in ``model._aipc_segment_kv_fusion``. Returns the model
    (modified in place; ``inplace=False`` is refused rather than silently copying a model). Undo with
    :func:`undo`.

    ``weights`` (``"int8"``, ``"int4"``, ``"lowbit2"``): quantizes every linear once, here
    (:mod:`ipex_segment_kv.weights`; ``lowbit2`` on a trained model needs ``allow_2bit_ptq=True``); the
    fused layers and the lm_head then run on ``aipc::lowbit_linear``. The float weights are released
    unless ``keep_float_weights=True`` (then :func:`undo` restores them). ``act_quant``: the kernels'
    int8 activations get one scale per token (``"per_token"``, the default) or one per token and weight
    group (``"per_group"``, IPEX's ``PER_BATCH_IC_BLOCK``; the lm_head stays per token). What was quantized is in
    ``model._aipc_segment_kv_weights``.

    Raises ValueError for architectures whose attention bypasses transformers' AttentionInterface and
    for dtypes the kernels do not support."""
    options = parse(OptimizeOptions, dict(response_step=response_step, fuse_layers=fuse_layers, inplace=inplace,
                                          weights=weights, keep_float_weights=keep_float_weights,
                                          allow_2bit_ptq=allow_2bit_ptq, act_quant=act_quant), NAMING)  # fmt: skip
    install()
    from .attention import ATTN_NAME
    from .generation import check_architecture

    if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
        raise ValueError(f"ipex_segment_kv.optimize: expected a transformers model, got {type(model).__name__}")
    check_architecture(model)
    dtype = getattr(model, "dtype", None)
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"ipex_segment_kv.optimize: model dtype {dtype} is not supported; use one of "
                         f"{[str(d).removeprefix('torch.') for d in SUPPORTED_DTYPES]} (model.to(dtype))")  # fmt: skip
    current = model.config._attn_implementation
    if current != ATTN_NAME:
        setattr(model, _PREVIOUS, current)
        model.set_attn_implementation(ATTN_NAME)
    if options.weights is not None:
        woq.quantize_model(model, options.weights, keep_float_weights=options.keep_float_weights,
                           allow_2bit_ptq=options.allow_2bit_ptq, act_quant=options.act_quant)  # fmt: skip
    model._aipc_segment_kv_step = options.response_step
    setattr(model, fusion.OPT_OUT, not options.fuse_layers)
    if options.fuse_layers:
        fusion.fuse_layers(model)
    else:
        fusion.unfuse_layers(model)
    return model


def undo(model: Any) -> Any:
    """Restores the attention implementation the model had before :func:`optimize` and the stock classes of
    the layers it rewrote (their modules and tensors were never changed: ``undo`` gives back the same
    objects), and the float linears kept by ``optimize(weights=..., keep_float_weights=True)`` (without
    them the linears stay quantized, with a warning)."""
    from .attention import ATTN_NAME

    previous = getattr(model, _PREVIOUS, None)
    if model.config._attn_implementation == ATTN_NAME:
        model.set_attn_implementation(previous or "sdpa")
    woq.restore_float(model)  # first: a kept lm_head fused before quantizing gets its stock class back below
    fusion.unfuse_layers(model)
    for attr in (_PREVIOUS, "_aipc_segment_kv_step", fusion.OPT_OUT):
        if hasattr(model, attr):
            delattr(model, attr)
    return model
