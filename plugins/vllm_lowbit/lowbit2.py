"""``lowbit2`` as a vLLM quantization method: :class:`LowBit2Config` (registered with
``register_quantization_config`` when this module is imported, by :func:`vllm_lowbit.register`) and its
linear methods. ``lowbit4`` on the fly is this method with 4-bit defaults (:mod:`vllm_lowbit.lowbit4`).

Two ways in, one config:

* ``vllm serve BF16_MODEL --quantization lowbit2``: the checkpoint has no quantization config, vLLM
  builds ``LowBit2Config()`` (defaults) and :class:`LowBit2OnlineLinearMethod` quantizes every linear
  layer while it loads, one layer at a time on the meta device (vLLM's online quantization), with the
  shared quantizer, unless its weight already lies on a binary/ternary/2-bit grid (``detect_grid``, e.g.
  ParetoQ's fake-quantized bf16 weights): then it is stored exactly in that code book
  (:mod:`aipc_kernels.checkpoints.grid_detect`), and :class:`LoadReport` logs once per model which layers
  were, and the largest reconstruction error of the quantized ones. A layer on no grid is refused when
  the code book has 1 or 2 bits, unless ``allow_2bit_ptq`` (:mod:`aipc_kernels.lowbit.quality_gate`). A
  ``group_size`` that does not divide a layer's K falls back to the largest supported group that does
  (logged once per K). Parameters through ``--hf-overrides '{"quantization_config": {"quant_method":
  "lowbit2", "group_size": 128}}'`` or ``--hf-overrides '{"quantization_config_file": "PATH"}'``.
* ``vllm serve LOWBIT2_MODEL``: a checkpoint written by ``python -m vllm_lowbit.quantize`` carries
  ``quantization_config`` with ``quant_method: lowbit2`` and ``prequantized: true``; vLLM picks the
  method from it (no flag needed) and :class:`LowBit2LinearMethod` loads the packed codes (``qweight``
  uint8 ``[N, K*bits/8]``), ``scales`` and, for the affine code book, ``zeros`` (``[N, K/G]``) with vLLM's
  packed / group-scale parameters, so merged QKV and gate-up shards and tensor-parallel slices land where
  they belong; every tensor is checked (shape, dtype, presence, code range) with an error naming it. An
  ``--hf-overrides`` quantization_config updates its config instead of replacing it
  (:meth:`LowBit2Config.maybe_update_config`), so it stays prequantized.

Both end in :func:`vllm_lowbit.layers.install_packed` (the weight repacked once for the layer's device)
and ``aipc::lowbit_linear``. The keys (``codebook``, ``group_size``, ``quantizer``, ``scale_dtype``,
``act_group``, ``activations``, ``modules_to_not_convert``, ``lm_head``, ``detect_grid``,
``allow_2bit_ptq``, ``prequantized``, ``layer_formats``), their types, choices, ranges and meaning are
declared once in :class:`vllm_lowbit.options.QuantizationConfigOptions`, the frozen object the config
keeps as ``options`` and the methods read.
"""
from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from vllm.logger import init_logger
from vllm.model_executor.layers.linear import LinearMethodBase, register_weight_loader_v2_supported_method
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from vllm.model_executor.parameter import ChannelQuantScaleParameter, GroupQuantScaleParameter, PackedvLLMParameter

from aipc_kernels.checkpoints.grid_detect import GridWeight, detect_grid, recovered_summary
from aipc_kernels.core.config_schema import to_dict
from aipc_kernels.lowbit.formats import LowBitWeight, get_codebook
from aipc_kernels.lowbit.quality_gate import OPT_IN_KEY, SAFE_REL_ERROR, ErrorReport, needs_opt_in, ptq_refusal, relative_error
from aipc_kernels.lowbit.progressive import quantize_layer

from . import PLUGIN_NAME
from .layers import (LowBitConfig, LowBitOnlineLinearMethod, apply_lowbit, apply_segments, check_partition,
                     checkpoint_rows, checkpoint_tensor_name, effective_group_size, install_packed, install_segments,
                     layer_shards, packed_embedding)  # fmt: skip
from .options import (CHECKPOINT_KEYS, CONFIG_NAMING, GGUF_SOURCE, STORED, STORED_EMBEDDING, STORED_HEAD,
                      QuantizationConfigOptions, gguf_layer_act_group, parse_quantization_config)  # fmt: skip

logger = init_logger(f"vllm.{__name__}")  # under "vllm": the logger vLLM configures (INFO shows)

#: --hf-overrides keys that carry a quantization_config in a file or a JSON string
OVERRIDE_FILE_KEYS = ("quantization_config_file", "quantization_config_dict_json")


@register_quantization_config(PLUGIN_NAME)
class LowBit2Config(LowBitConfig):
    """2-bit (and 1-bit) group-quantized weights in the shared ``lowbit2`` format, W2A8 on CPU.

    Built from ``quantization_config`` keys (``LowBit2Config(**keys)``, :meth:`from_config`), all
    checked by :class:`vllm_lowbit.options.QuantizationConfigOptions` (:attr:`options`): exact types,
    choices, ranges."""

    name = PLUGIN_NAME

    def __init__(self, /, **config: Any) -> None:
        super().__init__(**config)
        self._given = {**self.defaults, **config}  # the keys as vLLM passed them (see maybe_update_config)
        self.grid_report = LoadReport(self.get_name())  # on the fly: grid layers and reconstruction error (one log)

    def __repr__(self) -> str:
        o = self.options
        return (
            f"{type(self).__name__}(codebook={o.codebook}, group_size={o.group_size}, "
            f"{'prequantized' if o.prequantized else 'on-the-fly ' + o.quantizer}, "
            f"scale_dtype={o.scale_dtype}, act_group={o.act_group}, activations={o.activations}, "
            f"modules_to_not_convert={o.modules_to_not_convert}, lm_head={self.head_label}, "
            f"detect_grid={o.detect_grid}, allow_2bit_ptq={o.allow_2bit_ptq})"
        )

    # ------------------------------------------------------------------ vLLM interface

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
        CHECKPOINT_KEYS`: code book, group size, quantizer, scale dtype, modules kept unquantized,
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
            self.options = parse_quantization_config(config, self.naming)
        o = self.options
        tied = getattr(hf_config, "tie_word_embeddings", False)
        if STORED_EMBEDDING in o.layer_formats and tied and o.head_setting != STORED:
            raise ValueError(
                f"{CONFIG_NAMING.setting('lm_head', o.head_setting)}, but {model_name} stores its token embedding packed "
                f"(layer_formats {STORED_EMBEDDING!r}) and ties the output projection to it: the output projection "
                f"is served as stored; drop lm_head (or give lm_head {STORED!r})"
            )
        if self.options.prequantized and converted is None:
            raise ValueError(
                f"{CONFIG_NAMING.setting('prequantized', True)}, but {model_name} is not a checkpoint converted by "
                f"python -m vllm_lowbit.quantize (its config.json has no quantization_config with quant_method "
                f"{PLUGIN_NAME!r} and prequantized true); drop prequantized to quantize its weights while they "
                f"load, or convert it first: python -m vllm_lowbit.quantize {model_name} OUT_DIR"
            )

    def to_dict(self) -> dict[str, Any]:
        """The ``quantization_config`` entry that describes this config in a checkpoint."""
        return self.options.as_quantization_config()

    def embedding_method(self, layer: torch.nn.Module) -> Optional[QuantizeMethodBase]:
        """A GGUF conversion's token embedding (``layer_formats`` :data:`~vllm_lowbit.options.STORED_EMBEDDING`)
        and output projection (``lm_head: stored``: its own entry :data:`~vllm_lowbit.options.STORED_HEAD`, or
        tied, the embedding's) as stored: :class:`LowBit2EmbeddingMethod`."""
        o = self.options
        head = isinstance(layer, ParallelLMHead)
        if head and o.head_setting != STORED:
            return None
        name = STORED_HEAD if head and STORED_HEAD in o.layer_formats else STORED_EMBEDDING
        if name not in o.layer_formats:
            return None
        return LowBit2EmbeddingMethod(self._with_format([name], name), name)

    def linear_method(self, prefix: str) -> QuantizeMethodBase:
        if self.options.prequantized:
            parts = self.part_configs(prefix)
            if parts is not None:
                return LowBit2SegmentedLinearMethod(parts)
            return LowBit2LinearMethod(self.for_layer(prefix))
        self.grid_report.expect(prefix)
        return LowBit2OnlineLinearMethod(self)

    def _part_names(self, prefix: str) -> list[str]:
        """The checkpoint layers vLLM loads as its layer ``prefix`` (q/k/v, gate/up; else ``prefix`` itself)."""
        parent, _, last = prefix.rpartition(".")
        parts = self.packed_modules_mapping.get(last) or [last]
        return [f"{parent}.{p}" if parent else p for p in parts]

    def for_layer(self, prefix: str) -> "LowBit2Config":
        """This config with the ``layer_formats`` entry of layer ``prefix`` (of every checkpoint
        layer merged into it: q/k/v, gate/up, which must agree: else :meth:`part_configs`) as its options'
        code book, group size, scale dtype and super block."""
        return self._with_format(self._part_names(prefix), prefix)

    def part_configs(self, prefix: str) -> Optional[list["LowBit2Config"]]:
        """One config per checkpoint layer merged into vLLM's layer ``prefix`` where their ``layer_formats``
        entries differ (a GGUF Q4_K_M conversion's Q4_K q / k beside its Q6_K v), in merge order; None where
        they agree (:meth:`for_layer`)."""
        names = self._part_names(prefix)
        formats = [self.options.layer_formats.get(n) for n in names]
        if all(f == formats[0] for f in formats):
            return None
        return [self._with_format([n], prefix) for n in names]

    def _with_format(self, names: list[str], prefix: str) -> "LowBit2Config":
        """This config with the ``layer_formats`` entry of the checkpoint layers ``names`` (loaded as vLLM's
        layer ``prefix``), which must agree."""
        o = self.options
        formats = [o.layer_formats.get(n) for n in names]
        if any(f != formats[0] for f in formats):
            raise ValueError(
                f"{CONFIG_NAMING.key('layer_formats')} gives the layers {names}, which vLLM loads as one merged "
                f"layer {prefix!r}, different formats {formats}; LowBit2Config.part_configs gives one config "
                f"per part"
            )
        if formats[0] is None and o.source != GGUF_SOURCE:
            return self
        # codebook, group_size, scale_dtype and super_block (an entry without one: one level)
        layer_options = dataclasses.replace(o, **({"super_block": None, **formats[0]} if formats[0] else {}))
        if o.source == GGUF_SOURCE and layer_options.act_group and layer_options.group_size != -1:
            # as serving the GGUF file does (gguf.GGUFCPUConfig.layer_act_group, its default): a layer whose group
            # is larger than act_group (TQ1_0 / TQ2_0: 128) takes its group
            act_group = gguf_layer_act_group(layer_options.act_group, layer_options.group_size, None)
            layer_options = dataclasses.replace(layer_options, act_group=act_group)
        layer = copy.copy(self)
        layer.options = layer_options
        return layer


@register_weight_loader_v2_supported_method
class LowBit2LinearMethod(LinearMethodBase):
    """Pre-quantized ``lowbit2`` checkpoint -> device layout -> ``aipc::lowbit_linear``."""

    def __init__(self, config: LowBit2Config):
        self.config = config
        self.options = config.options  # this layer's (LowBit2Config.for_layer)
        self.cb = get_codebook(self.options.codebook)

    def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype, **extra_weight_attrs) -> None:  # fmt: skip
        o, bits = self.options, self.cb.bits
        K, N = input_size_per_partition, sum(output_partition_sizes)
        G = check_partition(self.config, layer, K)
        if o.super_block is not None and K % o.super_block:
            raise ValueError(
                f"{self.config.get_name()}: layer {layer.prefix!r} stores its super-block scales over {o.super_block} "
                f"inputs, which this rank's K={K} (in_features / tensor_parallel_size) does not hold whole; serve it "
                f"with a tensor_parallel_size that keeps K a multiple of {o.super_block} (e.g. 1)"
            )  # fmt: skip
        weight_loader = extra_weight_attrs["weight_loader"]
        layer.lowbit_loaded = set()
        layer.lowbit_k_partition = K

        qweight = PackedvLLMParameter(
            data=torch.empty(N, K * bits // 8, dtype=torch.uint8),
            input_dim=1,
            output_dim=0,
            packed_dim=1,
            packed_factor=8 // bits,
            weight_loader=self._checked_loader(layer, "qweight", weight_loader),
        )
        layer.register_parameter("qweight", qweight)
        names = ("scales", "zeros") if self.cb.per_group_tensor else ("scales",)  # zeros: zero points or mins
        for name in names:
            loader = self._checked_loader(layer, name, weight_loader)
            if o.group_size == -1:  # one scale per row: replicated across row-parallel ranks
                p = ChannelQuantScaleParameter(
                    data=torch.empty(N, 1, dtype=o.torch_scale_dtype), output_dim=0, weight_loader=loader
                )
            else:
                p = GroupQuantScaleParameter(
                    data=torch.empty(N, K // G, dtype=o.torch_scale_dtype), output_dim=0, input_dim=1,
                    weight_loader=loader,
                )  # fmt: skip
            layer.register_parameter(name, p)
        if not self.cb.per_group_tensor:
            layer.register_parameter("zeros", None)
        layer.register_parameter("supers", None)
        if o.super_block is not None:  # the two-level form: float32 [S, N, K/SB], S = 2 with mins
            supers = GroupQuantScaleParameter(
                data=torch.empty(self._supers_count(), N, K // o.super_block, dtype=torch.float32), output_dim=1,
                input_dim=2, weight_loader=self._checked_loader(layer, "supers", weight_loader),
            )  # fmt: skip
            layer.register_parameter("supers", supers)

    def _supers_count(self) -> int:
        """S of the two-level form's ``supers`` [S, N, K/SB]: the scales' super-block scale, and the mins' too."""
        return 2 if self.cb.mins else 1

    # ------------------------------------------------------------------ checkpoint checks

    def _checkpoint_name(self, layer: torch.nn.Module, pname: str, shard) -> str:
        return checkpoint_tensor_name(self.config, layer, pname, shard)

    def _checkpoint_rows(self, layer: torch.nn.Module, shard) -> int:
        return checkpoint_rows(layer, shard)

    def _expected(self, layer: torch.nn.Module, pname: str, shard) -> tuple[tuple[int, int], torch.dtype]:
        rows, K = self._checkpoint_rows(layer, shard), layer.input_size
        if pname == "qweight":
            return (rows, K * self.cb.bits // 8), torch.uint8
        if pname == "supers":
            return (self._supers_count(), rows, K // self.options.super_block), torch.float32
        groups = 1 if self.options.group_size == -1 else K // self.options.group_size
        return (rows, groups), self.options.torch_scale_dtype

    def _check_arrived(self, layer: torch.nn.Module, pname: str, shard, t: torch.Tensor) -> None:
        """Raises unless the checkpoint tensor ``pname`` of ``shard`` has this form's shape and dtype."""
        name = self._checkpoint_name(layer, pname, shard)
        shape, dtype = self._expected(layer, pname, shard)
        if tuple(t.shape) != shape:
            raise ValueError(
                f"lowbit2 checkpoint tensor {name} has shape {tuple(t.shape)}, expected {shape} "
                f"(codebook={self.options.codebook}, group_size={self.options.group_size}, in_features={layer.input_size})"
            )
        if t.dtype != dtype:
            raise ValueError(
                f"lowbit2 checkpoint tensor {name} has dtype {t.dtype}, expected {dtype} "
                f"(quantization_config.scale_dtype={self.options.scale_dtype})"
            )

    def _checked_loader(self, layer: torch.nn.Module, pname: str, loader: Callable) -> Callable:
        """vLLM's loader for ``pname``, after checking the checkpoint tensor's shape and dtype."""

        def lowbit2_weight_loader(param, loaded_weight: torch.Tensor, loaded_shard_id=None):
            self._check_arrived(layer, pname, loaded_shard_id, loaded_weight)
            if loaded_shard_id is None:
                layer.lowbit_loaded.update((pname, s) for s in layer_shards(layer))
                return loader(param, loaded_weight)
            ids = loaded_shard_id if isinstance(loaded_shard_id, tuple) else (loaded_shard_id,)
            layer.lowbit_loaded.update((pname, s) for s in ids)
            return loader(param, loaded_weight, loaded_shard_id)

        return lowbit2_weight_loader

    def _pnames(self) -> list[str]:
        """The checkpoint tensors of one layer in this method's form."""
        return (["qweight", "scales"] + (["zeros"] if self.cb.per_group_tensor else [])
                + (["supers"] if self.options.super_block is not None else []))  # fmt: skip

    def _missing(self, layer: torch.nn.Module, missing: list[str]) -> None:
        """Raises naming the first of the checkpoint tensors ``missing``, if any."""
        if missing:
            raise ValueError(
                f"lowbit2 checkpoint is missing tensor {missing[0]}"
                + (f" (and {len(missing) - 1} more of layer {layer.prefix})" if len(missing) > 1 else "")
                + f"; codebook={self.options.codebook} needs {', '.join(self._pnames())} for every quantized linear"
            )

    def _check_loaded(self, layer: torch.nn.Module) -> LowBitWeight:
        """The layer's canonical weight, after checking every tensor arrived and holds valid codes."""
        self._missing(layer, [self._checkpoint_name(layer, p, s) for p in self._pnames() for s in layer_shards(layer)
                              if (p, s) not in layer.lowbit_loaded])  # fmt: skip
        zeros = layer.zeros.data if self.cb.per_group_tensor else None
        supers = None if layer.supers is None else layer.supers.data
        return self._canonical(layer, None, layer.qweight.data, layer.scales.data, zeros, supers)

    def _canonical(self, layer: torch.nn.Module, shard, qweight: torch.Tensor, scales: torch.Tensor,
                   zeros: Optional[torch.Tensor], supers: Optional[torch.Tensor]) -> LowBitWeight:  # fmt: skip
        """The canonical weight of ``layer`` (``shard``: of that part only) over these loaded tensors, after
        checking that its scales are finite and its codes valid (errors name the checkpoint tensor)."""
        K = layer.lowbit_k_partition
        G = effective_group_size(self.config, layer, K)
        name = layer.prefix if shard is None else f"{layer.prefix} shard {shard!r}"
        w = LowBitWeight(qweight, scales, zeros, self.options.codebook, G, K, name=name, supers=supers)
        for pname, t in (("scales", w.scales), ("zeros", w.zeros), ("supers", w.supers)):  # int8 (two-level): finite
            if t is not None and t.is_floating_point() and not torch.isfinite(t).all():
                raise ValueError(f"lowbit2 checkpoint tensor {self._checkpoint_name(layer, pname, shard)} holds NaN or Inf")
        if self.cb.max_code < (1 << self.cb.bits) - 1 and (w.codes() > self.cb.max_code).any():
            raise ValueError(
                f"lowbit2 checkpoint tensor {self._checkpoint_name(layer, 'qweight', shard)} holds codes above "
                f"{self.cb.max_code}, invalid for codebook={self.options.codebook}"
            )
        return w

    # ------------------------------------------------------------------ vLLM interface

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if getattr(layer, "_already_called_process_weights_after_loading", False):
            return
        install_packed(layer, self._check_loaded(layer), self.options.act_group, self.options.activations)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        return apply_lowbit(layer, x, bias)


class LowBit2SegmentedLinearMethod(LinearMethodBase):
    """A merged layer (q/k/v, gate/up) of a converted checkpoint whose parts ``layer_formats`` stores in
    different forms (a GGUF Q4_K_M conversion's Q4_K q / k beside its Q6_K v, as the file has them): each part's
    tensors are checked against its own form as they arrive (:class:`LowBit2LinearMethod`'s checks, one
    method per part) and kept; after loading, runs of consecutive parts of one form
    (:func:`~aipc_kernels.checkpoints.gguf.form_runs`) become segments, each with its own op call
    (:func:`~vllm_lowbit.layers.install_segments`), as serving the GGUF file holds the layer."""

    def __init__(self, parts: list[LowBit2Config]):
        self.parts = [LowBit2LinearMethod(p) for p in parts]

    def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype, **extra_weight_attrs) -> None:  # fmt: skip
        if getattr(layer, "tp_size", 1) != 1:
            raise ValueError(f"lowbit2: layer {layer.prefix!r} merges parts stored in different forms "
                             f"(quantization_config.layer_formats), served with tensor_parallel_size=1 for now")  # fmt: skip
        shards = layer_shards(layer)
        if len(shards) != len(self.parts):
            raise ValueError(f"lowbit2: layer {layer.prefix!r} loads {len(shards)} shards {shards}, but "
                             f"quantization_config.layer_formats gives {len(self.parts)} parts")  # fmt: skip
        for part in self.parts:
            check_partition(part.config, layer, input_size_per_partition)
        layer.lowbit_k_partition = input_size_per_partition
        layer.lowbit_parts = {s: {} for s in shards}  # shard -> checkpoint tensor name -> tensor, as they arrive
        methods = dict(zip(shards, self.parts))

        def loader(pname: str) -> Callable:
            def lowbit2_part_loader(param, loaded_weight: torch.Tensor, loaded_shard_id=None):
                if loaded_shard_id not in methods:
                    raise ValueError(f"lowbit2: layer {layer.prefix!r} merges parts of different forms and takes "
                                     f"its tensors per shard {shards}, not {loaded_shard_id!r}")  # fmt: skip
                part = methods[loaded_shard_id]
                if pname not in part._pnames():
                    raise ValueError(f"lowbit2 checkpoint has tensor {part._checkpoint_name(layer, pname, loaded_shard_id)}, "
                                     f"which codebook={part.options.codebook} (quantization_config.layer_formats) "
                                     f"does not have")  # fmt: skip
                part._check_arrived(layer, pname, loaded_shard_id, loaded_weight)  # against the part's own form
                layer.lowbit_parts[loaded_shard_id][pname] = loaded_weight

            return lowbit2_part_loader

        for pname in ("qweight", "scales", "zeros", "supers"):  # any part's tensors: placeholders, filled per part
            p = torch.nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
            p.weight_loader = loader(pname)
            layer.register_parameter(pname, p)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if getattr(layer, "_already_called_process_weights_after_loading", False):
            return
        from aipc_kernels.checkpoints.gguf import stack_runs

        weights = []
        for shard, part in zip(layer_shards(layer), self.parts):
            got = layer.lowbit_parts[shard]
            part._missing(layer, [part._checkpoint_name(layer, p, shard) for p in part._pnames() if p not in got])
            weights.append(part._canonical(layer, shard, got["qweight"], got["scales"], got.get("zeros"),
                                           got.get("supers")))  # fmt: skip
        del layer.lowbit_parts
        segments = stack_runs(weights, layer.prefix)
        install_segments(layer, [w for _, w in segments], [self.parts[run[0]].options.act_group for run, _ in segments],
                         [self.parts[run[0]].options.activations for run, _ in segments])  # fmt: skip

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        return apply_segments(layer, x, bias)


class LowBit2EmbeddingMethod(LowBit2LinearMethod):
    """A GGUF conversion's token embedding, or untied output projection, as stored (the file's own blocks, as
    ``vllm serve X.gguf`` holds them): loaded and checked as a linear layer's tensors (rows: the vocabulary,
    zero rows up to vLLM's padded vocabulary), packed once; the lookup dequantizes only the rows it reads
    (:func:`~vllm_lowbit.layers.packed_embedding`), the output projection multiplies the packed tensor on the
    W·A8 kernels, and a tied one is the embedding layer itself (:meth:`tie_weights`): one tensor in memory."""

    def __init__(self, config: LowBit2Config, name: str):
        super().__init__(config)
        self.name = name  # the checkpoint's (layer_formats') name: STORED_EMBEDDING or STORED_HEAD

    def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype, **extra_weight_attrs) -> None:  # fmt: skip
        if getattr(layer, "tp_size", 1) != 1:
            raise ValueError(f"lowbit2: the stored {self.name} of a GGUF conversion is served with "
                             f"tensor_parallel_size=1 for now (layer {layer.prefix!r})")  # fmt: skip
        layer.lowbit_params_dtype = params_dtype
        super().create_weights(layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                               params_dtype, **{**extra_weight_attrs, "weight_loader": _padded_rows_loader})  # fmt: skip

    def _checkpoint_name(self, layer: torch.nn.Module, pname: str, shard) -> str:
        return f"{self.name}.{pname}"

    def _checkpoint_rows(self, layer: torch.nn.Module, shard) -> int:
        return layer.org_vocab_size

    def embedding(self, layer: torch.nn.Module, input_: torch.Tensor) -> torch.Tensor:
        return packed_embedding(layer, input_, layer.lowbit_params_dtype)

    def tie_weights(self, layer: torch.nn.Module, embed_tokens: torch.nn.Module) -> torch.nn.Module:
        return embed_tokens  # one packed tensor: the lookup reads its rows, the projection multiplies it


def _padded_rows_loader(param: torch.nn.Parameter, loaded_weight: torch.Tensor, loaded_shard_id=None) -> None:
    """A stored embedding's tensor into its parameter: the vocabulary's rows along the parameter's
    ``output_dim``, zeros (value 0) in vLLM's padding rows after them."""
    dim, rows = param.output_dim, loaded_weight.shape[param.output_dim]
    param.data.narrow(dim, 0, rows).copy_(loaded_weight)
    param.data.narrow(dim, rows, param.shape[dim] - rows).zero_()


class LoadReport:
    """What on-the-fly quantization did to a model, logged once every expected layer is processed: the
    layers ``detect_grid`` recovered (with a warning when only some of them lay on a grid) and the
    largest relative reconstruction error of the quantized ones against the quality table's bounds
    (:class:`aipc_kernels.lowbit.quality_gate.ErrorReport`)."""

    def __init__(self, method: str) -> None:
        self.method = method
        self.pending: set[str] = set()
        self.grids: dict[str, GridWeight] = {}
        self.others: list[str] = []
        self.errors = ErrorReport()

    def expect(self, prefix: str) -> None:
        self.pending.add(prefix)

    def add(self, prefix: str, grid: Optional[GridWeight], config: LowBit2Config,
            error: Optional[float] = None) -> None:  # fmt: skip
        self.pending.discard(prefix)
        if grid is None:
            self.others.append(prefix)
        else:
            self.grids[prefix] = grid
        if error is not None:
            self.errors.add(prefix, error)
        if not self.pending:
            self._log(config)
            self.grids, self.others, self.errors = {}, [], ErrorReport()

    def _log(self, config: LowBit2Config) -> None:
        line = self.errors.line(self.method)
        if line is not None:
            (logger.warning if self.errors.worst[0] > SAFE_REL_ERROR else logger.info)(line)
        if not self.grids:
            return
        n, total = len(self.grids), len(self.grids) + len(self.others)
        grids = list(self.grids.values())
        summary = recovered_summary([g.codebook for g in grids], [g.exact for g in grids],
                                    max(g.max_rel_error for g in grids))  # fmt: skip
        logger.info(
            "%s: %d of %d linear layers already lie on a low-bit grid (ParetoQ-style) and are stored "
            "with one scale per row instead of being quantized: %s", self.method, n, total, summary,
        )  # fmt: skip
        if self.others:
            logger.warning(
                "%s: %d of %d linear layers lie on a low-bit grid but %d do not (e.g. %s) and were quantized "
                "with codebook=%s group_size=%d (lossy); if the checkpoint is meant to be fully quantized, those "
                "layers were not exported on their grid (quantization_config.detect_grid false treats all alike)",
                self.method, n, total, len(self.others), self.others[0], config.options.codebook, config.options.group_size,
            )  # fmt: skip


class LowBit2OnlineLinearMethod(LowBitOnlineLinearMethod):
    """bf16/fp16 checkpoint -> quantized while loading, one layer at a time -> ``aipc::lowbit_linear``."""

    config: LowBit2Config

    def prepare(self, layer: torch.nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                extra_weight_attrs: dict[str, Any]) -> None:  # fmt: skip
        check_partition(self.config, layer, input_size_per_partition, fit=True)  # fail before loading anything

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if getattr(layer, "_already_called_process_weights_after_loading", False):
            return
        cfg, o = self.config, self.config.options
        weight = self.get_weight_for_quantization(layer)
        if weight.is_meta:
            raise ValueError(f"{cfg.get_name()}: layer {layer.prefix!r} received no weight from the checkpoint")
        G = effective_group_size(cfg, layer, weight.shape[1], fit=True)
        grid, error = None, None
        if o.detect_grid:  # whole-row scales, unless act_group needs groups
            grid = detect_grid(weight.detach(), layer.prefix, -1 if o.act_group == 0 else G, o.torch_scale_dtype)
        if grid is not None:
            w = grid.weight
        else:
            if needs_opt_in(o.codebook) and not o.allow_2bit_ptq:
                raise ValueError(ptq_refusal(layer.prefix, o.codebook, cfg.get_name(), _opt_in_hint(cfg)))
            w = quantize_layer(weight.detach(), o.codebook, G, o.quantizer, o.torch_scale_dtype, name=layer.prefix)
            error = relative_error(weight, w)
        install_packed(layer, w, o.act_group, o.activations)
        cfg.grid_report.add(layer.prefix, grid, cfg, error)
        if self.requantization_source is not None:
            self.release_requantization_source_weights(layer)


def _opt_in_hint(config: LowBit2Config) -> str:
    """How a server user sets the opt-in (the keys they gave, plus it)."""
    return (f"--hf-overrides '{{\"quantization_config\": {{\"quant_method\": \"{config.get_name()}\", "
            f"\"{OPT_IN_KEY}\": true}}}}' (or {OPT_IN_KEY}: true in the quantization_config you pass), or convert "
            f"with python -m vllm_lowbit.quantize MODEL OUT --allow-2bit-ptq")  # fmt: skip


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


__all__ = ["LoadReport", "LowBit2Config", "LowBit2LinearMethod", "LowBit2OnlineLinearMethod"]
