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

Config keys (``quantization_config`` of config.json, ``--hf-overrides`` or a JSON file given as
``--hf-overrides '{"quantization_config_file": "PATH"}'``): ``codebook`` (affine, int2, sym, ternary,
binary), ``group_size`` (32, 64, 128 or -1 for one group per row), ``quantizer`` (optimized, rtn;
on-the-fly only), ``scale_dtype`` (float16, bfloat16), ``act_group`` (0: one int8 activation scale
per token; else per K-group), ``modules_to_not_convert`` (name fragments that stay unquantized;
``lm_head`` and the embeddings stay unquantized), ``quantize_lm_head`` (opt-in: the output
projection quantized at load too; decode of small models is dominated by it), ``prequantized``.
"""
from __future__ import annotations

import json
from typing import Any, Optional

import torch
from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase
from vllm.model_executor.layers.quantization.utils.quant_utils import is_layer_skipped
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

from aipc_kernels.formats import FORMAT_VERSION, GROUP_SIZES, get_codebook
from aipc_kernels.modules import DEFAULT_SKIP
from aipc_kernels.quantizers import QUANTIZERS

from . import PLUGIN_NAME
from .checkpoint import SCALE_DTYPES, quantization_config_dict
KNOWN_KEYS = {
    "quant_method", "codebook", "group_size", "quantizer", "scale_dtype", "act_group",
    "modules_to_not_convert", "prequantized", "quantize_lm_head", "format_version", "source",
}  # fmt: skip


@register_quantization_config(PLUGIN_NAME)
class LowBit2Config(QuantizationConfig):
    """2-bit (and 1-bit) group-quantized weights in the shared ``lowbit2`` format, W2A8 on CPU."""

    def __init__(
        self,
        codebook: str = "affine",
        group_size: int = 64,
        quantizer: str = "optimized",
        scale_dtype: str = "float16",
        act_group: int = 0,
        modules_to_not_convert: Optional[list[str]] = None,
        prequantized: bool = False,
        quantize_lm_head: bool = False,
    ) -> None:
        super().__init__()
        get_codebook(codebook)  # error lists the known code books
        if group_size != -1 and group_size not in GROUP_SIZES:
            raise ValueError(
                f"lowbit2 quantization_config.group_size={group_size} is not supported; "
                f"use one of {GROUP_SIZES} or -1 (one group per row)"
            )
        if quantizer not in QUANTIZERS:
            raise ValueError(f"lowbit2 quantization_config.quantizer={quantizer!r} is unknown; use one of {QUANTIZERS}")
        if scale_dtype not in SCALE_DTYPES:
            raise ValueError(
                f"lowbit2 quantization_config.scale_dtype={scale_dtype!r} is not supported; use one of {sorted(SCALE_DTYPES)}"
            )
        if act_group < 0 or (act_group and group_size != -1 and act_group % group_size):
            raise ValueError(
                f"lowbit2 quantization_config.act_group={act_group} must be 0 (per token) or a multiple of group_size={group_size}"
            )
        self.codebook = codebook
        self.group_size = group_size
        self.quantizer = quantizer
        self.scale_dtype_name = scale_dtype
        self.scale_dtype = SCALE_DTYPES[scale_dtype]
        self.act_group = act_group
        self.modules_to_not_convert = list(modules_to_not_convert or [])
        self.prequantized = prequantized
        self.quantize_lm_head = quantize_lm_head

    def __repr__(self) -> str:
        return (
            f"LowBit2Config(codebook={self.codebook}, group_size={self.group_size}, "
            f"{'prequantized' if self.prequantized else 'on-the-fly ' + self.quantizer}, "
            f"scale_dtype={self.scale_dtype_name}, act_group={self.act_group}, "
            f"modules_to_not_convert={self.modules_to_not_convert}, quantize_lm_head={self.quantize_lm_head})"
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
        unknown = set(config) - KNOWN_KEYS
        if unknown:
            raise ValueError(
                f"lowbit2 quantization_config has unknown keys {sorted(unknown)}; known keys: {sorted(KNOWN_KEYS)}"
            )
        method = config.get("quant_method", PLUGIN_NAME)
        if method != PLUGIN_NAME:
            raise ValueError(f"quantization_config.quant_method={method!r} is not {PLUGIN_NAME!r}")
        version = int(config.get("format_version", FORMAT_VERSION))
        if version > FORMAT_VERSION:
            raise ValueError(
                f"lowbit2 checkpoint format_version {version} is newer than this aipc-plugins "
                f"({FORMAT_VERSION}); upgrade aipc-plugins"
            )
        defaults = cls()
        return cls(
            codebook=config.get("codebook", defaults.codebook),
            group_size=int(config.get("group_size", defaults.group_size)),
            quantizer=config.get("quantizer", defaults.quantizer),
            scale_dtype=config.get("scale_dtype", defaults.scale_dtype_name),
            act_group=int(config.get("act_group", defaults.act_group)),
            modules_to_not_convert=config.get("modules_to_not_convert"),
            prequantized=bool(config.get("prequantized", False)),
            quantize_lm_head=bool(config.get("quantize_lm_head", False)),
        )

    @classmethod
    def from_config_file(cls, path: str) -> "LowBit2Config":
        """``--hf-overrides '{"quantization_config_file": PATH}'``: a JSON file of config keys."""
        with open(path) as f:
            return cls.from_config(json.load(f))

    @classmethod
    def from_config_dict_json(cls, text: str) -> "LowBit2Config":
        """``--hf-overrides '{"quantization_config_dict_json": "{...}"}'``."""
        return cls.from_config(json.loads(text))

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg, user_quant, hf_config=None) -> Optional[str]:
        """A checkpoint with ``quant_method: lowbit2`` selects this method without ``--quantization``."""
        if hf_quant_cfg.get("quant_method") == PLUGIN_NAME and user_quant in (None, PLUGIN_NAME):
            return PLUGIN_NAME
        return None

    def to_dict(self) -> dict[str, Any]:
        """The ``quantization_config`` entry that describes this config in a checkpoint."""
        d = quantization_config_dict(
            self.codebook, self.group_size, self.quantizer, self.scale_dtype_name, self.act_group,
            self.modules_to_not_convert, self.prequantized,
        )  # fmt: skip
        if self.quantize_lm_head:
            d["quantize_lm_head"] = True
        return d

    def is_skipped(self, prefix: str) -> bool:
        """Whether the linear layer ``prefix`` stays unquantized (``modules_to_not_convert``)."""
        skip = list(DEFAULT_SKIP) + self.modules_to_not_convert
        return is_layer_skipped(prefix, skip, self.packed_modules_mapping, match_mode="substring")

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> Optional[QuantizeMethodBase]:
        if isinstance(layer, ParallelLMHead) and self.quantize_lm_head:
            from .linear_method import LowBit2LMHeadMethod

            return LowBit2LMHeadMethod(self)
        if not isinstance(layer, LinearBase):
            return None  # embeddings (and lm_head unless quantize_lm_head) stay in the model dtype
        if self.is_skipped(prefix):
            return UnquantizedLinearMethod()
        from .linear_method import LowBit2LinearMethod, LowBit2OnlineLinearMethod

        return LowBit2LinearMethod(self) if self.prequantized else LowBit2OnlineLinearMethod(self)


__all__ = ["LowBit2Config"]
