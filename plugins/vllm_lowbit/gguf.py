"""llama.cpp GGUF files served on vLLM-CPU: ``LLM("./X.gguf")`` and ``vllm serve ./X.gguf``, the file's
quantized blocks re-laid out exactly onto the lowbit kernels (``aipc::lowbit_linear``).

vLLM 0.32 has no GGUF code. Three of its extension points, and one small patch:

* **Routing** (:func:`install_routing`, the patch): ``EngineArgs.create_engine_config`` and
  ``create_model_config`` are wrapped so that a ``model`` naming a ``.gguf`` file is opened and checked
  (:func:`vllm_lowbit.gguf_source.open_gguf`: structure, architecture, every tensor's type; a refusal
  names the file and the tensor, in the calling process), its config and tokenizer are materialised once
  into a cache folder (:func:`vllm_lowbit.gguf_source.config_folder`) and the engine arguments become
  ``model``/``tokenizer`` = that folder, ``model_weights`` = the .gguf, ``quantization`` = ``load_format``
  = :data:`GGUF_CPU`, ``served_model_name`` = the name given. This is what the out-of-tree
  ``vllm-gguf-plugin`` does for CUDA (its kernels are CUDA-only); with both plugins installed this one acts
  on CPU only (``current_platform.is_cpu()``) and leaves every other device to that plugin. Tensor and
  pipeline parallelism are refused for now.
* **Quantization method** ``gguf_cpu`` (:class:`GGUFCPUConfig`, ``register_quantization_config``). Not
  ``gguf``: that is the ``vllm-gguf-plugin``'s name, and vLLM lets the last registration of a name win
  silently (a debug log), so with both installed the method a process got would depend on plugin load
  order. :class:`GGUFLinearMethod` receives each layer's blocks (raw ``qweight`` + ``qweight_type``, or a
  float ``weight``; merged q/k/v and gate/up as shards, or whole as Phi-3 stores them) and at
  ``process_weights_after_loading`` re-lays them out (:func:`aipc_kernels.checkpoints.gguf.relayout`),
  concatenates the shards along N when they share code book and group and installs them exactly as the
  lowbit2 / lowbit4 methods do (:func:`vllm_lowbit.layers.install_packed`,
  :func:`~vllm_lowbit.layers.apply_lowbit`); shards of different forms (Q4_K_M's Q4_K q / k beside a Q6_K v)
  become segments of the layer, each in its own form and op call (:func:`vllm_lowbit.layers.install_segments`),
  none widened to a common one (a merged layer of float and quantized tensors is refused, naming the layer and
  the types).
  Float layers (F32 / F16 / BF16) run vLLM's own unquantized path. :class:`GGUFEmbeddingMethod` holds the
  token embedding packed once: the lookup dequantizes only the rows it reads
  (:func:`aipc_kernels.lowbit.packing.dequantize_rows`, the file's exact values) and a tied output projection
  multiplies the same packed tensor on the W·A8 kernels (Q8_0 is the ``int8`` code book, groups of 32).
* **Model loader** ``gguf_cpu`` (:class:`GGUFCPUModelLoader`, ``register_model_loader``): reads the
  tensors with :class:`aipc_kernels.checkpoints.gguf.GGUFCheckpoint` under transformers' GGUF name mapping
  (:class:`vllm_lowbit.gguf_source.GGUFTensors`, llama's q / k rows put back in Hugging Face order) into
  the model's own ``load_weights``, and refuses a file that leaves a parameter unloaded, naming it.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from vllm.engine.arg_utils import EngineArgs
from vllm.logger import init_logger
from vllm.model_executor.layers.linear import LinearBase, LinearMethodBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod, VocabParallelEmbedding
from vllm.model_executor.model_loader import register_model_loader
from vllm.model_executor.model_loader.base_loader import BaseModelLoader

from aipc_kernels.lowbit.formats import LowBitWeight

from . import gguf_source
from .layers import (PluginQuantizationConfig, apply_lowbit, apply_segments, checkpoint_rows, checkpoint_tensor_name,
                     install_packed, install_segments, layer_shards, packed_embedding)  # fmt: skip
from .options import GGUF_ACT_GROUP, gguf_layer_act_group

logger = init_logger(f"vllm.{__name__}")  # under "vllm": the logger vLLM configures (INFO shows)

#: the quantization method's and the model loader's name
GGUF_CPU = "gguf_cpu"
#: what the loader sends a layer, and its dtype (placeholders of these dtypes: vLLM's loader then logs no
#: mismatch; None: the model's dtype, in which the loader sends float tensors)
_SLOTS = {"qweight": torch.uint8, "qweight_type": torch.int64, "weight": None}


# ---------------------------------------------------------------------- routing


def route_gguf(args: EngineArgs) -> bool:
    """Rewrites ``args`` for a ``model`` naming a ``.gguf`` file; returns whether it did. Only on CPU: on any
    other device (``current_platform.is_cpu()`` false) a .gguf model is left as given, for the
    ``vllm-gguf-plugin`` (whose ``EngineArgs`` patch then sees it) or vLLM's own error. Every refusal
    (not a GGUF file, architecture, tensor type, a merged layer of mixed formats, another quantization or
    load format, tensor / pipeline parallelism) is raised here, in the process that builds the engine."""
    from vllm.platforms import current_platform

    model = args.model
    if not gguf_source.is_gguf_reference(model) or not current_platform.is_cpu():
        return False
    ck = gguf_source.open_gguf(model)
    if args.quantization not in (None, GGUF_CPU):
        raise ValueError(f"{model} is a GGUF file, whose weights are quantized already: it is served with "
                         f"quantization {GGUF_CPU!r} (its own blocks); drop --quantization {args.quantization}")  # fmt: skip
    if str(args.load_format).lower() not in ("auto", GGUF_CPU):
        raise ValueError(f"{model} is a GGUF file: it loads with load_format {GGUF_CPU!r}; drop --load-format "
                         f"{args.load_format}")  # fmt: skip
    if args.tensor_parallel_size != 1 or args.pipeline_parallel_size != 1:
        raise ValueError(f"{model}: GGUF files are served with tensor_parallel_size=1 and pipeline_parallel_size=1 "
                         f"for now (got {args.tensor_parallel_size} and {args.pipeline_parallel_size})")  # fmt: skip
    folder = str(gguf_source.config_folder(ck))
    if args.tokenizer in (None, model):
        args.tokenizer = folder
    if args.served_model_name is None:
        args.served_model_name = [str(model)]
    args.model_weights = str(ck.path.resolve())
    args.model = folder
    args.quantization = GGUF_CPU
    args.load_format = GGUF_CPU
    logger.info("GGUF file %s (%s): config and tokenizer from %s, weights served by %s", ck.path,
                ck.architecture, folder, GGUF_CPU)  # fmt: skip
    return True


def install_routing() -> None:
    """Wraps ``EngineArgs.create_engine_config`` (before vLLM's speculator probe reads the model's config)
    and ``create_model_config`` (its direct callers) with :func:`route_gguf`; idempotent."""
    for name in ("create_engine_config", "create_model_config"):
        original = getattr(EngineArgs, name)
        if getattr(original, "_gguf_cpu_routed", False):
            continue

        def wrap(original: Callable) -> Callable:
            @functools.wraps(original)
            def routed(self, *args, **kwargs):
                route_gguf(self)
                return original(self, *args, **kwargs)

            routed._gguf_cpu_routed = True
            return routed

        setattr(EngineArgs, name, wrap(original))


# ---------------------------------------------------------------------- quantization method


@register_quantization_config(GGUF_CPU)
class GGUFCPUConfig(PluginQuantizationConfig):
    """A GGUF file's own blocks on the lowbit kernels (set by the routing for a ``.gguf`` model; the loader
    gives it the file's tensor names for the errors). Its keys, given as ``--hf-overrides '{"quantization_config":
    {"quant_method": "gguf_cpu", "act_group": 0}}'``: ``act_group`` (default
    :data:`~vllm_lowbit.options.GGUF_ACT_GROUP`; 0 or a multiple of 32) and ``act_super_block`` (default false:
    true gives the K-quant layers one activation scale per super-block of 256, llama.cpp's Q8_K grouping)."""

    def __init__(self, act_group: int = GGUF_ACT_GROUP, act_super_block: bool = False) -> None:
        super().__init__()
        if type(act_group) is not int or act_group < 0 or act_group % 32:
            raise ValueError(f"{GGUF_CPU} quantization_config.act_group={act_group!r} must be 0 (one int8 activation "
                             f"scale per token) or a positive multiple of 32 (per that many inputs, e.g. {GGUF_ACT_GROUP})")  # fmt: skip
        if type(act_super_block) is not bool:
            raise ValueError(f"{GGUF_CPU} quantization_config.act_super_block={act_super_block!r} must be true (the "
                             f"K-quant layers' activations per super-block of 256, as llama.cpp's Q8_K) or false")  # fmt: skip
        if act_super_block and not act_group:
            raise ValueError(f"{GGUF_CPU} quantization_config.act_super_block=true needs act_group > 0 (it widens "
                             f"the groups; act_group 0 is one scale per token): drop one of the two")  # fmt: skip
        self.act_group = act_group
        self.act_super_block = act_super_block
        self.source: Optional[gguf_source.GGUFTensors] = None

    def __repr__(self) -> str:
        where = "" if self.source is None else f"{str(self.source.ck.path)!r}, "
        return f"GGUFCPUConfig({where}act_group={self.act_group}, act_super_block={self.act_super_block})"

    def layer_act_group(self, w: LowBitWeight) -> int:
        """The op's ``act_group`` for weight ``w``: :attr:`act_group`, widened to a multiple of ``w``'s group and,
        with :attr:`act_super_block`, of its super-block (K-quants; :func:`~vllm_lowbit.options.gguf_layer_act_group`)."""
        return gguf_layer_act_group(self.act_group, w.group_size, w.super_block if self.act_super_block else None,
                                    w.in_features)  # fmt: skip

    @classmethod
    def get_name(cls) -> str:
        return GGUF_CPU

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "GGUFCPUConfig":
        keys = {k: v for k, v in (config or {}).items() if k != "quant_method"}
        unknown = sorted(set(keys) - {"act_group", "act_super_block"})
        if unknown:
            raise ValueError(f"{GGUF_CPU} quantization_config has unknown keys {unknown}; its keys are act_group and "
                             f"act_super_block")  # fmt: skip
        return cls(**keys)

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg, user_quant, hf_config=None) -> Optional[str]:
        return GGUF_CPU if user_quant == GGUF_CPU else None

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> Optional[QuantizeMethodBase]:
        if isinstance(layer, VocabParallelEmbedding):  # the token embedding and the output projection
            return GGUFEmbeddingMethod(self)
        if isinstance(layer, LinearBase):
            return GGUFLinearMethod(self)
        return None

    def tensor_name(self, layer: torch.nn.Module, shard=None) -> str:
        """The GGUF tensor (and Hugging Face parameter) that fills ``layer``'s ``shard``, for errors."""
        hf = checkpoint_tensor_name(self, layer, "weight", shard)
        gguf = self.source.gguf_name(hf) if self.source is not None else None
        where = f" of {str(self.source.ck.path)!r}" if self.source is not None else ""
        return f"{gguf!r} ({hf}){where}" if gguf else f"{hf}{where}"


# ---------------------------------------------------------------------- loading the blocks


def _register_slots(layer: torch.nn.Module, config: GGUFCPUConfig, shards: list, params_dtype: torch.dtype) -> None:
    """Placeholders for what the loader sends a layer (raw blocks ``qweight`` with their ``qweight_type``,
    or a float ``weight``), each shard kept as it arrives in ``layer.gguf_parts[shard]``."""
    layer.gguf_parts = {}
    layer.gguf_shards = shards

    def loader(slot: str) -> Callable:
        def gguf_cpu_weight_loader(param, loaded_weight: torch.Tensor, loaded_shard_id=None):
            if loaded_shard_id is not None and loaded_shard_id not in shards:
                raise ValueError(f"{GGUF_CPU}: layer {layer.prefix!r} has no shard {loaded_shard_id!r} (it has {shards})")
            part = layer.gguf_parts.setdefault(loaded_shard_id, {})
            if slot == "qweight_type":
                part["type"] = int(loaded_weight)
            else:
                part["data"], part["float"] = loaded_weight, slot == "weight"
                _check_rows(layer, config, loaded_shard_id, loaded_weight, slot)

        return gguf_cpu_weight_loader

    for slot, dtype in _SLOTS.items():
        p = torch.nn.Parameter(torch.empty(0, dtype=dtype or params_dtype), requires_grad=False)
        p.weight_loader = loader(slot)
        layer.register_parameter(slot, p)


def _expected_rows(layer: torch.nn.Module, shard) -> int:
    if isinstance(layer, VocabParallelEmbedding):
        return layer.org_vocab_size
    return checkpoint_rows(layer, shard)


def _check_rows(layer: torch.nn.Module, config: GGUFCPUConfig, shard, t: torch.Tensor, slot: str) -> None:
    rows = _expected_rows(layer, shard)
    if t.dim() != 2 or t.shape[0] != rows or (slot == "weight" and t.shape[1] != layer.input_size):
        want = f"[{rows}, {layer.input_size}]" if slot == "weight" else f"{rows} rows"
        raise ValueError(f"{GGUF_CPU}: GGUF tensor {config.tensor_name(layer, shard)} has shape {tuple(t.shape)}; "
                         f"layer {layer.prefix!r} needs {want}")  # fmt: skip


def _layer_weight(layer: torch.nn.Module, config: GGUFCPUConfig, params_dtype: torch.dtype):
    """The layer's whole weight from its shards: a float tensor, or a list of :class:`LowBitWeight` over
    consecutive output rows, one per run of shards of one stored form
    (:func:`~aipc_kernels.checkpoints.gguf.form_runs`: one weight unless the shards' forms differ)."""
    from aipc_kernels.checkpoints.gguf import relayout

    parts = layer.gguf_parts
    order = [None] if None in parts or layer.gguf_shards == [None] else layer.gguf_shards
    missing = [s for s in order if s not in parts or "data" not in parts[s]]
    if missing:
        raise ValueError(f"{GGUF_CPU}: the GGUF file has no tensor for {config.tensor_name(layer, missing[0])}; "
                         f"layer {layer.prefix!r} cannot be loaded")  # fmt: skip
    if None in parts and len(parts) > 1:
        raise ValueError(f"{GGUF_CPU}: layer {layer.prefix!r} got both a whole tensor and shards {sorted(map(str, parts))}")
    K = layer.input_size_per_partition if isinstance(layer, LinearBase) else layer.embedding_dim
    weights, formats = [], set()
    for s in order:
        part = parts[s]
        if part["float"]:
            weights.append(part["data"])
            formats.add(("float",))
            continue
        name = config.tensor_name(layer, s)
        if "type" not in part:
            raise ValueError(f"{GGUF_CPU}: GGUF tensor {name} arrived without its qweight_type")
        w = relayout(part["data"], part["type"], (part["data"].shape[0], K), name)
        weights.append(w)
        formats.add((w.codebook, w.group_size))  # e.g. three Q4_K: min4 g32, one layer
    if len(formats) > 1 and ("float",) in formats:  # open_gguf refuses such files before loading; the layer's own check
        import gguf  # the gguf package (absolute import), for the type names

        types = [("float", None) if parts[s]["float"] else (None, gguf.GGMLQuantizationType(parts[s]["type"]))
                 for s in order]  # fmt: skip
        desc = ", ".join(f"{config.tensor_name(layer, s)}: {f or t.name}" for s, (f, t) in zip(order, types))
        raise ValueError(f"{GGUF_CPU}: layer {layer.prefix!r} merges GGUF tensors of different formats ({desc}); "
                         f"float with quantized parts in one layer is not served yet")  # fmt: skip
    del layer.gguf_parts
    if all(isinstance(w, torch.Tensor) for w in weights):
        return torch.cat([w.to(params_dtype) for w in weights]) if len(weights) > 1 else weights[0].to(params_dtype)
    from aipc_kernels.checkpoints.gguf import stack_runs

    # e.g. Q4_K_M's Q4_K q / k, then its Q6_K v: two segments, each in its own form
    return [w for _, w in stack_runs(weights, layer.prefix)]


def _pad_rows(w: LowBitWeight, n: int) -> LowBitWeight:
    """``w`` with zero rows (codes, scales and mins 0: value 0) up to ``n`` rows (vLLM's padded vocabulary)."""
    extra = n - w.out_features
    if extra <= 0:
        return w

    def pad(t, dim=0):  # rows are dim 0, and dim 1 of the super-block scales [S, N, K/SB]
        if t is None:
            return None
        shape = list(t.shape)
        shape[dim] = extra
        return torch.cat([t, t.new_zeros(shape)], dim)

    return LowBitWeight(pad(w.qweight), pad(w.scales), pad(w.zeros), w.codebook, w.group_size, w.in_features,
                        name=w.name, supers=pad(w.supers, 1))  # fmt: skip


def _drop_slots(layer: torch.nn.Module) -> None:
    for slot in _SLOTS:
        if slot in layer._parameters:
            delattr(layer, slot)


def _check_single_rank(layer: torch.nn.Module) -> None:
    if getattr(layer, "tp_size", 1) != 1:
        raise ValueError(f"{GGUF_CPU}: layer {layer.prefix!r} is split over {layer.tp_size} tensor-parallel ranks; "
                         f"GGUF files are served with tensor_parallel_size=1 for now")  # fmt: skip


class _GGUFMethod:
    """What the linear and the embedding methods share: the config, the float types' vLLM method (set by
    the subclass), the loading (the layer's GGUF tensors, from :meth:`shards`, into a packed weight, or a
    float ``weight`` handed to that method) and the multiplication, on the lowbit kernels or through that
    method."""

    float_method: QuantizeMethodBase

    def __init__(self, config: GGUFCPUConfig):
        self.config = config

    def shards(self, layer: torch.nn.Module) -> list:
        """The checkpoint shards the layer's tensors arrive as (``None``: one whole tensor)."""
        return layer_shards(layer)

    def float_weight(self, layer: torch.nn.Module, w: torch.Tensor) -> torch.Tensor:
        """The ``weight`` parameter the float method gets for a float GGUF tensor ``w``."""
        return w.contiguous()

    def packed_weight(self, layer: torch.nn.Module, w: LowBitWeight) -> LowBitWeight:
        """The weight installed on the lowbit kernels for a quantized GGUF tensor ``w``."""
        return w

    def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype, **extra_weight_attrs) -> None:  # fmt: skip
        _check_single_rank(layer)
        layer.gguf_params_dtype = params_dtype
        layer.gguf_rows = sum(output_partition_sizes)
        _register_slots(layer, self.config, self.shards(layer), params_dtype)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if getattr(layer, "_already_called_process_weights_after_loading", False):
            return
        w = _layer_weight(layer, self.config, layer.gguf_params_dtype)
        _drop_slots(layer)
        layer.gguf_float = isinstance(w, torch.Tensor)
        if layer.gguf_float:
            layer.register_parameter("weight", torch.nn.Parameter(self.float_weight(layer, w), requires_grad=False))
            self.float_method.process_weights_after_loading(layer)
            return
        if len(w) > 1:  # parts of different stored forms: one op call each, no part widened
            install_segments(layer, w, [self.config.layer_act_group(part) for part in w])
            return
        install_packed(layer, self.packed_weight(layer, w[0]), self.config.layer_act_group(w[0]))

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        if layer.gguf_float:
            return self.float_method.apply(layer, x, bias)
        if hasattr(layer, "lowbit_segments"):
            return apply_segments(layer, x, bias)
        return apply_lowbit(layer, x, bias)


class GGUFLinearMethod(_GGUFMethod, LinearMethodBase):
    """A linear layer's GGUF tensors -> exact re-layout -> ``aipc::lowbit_linear`` (float types: vLLM's own)."""

    def __init__(self, config: GGUFCPUConfig):
        super().__init__(config)
        self.float_method = UnquantizedLinearMethod()


class GGUFEmbeddingMethod(_GGUFMethod, QuantizeMethodBase):
    """The token embedding (and an untied output projection) from its GGUF tensor, packed once for the
    lowbit kernels: :meth:`embedding` dequantizes only the rows it looks up (exact values), :meth:`apply`
    (the output projection, also when tied: :meth:`tie_weights` hands back the embedding layer itself)
    multiplies the same packed tensor. Float tables: vLLM's unquantized embedding. Both are padded to
    vLLM's padded vocabulary."""

    def __init__(self, config: GGUFCPUConfig):
        super().__init__(config)
        self.float_method = UnquantizedEmbeddingMethod()

    def shards(self, layer: torch.nn.Module) -> list:
        return [None]

    def float_weight(self, layer: torch.nn.Module, w: torch.Tensor) -> torch.Tensor:
        table = w.new_zeros(layer.gguf_rows, w.shape[1])
        table[: w.shape[0]] = w
        return table

    def packed_weight(self, layer: torch.nn.Module, w: LowBitWeight) -> LowBitWeight:
        return _pad_rows(w, layer.gguf_rows)

    def embedding(self, layer: torch.nn.Module, input_: torch.Tensor) -> torch.Tensor:
        if layer.gguf_float:
            return F.embedding(input_, layer.weight)
        return packed_embedding(layer, input_, layer.gguf_params_dtype)

    def tie_weights(self, layer: torch.nn.Module, embed_tokens: VocabParallelEmbedding):
        return embed_tokens  # one packed tensor: the lookup reads its rows, the projection multiplies it


# ---------------------------------------------------------------------- model loader


@register_model_loader(GGUF_CPU)
class GGUFCPUModelLoader(BaseModelLoader):
    """Reads the ``.gguf`` named by ``model_weights`` into the model (set up by the routing)."""

    def __init__(self, load_config):
        super().__init__(load_config)
        if load_config.model_loader_extra_config:
            raise ValueError(f"load_format {GGUF_CPU!r} takes no model_loader_extra_config "
                             f"(got {load_config.model_loader_extra_config})")  # fmt: skip
        self.source: Optional[gguf_source.GGUFTensors] = None

    @staticmethod
    def _path(model_config) -> str:
        path = model_config.model_weights
        if not path:
            raise ValueError(f"load_format {GGUF_CPU!r} reads the .gguf file named by model_weights; pass the .gguf "
                             f"file as the model (LLM('./model.gguf'), vllm serve ./model.gguf)")  # fmt: skip
        return path

    def _source(self, model_config) -> gguf_source.GGUFTensors:
        if self.source is None:
            ck = gguf_source.open_gguf(self._path(model_config))
            self.source = gguf_source.GGUFTensors(ck, model_config.hf_config)
            if self.source.missing:
                m = self.source.missing
                raise ValueError(f"GGUF file {str(ck.path)!r} lacks the tensors of {m[0]}"
                                 + (f" and {len(m) - 1} more" if len(m) > 1 else "")
                                 + f" ({ck.architecture}, {self.source.config.num_hidden_layers} layers)")  # fmt: skip
            if self.source.unmapped:
                logger.info("GGUF file %s: tensors without a Hugging Face parameter, not loaded: %s", ck.path,
                            self.source.unmapped)  # fmt: skip
        return self.source

    def download_model(self, model_config) -> None:
        gguf_source.open_gguf(self._path(model_config))

    def create_model(self, vllm_config, model_config, prefix: str = "") -> torch.nn.Module:
        config = vllm_config.quant_config
        if not isinstance(config, GGUFCPUConfig):
            raise ValueError(f"load_format {GGUF_CPU!r} needs quantization {GGUF_CPU!r} (got "
                             f"{type(config).__name__}); pass the .gguf file as the model")  # fmt: skip
        config.source = self._source(model_config)
        return super().create_model(vllm_config, model_config, prefix)

    def load_weights(self, model: torch.nn.Module, model_config) -> None:
        source = self._source(model_config)
        loaded = model.load_weights(source.weights(model_config.dtype))
        if loaded is None:
            return
        ours = {name for name, m in model.named_modules()
                if isinstance(getattr(m, "quant_method", None), (GGUFLinearMethod, GGUFEmbeddingMethod))}  # fmt: skip
        missing = sorted(n for n, _ in model.named_parameters() if n not in loaded and not (
            n.rpartition(".")[0] in ours and n.rpartition(".")[2] in _SLOTS))  # a slot of ours: its layer checks it
        if missing:
            raise ValueError(f"GGUF file {str(source.ck.path)!r} left {len(missing)} parameters of "
                             f"{type(model).__name__} unloaded, e.g. {missing[:3]}")  # fmt: skip


install_routing()

__all__ = ["GGUF_CPU", "GGUFCPUConfig", "GGUFCPUModelLoader", "GGUFEmbeddingMethod", "GGUFLinearMethod",
           "install_routing", "route_gguf"]  # fmt: skip
