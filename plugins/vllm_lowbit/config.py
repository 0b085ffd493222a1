"""``lowbit2`` as a vLLM quantization method: the :class:`LowBit2Config` registered with
``register_quantization_config``. Importing this module performs the registration (done by
:func:`vllm_lowbit.register`, vLLM's ``general_plugins`` hook).

Two ways in, one config:

* ``vllm serve BF16_MODEL --quantization lowbit2``: the checkpoint has no quantization config, vLLM
  builds ``LowBit2Config()`` (defaults) and every linear layer is quantized while it loads, layer by
  layer on the meta device (vLLM's online-quantization mechanism). Parameters through
  ``--hf-overrides '{"quantization_config": {"quant_method": "lowbit2", "group_size": 128}}'``.
* ``vllm serve LOWBIT2_MODEL``: a checkpoint written by ``python -m vllm_lowbit.quantize`` carries
  ``quantization_config`` with ``quant_method: lowbit2`` and ``prequantized: true``; vLLM picks the
  method from it (no flag needed) and loads the packed codes and group scales, sharded for TP.
  An ``--hf-overrides`` quantization_config updates its config instead of replacing it
  (:meth:`LowBit2Config.maybe_update_config`), so it stays prequantized.

Config keys (``quantization_config`` of config.json, ``--hf-overrides`` or a JSON file given as
``--hf-overrides '{"quantization_config_file": "PATH"}'``): ``codebook`` (affine, int2, sym, ternary,
binary), ``group_size`` (32, 64, 128 or -1 for one group per row), ``quantizer`` (optimized, rtn;
on-the-fly only), ``scale_dtype`` (float16, bfloat16), ``act_group`` (0: one int8 activation scale
per token; else per K-group), ``modules_to_not_convert`` (name fragments that stay unquantized;
the embeddings stay unquantized), ``lm_head`` (the output projection, quantized at load: ``int8``
per output channel by default, ``lowbit`` with the keys above, ``float`` to keep it; decode of small
models is dominated by it; ``quantize_lm_head``, the older key: true is ``lowbit``), ``activations`` (``int8``: W*A8, the
default; ``float``: 4-bit code books on the activation-exact W4A16 kernels), ``detect_grid``
(default true; on-the-fly only: a layer whose weights already lie on a binary, ternary or 2-bit
grid, e.g. a ParetoQ checkpoint stored as bf16, is stored exactly in the matching code book with
one scale per row instead of being quantized; false quantizes every layer with the keys above),
``allow_2bit_ptq`` (default false; on-the-fly only: a layer on no grid with a 1- or 2-bit code book
is refused at load, since 2-bit post-training quantization turns a real trained model into noise
(:mod:`aipc_kernels.quality_gate`); true quantizes it anyway), ``prequantized``, ``layer_formats``
(written by the converter: checkpoint layer name -> ``{codebook, group_size, scale_dtype}`` for the
layers it recovered from a grid or whose K the configured group does not divide).
A ``group_size`` that does not divide a layer's K falls back, on the fly, to the largest supported
group that does (logged once per K).
Their types, choices and ranges are declared once in :mod:`vllm_lowbit.options`.
"""
from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any, Optional

import torch
from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase
from vllm.model_executor.layers.quantization.utils.quant_utils import is_layer_skipped
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

from aipc_kernels.config_schema import to_dict
from aipc_kernels.modules import DEFAULT_SKIP
from aipc_kernels.output_projection import head_act_group

from . import PLUGIN_NAME
from .linear_method import LoadReport, LowBit2LinearMethod, LowBit2OnlineLinearMethod, QuantizedLMHeadMethod
from .options import (CHECKPOINT_KEYS, CHECKPOINT_SCALE_DTYPES, CONFIG_NAMING, GGUF_SOURCE, QuantizationConfigOptions,
                      parse_quantization_config, quantization_config_dict)  # fmt: skip

#: --hf-overrides keys that carry a quantization_config in a file or a JSON string
OVERRIDE_FILE_KEYS = ("quantization_config_file", "quantization_config_dict_json")


@register_quantization_config(PLUGIN_NAME)
class LowBit2Config(QuantizationConfig):
    """2-bit (and 1-bit) group-quantized weights in the shared ``lowbit2`` format, W2A8 on CPU.

    Built from ``quantization_config`` keys (``LowBit2Config(**keys)``, :meth:`from_config`), all
    checked by :class:`vllm_lowbit.options.QuantizationConfigOptions`: exact types, choices, ranges."""

    #: how errors about this method's quantization_config name a key
    naming = CONFIG_NAMING

    def __init__(self, /, **config: Any) -> None:
        super().__init__()
        self._given = dict(config)  # the keys as vLLM passed them (see maybe_update_config)
        self._apply(parse_quantization_config(config, self.naming))
        self.grid_report = LoadReport(self.get_name())  # on the fly: grid layers and reconstruction error (one log)
        self.group_fallbacks: set[tuple[int, int]] = set()  # (K, group) already logged

    def _apply(self, o: QuantizationConfigOptions) -> None:
        self.options = o
        self.codebook = o.codebook
        self.group_size = o.group_size
        self.quantizer = o.quantizer
        self.scale_dtype_name = o.scale_dtype
        self.scale_dtype = CHECKPOINT_SCALE_DTYPES[o.scale_dtype]
        self.act_group = o.act_group
        self.activations = o.activations
        self.modules_to_not_convert = list(o.modules_to_not_convert)
        self.prequantized = o.prequantized
        self.head_format = o.head_format
        self.detect_grid = o.detect_grid
        self.allow_2bit_ptq = o.allow_2bit_ptq
        self.layer_formats = dict(o.layer_formats)

    def __repr__(self) -> str:
        return (
            f"LowBit2Config(codebook={self.codebook}, group_size={self.group_size}, "
            f"{'prequantized' if self.prequantized else 'on-the-fly ' + self.quantizer}, "
            f"scale_dtype={self.scale_dtype_name}, act_group={self.act_group}, activations={self.activations}, "
            f"modules_to_not_convert={self.modules_to_not_convert}, lm_head={self.head_format}, "
            f"detect_grid={self.detect_grid}, allow_2bit_ptq={self.allow_2bit_ptq})"
        )

    # ------------------------------------------------------------------ vLLM interface

    @classmethod
    def get_name(cls) -> str:
        return PLUGIN_NAME

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0  # no CUDA-capability requirement: CPU native kernel, reference/Triton elsewhere

    @staticmethod
    def get_config_filenames() -> list[str]:
        # Empty: without a quantization_config in config.json (a bf16/fp16 checkpoint) vLLM builds
        # LowBit2Config() and the weights are quantized on the fly.
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "LowBit2Config":
        """A ``quantization_config`` dict (config.json or ``--hf-overrides``); errors name the key."""
        if not isinstance(config, dict):
            parse_quantization_config(config, cls.naming)  # raises: must be a JSON object
        if config.get("quant_method") == "":  # vLLM's model_arch_config writes "" for a missing quant_method
            config = {k: v for k, v in config.items() if k != "quant_method"}
        return cls(**config)

    @classmethod
    def from_config_file(cls, path: str) -> "LowBit2Config":
        """``--hf-overrides '{"quantization_config_file": PATH}'``: a JSON file of config keys."""
        return cls.from_config(_read_json("quantization_config_file", path, from_file=True))

    @classmethod
    def from_config_dict_json(cls, text: str) -> "LowBit2Config":
        """``--hf-overrides '{"quantization_config_dict_json": "{...}"}'``."""
        return cls.from_config(_read_json("quantization_config_dict_json", text, from_file=False))

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg, user_quant, hf_config=None) -> Optional[str]:
        """A checkpoint with ``quant_method: lowbit2`` selects this method without ``--quantization``;
        so does a converted checkpoint whose ``quantization_config`` an ``--hf-overrides`` without
        ``quant_method`` replaced (the checkpoint's own config.json says what its tensors are)."""
        if user_quant not in (None, PLUGIN_NAME):
            return None
        method = hf_quant_cfg.get("quant_method")
        if method == PLUGIN_NAME:
            return PLUGIN_NAME
        if not method and hf_config is not None and _is_converted(
            _checkpoint_quantization_config(getattr(hf_config, "name_or_path", ""), None)
        ):  # fmt: skip
            return PLUGIN_NAME
        return None

    def maybe_update_config(self, model_name: str, hf_config: Any = None, revision: Optional[str] = None) -> None:
        """Reconciles this config with the checkpoint's own (vLLM calls it once the config is built).

        vLLM's ``--hf-overrides '{"quantization_config": {...}}'`` replaces the checkpoint's whole
        ``quantization_config``, and ignores ``quantization_config_file`` when the checkpoint has one.
        For a checkpoint converted by ``python -m vllm_lowbit.quantize`` the override instead updates
        the checkpoint's own config.json entry: it may set ``act_group`` and ``lm_head``, and a
        value that differs from what the tensors were written with (:data:`~vllm_lowbit.options.
        CHECKPOINT_KEYS`: code book, group size, scale dtype, modules kept unquantized,
        ``prequantized``) is refused, naming the key. ``prequantized: true`` for a checkpoint that was
        not converted is refused too."""
        stored = _checkpoint_quantization_config(model_name, revision)
        override = _override_from_hf_config(hf_config) if stored is not None else None
        if override is None and stored is not None and self._given != stored:
            override = self._given
        converted = stored if _is_converted(stored) else None
        if override is not None:
            config = _merge_with_checkpoint(parse_quantization_config(converted), override) if converted else override
            self._given = config
            self._apply(parse_quantization_config(config, self.naming))
        if self.prequantized and converted is None:
            raise ValueError(
                f"{CONFIG_NAMING.setting('prequantized', True)}, but {model_name} is not a checkpoint converted by "
                f"python -m vllm_lowbit.quantize (its config.json has no quantization_config with quant_method "
                f"{PLUGIN_NAME!r} and prequantized true); drop prequantized to quantize its weights while they "
                f"load, or convert it first: python -m vllm_lowbit.quantize {model_name} OUT_DIR"
            )

    def to_dict(self) -> dict[str, Any]:
        """The ``quantization_config`` entry that describes this config in a checkpoint."""
        d = quantization_config_dict(
            self.codebook, self.group_size, self.quantizer, self.scale_dtype_name, self.act_group,
            self.modules_to_not_convert, self.prequantized, self.options.source, self.layer_formats,
            lm_head=None if self.head_format == "int8" else self.head_format,
        )  # fmt: skip
        if not self.detect_grid:
            d["detect_grid"] = False
        if self.allow_2bit_ptq:
            d["allow_2bit_ptq"] = True
        return d

    def is_skipped(self, prefix: str) -> bool:
        """Whether the linear layer ``prefix`` stays unquantized (``modules_to_not_convert``)."""
        skip = list(DEFAULT_SKIP) + self.modules_to_not_convert
        return is_layer_skipped(prefix, skip, self.packed_modules_mapping, match_mode="substring")

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> Optional[QuantizeMethodBase]:
        if isinstance(layer, ParallelLMHead) and self.head_format != "float":
            return QuantizedLMHeadMethod(
                head_act_group(self.head_format, self.act_group), head_format=self.head_format,
                codebook=self.codebook, group_size=self.group_size, quantizer=self.quantizer, scale_dtype=self.scale_dtype,
            )  # fmt: skip
        if not isinstance(layer, LinearBase):
            return None  # embeddings (and lm_head: float) stay in the model dtype
        if self.is_skipped(prefix):
            return UnquantizedLinearMethod()
        if self.prequantized:
            return LowBit2LinearMethod(self.for_layer(prefix))
        self.grid_report.expect(prefix)
        return LowBit2OnlineLinearMethod(self)

    def for_layer(self, prefix: str) -> "LowBit2Config":
        """This config with the ``layer_formats`` entry of layer ``prefix`` (of every checkpoint
        layer merged into it: q/k/v, gate/up) as its code book, group size and scale dtype."""
        parent, _, last = prefix.rpartition(".")
        parts = self.packed_modules_mapping.get(last) or [last]
        names = [f"{parent}.{p}" if parent else p for p in parts]
        formats = [self.layer_formats.get(n) for n in names]
        if any(f != formats[0] for f in formats):
            raise ValueError(
                f"{CONFIG_NAMING.key('layer_formats')} gives the layers {names}, which vLLM loads as one merged "
                f"layer {prefix!r}, different formats {formats}; convert the model again with python -m "
                f"vllm_lowbit.quantize (it gives merged layers one format)"
            )
        if formats[0] is None and self.options.source != GGUF_SOURCE:
            return self
        layer = copy.copy(self)
        if formats[0] is not None:
            layer.codebook, layer.group_size = formats[0]["codebook"], formats[0]["group_size"]
            layer.scale_dtype_name = formats[0]["scale_dtype"]
            layer.scale_dtype = CHECKPOINT_SCALE_DTYPES[layer.scale_dtype_name]
        if self.options.source == GGUF_SOURCE and layer.act_group and layer.group_size != -1:
            # as serving the GGUF file does (gguf_cpu.GGUFCPUConfig.layer_act_group): a layer whose group is
            # larger than act_group (TQ1_0 / TQ2_0: 128) takes its group
            layer.act_group = math.lcm(layer.act_group, layer.group_size)
        return layer


# ---------------------------------------------------------------------- the checkpoint's own config


def _read_json(key: str, source: str, from_file: bool) -> Any:
    """``--hf-overrides`` ``quantization_config_file`` (a path) or ``quantization_config_dict_json``
    (JSON text) -> its value; errors name the key and the file."""
    try:
        if from_file:
            with open(source) as f:
                return json.load(f)
        return json.loads(source)
    except OSError as e:
        raise ValueError(f"{CONFIG_NAMING.owner}: cannot read {key}={source!r}: {e.strerror}; pass an existing JSON file") from None
    except (TypeError, json.JSONDecodeError) as e:
        raise ValueError(f"{CONFIG_NAMING.owner}: {key}={source!r} is not valid JSON ({e}); write a JSON object "
                         f'such as {{"quant_method": "{PLUGIN_NAME}", "group_size": 64}}') from None  # fmt: skip


def _checkpoint_quantization_config(model: str, revision: Optional[str]) -> Optional[dict[str, Any]]:
    """The ``quantization_config`` of ``model``'s own config.json (before ``--hf-overrides``), or None."""
    path = Path(model) / "config.json"
    try:
        if path.is_file():
            config = json.loads(path.read_text())
        else:  # a Hub id: vLLM has fetched config.json already
            from vllm.transformers_utils.repo_utils import get_hf_file_to_dict

            config = get_hf_file_to_dict("config.json", model, revision) or {}
    except (OSError, ValueError):
        return None
    q = config.get("quantization_config") if isinstance(config, dict) else None
    return q if isinstance(q, dict) else None


def _is_converted(stored: Optional[dict[str, Any]]) -> bool:
    """Whether a checkpoint's quantization_config is the converter's (packed lowbit2 tensors)."""
    return bool(stored) and stored.get("quant_method") == PLUGIN_NAME and stored.get("prequantized") is True


def _override_from_hf_config(hf_config: Any) -> Optional[dict[str, Any]]:
    """The keys of ``--hf-overrides`` ``quantization_config_file`` / ``quantization_config_dict_json``
    (vLLM sets them as config attributes; it reads them only when the checkpoint has no quantization_config)."""
    for key in OVERRIDE_FILE_KEYS:
        value = getattr(hf_config, key, None)
        if value is not None:
            config = _read_json(key, value, from_file=key.endswith("_file"))
            parse_quantization_config(config)  # type errors name the key before the merge
            return config
    return None


def _merge_with_checkpoint(checkpoint: QuantizationConfigOptions, override: dict[str, Any]) -> dict[str, Any]:
    """The converted checkpoint's config updated by ``override``; raises when the override changes a
    key the checkpoint's tensors fix."""
    stored = to_dict(checkpoint)
    fixed = {k: v for k, v in stored.items() if k in CHECKPOINT_KEYS}
    for key, value in override.items():
        if key in fixed and not (type(value) is type(fixed[key]) and value == fixed[key]):
            raise ValueError(
                f"{CONFIG_NAMING.setting(key, value)} conflicts with the converted checkpoint, whose tensors were "
                f"written with {key}={fixed[key]!r}; drop {key!r} from --hf-overrides (the checkpoint's value is "
                f"used), or convert the original model again with python -m vllm_lowbit.quantize to change it"
            )
    return {**stored, **override, **fixed}


__all__ = ["LowBit2Config"]
