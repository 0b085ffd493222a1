"""The ``lowbit2`` / ``lowbit4`` options, declared once for the server and the converter (no vLLM import).

:class:`LowBit2Options` holds what both take (code book, group size, quantizer, scale dtype,
activation groups, modules kept unquantized, grid detection); :class:`QuantizationConfigOptions` is
the whole ``quantization_config`` entry (config.json, ``--hf-overrides``, ``quantization_config_file``),
with the per-layer :class:`LayerFormat` of ``layer_formats``: the one frozen object a config keeps as
``options`` (:class:`vllm_lowbit.layers.LowBitConfig`) and its methods read (``config.options.group_size``);
:class:`ConverterOptions` adds the converter's ``--threads``. All are checked by
:func:`aipc_kernels.core.config_schema.parse`: exact types, choices, ranges, and ``act_group`` against
``group_size``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

from aipc_kernels.core.config_schema import Naming, field_names, option, parse, to_dict
import torch

from aipc_kernels.lowbit.formats import CODEBOOKS, FILE_GROUP_SIZES, FORMAT_NAME, FORMAT_VERSION, GROUP_SIZES, SCALE_DTYPES
from aipc_kernels.lowbit.output_projection import DEFAULT_HEAD_FORMAT, HEAD_CHOICES
from aipc_kernels.lowbit.progressive import CODEBOOKS as PROGRESSIVE_CODEBOOKS
from aipc_kernels.lowbit.progressive import LAYER_QUANTIZERS
from aipc_kernels.lowbit.progressive import QUANTIZER as PROGRESSIVE

#: errors about a quantization_config (config.json, --hf-overrides, quantization_config_file)
CONFIG_NAMING = Naming(f"{FORMAT_NAME} quantization_config", "json")
#: errors about the converter's command-line options
CLI_NAMING = Naming("python -m vllm_lowbit.quantize", "cli")
#: the code books a config may name: the min form (min2 / min4 / min8) holds GGUF's blocks, which
#: vllm_lowbit.gguf serves from the file as they are
CONFIG_CODEBOOKS = tuple(sorted(name for name, cb in CODEBOOKS.items() if not cb.mins))
#: what quantizing float weights may give: :data:`CONFIG_CODEBOOKS`, and with ``quantizer: progressive`` the
#: progressive two-level form's min2 / min4 (:mod:`aipc_kernels.lowbit.progressive`: a float16 scale per row,
#: int8 group scales and mins; stored per layer as the two-level form, ``layer_formats`` with ``super_block``)
QUANTIZE_CODEBOOKS = tuple(sorted(CONFIG_CODEBOOKS + PROGRESSIVE_CODEBOOKS))
#: what a checkpoint converted from a GGUF file (``source: gguf``, written by
#: :mod:`vllm_lowbit.gguf_convert`) may also store: the min form, GGUF's K-quant sub-blocks of 16 and their
#: float32 scales. Never offered for quantizing float weights (the converter's options and on-the-fly
#: quantization keep :data:`CONFIG_CODEBOOKS`, :data:`~aipc_kernels.lowbit.formats.GROUP_SIZES`, ``SCALE_DTYPES``).
GGUF_SOURCE = "gguf"
CHECKPOINT_CODEBOOKS = tuple(sorted(CODEBOOKS))
CHECKPOINT_GROUP_SIZES = FILE_GROUP_SIZES + (-1,)
#: scale dtypes by name, float32 included, and int8: the two-level form of GGUF's K-quants (int8 sub-block scales
#: and mins times float32 super-block scales, the layer's ``supers``; ``super_block`` says over how many
#: inputs) (``source: gguf`` checkpoints only)
CHECKPOINT_SCALE_DTYPES: dict[str, torch.dtype] = {**SCALE_DTYPES, "float32": torch.float32, "int8": torch.int8}
#: the super-block sizes (inputs per float32 super-block scale) of the two-level form: the K-quants' 256
SUPER_BLOCKS = (256,)
#: the ``layer_formats`` names under which a GGUF conversion stores its token embedding and an untied output
#: projection packed (their Hugging Face names, every architecture it converts), and ``lm_head``'s value for an
#: output projection served as stored (untied: its own tensors; tied: the embedding's): ``source: gguf`` only
STORED_EMBEDDING = "model.embed_tokens"
STORED_HEAD = "lm_head"
STORED = "stored"

#: errors about convert_checkpoint's keyword arguments
API_NAMING = Naming("convert_checkpoint", "python")


def _check_two_level(scale_dtype: str, super_block: Optional[int], naming: Naming) -> None:
    """The two-level form (a GGUF conversion's K-quants, the progressive form): ``scale_dtype`` int8 exactly
    when ``super_block`` is given."""
    if super_block is not None and scale_dtype != "int8":
        raise naming.error(
            "super_block", super_block,
            f"needs {naming.ref('scale_dtype')}=int8 (the two-level form: a GGUF conversion's K-quants, or the "
            f"progressive form), not {scale_dtype!r}; drop super_block, or convert the model again",
        )  # fmt: skip
    if scale_dtype == "int8" and super_block is None:
        raise naming.error("scale_dtype", scale_dtype, f"(the two-level form) needs {naming.ref('super_block')} "
                           f"(inputs per super-block scale, e.g. {SUPER_BLOCKS[0]}); convert the model again")  # fmt: skip


@dataclass(frozen=True)
class LowBit2Options:
    """How weights are quantized: the options the converter and the server share."""

    codebook: str = option("affine", choices=QUANTIZE_CODEBOOKS)
    group_size: int = option(64, choices=GROUP_SIZES + (-1,), note="-1: one group per row")
    #: ``progressive``: the progressive two-level form (codebook min2 / min4), whose int8 levels the CPU
    #: kernels accumulate in int32 over the whole K (prefill, AMX above all) and the GPU's ``progressive`` kernel
    quantizer: str = option("optimized", choices=LAYER_QUANTIZERS)
    scale_dtype: str = option("float16", choices=tuple(SCALE_DTYPES))
    act_group: int = option(0, ge=0, example=64)
    modules_to_not_convert: list[str] = option([], example=["lm_head"])
    #: layers whose float weights already lie on a binary/ternary/2-bit grid are stored exactly
    #: (aipc_kernels.checkpoints.grid_detect) instead of being quantized with the options above
    detect_grid: bool = option(True)
    #: quantize float weights that lie on no grid to a 1- or 2-bit code book anyway (refused by default:
    #: :mod:`aipc_kernels.lowbit.quality_gate` says what that does to a real trained model)
    allow_2bit_ptq: bool = option(False)

    def check(self, naming: Naming) -> None:
        """``act_group``: 0 (one int8 activation scale per token) or a multiple of ``group_size``; the
        progressive form's code books with its quantizer only, and its float16 scales."""
        progressive_codebook = self.codebook in PROGRESSIVE_CODEBOOKS
        if self.quantizer == PROGRESSIVE and not progressive_codebook:
            raise naming.error(
                "quantizer", self.quantizer,
                f"gives the progressive two-level form, {naming.ref('codebook')} {' or '.join(PROGRESSIVE_CODEBOOKS)} "
                f"(2- / 4-bit codes, an integer scale and min per group, a float16 scale per row); {self.codebook!r} "
                f"is not one: give codebook {PROGRESSIVE_CODEBOOKS[-1]!r}, or another quantizer",
            )  # fmt: skip
        if progressive_codebook and self.quantizer != PROGRESSIVE:
            raise naming.error(
                "codebook", self.codebook,
                f"is the progressive two-level form's code book: it needs {naming.ref('quantizer')}={PROGRESSIVE!r} "
                f"(the quantizer {self.quantizer!r} fits float group scales: use affine / affine4 with it)",
            )  # fmt: skip
        if self.quantizer == PROGRESSIVE and self.scale_dtype != "float16":
            raise naming.error(
                "scale_dtype", self.scale_dtype,
                f"does not apply with {naming.ref('quantizer')}={PROGRESSIVE!r}: its row scales hold float16 values and "
                f"its group scales and mins are int8; drop scale_dtype (float16)",
            )  # fmt: skip
        if self.act_group and self.group_size != -1 and self.act_group % self.group_size:
            raise naming.error(
                "act_group", self.act_group,
                f"must be 0 (per token) or a multiple of {naming.ref('group_size')}={self.group_size}, "
                f"e.g. {self.group_size}",
            )  # fmt: skip


@dataclass(frozen=True)
class LayerFormat:
    """One entry of ``layer_formats``: how a converted checkpoint stores that layer (all keys required)."""

    codebook: str = option(None, choices=CONFIG_CODEBOOKS)
    group_size: int = option(None, choices=GROUP_SIZES + (-1,), note="-1: one group per row")
    scale_dtype: str = option(None, choices=tuple(SCALE_DTYPES))


@dataclass(frozen=True)
class ProgressiveLayerFormat(LayerFormat):
    """A ``layer_formats`` entry of a checkpoint quantized with ``quantizer: progressive``: also the form's
    min2 / min4 codes with int8 group scales and the row scale repeated per ``super_block`` inputs (the
    canonical two-level form, :func:`aipc_kernels.lowbit.progressive.super_block`; a fallback group or a
    grid layer keeps :class:`LayerFormat`'s keys)."""

    codebook: str = option(None, choices=QUANTIZE_CODEBOOKS)
    scale_dtype: str = option(None, choices=tuple(SCALE_DTYPES) + ("int8",))
    #: the two-level form (``scale_dtype: int8``): inputs per row-scale entry (tensor ``supers``)
    super_block: Optional[int] = option(None, ge=1, example=2048)


@dataclass(frozen=True)
class GGUFLayerFormat(LayerFormat):
    """A ``layer_formats`` entry of a checkpoint converted from a GGUF file: also the min form, GGUF's
    K-quant sub-blocks of 16, their float32 scales, and their two levels (``scale_dtype: int8`` with
    ``super_block``)."""

    codebook: str = option(None, choices=CHECKPOINT_CODEBOOKS)
    group_size: int = option(None, choices=CHECKPOINT_GROUP_SIZES, note="-1: one group per row")
    scale_dtype: str = option(None, choices=tuple(CHECKPOINT_SCALE_DTYPES))
    #: the two-level form (``scale_dtype: int8``): inputs per float32 super-block scale (tensor ``supers``)
    super_block: Optional[int] = option(None, choices=(None,) + SUPER_BLOCKS)


@dataclass(frozen=True)
class QuantizationConfigOptions(LowBit2Options):
    """The ``quantization_config`` entry of a ``lowbit2`` checkpoint or ``--hf-overrides``."""

    quant_method: str = option(FORMAT_NAME, choices=(FORMAT_NAME,))
    format_version: int = option(FORMAT_VERSION, ge=1)
    prequantized: bool = option(False)
    #: the output projection: ``auto`` (the default: ``int6`` where the CPU kernels run with AVX2 / AVX-VNNI and
    #: no AVX-512, else ``int8``), ``int8`` (one scale per output channel), ``int6`` (6-bit codes in groups of 32,
    #: as a GGUF's Q6_K head), ``lowbit`` (the code book and group of the linears) or ``float`` (the model
    #: dtype); embeddings stay a float gather, except in a GGUF conversion (``stored``, below)
    lm_head: str = option(DEFAULT_HEAD_FORMAT, choices=HEAD_CHOICES)
    #: before ``lm_head``: true is ``lm_head: lowbit``, false is ``lm_head: float``
    quantize_lm_head: Optional[bool] = option(None)
    #: the linears' activations: ``int8`` (W*A8, quantized inside the kernel) or ``float`` (4-bit code books
    #: only: the activation-exact W4A16 kernels, ``aipc::lowbit_linear_a16``; the codes dequantized as the CPU
    #: kernel runs fastest, an int conversion on AVX2 and E0M4 elsewhere); layers
    #: that ``detect_grid`` stores in a 1-/2-bit code book and the output projection stay W*A8
    activations: str = option("int8", choices=("int8", "float"))
    #: what the converter read: a BitNet checkpoint, or a GGUF file (its blocks re-laid out exactly: the
    #: only checkpoints that may store the min form, groups of 16 and float32 scales; int8 activation
    #: groups widened per layer to the layer's group where that is larger, as serving the GGUF does)
    source: Optional[str] = option(None, choices=(None, "bitnet", GGUF_SOURCE))
    #: checkpoint layer name -> LayerFormat keys, overriding codebook/group_size/scale_dtype for it
    #: (the converter writes it for layers recovered from a grid)
    layer_formats: dict[str, Any] = option({}, example={"model.layers.0.mlp.up_proj": {
        "codebook": "sym", "group_size": -1, "scale_dtype": "float16"}})  # fmt: skip
    #: the two-level form of a GGUF conversion's K-quants (``scale_dtype: int8``): inputs per float32
    #: super-block scale, the layer's ``supers`` tensor (``source: gguf`` only; None: one level)
    super_block: Optional[int] = option(None, choices=(None,) + SUPER_BLOCKS)

    @property
    def head_setting(self) -> str:
        """The output projection's setting (``auto`` or a format: :func:`~aipc_kernels.lowbit.output_projection.resolve_head_format`
        gives the format), ``quantize_lm_head`` (the older key) read as ``lm_head``."""
        if self.quantize_lm_head is None:
            return self.lm_head
        return "lowbit" if self.quantize_lm_head else "float"

    @property
    def torch_scale_dtype(self) -> torch.dtype:
        """``scale_dtype`` as a torch dtype."""
        return CHECKPOINT_SCALE_DTYPES[self.scale_dtype]

    def as_quantization_config(self) -> dict[str, Any]:
        """These options as the ``quantization_config`` entry of a checkpoint (:func:`quantization_config_dict`,
        the current ``format_version``; ``detect_grid`` and ``allow_2bit_ptq`` only where not the default)."""
        d = quantization_config_dict(**{k: getattr(self, k) for k in _ENTRY_KEYS},
                                     lm_head=None if self.head_setting == DEFAULT_HEAD_FORMAT else self.head_setting)  # fmt: skip
        if not self.detect_grid:
            d["detect_grid"] = False
        if self.allow_2bit_ptq:
            d["allow_2bit_ptq"] = True
        return d

    def check(self, naming: Naming) -> None:
        gguf = self.source == GGUF_SOURCE
        if not gguf:  # a GGUF conversion's layers widen act_group to their group (vllm_lowbit.lowbit2.for_layer)
            super().check(naming)
        elif type(self) is not GGUFQuantizationConfigOptions:
            raise naming.error("source", self.source, "is read by parse_quantization_config only")
        elif not self.prequantized:
            raise naming.error("source", self.source, f"marks a checkpoint converted from a GGUF file; it needs "
                                                      f"{naming.ref('prequantized')}=true")  # fmt: skip
        _check_two_level(self.scale_dtype, self.super_block, naming)
        if self.activations == "float" and CODEBOOKS[self.codebook].bits != 4:
            four = [name for name in CONFIG_CODEBOOKS if CODEBOOKS[name].bits == 4]
            raise naming.error(
                "activations", self.activations,
                f"needs a 4-bit {naming.ref('codebook')} ({four}); {self.codebook!r} has "
                f"{CODEBOOKS[self.codebook].bits}-bit codes: use activations int8",
            )  # fmt: skip
        if self.activations == "float" and self.quantizer == PROGRESSIVE:
            raise naming.error(
                "activations", self.activations,
                f"runs float activations; {naming.ref('quantizer')}={PROGRESSIVE!r} gives int8 levels that the W·A8 "
                f"kernels accumulate in int32: use activations int8, or an affine4 code book",
            )  # fmt: skip
        if self.activations == "float" and self.act_group:
            raise naming.error(
                "act_group", self.act_group,
                f"sets the int8 activation groups; with {naming.ref('activations')}=float nothing is quantized: use 0",
            )  # fmt: skip
        if self.quantize_lm_head is not None and self.lm_head != DEFAULT_HEAD_FORMAT:
            raise naming.error(
                "quantize_lm_head", self.quantize_lm_head,
                f"is the older spelling of {naming.ref('lm_head')}; give {naming.ref('lm_head')} alone",
            )  # fmt: skip
        for layer, fmt in self.layer_formats.items():
            inner = Naming(f"{naming.key('layer_formats')}[{layer!r}]", naming.style)
            parse(GGUFLayerFormat if gguf else ProgressiveLayerFormat if self.quantizer == PROGRESSIVE else LayerFormat,
                  fmt, inner)  # fmt: skip
            missing = [k for k in field_names(LayerFormat) if k not in fmt]
            if missing:
                raise naming.error("layer_formats", {layer: fmt}, f"lacks {missing}: each layer needs "
                                   f"{list(field_names(LayerFormat))}")  # fmt: skip
            _check_two_level(fmt["scale_dtype"], fmt.get("super_block"), inner)
        stored = [n for n in (STORED_EMBEDDING, STORED_HEAD) if n in self.layer_formats]
        if self.lm_head == STORED and not stored:
            raise naming.error(
                "lm_head", self.lm_head,
                f"needs {naming.ref('layer_formats')} to store the output projection ({STORED_HEAD!r}) or the token "
                f"embedding it is tied to ({STORED_EMBEDDING!r}); this checkpoint stores neither: drop lm_head",
            )  # fmt: skip
        if STORED_HEAD in stored and self.lm_head != STORED:
            raise naming.error(
                "lm_head", self.lm_head,
                f"must be {STORED!r}: {naming.ref('layer_formats')} stores the output projection ({STORED_HEAD!r}) as "
                f"the GGUF file has it; give lm_head {STORED!r}, or convert the GGUF file again",
            )  # fmt: skip
        if self.format_version > FORMAT_VERSION:
            raise naming.error(
                "format_version", self.format_version,
                f"is newer than this aipc-plugins ({FORMAT_VERSION}); upgrade aipc-plugins",
            )  # fmt: skip


@dataclass(frozen=True)
class GGUFQuantizationConfigOptions(QuantizationConfigOptions):
    """The ``quantization_config`` of a checkpoint converted from a GGUF file (``source: gguf``, written by
    :mod:`vllm_lowbit.gguf_convert`): its stored forms may also be the min form, groups of 16 and float32
    scales (:class:`GGUFLayerFormat`); never offered for quantizing float weights."""

    codebook: str = option("affine", choices=CHECKPOINT_CODEBOOKS)
    group_size: int = option(64, choices=CHECKPOINT_GROUP_SIZES, note="-1: one group per row")
    scale_dtype: str = option("float16", choices=tuple(CHECKPOINT_SCALE_DTYPES))
    #: also ``stored``: the output projection as the checkpoint stores it (:data:`STORED_HEAD`, or tied: the
    #: token embedding :data:`STORED_EMBEDDING`), the file's own blocks on the W·A8 kernels
    lm_head: str = option(DEFAULT_HEAD_FORMAT, choices=HEAD_CHOICES + (STORED,))


#: the keys of :func:`quantization_config_dict` that :meth:`QuantizationConfigOptions.as_quantization_config` passes on
_ENTRY_KEYS = ("codebook", "group_size", "quantizer", "scale_dtype", "act_group", "modules_to_not_convert", "prequantized",
               "source", "layer_formats", "super_block")  # fmt: skip
#: keys fixed by the tensors of a converted checkpoint (an override may not change them)
CHECKPOINT_KEYS = ("quant_method", "format_version", "codebook", "group_size", "quantizer", "scale_dtype",
                   "modules_to_not_convert", "prequantized", "source", "layer_formats", "super_block")  # fmt: skip


@dataclass(frozen=True)
class ConverterOptions(LowBit2Options):
    """``python -m vllm_lowbit.quantize`` options: the shared ones plus the quantizer's threads."""

    threads: Optional[int] = option(None, ge=1, example=4)


#: int8 activation scales per this many K when vLLM serves (or the converter writes) a GGUF file (0: one per
#: token). 32 is how llama.cpp's own CPU dot products quantize the activations of Q4_0 .. Q8_0 weights (Q8_0 /
#: Q8_1 blocks of 32); a layer whose group is larger (TQ1_0 / TQ2_0: 128) takes its group. llama.cpp quantizes
#: the K-quants' activations per super-block of 256 (Q8_K): the ``gguf_cpu`` key ``act_super_block``, not the
#: default, as it moves the served model away from its float weights (Gemma-3-270M Q4_K_M: KL 0.0052 against
#: 0.0019 per 32; bench/quality.py, docs/vllm_lowbit.md). On SmolLM2-135M Q4_1, 32 gives 96-98% teacher-forced
#: top-1 agreement with transformers' float model; per-token scales (0) 90% (tests/vllm_lowbit/test_gguf.py).
GGUF_ACT_GROUP = 32


def gguf_layer_act_group(act_group: int, group_size: int, super_block: Optional[int],
                         in_features: Optional[int] = None) -> int:
    """The op's ``act_group`` for a layer of a GGUF file (served, or converted): the configured ``act_group``
    (0: one int8 activation scale per token) widened to a multiple of the layer's group and, where
    ``super_block`` is given (a K-quant served with ``act_super_block``), of its super-block, as llama.cpp's Q8_K
    activations. Where ``in_features`` is not a multiple of that, the layer's group."""
    if act_group == 0:
        return 0
    a = math.lcm(act_group, group_size, super_block or 1)
    return a if in_features is None or in_features % a == 0 else group_size


def parse_quantization_config(config: dict[str, Any], naming: Naming = CONFIG_NAMING) -> QuantizationConfigOptions:
    """A ``quantization_config`` dict -> checked options (errors name ``lowbit2 quantization_config.KEY``, or
    the method's own ``naming``); ``source: gguf`` (a converted GGUF file) admits its stored forms too."""
    gguf = isinstance(config, dict) and config.get("source") == GGUF_SOURCE
    return parse(GGUFQuantizationConfigOptions if gguf else QuantizationConfigOptions, config, naming)


def quantization_config_dict(
    codebook: str,
    group_size: int,
    quantizer: str = "optimized",
    scale_dtype: str = "float16",
    act_group: int = 0,
    modules_to_not_convert: Optional[list[str]] = None,
    prequantized: bool = True,
    source: Optional[str] = None,
    layer_formats: Optional[dict[str, Any]] = None,
    lm_head: Optional[str] = None,
    super_block: Optional[int] = None,
) -> dict[str, Any]:
    """The ``quantization_config`` entry of a ``lowbit2`` checkpoint's config.json (``detect_grid``,
    ``allow_2bit_ptq``, ``lm_head`` unless given, ``quantize_lm_head`` and empty ``source``/``layer_formats``
    left out: the server's defaults apply)."""
    d = to_dict(
        parse_quantization_config(dict(
            codebook=codebook, group_size=group_size, quantizer=quantizer, scale_dtype=scale_dtype,
            act_group=act_group, modules_to_not_convert=list(modules_to_not_convert or []),
            prequantized=prequantized, source=source, layer_formats=dict(layer_formats or {}),
            **({} if lm_head is None else {"lm_head": lm_head}),
            **({} if super_block is None else {"super_block": super_block}),
        ))
    )  # fmt: skip
    d.pop("quantize_lm_head")
    if lm_head is None:
        d.pop("lm_head")
    d.pop("detect_grid")
    d.pop("allow_2bit_ptq")  # the converter's decision, taken before the tensors were written
    if source is None:
        d.pop("source")
    if not d["layer_formats"]:
        d.pop("layer_formats")
    if d["super_block"] is None:
        d.pop("super_block")
    return d


__all__ = [
    "CHECKPOINT_CODEBOOKS", "CHECKPOINT_GROUP_SIZES", "CHECKPOINT_KEYS", "CHECKPOINT_SCALE_DTYPES", "ConverterOptions",
    "GGUF_SOURCE", "GGUFLayerFormat", "ProgressiveLayerFormat", "QUANTIZE_CODEBOOKS", "STORED", "STORED_EMBEDDING", "STORED_HEAD", "SUPER_BLOCKS", "GGUFQuantizationConfigOptions", "LayerFormat", "LowBit2Options", "QuantizationConfigOptions",
    "GGUF_ACT_GROUP", "gguf_layer_act_group", "parse_quantization_config", "quantization_config_dict",
]  # fmt: skip
