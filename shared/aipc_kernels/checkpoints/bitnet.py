"""BitNet b1.58 checkpoints (transformers' ``quant_method: bitnet``) read into the ``ternary`` code book.

The published families and what their tensors mean (transformers ``integrations/bitnet.py``):

* packed weights, uint8 ``[N/4, K]``: byte ``[j, k]`` holds rows ``i*N/4 + j`` (i = 0..3) in bits
  ``2i..2i+1``, stored as ``v + 1`` (0 -> -1, 1 -> 0, 2 -> +1; 3 is not a value). Row blocks are
  local to one packed tensor, so a merged or tensor-parallel slice is cut only after unpacking.
  One ``weight_scale`` per tensor, whose meaning depends on ``linear_class``:
  ``autobitlinear`` (microsoft/bitnet-b1.58-2B-4T) multiplies the output by it (``W = v * s``),
  ``bitlinear`` (the default; Falcon3-*-1.58bit, Falcon-E) divides by it (``W = v / s``);
* bf16 masters (``linear_class: autobitlinear``, ``quantization_mode: online``): float weights
  ternarized per tensor by BitNet's absmean rule, ``v = clamp(round(W / mean|W|), -1, 1)``,
  ``W = v * mean|W|`` (:func:`absmean_multiplier` of the whole tensor, then :func:`ternarize` of any slice: the arithmetic
  of transformers' ``WeightQuant``).

Activations are int8 absmax per token in every family: what the ``lowbit_linear`` kernels do with
``act_group=0``. :func:`ternary_weight` turns codes and per-row values into the canonical
:class:`~aipc_kernels.lowbit.formats.LowBitWeight` (whole-row groups); the serving method and the
converter both go through it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Optional

import torch

from aipc_kernels.core.config_schema import Naming, field_names, option, parse
from aipc_kernels.lowbit.formats import LowBitWeight, pack_codes, resolve_group_size

QUANT_METHOD = "bitnet"
VALUES_PER_BYTE = 4
#: errors about a checkpoint's ``quantization_config`` with ``quant_method: bitnet``
NAMING = Naming("bitnet quantization_config", "json")


@dataclass(frozen=True)
class BitNetQuantization:
    """The ``quantization_config`` of a BitNet checkpoint (transformers' ``BitNetQuantConfig`` keys)."""

    quant_method: str = option(QUANT_METHOD, choices=(QUANT_METHOD,))
    linear_class: str = option("bitlinear", choices=("bitlinear", "autobitlinear"))
    quantization_mode: str = option("offline", choices=("offline", "online"))
    modules_to_not_convert: Optional[list[str]] = option(None, example=["lm_head"])
    use_rms_norm: bool = option(False)
    rms_norm_eps: float = option(1e-6, ge=0.0)

    def check(self, naming: Naming) -> None:
        if self.use_rms_norm:
            raise naming.error(
                "use_rms_norm", True,
                "(an RMSNorm inside every linear, before its activation quantization) is not supported by "
                "aipc-plugins; serve this model with transformers, or ask for it in an issue",
            )  # fmt: skip

    @property
    def packed(self) -> bool:
        """Whether the linears hold packed ternary weights (transformers' BitLinear ignores the mode;
        AutoBitLinear holds float masters in ``online`` mode)."""
        return not (self.linear_class == "autobitlinear" and self.quantization_mode == "online")

    @property
    def skipped(self) -> tuple[str, ...]:
        return tuple(self.modules_to_not_convert or ())


def parse_quantization_config(config: dict[str, Any]) -> tuple[BitNetQuantization, list[str]]:
    """Checks a BitNet ``quantization_config``; returns it and the keys it ignored (keys of
    transformers' serialisation that do not change the weights, e.g. ``pre_quantized``)."""
    known = set(field_names(BitNetQuantization))
    ignored = sorted(k for k in config if k not in known)
    return parse(BitNetQuantization, {k: v for k, v in config.items() if k in known}, NAMING), ignored


def not_converted(module: str, patterns: tuple[str, ...]) -> bool:
    """Whether ``modules_to_not_convert`` keeps ``module`` a float linear: transformers' rule
    (``should_convert_module``, as of 5.24): a pattern (a regex) that matches the name's start up to a
    dot or its end, or a suffix of the name. (Before 5.24 a pattern matched any start: ``layers.1``
    also kept ``layers.11``.)"""
    boundary = r"(?:(?<=\.)|(?=\.|$))"
    return any(re.match(rf"(?:{p}){boundary}", module) or module.endswith(p) for p in patterns)


def unpack_ternary(packed: torch.Tensor, name: str) -> torch.Tensor:
    """Packed BitNet weight ``[N/4, K]`` -> ternary values int8 ``[N, K]`` in {-1, 0, 1}.

    ``name`` is the checkpoint tensor's, for the errors (wrong dtype or rank, code 3)."""
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise ValueError(
            f"BitNet tensor {name} must be a packed 2-D uint8 tensor [out_features/4, in_features], got "
            f"{packed.dtype} {tuple(packed.shape)}; for bf16 master weights the quantization_config needs "
            f"linear_class: autobitlinear and quantization_mode: online"
        )
    shifts = torch.arange(0, 2 * VALUES_PER_BYTE, 2, dtype=torch.uint8, device=packed.device)
    codes = (packed.unsqueeze(0) >> shifts.view(-1, 1, 1)) & 3  # [4, N/4, K]: block i holds rows i*N/4...
    if (codes == 3).any():
        raise ValueError(f"BitNet tensor {name} holds the 2-bit code 3, which is no ternary value; the file is corrupt")
    return codes.reshape(-1, packed.shape[1]).to(torch.int8) - 1


def packed_scale(weight_scale: torch.Tensor, linear_class: str, name: str) -> float:
    """The value of a ternary 1 in one packed tensor: ``s`` (autobitlinear) or ``1/s`` (bitlinear)."""
    if weight_scale.numel() != 1:
        raise ValueError(f"BitNet tensor {name} has {weight_scale.numel()} elements; expected one scale per tensor")
    s = float(weight_scale.double().reshape(()))
    if not (s > 0.0 and s < float("inf")):
        raise ValueError(f"BitNet tensor {name} is {s}; a weight scale must be positive and finite")
    return s if linear_class == "autobitlinear" else 1.0 / s


def absmean_multiplier(weight: torch.Tensor) -> float:
    """BitNet's online rule, first half: the float32 ``1 / mean|W|`` of one whole tensor (as
    transformers' ``WeightQuant`` computes it)."""
    return float(1.0 / weight.float().abs().mean().clamp_(min=1e-5))


def ternarize(weight: torch.Tensor, multiplier: float) -> tuple[torch.Tensor, float]:
    """BitNet's online rule, second half, for a tensor or any slice of it: int8 values
    ``clamp(round(W * multiplier), -1, 1)`` and the float32 value of a 1 (``1 / multiplier``),
    with ``WeightQuant``'s float32 arithmetic."""
    m = torch.tensor(multiplier, dtype=torch.float32)
    values = (weight.float() * m).round_().clamp_(-1, 1).to(torch.int8)
    return values, float(torch.ones((), dtype=torch.float32) / m)


def _scale_dtype(values: torch.Tensor) -> torch.dtype:
    """bf16 when it holds every per-row value exactly (autobitlinear's and the masters' bf16 scales),
    else fp16 (10 fraction bits) when the values are in its normal range, else bf16."""
    if torch.equal(values.to(torch.bfloat16).float(), values):
        return torch.bfloat16
    fp16 = torch.finfo(torch.float16)
    if bool(((values >= fp16.tiny) & (values <= fp16.max)).all()):
        return torch.float16
    return torch.bfloat16


def ternary_weight(values: torch.Tensor, row_one: torch.Tensor, name: str, scale_dtype: Optional[torch.dtype] = None,
                   group_size: int = -1) -> LowBitWeight:  # fmt: skip
    """int8 ternary values ``[N, K]`` and the float value of a 1 per row ``[N]`` -> a ``ternary``
    :class:`LowBitWeight` (the codes are exact; each row's value is rounded once to ``scale_dtype``,
    by default the 16-bit type that holds it best) with ``group_size`` (-1: one group per row)."""
    N, K = values.shape
    try:
        G = resolve_group_size(group_size, K)
    except ValueError as e:
        raise ValueError(f"BitNet layer {name} cannot be packed: {e}; list it in modules_to_not_convert") from None
    scale = row_one.float().reshape(N, 1)
    scale = scale.to(scale_dtype or _scale_dtype(scale)).expand(N, K // G).contiguous()
    return LowBitWeight(pack_codes((values + 1).to(torch.uint8), 2), scale, None, "ternary", G, K, name=name)


__all__ = [
    "BitNetQuantization", "NAMING", "QUANT_METHOD", "VALUES_PER_BYTE", "packed_scale",
    "absmean_multiplier", "not_converted", "parse_quantization_config", "ternarize", "ternary_weight", "unpack_ternary",
]  # fmt: skip
