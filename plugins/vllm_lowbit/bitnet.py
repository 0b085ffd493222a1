"""BitNet b1.58 checkpoints served as published: the vLLM quantization method ``bitnet``.

``vllm serve DIR`` with no flag: vLLM reads ``quant_method: bitnet`` from the checkpoint's
config.json and builds :class:`BitNetConfig` (``--quantization lowbit2`` on such a checkpoint is
taken for it too). Every family of :mod:`aipc_kernels.checkpoints.bitnet` loads straight into the
``ternary`` code book and runs on ``aipc::lowbit_linear`` (W2A8, activations int8 per token as
BitNet quantizes them):

* packed weights (``bitlinear``: Falcon3-*-1.58bit, Falcon-E; ``autobitlinear`` offline:
  bitnet-b1.58-2B-4T): :class:`BitNetPackedLinearMethod` unpacks each checkpoint tensor before
  vLLM's loader cuts its merged-layer and tensor-parallel slice (the packing's row blocks are local
  to one tensor) and keeps its ``weight_scale``, read as the family reads it;
* bf16 masters (``autobitlinear``, ``quantization_mode: online``): :class:`BitNetOnlineLinearMethod`
  takes BitNet's absmean scale of each whole checkpoint tensor as it loads (also inside merged layers
  and under tensor parallelism) and ternarizes with it.

Both load one layer at a time (vLLM's layerwise online processing: the weights wait on the meta
device), so the unpacked int8 values of one layer are resident at most, and repack once into the
CPU kernel's layout. ``modules_to_not_convert`` layers stay float, as in transformers. ``--quantization
bitnet`` on an unquantized checkpoint ternarizes it with the online rule.

The output projection, which BitNet keeps in bf16, is quantized at load as lowbit2's is (``lm_head: auto``, the
default: int6 in groups of 32 where the CPU kernels run without AMX, int8 per output channel with AMX;
:mod:`aipc_kernels.lowbit.output_projection`: half its bytes per token or less, activations int8 per token like the
ternary linears'); ``"lm_head"`` in the ``quantization_config`` (a key of this plugin, e.g.
through ``--hf-overrides``) pins ``int8`` or ``int6``, or keeps it as published (``float``).

Tensor parallelism: a row-parallel layer (``o_proj``, ``down_proj``) gets each rank's slice of the
input's features, and BitNet quantizes activations per token over all of them. Each rank all-gathers
its slice's per-token absmax over the TP group (vLLM's collective, traceable under torch.compile)
and passes the maximum as the op's ``act_amax``, so every rank's int8 codes are the single-rank codes
(:func:`vllm_lowbit.layers.whole_row_amax`, which every lowbit linear with per-token
activation scales uses). With one rank nothing changes.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from vllm.logger import init_logger
from vllm.model_executor.layers.linear import (
    LinearBase,
    LinearMethodBase,
    UnquantizedLinearMethod,
    register_weight_loader_v2_supported_method,
)
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
from vllm.model_executor.model_loader.reload.layerwise import initialize_online_processing
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from vllm.model_executor.parameter import ModelWeightParameter

from aipc_kernels.checkpoints import bitnet as bf
from aipc_kernels.core.config_schema import OptionError
from aipc_kernels.lowbit.output_projection import DEFAULT_HEAD_FORMAT, head_act_group

from . import PLUGIN_NAME
from .layers import (LowBitOnlineLinearMethod, PluginQuantizationConfig, QuantizedLMHeadMethod, apply_lowbit,
                     checkpoint_rows, checkpoint_tensor_name, install_packed, layer_shards, shard_index)  # fmt: skip

logger = init_logger(f"vllm.{__name__}")  # under "vllm": the logger vLLM configures (INFO shows)

#: this plugin's key in a BitNet quantization_config: the output projection's format
HEAD_KEY = "lm_head"
#: ``auto`` (the default: int6 or int8 by the CPU kernels' instruction set), int8 per output channel, int6 in
#: groups of 32, or float as published (BitNet has no low-bit head)
HEAD_FORMATS = (DEFAULT_HEAD_FORMAT, "int8", "int6", "float")


@register_quantization_config(bf.QUANT_METHOD)
class BitNetConfig(PluginQuantizationConfig):
    """A BitNet b1.58 ``quantization_config`` (transformers' keys, checked by
    :class:`aipc_kernels.checkpoints.bitnet.BitNetQuantization`). Built without one (``--quantization
    bitnet`` on a float checkpoint), it ternarizes the float weights with BitNet's online rule."""

    def __init__(self, spec: Optional[bf.BitNetQuantization] = None, head_format: str = DEFAULT_HEAD_FORMAT) -> None:
        super().__init__()
        self.spec = spec or bf.BitNetQuantization(linear_class="autobitlinear", quantization_mode="online")
        if head_format not in HEAD_FORMATS:
            raise OptionError(f"{bf.NAMING.setting('lm_head', head_format)} is not one of {list(HEAD_FORMATS)}: "
                              f"'auto' picks int6 or int8 by the CPU, 'int8' quantizes the output projection per "
                              f"output channel, 'int6' in groups of 32, 'float' keeps it as published",
                              "lm_head")  # fmt: skip
        self._head_setting = head_format

    def __repr__(self) -> str:
        s = self.spec
        return (f"BitNetConfig(linear_class={s.linear_class}, quantization_mode={s.quantization_mode}, "
                f"modules_to_not_convert={list(s.skipped)}, lm_head={self.head_label})")  # fmt: skip

    @property
    def head_setting(self) -> str:
        return self._head_setting

    @classmethod
    def get_name(cls) -> str:
        return bf.QUANT_METHOD

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "BitNetConfig":
        head_format = config.get(HEAD_KEY, DEFAULT_HEAD_FORMAT) if isinstance(config, dict) else DEFAULT_HEAD_FORMAT
        if isinstance(config, dict):
            config = {k: v for k, v in config.items() if k != HEAD_KEY}
        spec, ignored = bf.parse_quantization_config(config)
        if ignored:
            logger.info("bitnet: quantization_config keys %s do not change the weights; ignored", ignored)
        return cls(spec, head_format)

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg, user_quant, hf_config=None) -> Optional[str]:
        """A ``quant_method: bitnet`` checkpoint is served by this method, with no flag or with
        ``--quantization lowbit2`` (its weights are ternary already: nothing else to choose)."""
        if hf_quant_cfg.get("quant_method") == bf.QUANT_METHOD and user_quant in (None, bf.QUANT_METHOD, PLUGIN_NAME):
            return bf.QUANT_METHOD
        return None

    def is_skipped(self, prefix: str) -> bool:
        """Whether ``modules_to_not_convert`` keeps the layer float (transformers' matching, applied
        to each checkpoint module of a merged layer; they must agree)."""
        parent, _, last = prefix.rpartition(".")
        names = [f"{parent}.{p}" if parent else p for p in self.packed_modules_mapping.get(last, [last])]
        kept = {n: bf.not_converted(n, self.spec.skipped) for n in names}
        if len(set(kept.values())) > 1:
            raise ValueError(
                f"{bf.NAMING.key('modules_to_not_convert')} keeps {[n for n, k in kept.items() if k]} float but not "
                f"{[n for n, k in kept.items() if not k]}, which vLLM runs as one layer {prefix!r}; list all or "
                f"none of them"
            )
        return bool(kept) and next(iter(kept.values()))

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> Optional[QuantizeMethodBase]:
        if isinstance(layer, ParallelLMHead) and (head := self.head_format) != "float":
            return QuantizedLMHeadMethod(head_act_group(head, 0), head_format=head)
        if not isinstance(layer, LinearBase):
            return None  # embeddings (and the output projection with lm_head: float) stay float
        if self.is_skipped(prefix):
            return UnquantizedLinearMethod()
        return BitNetPackedLinearMethod(self) if self.spec.packed else BitNetOnlineLinearMethod(self)


# ---------------------------------------------------------------------- shared by both methods


def _start(layer: torch.nn.Module, output_partition_sizes: list[int]) -> None:
    """Per-layer loading state: each merged-layer slot's rows and checkpoint shard, and the value
    each slot's checkpoint tensor gave (recorded by the loaders)."""
    layer.bitnet_widths = list(output_partition_sizes)
    layer.bitnet_shards = layer_shards(layer)
    layer.bitnet_slot_value = {}


def _record(layer: torch.nn.Module, shard, value: float) -> list[int]:
    """Records ``value`` for the slots one checkpoint tensor fills (every slot for an unsharded one)
    and returns them."""
    if shard is None:
        slots = range(len(layer.bitnet_widths))
    else:
        slots = [shard_index(s) for s in shard] if isinstance(shard, tuple) else [shard_index(shard)]
    for i in slots:
        layer.bitnet_slot_value[i] = value
    return list(slots)


def _slot_values(layer: torch.nn.Module, config: BitNetConfig, pname: str) -> list[float]:
    """Each slot's recorded value; an error names the first checkpoint tensor that never arrived."""
    for i, shard in enumerate(layer.bitnet_shards):
        if i not in layer.bitnet_slot_value:
            name = checkpoint_tensor_name(config, layer, pname, shard)
            raise ValueError(f"bitnet checkpoint is missing tensor {name}")
    return [layer.bitnet_slot_value[i] for i in range(len(layer.bitnet_shards))]


def _load(vllm_loader: Callable, param, tensor: torch.Tensor, shard):
    """vLLM's loader with a shard id only where the checkpoint tensor is one slot of a merged layer
    (the loaders of unmerged layers take none)."""
    return vllm_loader(param, tensor) if shard is None else vllm_loader(param, tensor, shard)


def _install(layer: torch.nn.Module, values: torch.Tensor, ones: list[float]) -> None:
    """Replaces the layer's parameters by the packed ternary weight (``ones``: a 1's value per slot);
    a row-parallel layer over several ranks will quantize with the whole row's absmax."""
    row_one = torch.cat([torch.full((w,), v, dtype=torch.float32) for w, v in zip(layer.bitnet_widths, ones)])
    install_packed(layer, bf.ternary_weight(values, row_one, layer.prefix), act_group=0)
    if "weight_scale" in layer._parameters:
        delattr(layer, "weight_scale")
    del layer.bitnet_slot_value


@register_weight_loader_v2_supported_method
class BitNetPackedLinearMethod(LinearMethodBase):
    """Packed ternary weights + one ``weight_scale`` per checkpoint tensor -> ``aipc::lowbit_linear``."""

    uses_meta_device = True  # loaded layer by layer (vLLM's layerwise online processing)

    def __init__(self, config: BitNetConfig):
        self.config = config

    def _name(self, layer: torch.nn.Module, pname: str, shard) -> str:
        return checkpoint_tensor_name(self.config, layer, pname, shard)

    def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype, **extra_weight_attrs) -> None:  # fmt: skip
        vllm_loader = extra_weight_attrs["weight_loader"]
        _start(layer, output_partition_sizes)
        values = ModelWeightParameter(
            data=torch.empty(sum(output_partition_sizes), input_size_per_partition, dtype=torch.int8, device="meta"),
            input_dim=1,
            output_dim=0,
            weight_loader=self._weight_loader(layer, vllm_loader),
        )
        layer.register_parameter("weight", values)
        scale = torch.nn.Parameter(torch.empty(len(output_partition_sizes), dtype=torch.float32, device="meta"),
                                   requires_grad=False)  # fmt: skip
        scale.weight_loader = self._scale_loader(layer)
        layer.register_parameter("weight_scale", scale)
        initialize_online_processing(layer)

    def _weight_loader(self, layer: torch.nn.Module, vllm_loader: Callable) -> Callable:
        def bitnet_weight_loader(param, loaded_weight: torch.Tensor, loaded_shard_id=None):
            name = self._name(layer, "weight", loaded_shard_id)
            values = bf.unpack_ternary(loaded_weight, name)
            expect = (checkpoint_rows(layer, loaded_shard_id), layer.input_size)
            if tuple(values.shape) != expect:
                raise ValueError(
                    f"bitnet checkpoint tensor {name} has shape {tuple(loaded_weight.shape)}, unpacking to "
                    f"{tuple(values.shape)}; expected [{expect[0]}/4, {expect[1]}] for this layer"
                )
            return _load(vllm_loader, param, values, loaded_shard_id)

        return bitnet_weight_loader

    def _scale_loader(self, layer: torch.nn.Module) -> Callable:
        linear_class = self.config.spec.linear_class

        def bitnet_scale_loader(param, loaded_weight: torch.Tensor, loaded_shard_id=None):
            one = bf.packed_scale(loaded_weight, linear_class, self._name(layer, "weight_scale", loaded_shard_id))
            slots = _record(layer, loaded_shard_id, one)
            # a copy into the parameter, which vLLM's layerwise loading counts towards the layer's total
            param.data[slots[0] : slots[-1] + 1].copy_(loaded_weight.reshape(1).float().expand(len(slots)))

        return bitnet_scale_loader

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if getattr(layer, "_already_called_process_weights_after_loading", False):
            return
        if layer.weight.is_meta:
            raise ValueError(f"bitnet checkpoint is missing tensor {self._name(layer, 'weight', None)}")
        _install(layer, layer.weight.data, _slot_values(layer, self.config, "weight_scale"))

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        return apply_lowbit(layer, x, bias)


class BitNetOnlineLinearMethod(LowBitOnlineLinearMethod):
    """bf16 master weights -> BitNet's absmean ternarization per checkpoint tensor -> ``aipc::lowbit_linear``."""

    config: BitNetConfig

    def prepare(self, layer: torch.nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                extra_weight_attrs: dict[str, Any]) -> None:  # fmt: skip
        _start(layer, output_partition_sizes)  # slot value: the float32 1/mean|W| of its whole tensor
        vllm_loader = extra_weight_attrs["weight_loader"]

        def bitnet_master_loader(param, loaded_weight: torch.Tensor, loaded_shard_id=None):
            _record(layer, loaded_shard_id, bf.absmean_multiplier(loaded_weight))  # before any TP slice
            return _load(vllm_loader, param, loaded_weight, loaded_shard_id)

        extra_weight_attrs["weight_loader"] = bitnet_master_loader

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if getattr(layer, "_already_called_process_weights_after_loading", False):
            return
        weight = layer.weight
        if weight.is_meta:
            raise ValueError(f"bitnet: layer {layer.prefix!r} received no weight from the checkpoint")
        multipliers = _slot_values(layer, self.config, "weight")
        parts = [bf.ternarize(w, m) for w, m in zip(torch.split(weight.detach(), layer.bitnet_widths), multipliers)]
        _install(layer, torch.cat([v for v, _ in parts]), [one for _, one in parts])


__all__ = ["BitNetConfig", "BitNetOnlineLinearMethod", "BitNetPackedLinearMethod"]
