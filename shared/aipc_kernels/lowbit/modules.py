"""``torch.nn`` modules over the low-bit op, and swapping them into a model.

Used outside serving frameworks (demo, benchmarks, references for the plugins' tests): vLLM has its
own linear-method mechanism and uses the op directly.
"""
from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch
from torch import nn

from aipc_kernels.lowbit.formats import LowBitWeight, fitting_group_size
from aipc_kernels.lowbit.ops import a16_dequant, lowbit_linear, lowbit_linear_a16
from aipc_kernels.lowbit.packing import PackedLowBit, pack_for_cpu
from aipc_kernels.lowbit.quantizers import quantize_weight

DEFAULT_SKIP = ("lm_head", "embed_tokens", "embed_in", "embed_out", "wte")
#: LowBitLinear buffers that belong to the weight's format: never cast by a module dtype change
_FORMAT_BUFFERS = ("scales", "zeros")
#: all of LowBitLinear's tensors: assigning one bumps ``tensors_version``
_TENSORS = ("qweight", "scales", "zeros", "bias")


class LowBitLinear(nn.Module):
    """A linear layer whose weight is a packed low-bit weight (``aipc::lowbit_linear``; with
    ``activations="float"``, a 4-bit weight on the activation-exact ``aipc::lowbit_linear_a16``)."""

    #: bumped whenever one of the module's tensors is assigned or replaced (``m.qweight = t``, ``model.to(...)``):
    #: what is built over them (:class:`~aipc_kernels.decoder.fused_lowbit.LowBitProjection`) checks it instead of the
    #: tensors' identities on every call
    tensors_version: int = 0

    def __init__(self, weight: LowBitWeight, bias: Optional[torch.Tensor] = None, act_group: int = 0,
                 activations: str = "int8"):  # fmt: skip
        super().__init__()
        if activations not in ("int8", "float"):
            raise ValueError(f"activations={activations!r}; use 'int8' (W*A8) or 'float' (W4A16)")
        self.activations = activations
        self.in_features, self.out_features = weight.in_features, weight.out_features
        self.codebook, self.group_size, self.act_group = weight.codebook, weight.group_size, act_group
        packed = pack_for_cpu(weight.single_level())  # two-level scales as their float32 products
        self.layout = packed.layout
        self.dequant = a16_dequant(self.layout)  # W4A16: chosen here, outside any compiled region
        self.register_buffer("qweight", packed.qweight)
        self.register_buffer("scales", packed.scales)
        self.register_buffer("zeros", packed.zeros)
        self.register_buffer("bias", bias)

    def _apply(self, fn, recurse: bool = True):
        """``model.to(...)`` / ``.float()`` / ``.half()``: the packed weight's scales and zeros move with the
        device but keep their dtype (they are part of the format: a cast could round float32 scales, and the
        W4A16 kernels take 16-bit ones only); the bias follows the model as any buffer."""
        kept = {n: self._buffers[n] for n in _FORMAT_BUFFERS}
        names = list(self._buffers)
        for n in kept:
            self._buffers[n] = None
        super()._apply(fn, recurse)
        for n, t in kept.items():
            if t is not None:
                device = fn(torch.empty(0, dtype=t.dtype, device=t.device)).device
                kept[n] = t if t.device == device else t.to(device)
        self._buffers = {n: kept[n] if n in kept else self._buffers[n] for n in names}
        self.__dict__["tensors_version"] = self.tensors_version + 1
        return self

    def __setattr__(self, name: str, value) -> None:
        super().__setattr__(name, value)
        if name in _TENSORS:
            self.__dict__["tensors_version"] = self.tensors_version + 1

    @property
    def packed(self) -> PackedLowBit:
        """The weight as the op takes it, over this module's buffers as they are now."""
        return PackedLowBit(self.layout, self.qweight, self.scales, self.zeros, self.codebook, self.group_size,
                            self.out_features, self.in_features)  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activations == "float":
            return lowbit_linear_a16(x, self.packed, self.bias, self.dequant)
        return lowbit_linear(x, self.packed, self.bias, self.act_group)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, codebook={self.codebook}, group={self.group_size}"


def linear_names(model: nn.Module, skip: Iterable[str] = DEFAULT_SKIP) -> list[str]:
    """Names of the ``nn.Linear`` modules that quantization applies to (``skip``: name fragments)."""
    skip = tuple(skip)
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and not any(s in n for s in skip)]


def quantize_linears(
    model: nn.Module,
    codebook: str = "affine",
    group_size: int = 64,
    method: str = "optimized",
    skip: Iterable[str] = DEFAULT_SKIP,
    replace: Callable[[nn.Linear, LowBitWeight], nn.Module] | None = None,
) -> dict[str, LowBitWeight]:
    """Quantizes every eligible ``nn.Linear`` of ``model`` in place and returns the weights by name (a
    ``group_size`` that does not divide a layer's K falls back as the plugins' on-the-fly quantization
    does: :func:`~aipc_kernels.lowbit.formats.fitting_group_size`).

    ``replace(linear, weight)`` builds the substitute module; the default is :class:`LowBitLinear`.
    Pass ``lambda lin, w: dequantized_linear(lin, w)`` for a float reference with the same weights.
    """
    replace = replace or (lambda lin, w: LowBitLinear(w, None if lin.bias is None else lin.bias.detach().float()))
    out = {}
    for name in linear_names(model, skip):
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        lin = getattr(parent, child)
        w = quantize_weight(lin.weight.detach().float(), codebook, fitting_group_size(group_size, lin.in_features),
                            method=method)
        setattr(parent, child, replace(lin, w))
        out[name] = w
    return out


def dequantized_linear(lin: nn.Linear, w: LowBitWeight) -> nn.Linear:
    """``lin`` with its weight replaced by the dequantized low-bit weight (same dtype as before)."""
    new = nn.Linear(lin.in_features, lin.out_features, bias=lin.bias is not None, dtype=lin.weight.dtype)
    with torch.no_grad():
        new.weight.copy_(w.dequantize(torch.float32).to(lin.weight.dtype))
        if lin.bias is not None:
            new.bias.copy_(lin.bias)
    return new
