"""What the plugin's quantization methods share (``lowbit2``, ``lowbit4``, ``bitnet``, ``gguf_cpu``), as
vLLM's own layer helpers sit apart from its methods.

* A layer's weight in, ``aipc::lowbit_linear`` out: :func:`install_packed` repacks a canonical
  :class:`~aipc_kernels.lowbit.formats.LowBitWeight` once into the layout of the device the layer lives on
  (``cpu_vnni16`` on CPU) and :func:`apply_lowbit` calls the op (its dispatch picks the kernel: native
  W·A8 on CPU); :func:`installed_weight` reads the packed weight back.
* Checking a layer's partition (:func:`check_partition`, :func:`effective_group_size`) against a
  :class:`LowBitConfig`'s ``options``.
* Where a checkpoint tensor lands in a layer: merged q/k/v and gate/up shards (:func:`layer_shards`,
  :func:`checkpoint_rows`, :func:`shard_index`) and its name for errors (:func:`checkpoint_tensor_name`).
* :func:`whole_row_amax`: the per-token activation scale of a row-parallel layer over several ranks.
* :class:`QuantizedLMHeadMethod`: the output projection quantized at load (``lowbit2``, ``lowbit4``,
  ``bitnet``); :class:`LowBitOnlineLinearMethod`: vLLM's online quantization onto the op (``lowbit2`` /
  ``lowbit4`` on the fly, BitNet's bf16 masters).
* The configs' bases: :class:`PluginQuantizationConfig`, what every config of this plugin answers vLLM
  alike; :class:`LowBitConfig`, a config over lowbit2's keys kept as one frozen ``options`` object
  (``lowbit2``, ``lowbit4`` and its GPTQ / AWQ checkpoints).
"""
from __future__ import annotations

from typing import Any, ClassVar, Optional

import torch
from vllm.distributed import get_tp_group
from vllm.logger import init_logger
from vllm.platforms import current_platform
from vllm.model_executor.layers.linear import (LinearBase, MergedColumnParallelLinear, QKVParallelLinear,
                                               RowParallelLinear, UnquantizedLinearMethod)  # fmt: skip
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase
from vllm.model_executor.layers.quantization.online.fp8 import OnlineLinearBase
from vllm.model_executor.layers.quantization.utils.quant_utils import is_layer_skipped
from vllm.model_executor.layers.vocab_parallel_embedding import (ParallelLMHead, UnquantizedEmbeddingMethod,
                                                                 VocabParallelEmbedding)  # fmt: skip

import aipc_kernels.lowbit.ops  # noqa: F401  (registers torch.ops.aipc.lowbit_linear)
from aipc_kernels.lowbit.ops import a16_dequant
from aipc_kernels.core.config_schema import Naming
from aipc_kernels.lowbit import packing
from aipc_kernels.lowbit.formats import FILE_GROUP_SIZES, LowBitWeight, fitting_group_size, resolve_group_size
from aipc_kernels.lowbit.modules import DEFAULT_SKIP
from aipc_kernels.lowbit.output_projection import head_act_group, quantize_output_projection, resolve_head_format
from aipc_kernels.lowbit.packing import PackedLowBit, as_canonical_packed, dequantize_rows, pack_for_cpu
from aipc_kernels.lowbit.planned_ops import plan_cpu_call

from .options import CONFIG_NAMING, STORED, QuantizationConfigOptions, parse_quantization_config

_QKV_INDEX = {"q": 0, "k": 1, "v": 2}
logger = init_logger(f"vllm.{__name__}")  # under "vllm": the logger vLLM configures (INFO shows)


def pack_for_device(w: LowBitWeight, device: torch.device) -> PackedLowBit:
    """The layout the op's kernel for ``device`` reads: ``cpu_vnni16`` on CPU, the Triton layout on
    GPUs where aipc_kernels has it, else canonical (the op's reference path)."""
    if device.type == "cpu":
        return pack_for_cpu(w)
    pack_for_triton = getattr(packing, "pack_for_triton", None)
    return pack_for_triton(w) if pack_for_triton is not None else as_canonical_packed(w)


def effective_group_size(config: LowBitConfig, layer: torch.nn.Module, k_part: int, fit: bool = False) -> int:
    """The group size of this layer's partition, with an error naming the layer when it does not fit.
    ``fit`` (quantizing on the fly): a configured group that does not divide K falls back to the
    largest supported one that does (:func:`~aipc_kernels.lowbit.formats.fitting_group_size`), logged once
    per (K, group), and -1 stays -1 (the quantizers' spelling of one group per row); a checkpoint's
    tensors fix their group, so it is never refitted."""
    group = config.options.group_size
    try:
        # a checkpoint's stored groups (a GGUF conversion's K-quant sub-blocks of 16 too; the config refuses
        # them in any other checkpoint)
        G = (fitting_group_size(group, k_part) if fit
             else resolve_group_size(group, k_part, FILE_GROUP_SIZES))  # fmt: skip
    except ValueError as e:
        tp = "" if k_part == layer.input_size else f" (this tensor-parallel rank holds K={k_part} of {layer.input_size})"
        raise ValueError(
            f"{config.get_name()} cannot quantize layer {layer.prefix!r}{tp}: {e}; or list it in "
            f"quantization_config.modules_to_not_convert"
        ) from None
    if fit and group not in (-1, G) and (k_part, G) not in config.group_fallbacks:
        config.group_fallbacks.add((k_part, G))
        logger.info("%s: group_size=%d does not divide K=%d (e.g. layer %s); layers with that K use group_size=%d",
                    config.get_name(), group, k_part, layer.prefix, G)  # fmt: skip
    return G


def check_partition(config: LowBitConfig, layer: torch.nn.Module, k_part: int, fit: bool = False) -> int:
    """Validates this rank's slice of a layer and returns its group size (``fit``: as
    :func:`effective_group_size`)."""
    G = effective_group_size(config, layer, k_part, fit)
    act_group = config.options.act_group
    if act_group and k_part % act_group:
        raise ValueError(
            f"{config.get_name()} act_group={act_group} does not divide this rank's K={k_part} of layer "
            f"{layer.prefix!r}; pick an act_group that divides in_features / tensor_parallel_size"
        )
    return G


def splits_token_rows(layer: torch.nn.Module, act_group: int) -> bool:
    """Whether ``layer``, if it quantizes its activations to int8, holds only its rank's slice of each
    token's features under one scale per token: a row-parallel layer over several ranks with
    ``act_group`` 0. Such a layer takes the whole row's absmax (:func:`whole_row_amax`)."""
    return act_group == 0 and isinstance(layer, RowParallelLinear) and getattr(layer, "tp_size", 1) > 1


def whole_row_amax(x: torch.Tensor) -> torch.Tensor:
    """float32 [M]: the per-token absmax of the whole rows of which ``x [..., K / tp]`` holds this rank's
    slice: each rank's absmax all-gathered over the TP group ([M, tp]), then the max (vLLM's collective,
    traceable under torch.compile). Every rank then quantizes its slice with the single-rank scale."""
    local = x.abs().amax(dim=-1).float().reshape(-1, 1)  # the max is exact in x's dtype
    return get_tp_group().all_gather(local, dim=-1).amax(dim=-1)


def _drop_weight_parameters(layer: torch.nn.Module) -> None:
    """Removes the weight parameters a packed install replaces (the float ``weight``, a checkpoint's own)."""
    for name in ("weight", "qweight", "scales", "zeros", "supers"):
        if name in layer._parameters:
            delattr(layer, name)


def install_packed(layer: torch.nn.Module, w: LowBitWeight, act_group: int, activations: str = "int8") -> None:
    """Replaces the layer's weight parameters by ``w`` packed for the layer's device (once);
    ``activations``: ``float`` runs a 4-bit weight on the activation-exact W4A16 op (other widths stay
    W*A8)."""
    device = w.qweight.device
    packed = pack_for_device(w, device)
    _drop_weight_parameters(layer)
    for name, t in (("qweight", packed.qweight), ("scales", packed.scales), ("zeros", packed.zeros),
                    ("supers", packed.supers)):  # fmt: skip
        layer.register_parameter(name, None if t is None else torch.nn.Parameter(t, requires_grad=False))
    layer.lowbit_layout = packed.layout
    layer.lowbit_codebook = packed.codebook
    layer.lowbit_group_size = packed.group_size
    layer.lowbit_out_features = packed.out_features
    layer.lowbit_act_group = act_group
    layer.lowbit_a16 = activations == "float" and w.bits == 4
    layer.lowbit_a16_dequant = a16_dequant(packed.layout)  # chosen once: a plain attribute under torch.compile
    layer.lowbit_split_rows = not layer.lowbit_a16 and splits_token_rows(layer, act_group)
    # on a CPU: the planned op (operands checked here, once; the per-call cost in C++), when built
    layer.lowbit_cpu_call = plan_cpu_call(packed, act_group, layer.lowbit_a16_dequant if layer.lowbit_a16 else None)
    layer._already_called_process_weights_after_loading = True


class PackedSegment(torch.nn.Module):
    """Output rows ``[start, stop)`` of a merged layer whose parts have different stored forms (a GGUF
    Q4_K_M layer's Q4_K q / k beside its Q6_K v): its own packed weight (:func:`install_packed`), run by its
    own op call (:func:`apply_segments`)."""

    def __init__(self, start: int, stop: int, input_size: int):
        super().__init__()
        self.start, self.stop = start, stop
        self.input_size_per_partition = input_size


def install_segments(layer: torch.nn.Module, weights: list[LowBitWeight], act_groups: list[int],
                     activations: Optional[list[str]] = None) -> None:  # fmt: skip
    """Installs ``weights`` (consecutive output rows of ``layer``, each with its op's ``act_group`` and
    ``activations``, as :func:`install_packed` takes them; default int8) as ``layer.lowbit_segments``, each
    part in its own stored form, so no part is widened to a common one."""
    _drop_weight_parameters(layer)
    segments, start = [], 0
    for w, act_group, acts in zip(weights, act_groups, activations or ["int8"] * len(weights)):
        segment = PackedSegment(start, start + w.out_features, w.in_features)
        install_packed(segment, w, act_group, acts)
        segments.append(segment)
        start += w.out_features
    layer.lowbit_segments = torch.nn.ModuleList(segments)
    layer.lowbit_out_features = start
    layer._already_called_process_weights_after_loading = True


def apply_segments(layer: torch.nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``x @ W^T + bias`` for a layer :func:`install_segments` installed: one :func:`apply_lowbit` call per
    segment, the outputs side by side."""
    return torch.cat([apply_lowbit(s, x, None if bias is None else bias[s.start : s.stop])
                      for s in layer.lowbit_segments], dim=-1)  # fmt: skip


def installed_weight(layer: torch.nn.Module) -> PackedLowBit:
    """The packed weight :func:`install_packed` put on ``layer`` (a linear layer or an embedding), over the
    layer's tensors as they are now."""
    K = layer.embedding_dim if hasattr(layer, "embedding_dim") else layer.input_size_per_partition
    return PackedLowBit(layer.lowbit_layout, layer.qweight, layer.scales, layer.zeros, layer.lowbit_codebook,
                        layer.lowbit_group_size, layer.lowbit_out_features, K, layer.supers)  # fmt: skip


def packed_embedding(layer: torch.nn.Module, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The rows ``ids`` of the token embedding :func:`install_packed` put on ``layer``, dequantized to ``dtype``
    (only the rows read; :func:`~aipc_kernels.lowbit.packing.dequantize_rows`: the stored values exactly), shaped
    ``[*ids.shape, embedding_dim]``. A tied output projection multiplies the same packed tensor."""
    rows = dequantize_rows(installed_weight(layer), ids, dtype)
    return rows.reshape(*ids.shape, layer.embedding_dim)


def apply_lowbit(layer: torch.nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor],
                 act_amax: Optional[torch.Tensor] = None) -> torch.Tensor:  # fmt: skip
    """``x @ W^T + bias`` through ``aipc::lowbit_linear`` (its fake kernel makes it torch.compile-able);
    ``act_amax``: the op's per-token activation absmax, None for each token's own (a row-parallel layer
    over several ranks with per-token scales takes the whole row's: :func:`splits_token_rows`). A layer
    installed with float activations runs ``aipc::lowbit_linear_a16`` instead, with the dequantization
    :func:`~aipc_kernels.lowbit.ops.a16_dequant` chose at install. On a CPU each runs as its planned form
    (:mod:`aipc_kernels.lowbit.planned_ops`), operands checked at install."""
    if act_amax is None and layer.lowbit_split_rows:
        act_amax = whole_row_amax(x)
    if layer.lowbit_cpu_call is not None:
        return layer.lowbit_cpu_call(x, layer.qweight, layer.scales, layer.zeros, bias, act_amax, layer.supers)
    if layer.lowbit_a16:
        return torch.ops.aipc.lowbit_linear_a16(
            x, layer.qweight, layer.scales, layer.zeros, bias, layer.lowbit_layout, layer.lowbit_codebook,
            layer.lowbit_group_size, layer.lowbit_out_features, layer.lowbit_a16_dequant,
        )  # fmt: skip
    return torch.ops.aipc.lowbit_linear(
        x, layer.qweight, layer.scales, layer.zeros, bias, layer.lowbit_layout, layer.lowbit_codebook,
        layer.lowbit_group_size, layer.lowbit_out_features, layer.lowbit_act_group, act_amax, layer.supers,
    )  # fmt: skip


def layer_shards(layer: torch.nn.Module) -> list:
    """The checkpoint shards a layer is loaded from (``None``: one unfused tensor)."""
    if isinstance(layer, QKVParallelLinear):
        return ["q", "k", "v"]
    if isinstance(layer, MergedColumnParallelLinear):
        return list(range(len(layer.output_sizes)))
    return [None]


def checkpoint_rows(layer: torch.nn.Module, shard) -> int:
    """Rows (output features) of the full, unsharded checkpoint tensor for ``shard``."""
    if isinstance(layer, QKVParallelLinear):
        sizes = {
            "q": layer.total_num_heads * layer.head_size,
            "k": layer.total_num_kv_heads * layer.head_size,
            "v": layer.total_num_kv_heads * layer.v_head_size,
        }
        return sum(sizes.values()) if shard is None else sizes[shard]
    if isinstance(layer, MergedColumnParallelLinear):
        if shard is None:
            return sum(layer.output_sizes)
        if isinstance(shard, tuple):
            return sum(layer.output_sizes[i] for i in shard)
        return layer.output_sizes[shard]
    return layer.output_size


def shard_index(shard) -> int:
    """Position of a checkpoint shard in its merged layer (q, k, v -> 0, 1, 2; merged index as is)."""
    return _QKV_INDEX.get(shard, shard)


def checkpoint_tensor_name(config: QuantizationConfig, layer: torch.nn.Module, pname: str, shard) -> str:
    """The checkpoint name of ``layer``'s tensor ``pname`` for ``shard`` (``q_proj.weight`` for the
    q shard of ``qkv_proj``), for the errors of the loaders."""
    if shard is None:
        return f"{layer.prefix}.{pname}"
    parent, _, last = layer.prefix.rpartition(".")
    parts = config.packed_modules_mapping.get(last)
    idx = shard_index(shard)
    if parts and isinstance(idx, int) and idx < len(parts):
        return f"{parent}.{parts[idx]}.{pname}" if parent else f"{parts[idx]}.{pname}"
    return f"{layer.prefix}.{pname} (shard {shard})"


class QuantizedLMHeadMethod(UnquantizedEmbeddingMethod):
    """The output projection quantized at load (``lm_head: int8``, ``int6`` or ``lowbit``; ``auto``, the
    default, is one of the first two: :attr:`PluginQuantizationConfig.head_format`) by
    :func:`aipc_kernels.lowbit.output_projection.quantize_output_projection` with ``quantize_options`` (its
    keyword arguments after the weight and name) and run through ``aipc::lowbit_linear``. Its float
    weight is loaded (or tied to the input embedding) as usual; a tied embedding keeps it for the
    token lookup, an untied head drops it after quantizing. Used by ``lowbit2`` and ``bitnet``."""

    def __init__(self, act_group: int = 0, **quantize_options):
        self.act_group = act_group
        self.quantize_options = quantize_options

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if getattr(layer, "_already_called_process_weights_after_loading", False):
            return
        name = getattr(layer, "prefix", "") or "lm_head"
        w = quantize_output_projection(layer.weight.detach(), name=name, **self.quantize_options)
        install_packed(layer, w, self.act_group)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        return apply_lowbit(layer, x, bias)


class LowBitOnlineLinearMethod(OnlineLinearBase):
    """vLLM's online quantization onto ``aipc::lowbit_linear`` (``lowbit2`` / ``lowbit4`` on the fly, BitNet's
    bf16 masters): the float weight waits on the meta device and one layer at a time materializes; a
    subclass readies the layer first (:meth:`prepare`) and installs it in ``process_weights_after_loading``."""

    def __init__(self, config: QuantizationConfig):
        super().__init__()
        self.config = config

    def prepare(self, layer: torch.nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                extra_weight_attrs: dict[str, Any]) -> None:  # fmt: skip
        """Before vLLM declares the float weight (may replace ``extra_weight_attrs["weight_loader"]``)."""

    def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype, **extra_weight_attrs) -> None:  # fmt: skip
        self.prepare(layer, input_size_per_partition, output_partition_sizes, extra_weight_attrs)
        super().create_weights(
            layer, input_size_per_partition, output_partition_sizes, input_size, output_size, params_dtype,
            **extra_weight_attrs,
        )  # fmt: skip

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        return apply_lowbit(layer, x, bias)


# ---------------------------------------------------------------------- the configs' bases


class PluginQuantizationConfig(QuantizationConfig):
    """What every quantization method of this plugin answers vLLM alike: float activations of any width,
    no CUDA-capability requirement (the native kernel on CPU, reference / Triton elsewhere), and no config
    file of its own (without a ``quantization_config`` in config.json, vLLM builds the config from its
    defaults: ``--quantization lowbit2`` on a bf16 checkpoint quantizes it on the fly)."""

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @property
    def head_setting(self) -> str:
        """The ``lm_head`` setting as configured: ``auto`` or a format."""
        raise NotImplementedError

    @property
    def head_format(self) -> str:
        """The output projection's format on this platform: :attr:`head_setting` with ``auto`` resolved
        (:func:`~aipc_kernels.lowbit.output_projection.auto_head_format`: by the CPU kernels' instruction set);
        ``stored`` (a GGUF conversion's own head) as it is."""
        if self.head_setting == STORED:
            return STORED
        return resolve_head_format(self.head_setting, on_cpu=current_platform.is_cpu())

    @property
    def head_label(self) -> str:
        """``lm_head`` as a config's repr logs it: the format, or ``auto`` with the one chosen."""
        given, head = self.head_setting, self.head_format
        return given if given == head else f"{given} ({head})"


class LowBitConfig(PluginQuantizationConfig):
    """A config over lowbit2's ``quantization_config`` keys, what ``lowbit2`` and ``lowbit4`` share: the keys
    parsed once (over the class's :attr:`defaults`; errors name :attr:`naming`'s key) into :attr:`options`,
    the frozen :class:`~vllm_lowbit.options.QuantizationConfigOptions` every method reads;
    ``modules_to_not_convert``; the output projection (``lm_head``); the group fallbacks already logged.
    A subclass names the method (:attr:`name`) and gives each quantized linear its :meth:`linear_method`."""

    #: the quantization method's name (``--quantization``)
    name: ClassVar[str]
    #: how errors about this method's quantization_config name a key
    naming: ClassVar[Naming] = CONFIG_NAMING
    #: keys applied before the given ones
    defaults: ClassVar[dict[str, Any]] = {}

    def __init__(self, /, **config: Any) -> None:
        super().__init__()
        self.options: QuantizationConfigOptions = parse_quantization_config({**self.defaults, **config}, self.naming)
        self.group_fallbacks: set[tuple[int, int]] = set()  # (K, group) already logged

    @classmethod
    def get_name(cls) -> str:
        return cls.name

    def is_skipped(self, prefix: str) -> bool:
        """Whether the linear layer ``prefix`` stays unquantized (``modules_to_not_convert``)."""
        skip = list(DEFAULT_SKIP) + list(self.options.modules_to_not_convert)
        return is_layer_skipped(prefix, skip, self.packed_modules_mapping, match_mode="substring")

    @property
    def head_setting(self) -> str:
        return self.options.head_setting

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> Optional[QuantizeMethodBase]:
        o = self.options
        if isinstance(layer, VocabParallelEmbedding) and (method := self.embedding_method(layer)) is not None:
            return method
        if isinstance(layer, ParallelLMHead) and (head := self.head_format) != "float":
            return QuantizedLMHeadMethod(
                head_act_group(head, o.act_group), head_format=head, codebook=o.codebook,
                group_size=o.group_size, quantizer=o.quantizer, scale_dtype=o.torch_scale_dtype,
            )  # fmt: skip
        if not isinstance(layer, LinearBase):
            return None  # embeddings (and lm_head: float) stay in the model dtype
        if self.is_skipped(prefix):
            return UnquantizedLinearMethod()
        return self.linear_method(prefix)

    def linear_method(self, prefix: str) -> QuantizeMethodBase:
        """The method of the quantized linear layer ``prefix``."""
        raise NotImplementedError

    def embedding_method(self, layer: VocabParallelEmbedding) -> Optional[QuantizeMethodBase]:
        """The method of a token embedding or output projection that the checkpoint stores packed, or None
        (embeddings a float gather, the output projection as ``lm_head`` says)."""
        return None
