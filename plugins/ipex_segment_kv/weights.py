"""``optimize(model, weights=...)``: the model's linears quantized once and run on ``aipc::lowbit_linear``
(the weight-only quantization ``ipex.llm.optimize`` gave CPU users, plus 2 bits).

Every ``nn.Linear`` of the model becomes an :class:`aipc_kernels.lowbit.modules.LowBitLinear` holding its weight in
one of :data:`aipc_kernels.lowbit.weight_schemes.SCHEMES` (the output projection in ``int8``); activations are
quantized to int8 inside the kernel, one scale per token (``act_quant="per_token"``) or per token and
weight group (``"per_group"``; ``bench/results/quality/segment_kv_quality.md`` has both). A fused decoder layer
reads its q/k/v and gate/up modules as one weight (:mod:`aipc_kernels.decoder.fused_lowbit`); a layer the fused
path does not cover runs its stock forward over the same modules. A linear whose in_features is not a multiple of 32 stays float (listed in the report).

Memory: the float weights are released (a tied output projection's weight stays, as the input embedding);
``keep_float_weights=True`` keeps the original modules aside, so that :func:`restore_float` (``undo``) puts
them back bit-identically, at the cost of the float weights staying in memory.
"""
from __future__ import annotations

import os
import warnings
from typing import Any

from torch import nn

from aipc_kernels.lowbit.modules import LowBitLinear
from aipc_kernels.lowbit.quality_gate import needs_opt_in, ptq_refusal
from aipc_kernels.lowbit.weight_schemes import HEAD_SCHEME, SCHEMES, can_quantize

from .fused_layers import stock_class

#: environment variable of the zero-code path: the scheme applied at the first generate
ENV_WEIGHTS = "AIPC_SEGMENT_KV_WEIGHTS"
#: model attribute: what quantize_model did (its return value)
WEIGHTS_REPORT = "_aipc_segment_kv_weights"
#: model attribute: {name: the original nn.Linear}, kept with keep_float_weights=True
_FLOAT_LINEARS = "_aipc_segment_kv_float_linears"
#: act_quant values: one int8 activation scale per token, or per token and weight group
PER_TOKEN, PER_GROUP = "per_token", "per_group"
ACT_QUANT = (PER_TOKEN, PER_GROUP)


def _bytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in (*module.parameters(recurse=False), *module.buffers(recurse=False)))


def act_group_for(weight_group: int, in_features: int, act_quant: str) -> int:
    """The kernel's ``act_group`` of a linear: 0 (one activation scale per token) for ``per_token`` and for a
    weight with one group per row, else the weight's group size (one scale per token and group)."""
    return weight_group if act_quant == PER_GROUP and 0 < weight_group < in_features else 0


def quantize_model(model: nn.Module, weights: str, *, keep_float_weights: bool = False, allow_2bit_ptq: bool = False,
                   act_quant: str = PER_TOKEN, caller: str = "ipex_segment_kv.optimize") -> dict[str, Any]:  # fmt: skip
    """Replaces ``model``'s ``nn.Linear`` modules by ``LowBitLinear`` in the scheme ``weights`` (see the
    module docstring), their int8 activations scaled ``act_quant`` (the lm_head's per token), and returns
    what it did: ``weights``, ``act_quant``, ``quantized`` (count), ``float`` ({name: why} of the linears left
    float), ``bytes_before`` / ``bytes_after`` of the linears, ``float_kept``. Idempotent for the same
    scheme; another scheme on a quantized model is refused (the float weights are gone, or kept for ``undo``)."""
    scheme = SCHEMES[weights]
    if act_quant not in ACT_QUANT:
        raise ValueError(f"{caller}: act_quant={act_quant!r}; use one of {ACT_QUANT}")
    done = getattr(model, WEIGHTS_REPORT, None)
    if done is not None:
        if (done["weights"], done["act_quant"]) == (weights, act_quant):
            return done
        raise ValueError(f"{caller}: weights={weights!r}, act_quant={act_quant!r}, but the model's linears are already "
                         f"{done['weights']!r} with act_quant={done['act_quant']!r}; call ipex_segment_kv.undo(model) "
                         f"first (restores float weights kept with keep_float_weights=True), or load the model "
                         f"again")  # fmt: skip
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    # an lm_head already fused by optimize(model) is an nn.Linear under its rewritten class
    linears = [(n, m) for n, m in model.named_modules() if stock_class(m) is nn.Linear]
    if needs_opt_in(scheme.codebook) and not allow_2bit_ptq:
        first = next((n for n, m in linears if m is not head), "?")
        raise ValueError(ptq_refusal(first, scheme.codebook, f"{caller}(weights={weights!r})",
                                     f"ipex_segment_kv.optimize(model, weights={weights!r}, allow_2bit_ptq=True)"))  # fmt: skip
    kept: dict[str, nn.Module] = {}
    left: dict[str, str] = {}
    before = after = 0
    for name, lin in linears:
        if not can_quantize(lin.in_features):
            left[name] = f"in_features {lin.in_features} is not a multiple of 32"
            continue
        w = (HEAD_SCHEME if lin is head else scheme).quantize(lin.weight, name)
        act_group = 0 if lin is head else act_group_for(w.group_size, lin.in_features, act_quant)
        new = LowBitLinear(w, None if lin.bias is None else lin.bias.detach(), act_group=act_group)
        model.set_submodule(name, new)
        before, after = before + _bytes(lin), after + _bytes(new)
        if keep_float_weights:
            kept[name] = lin
    report = dict(weights=weights, act_quant=act_quant, quantized=len(linears) - len(left), float=left,
                  bytes_before=before, bytes_after=after, float_kept=keep_float_weights)  # fmt: skip
    setattr(model, WEIGHTS_REPORT, report)
    if keep_float_weights:
        setattr(model, _FLOAT_LINEARS, kept)
    return report


def restore_float(model: nn.Module) -> bool:
    """Puts back the original float linears kept by ``keep_float_weights=True`` (the same objects) and
    returns True; warns and returns False when the model's linears are quantized and nothing was kept."""
    report = getattr(model, WEIGHTS_REPORT, None)
    if report is None:
        return True
    kept = getattr(model, _FLOAT_LINEARS, None)
    if kept is None:
        warnings.warn(f"ipex_segment_kv.undo: the model's linears stay quantized ({report['weights']}): their float "
                      "weights were released by optimize(weights=...); pass keep_float_weights=True to optimize "
                      "to get them back with undo, or load the model again", stacklevel=3)  # fmt: skip
        return False
    for name, lin in kept.items():
        model.set_submodule(name, lin)
    delattr(model, _FLOAT_LINEARS)
    delattr(model, WEIGHTS_REPORT)
    return True


def weights_for_generate(model: nn.Module) -> None:
    """The zero-code path: quantizes ``model`` at its first ``generate`` when ``AIPC_SEGMENT_KV_WEIGHTS``
    names a scheme (and ``optimize`` did not already)."""
    value = os.environ.get(ENV_WEIGHTS, "").strip()
    if not value or hasattr(model, WEIGHTS_REPORT):
        return
    if value not in SCHEMES:
        raise ValueError(f"{ENV_WEIGHTS}={value!r} is not a weight scheme; use one of {sorted(SCHEMES)}, or unset it "
                         "for float weights")  # fmt: skip
    quantize_model(model, value, caller=ENV_WEIGHTS)
