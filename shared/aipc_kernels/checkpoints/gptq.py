"""GPTQ and AWQ 4-bit checkpoints read into the ``int4`` / ``affine4`` code books, exactly.

The published tensors of one linear ``W[N, K]`` (``G``: the group size, ``K`` for ``group_size: -1``),
each 4-bit value in an int32 at bits ``4*i`` (``i = 0..7``):

* GPTQ (``quant_method: gptq``; AutoGPTQ, GPTQModel, optimum): ``qweight`` int32 ``[K/8, N]``
  packed along K (value ``k`` at bits ``4*(k % 8)`` of row ``k // 8``); ``qzeros`` int32
  ``[K/G, N/8]`` packed along N in the same order; ``scales`` fp16 ``[K/G, N]``; ``g_idx`` int32
  ``[K]``, the group of each input feature. ``W[n, k] = scales[g, n] * (c - z)`` with
  ``g = g_idx[k]``; ``checkpoint_format: gptq`` (v1, the default) stores ``z - 1`` in ``qzeros``,
  ``gptq_v2`` stores ``z``. ``sym: true`` means ``z = 8`` everywhere.
* AWQ GEMM (``quant_method: awq``, ``version: gemm``, ``zero_point: true``; AutoAWQ): ``qweight``
  int32 ``[K, N/8]`` and ``qzeros`` int32 ``[K/G, N/8]`` packed along N in AWQ's interleaved order
  (bits ``4*j`` hold column ``AWQ_ORDER[j]`` of each 8); ``scales`` fp16 ``[K/G, N]``;
  ``W[n, k] = scales[g, n] * (c - z)``, ``g = k // G``.

:func:`read_linear` re-lays these integers out into a :class:`~aipc_kernels.lowbit.formats.LowBitWeight`
(codes packed along K, scales ``[N, K/G]`` in the checkpoint's fp16/bf16, no re-quantization):
``int4`` when every zero point is 8, else ``affine4`` with the integer zero points stored in the
scales' dtype (exact: they are at most 16). Activation order (``desc_act: true``) is read only when
``g_idx`` is the identity grouping ``g_idx[k] == k // G`` (GPTQ's ``static_groups`` writes it so);
a real permutation is refused naming the tensor. Every error names the checkpoint tensor or config
key. The vLLM method ``lowbit4`` and the tests use these functions; nothing here imports vLLM.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from aipc_kernels.core.config_schema import Naming, field_names, option, parse
from aipc_kernels.lowbit.formats import GROUP_SIZES, SCALE_DTYPES, LowBitWeight, pack_codes

BITS = 4
PER_INT32 = 32 // BITS
#: AWQ's order inside an int32: bits 4*j hold column AWQ_ORDER[j] of each block of 8
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
#: GPTQ checkpoint_format -> what qzeros hold below the zero point (v1: z - 1)
GPTQ_ZERO_OFFSETS = {"gptq": 1, "gptq_v2": 0}
GPTQ_NAMING = Naming("gptq quantization_config", "json")
AWQ_NAMING = Naming("awq quantization_config", "json")
_SERVE_OTHERWISE = "serve this checkpoint without --quantization lowbit4 (vLLM's own method)"


@dataclass(frozen=True)
class GPTQQuantization:
    """The keys of a GPTQ ``quantization_config`` that decide what its tensors mean."""

    quant_method: str = option("gptq", choices=("gptq",))
    bits: int = option(BITS, choices=(BITS,), note=f"aipc-plugins reads 4-bit GPTQ; {_SERVE_OTHERWISE}")
    group_size: int = option(128, choices=GROUP_SIZES + (-1,), note="-1: one group per row")
    desc_act: bool = option(False)
    sym: bool = option(True)
    #: v1 (``gptq``, the default: qzeros hold z - 1) or ``gptq_v2`` (qzeros hold z)
    checkpoint_format: Optional[str] = option(None, choices=(None,) + tuple(GPTQ_ZERO_OFFSETS))
    #: GPTQModel's other name for checkpoint_format
    format: Optional[str] = option(None, choices=(None,) + tuple(GPTQ_ZERO_OFFSETS))
    lm_head: bool = option(False)
    is_marlin_format: bool = option(False)
    dynamic: Optional[dict[str, Any]] = option(None)
    modules_in_block_to_quantize: Optional[list[Any]] = option(None)

    def check(self, naming: Naming) -> None:
        if None not in (self.format, self.checkpoint_format) and self.format != self.checkpoint_format:
            raise naming.error("format", self.format, f"contradicts {naming.ref('checkpoint_format')}="
                               f"{self.checkpoint_format!r}; give one of them")  # fmt: skip
        refused = {
            "lm_head": (self.lm_head, "(a quantized output projection in the checkpoint) is not read by aipc-plugins"),
            "is_marlin_format": (self.is_marlin_format, "(Marlin's tile layout) is not read by aipc-plugins"),
            "dynamic": (self.dynamic, "(per-layer bits/group overrides) is not read by aipc-plugins"),
            "modules_in_block_to_quantize": (self.modules_in_block_to_quantize, "(a partly quantized model) is not "
                                             "read by aipc-plugins"),
        }  # fmt: skip
        for key, (value, why) in refused.items():
            if value:
                raise naming.error(key, value, f"{why}; {_SERVE_OTHERWISE}")

    @property
    def layout(self) -> str:
        return "gptq"

    @property
    def zero_offset(self) -> int:
        """What the stored zero points are below the real ones (v1: 1)."""
        return GPTQ_ZERO_OFFSETS[self.checkpoint_format or self.format or "gptq"]

    @property
    def skipped(self) -> tuple[str, ...]:
        return ()


@dataclass(frozen=True)
class AWQQuantization:
    """The keys of an AWQ ``quantization_config`` (config.json; ``w_bit`` / ``q_group_size`` of
    AutoAWQ's quant_config.json are read as ``bits`` / ``group_size``)."""

    quant_method: str = option("awq", choices=("awq",))
    bits: int = option(BITS, choices=(BITS,), note=f"aipc-plugins reads 4-bit AWQ; {_SERVE_OTHERWISE}")
    group_size: int = option(128, choices=GROUP_SIZES + (-1,), note="-1: one group per row")
    zero_point: bool = option(True, choices=(True,), note=f"AWQ without zero points is not read; {_SERVE_OTHERWISE}")
    version: str = option("gemm", choices=("gemm",), note=f"GEMV / Marlin / ExLlama layouts are not read; {_SERVE_OTHERWISE}")
    modules_to_not_convert: Optional[list[str]] = option(None, example=["visual"])

    @property
    def layout(self) -> str:
        return "awq"

    @property
    def zero_offset(self) -> int:
        return 0

    @property
    def skipped(self) -> tuple[str, ...]:
        return tuple(self.modules_to_not_convert or ())


Int4Checkpoint = GPTQQuantization | AWQQuantization
_AWQ_ALIASES = {"w_bit": "bits", "q_group_size": "group_size"}


def parse_quantization_config(config: dict[str, Any]) -> tuple[Int4Checkpoint, list[str]]:
    """A GPTQ or AWQ ``quantization_config`` -> its checked keys and the keys ignored (those of the
    quantizer's run that do not change the tensors, e.g. ``damp_percent``, ``true_sequential``)."""
    method = str(config.get("quant_method", "")).lower()
    if method == "gptq":
        schema, naming = GPTQQuantization, GPTQ_NAMING
    elif method == "awq":
        schema, naming = AWQQuantization, AWQ_NAMING
        config = {_AWQ_ALIASES.get(k, k): v for k, v in config.items()}
        if isinstance(config.get("version"), str):
            config["version"] = config["version"].lower()  # AutoAWQ writes "GEMM" in quant_config.json
    else:
        raise ValueError(f"quantization_config.quant_method={config.get('quant_method')!r} is neither 'gptq' nor 'awq'")
    known = set(field_names(schema))
    ignored = sorted(k for k in config if k not in known)
    values = {k: v for k, v in config.items() if k in known}
    values["quant_method"] = method
    return parse(schema, values, naming), ignored


def tensor_shapes(spec: Int4Checkpoint, in_features: int, out_features: int) -> dict[str, tuple[int, ...]]:
    """The shapes of one linear's checkpoint tensors (``g_idx``: GPTQ only)."""
    K, N = in_features, out_features
    groups = 1 if spec.group_size == -1 else K // spec.group_size
    shapes = {
        "qweight": (K // PER_INT32, N) if spec.layout == "gptq" else (K, N // PER_INT32),
        "qzeros": (groups, N // PER_INT32),
        "scales": (groups, N),
    }
    if spec.layout == "gptq":
        shapes["g_idx"] = (K,)
    return shapes


def check_layer(spec: Int4Checkpoint, in_features: int, out_features: int, name: str) -> int:
    """The effective group size of a layer (or of one tensor-parallel slice of it); an error naming
    ``name`` when the group does not divide K, K is not a multiple of 32 or N of 8."""
    K, N, G = in_features, out_features, spec.group_size
    G = K if G == -1 else G
    if K % G:
        raise ValueError(f"{spec.layout} layer {name}: group_size={spec.group_size} does not divide its in_features "
                         f"K={K}; {_SERVE_OTHERWISE}")  # fmt: skip
    if K % 32:
        raise ValueError(f"{spec.layout} layer {name}: in_features K={K} is not a multiple of 32, which the low-bit "
                         f"kernels need; {_SERVE_OTHERWISE}")  # fmt: skip
    if N % PER_INT32:
        raise ValueError(f"{spec.layout} layer {name}: out_features N={N} is not a multiple of 8 (qzeros packs 8 per "
                         f"int32); the checkpoint is not a {spec.layout} checkpoint")  # fmt: skip
    return G


def check_g_idx(g_idx: torch.Tensor, group_size: int, name: str, k_offset: int = 0) -> None:
    """Refuses a ``g_idx`` (GPTQ's group of each input feature, here of features ``k_offset..``) that
    is not ``k // group_size``: an activation-order permutation, which the packed groups cannot
    follow. ``group_size`` -1: every feature in group 0."""
    if g_idx.dim() != 1 or g_idx.dtype.is_floating_point or g_idx.dtype == torch.bool:
        raise ValueError(f"GPTQ tensor {name} must be a 1-D integer tensor [in_features], got {g_idx.dtype} "
                         f"{tuple(g_idx.shape)}")  # fmt: skip
    k = torch.arange(k_offset, k_offset + g_idx.numel(), dtype=torch.int64)
    expect = torch.zeros_like(k) if group_size == -1 else k // group_size
    bad = (g_idx.to(torch.int64) != expect).nonzero()
    if bad.numel():
        i = int(bad[0, 0])
        raise ValueError(
            f"GPTQ tensor {name} is an activation-order grouping (g_idx[{i + k_offset}]={int(g_idx[i])}, not "
            f"{int(expect[i])} = k // group_size): aipc-plugins reads GPTQ only with groups in input order; "
            f"quantize with desc_act false, or desc_act true with static_groups true (which keeps g_idx in order)"
        )


def unpack_int32(packed: torch.Tensor, dim: int, order: Optional[tuple[int, ...]] = None) -> torch.Tensor:
    """int32 tensor of 8 4-bit values each, packed along ``dim`` (0 or 1 of a 2-D tensor) -> uint8
    values, that dim 8 times longer; ``order[j]``: where the value at bits ``4*j`` goes in its 8
    (default: in bit order)."""
    slots = [((packed >> (BITS * j)) & 0xF).to(torch.uint8) for j in range(PER_INT32)]
    if order is not None:
        slots = [slots[order.index(i)] for i in range(PER_INT32)]
    return torch.stack(slots, dim=dim + 1).flatten(dim, dim + 1)


def _check(t: Optional[torch.Tensor], name: str, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...], what: str) -> torch.Tensor:
    if t is None:
        raise ValueError(f"checkpoint is missing tensor {name}")
    if t.dtype not in dtypes:
        raise ValueError(f"checkpoint tensor {name} has dtype {t.dtype}, expected {' or '.join(map(str, dtypes))} ({what})")
    if tuple(t.shape) != shape:
        raise ValueError(f"checkpoint tensor {name} has shape {tuple(t.shape)}, expected {shape} ({what})")
    return t


def read_linear(spec: Int4Checkpoint, tensors: dict[str, Optional[torch.Tensor]], name: str, k_offset: int = 0) -> LowBitWeight:
    """One linear's checkpoint tensors (``qweight``, ``qzeros``, ``scales``, GPTQ's optional ``g_idx``;
    a tensor-parallel slice of them, starting at input feature ``k_offset``) -> the exact
    :class:`LowBitWeight`. ``name``: the layer's checkpoint prefix, for the errors."""
    qweight = tensors.get("qweight")
    if qweight is None:
        raise ValueError(f"checkpoint is missing tensor {name}.qweight")
    if qweight.dtype != torch.int32 or qweight.dim() != 2:
        raise ValueError(f"checkpoint tensor {name}.qweight has dtype {qweight.dtype} and shape {tuple(qweight.shape)}, "
                         f"expected a 2-D torch.int32 tensor (4-bit values packed 8 per int32)")  # fmt: skip
    gptq = spec.layout == "gptq"
    K, N = (qweight.shape[0] * PER_INT32, qweight.shape[1]) if gptq else (qweight.shape[0], qweight.shape[1] * PER_INT32)
    G = check_layer(spec, K, N, name)
    shapes = tensor_shapes(spec, K, N)
    what = f"{spec.layout}, group_size={spec.group_size}, in_features={K}, out_features={N}"
    qzeros = _check(tensors.get("qzeros"), f"{name}.qzeros", shapes["qzeros"], (torch.int32,), what)
    scales = _check(tensors.get("scales"), f"{name}.scales", shapes["scales"], tuple(SCALE_DTYPES.values()), what)
    if not torch.isfinite(scales).all():
        raise ValueError(f"checkpoint tensor {name}.scales holds NaN or Inf")
    if gptq and tensors.get("g_idx") is not None:
        g_idx = _check(tensors["g_idx"], f"{name}.g_idx", shapes["g_idx"], (torch.int32, torch.int64), what)
        check_g_idx(g_idx, spec.group_size, f"{name}.g_idx", k_offset)
    elif gptq and spec.desc_act:
        raise ValueError(f"checkpoint is missing tensor {name}.g_idx, which desc_act true needs")
    if gptq:
        codes = unpack_int32(qweight, 0)  # [K, N]
        zeros = unpack_int32(qzeros, 1).to(torch.int16) + spec.zero_offset  # [K/G, N]
        if spec.sym and not bool((zeros == 8).all()):
            g, n = (zeros != 8).nonzero()[0].tolist()
            raise ValueError(f"checkpoint tensor {name}.qzeros holds the zero point {int(zeros[g, n])} (group {g}, "
                             f"column {n}) in a sym: true checkpoint, where every zero point is 8: the tensors do not "
                             f"match their quantization_config")  # fmt: skip
    else:
        codes = unpack_int32(qweight, 1, AWQ_ORDER)
        zeros = unpack_int32(qzeros, 1, AWQ_ORDER).to(torch.int16)
    return int4_weight(codes, zeros, scales, G, name)


def int4_weight(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group_size: int, name: str) -> LowBitWeight:
    """Codes ``[K, N]`` (0..15), integer zero points and scales ``[K/G, N]`` (the checkpoints' K-major
    layout) -> ``int4`` when every zero point is 8, else ``affine4`` (zeros in the scales' dtype)."""
    K = codes.shape[0]
    qweight = pack_codes(codes.t().contiguous(), BITS)
    s = scales.t().contiguous()
    if bool((zeros == 8).all()):
        return LowBitWeight(qweight, s, None, "int4", group_size, K, name=name)
    return LowBitWeight(qweight, s, zeros.t().to(s.dtype).contiguous(), "affine4", group_size, K, name=name)


__all__ = [
    "AWQ_ORDER", "AWQQuantization", "GPTQQuantization", "Int4Checkpoint", "check_g_idx", "check_layer",
    "int4_weight", "parse_quantization_config", "read_linear", "tensor_shapes", "unpack_int32",
]  # fmt: skip
