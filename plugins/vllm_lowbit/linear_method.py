"""vLLM linear methods for ``lowbit2``: weights in, ``aipc::lowbit_linear`` out.

* :class:`LowBit2LinearMethod` loads a pre-quantized checkpoint: canonical ``qweight`` (uint8
  ``[N, K*bits/8]``, codes packed along K), ``scales`` and, for the affine code book, ``zeros``
  (``[N, K/G]``), with vLLM's packed / group-scale parameters, so merged QKV and gate-up shards and
  tensor-parallel slices land where they belong. Every checkpoint tensor is checked (shape, dtype,
  presence, code range) with an error that names it.
* :class:`LowBit2OnlineLinearMethod` quantizes a bf16/fp16 checkpoint while it loads: vLLM's online
  quantization base keeps the float weight on the meta device and materializes one layer at a time,
  then ``process_weights_after_loading`` quantizes it with the shared quantizer, unless the weight
  already lies on a binary/ternary/2-bit grid (``detect_grid``, e.g. ParetoQ's fake-quantized bf16
  weights): then it is stored exactly in that code book (:mod:`aipc_kernels.grid_detect`), and
  :class:`LoadReport` logs once per model which layers were, and the largest reconstruction error
  of the quantized ones. A layer on no grid is refused when the code book has 1 or 2 bits, unless
  ``allow_2bit_ptq`` (:mod:`aipc_kernels.quality_gate`).

Both end in :func:`install_packed`: the canonical weight is repacked once into the layout of the
device the layer lives on (``cpu_vnni16`` on CPU) and ``apply`` calls the op; the op's dispatch
picks the kernel (native W2A8 on CPU).

Each method is built by ``LowBit2Config.get_quant_method`` with that config (its ``codebook``,
``group_size``, ``quantizer``, ``scale_dtype``, ``act_group``, ``packed_modules_mapping``); the
dependency goes one way, as in vLLM's own quantization methods: ``config`` imports this module, never
the reverse (the methods are typed with vLLM's ``QuantizationConfig``).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from vllm.distributed import get_tp_group
from vllm.logger import init_logger
from vllm.model_executor.layers.linear import (
    LinearMethodBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    register_weight_loader_v2_supported_method,
)
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig
from vllm.model_executor.layers.quantization.online.fp8 import OnlineLinearBase
from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
from vllm.model_executor.parameter import (
    ChannelQuantScaleParameter,
    GroupQuantScaleParameter,
    PackedvLLMParameter,
)

import aipc_kernels.ops  # noqa: F401  (registers torch.ops.aipc.lowbit_linear)
from aipc_kernels.formats import FILE_GROUP_SIZES, LowBitWeight, fitting_group_size, get_codebook, resolve_group_size
from aipc_kernels import packing
from aipc_kernels.grid_detect import GridWeight, detect_grid, recovered_summary
from aipc_kernels.output_projection import quantize_output_projection
from aipc_kernels.packing import PackedLowBit, as_canonical_packed, pack_for_cpu
from aipc_kernels.planned_ops import plan_cpu_call
from aipc_kernels.quality_gate import OPT_IN_KEY, SAFE_REL_ERROR, ErrorReport, needs_opt_in, ptq_refusal, relative_error
from aipc_kernels.quantizers import quantize_rows

_QKV_INDEX = {"q": 0, "k": 1, "v": 2}
logger = init_logger(f"vllm.{__name__}")  # under "vllm": the logger vLLM configures (INFO shows)


def pack_for_device(w: LowBitWeight, device: torch.device) -> PackedLowBit:
    """The layout the op's kernel for ``device`` reads: ``cpu_vnni16`` on CPU, the Triton layout on
    GPUs where aipc_kernels has it, else canonical (the op's reference path)."""
    if device.type == "cpu":
        return pack_for_cpu(w)
    pack_for_triton = getattr(packing, "pack_for_triton", None)
    return pack_for_triton(w) if pack_for_triton is not None else as_canonical_packed(w)


def effective_group_size(config: QuantizationConfig, layer: torch.nn.Module, k_part: int, fit: bool = False) -> int:
    """The group size of this layer's partition, with an error naming the layer when it does not fit.
    ``fit`` (quantizing on the fly): a configured group that does not divide K falls back to the
    largest supported one that does (:func:`~aipc_kernels.formats.fitting_group_size`), logged once
    per (K, group), and -1 stays -1 (the quantizers' spelling of one group per row); a checkpoint's
    tensors fix their group, so it is never refitted."""
    try:
        # a checkpoint's stored groups (a GGUF conversion's K-quant sub-blocks of 16 too; the config refuses
        # them in any other checkpoint)
        G = (fitting_group_size(config.group_size, k_part) if fit
             else resolve_group_size(config.group_size, k_part, FILE_GROUP_SIZES))  # fmt: skip
    except ValueError as e:
        tp = "" if k_part == layer.input_size else f" (this tensor-parallel rank holds K={k_part} of {layer.input_size})"
        raise ValueError(
            f"{config.get_name()} cannot quantize layer {layer.prefix!r}{tp}: {e}; or list it in "
            f"quantization_config.modules_to_not_convert"
        ) from None
    if fit and config.group_size not in (-1, G) and (k_part, G) not in config.group_fallbacks:
        config.group_fallbacks.add((k_part, G))
        logger.info("%s: group_size=%d does not divide K=%d (e.g. layer %s); layers with that K use group_size=%d",
                    config.get_name(), config.group_size, k_part, layer.prefix, G)  # fmt: skip
    return G


def check_partition(config: QuantizationConfig, layer: torch.nn.Module, k_part: int, fit: bool = False) -> int:
    """Validates this rank's slice of a layer and returns its group size (``fit``: as
    :func:`effective_group_size`)."""
    G = effective_group_size(config, layer, k_part, fit)
    if config.act_group and k_part % config.act_group:
        raise ValueError(
            f"{config.get_name()} act_group={config.act_group} does not divide this rank's K={k_part} of layer "
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


def install_packed(layer: torch.nn.Module, w: LowBitWeight, act_group: int, activations: str = "int8") -> None:
    """Replaces the layer's weight parameters by ``w`` packed for the layer's device (once);
    ``activations``: ``float`` runs a 4-bit weight on the activation-exact W4A16 op (other widths stay
    W*A8)."""
    device = w.qweight.device
    packed = pack_for_device(w, device)
    for name in ("weight", "qweight", "scales", "zeros", "supers"):
        if name in layer._parameters:
            delattr(layer, name)
    for name, t in (("qweight", packed.qweight), ("scales", packed.scales), ("zeros", packed.zeros),
                    ("supers", packed.supers)):  # fmt: skip
        layer.register_parameter(name, None if t is None else torch.nn.Parameter(t, requires_grad=False))
    layer.lowbit_layout = packed.layout
    layer.lowbit_codebook = packed.codebook
    layer.lowbit_group_size = packed.group_size
    layer.lowbit_out_features = packed.out_features
    layer.lowbit_act_group = act_group
    layer.lowbit_a16 = activations == "float" and w.bits == 4
    layer.lowbit_split_rows = not layer.lowbit_a16 and splits_token_rows(layer, act_group)
    # on a CPU: the planned op (operands checked here, once; the per-call cost in C++), when built
    layer.lowbit_cpu_call = plan_cpu_call(packed, act_group, "e0m4" if layer.lowbit_a16 else None)
    layer._already_called_process_weights_after_loading = True


def installed_weight(layer: torch.nn.Module) -> PackedLowBit:
    """The packed weight :func:`install_packed` put on ``layer`` (a linear layer or an embedding), over the
    layer's tensors as they are now."""
    K = layer.embedding_dim if hasattr(layer, "embedding_dim") else layer.input_size_per_partition
    return PackedLowBit(layer.lowbit_layout, layer.qweight, layer.scales, layer.zeros, layer.lowbit_codebook,
                        layer.lowbit_group_size, layer.lowbit_out_features, K, layer.supers)  # fmt: skip


def apply_lowbit(layer: torch.nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor],
                 act_amax: Optional[torch.Tensor] = None) -> torch.Tensor:  # fmt: skip
    """``x @ W^T + bias`` through ``aipc::lowbit_linear`` (its fake kernel makes it torch.compile-able);
    ``act_amax``: the op's per-token activation absmax, None for each token's own (a row-parallel layer
    over several ranks with per-token scales takes the whole row's: :func:`splits_token_rows`). A layer
    installed with float activations runs ``aipc::lowbit_linear_a16`` (E0M4 dequantization) instead. On a
    CPU each runs as its planned form (:mod:`aipc_kernels.planned_ops`), operands checked at install."""
    if act_amax is None and layer.lowbit_split_rows:
        act_amax = whole_row_amax(x)
    if layer.lowbit_cpu_call is not None:
        return layer.lowbit_cpu_call(x, layer.qweight, layer.scales, layer.zeros, bias, act_amax, layer.supers)
    if layer.lowbit_a16:
        return torch.ops.aipc.lowbit_linear_a16(
            x, layer.qweight, layer.scales, layer.zeros, bias, layer.lowbit_layout, layer.lowbit_codebook,
            layer.lowbit_group_size, layer.lowbit_out_features, "e0m4",
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


@register_weight_loader_v2_supported_method
class LowBit2LinearMethod(LinearMethodBase):
    """Pre-quantized ``lowbit2`` checkpoint -> device layout -> ``aipc::lowbit_linear``."""

    def __init__(self, config: QuantizationConfig):
        self.config = config
        self.cb = get_codebook(config.codebook)

    def create_weights(
        self,
        layer: torch.nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs,
    ) -> None:
        cfg, bits = self.config, self.cb.bits
        K, N = input_size_per_partition, sum(output_partition_sizes)
        G = check_partition(cfg, layer, K)
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
            if cfg.group_size == -1:  # one scale per row: replicated across row-parallel ranks
                p = ChannelQuantScaleParameter(
                    data=torch.empty(N, 1, dtype=cfg.scale_dtype), output_dim=0, weight_loader=loader
                )
            else:
                p = GroupQuantScaleParameter(
                    data=torch.empty(N, K // G, dtype=cfg.scale_dtype), output_dim=0, input_dim=1, weight_loader=loader
                )
            layer.register_parameter(name, p)
        if not self.cb.per_group_tensor:
            layer.register_parameter("zeros", None)

    # ------------------------------------------------------------------ checkpoint checks

    def _checkpoint_name(self, layer: torch.nn.Module, pname: str, shard) -> str:
        return checkpoint_tensor_name(self.config, layer, pname, shard)

    def _expected(self, layer: torch.nn.Module, pname: str, shard) -> tuple[tuple[int, int], torch.dtype]:
        rows, K = checkpoint_rows(layer, shard), layer.input_size
        if pname == "qweight":
            return (rows, K * self.cb.bits // 8), torch.uint8
        groups = 1 if self.config.group_size == -1 else K // self.config.group_size
        return (rows, groups), self.config.scale_dtype

    def _checked_loader(self, layer: torch.nn.Module, pname: str, loader: Callable) -> Callable:
        """vLLM's loader for ``pname``, after checking the checkpoint tensor's shape and dtype."""

        def lowbit2_weight_loader(param, loaded_weight: torch.Tensor, loaded_shard_id=None):
            name = self._checkpoint_name(layer, pname, loaded_shard_id)
            shape, dtype = self._expected(layer, pname, loaded_shard_id)
            if tuple(loaded_weight.shape) != shape:
                raise ValueError(
                    f"lowbit2 checkpoint tensor {name} has shape {tuple(loaded_weight.shape)}, expected {shape} "
                    f"(codebook={self.config.codebook}, group_size={self.config.group_size}, in_features={layer.input_size})"
                )
            if loaded_weight.dtype != dtype:
                raise ValueError(
                    f"lowbit2 checkpoint tensor {name} has dtype {loaded_weight.dtype}, expected {dtype} "
                    f"(quantization_config.scale_dtype={self.config.scale_dtype_name})"
                )
            if loaded_shard_id is None:
                layer.lowbit_loaded.update((pname, s) for s in layer_shards(layer))
                return loader(param, loaded_weight)
            ids = loaded_shard_id if isinstance(loaded_shard_id, tuple) else (loaded_shard_id,)
            layer.lowbit_loaded.update((pname, s) for s in ids)
            return loader(param, loaded_weight, loaded_shard_id)

        return lowbit2_weight_loader

    def _check_loaded(self, layer: torch.nn.Module) -> LowBitWeight:
        """The layer's canonical weight, after checking every tensor arrived and holds valid codes."""
        pnames = ["qweight", "scales"] + (["zeros"] if self.cb.per_group_tensor else [])
        missing = [self._checkpoint_name(layer, p, s) for p in pnames for s in layer_shards(layer) if (p, s) not in layer.lowbit_loaded]
        if missing:
            raise ValueError(
                f"lowbit2 checkpoint is missing tensor {missing[0]}"
                + (f" (and {len(missing) - 1} more of layer {layer.prefix})" if len(missing) > 1 else "")
                + f"; codebook={self.config.codebook} needs {', '.join(pnames)} for every quantized linear"
            )
        K = layer.lowbit_k_partition
        G = effective_group_size(self.config, layer, K)
        zeros = layer.zeros.data if self.cb.per_group_tensor else None
        w = LowBitWeight(layer.qweight.data, layer.scales.data, zeros, self.config.codebook, G, K, name=layer.prefix)
        for pname, t in (("scales", w.scales), ("zeros", w.zeros)):
            if t is not None and not torch.isfinite(t).all():
                raise ValueError(f"lowbit2 checkpoint tensor {layer.prefix}.{pname} holds NaN or Inf")
        if self.cb.max_code < (1 << self.cb.bits) - 1 and (w.codes() > self.cb.max_code).any():
            raise ValueError(
                f"lowbit2 checkpoint tensor {layer.prefix}.qweight holds codes above {self.cb.max_code}, "
                f"invalid for codebook={self.config.codebook}"
            )
        return w

    # ------------------------------------------------------------------ vLLM interface

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if getattr(layer, "_already_called_process_weights_after_loading", False):
            return
        install_packed(layer, self._check_loaded(layer), self.config.act_group, self.config.activations)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        return apply_lowbit(layer, x, bias)


class LoadReport:
    """What on-the-fly quantization did to a model, logged once every expected layer is processed: the
    layers ``detect_grid`` recovered (with a warning when only some of them lay on a grid) and the
    largest relative reconstruction error of the quantized ones against the quality table's bounds
    (:class:`aipc_kernels.quality_gate.ErrorReport`)."""

    def __init__(self, method: str) -> None:
        self.method = method
        self.pending: set[str] = set()
        self.grids: dict[str, GridWeight] = {}
        self.others: list[str] = []
        self.errors = ErrorReport()

    def expect(self, prefix: str) -> None:
        self.pending.add(prefix)

    def add(self, prefix: str, grid: Optional[GridWeight], config: QuantizationConfig,
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

    def _log(self, config: QuantizationConfig) -> None:
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
                self.method, n, total, len(self.others), self.others[0], config.codebook, config.group_size,
            )  # fmt: skip


class LowBit2OnlineLinearMethod(OnlineLinearBase):
    """bf16/fp16 checkpoint -> quantized while loading, one layer at a time -> ``aipc::lowbit_linear``."""

    def __init__(self, config: QuantizationConfig):
        super().__init__()
        self.config = config

    def create_weights(
        self,
        layer: torch.nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs,
    ) -> None:
        check_partition(self.config, layer, input_size_per_partition, fit=True)  # fail before loading anything
        super().create_weights(
            layer, input_size_per_partition, output_partition_sizes, input_size, output_size, params_dtype,
            **extra_weight_attrs,
        )  # fmt: skip

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if getattr(layer, "_already_called_process_weights_after_loading", False):
            return
        cfg = self.config
        weight = self.get_weight_for_quantization(layer)
        if weight.is_meta:
            raise ValueError(f"{cfg.get_name()}: layer {layer.prefix!r} received no weight from the checkpoint")
        G = effective_group_size(cfg, layer, weight.shape[1], fit=True)
        grid, error = None, None
        if cfg.detect_grid:  # whole-row scales, unless act_group needs groups
            grid = detect_grid(weight.detach(), layer.prefix, -1 if cfg.act_group == 0 else G, cfg.scale_dtype)
        if grid is not None:
            w = grid.weight
        else:
            if needs_opt_in(cfg.codebook) and not cfg.allow_2bit_ptq:
                raise ValueError(ptq_refusal(layer.prefix, cfg.codebook, cfg.get_name(), _opt_in_hint(cfg)))
            w = quantize_rows(weight.detach(), cfg.codebook, G, cfg.quantizer, cfg.scale_dtype, name=layer.prefix)
            error = relative_error(weight, w)
        install_packed(layer, w, cfg.act_group, cfg.activations)
        cfg.grid_report.add(layer.prefix, grid, cfg, error)
        if self.requantization_source is not None:
            self.release_requantization_source_weights(layer)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        return apply_lowbit(layer, x, bias)


def _opt_in_hint(config: QuantizationConfig) -> str:
    """How a server user sets the opt-in (the keys they gave, plus it)."""
    return (f"--hf-overrides '{{\"quantization_config\": {{\"quant_method\": \"{config.get_name()}\", "
            f"\"{OPT_IN_KEY}\": true}}}}' (or {OPT_IN_KEY}: true in the quantization_config you pass), or convert "
            f"with python -m vllm_lowbit.quantize MODEL OUT --allow-2bit-ptq")  # fmt: skip


class QuantizedLMHeadMethod(UnquantizedEmbeddingMethod):
    """The output projection quantized at load (``lm_head: int8``, the default, or ``lowbit``) by
    :func:`aipc_kernels.output_projection.quantize_output_projection` with ``quantize_options`` (its
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
