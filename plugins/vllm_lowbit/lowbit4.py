"""``lowbit4`` as a vLLM quantization method: 4-bit weights (W4A8) on ``aipc::lowbit_linear``.

Two ways in, one flag:

* ``vllm serve BF16_MODEL --quantization lowbit4``: quantized while it loads, exactly as ``lowbit2``
  does (:class:`LowBit4Config` is :class:`~vllm_lowbit.lowbit2.LowBit2Config` with the defaults
  ``codebook: affine4``, ``group_size: 64``, from the real-model rows of ``bench/results/quality/quality.md``;
  every other key and ``--hf-overrides`` work as there; a group that does not divide a layer's K
  falls back to the largest one that does).
* ``vllm serve GPTQ_OR_AWQ_MODEL --quantization lowbit4``: a published GPTQ (``quant_method: gptq``,
  4-bit, sym or asym, v1 or v2, groups in input order) or AWQ GEMM (``quant_method: awq``)
  checkpoint is claimed for this method (without the flag vLLM's own gptq / awq method serves it):
  ``LowBit4Config.from_config`` reads it into an :class:`Int4CheckpointConfig`, and
  :class:`Int4CheckpointLinearMethod` declares the checkpoint's own tensors (``qweight``,
  ``qzeros``, ``scales``, GPTQ's ``g_idx``) with vLLM's parameter classes as vLLM's GPTQ and AWQ
  methods do, so merged q/k/v and gate/up shards and tensor-parallel slices land where they belong,
  checks each tensor as it arrives (shape, dtype, activation-order ``g_idx``, naming it), and
  re-lays the integers out exactly into ``int4`` / ``affine4`` (:mod:`aipc_kernels.checkpoints.gptq`,
  the checkpoint's fp16 scales kept) before :func:`~vllm_lowbit.layers.install_packed`.

The output projection follows ``lm_head`` as in lowbit2 (``auto`` by default: int6 in groups of 32 where
the CPU kernels run with AVX2 / AVX-VNNI, int8 per output channel with AVX-512; GPTQ and AWQ keep it float
in the checkpoint). ``activations: float`` (in the on-the-fly keys, or added to a
GPTQ / AWQ ``quantization_config``) serves the 4-bit linears on the
activation-exact W4A16 kernels instead of W4A8. A GPTQ / AWQ ``quantization_config`` may name the head
format the same way (``--hf-overrides '{"quantization_config": {..., "lm_head": "int8"}}'``, the
checkpoint's keys kept): a string ``lm_head`` is lowbit2's key, GPTQ's boolean ``lm_head`` its own.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from vllm.logger import init_logger
from vllm.model_executor.layers.linear import LinearMethodBase, register_weight_loader_v2_supported_method
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
from vllm.model_executor.parameter import (
    ChannelQuantScaleParameter,
    GroupQuantScaleParameter,
    PackedColumnParameter,
    PackedvLLMParameter,
    RowvLLMParameter,
)

from aipc_kernels.checkpoints import gptq as gf
from aipc_kernels.core.config_schema import Naming
from aipc_kernels.lowbit.formats import SCALE_DTYPES

from .layers import (LowBitConfig, apply_lowbit, check_partition, checkpoint_rows, checkpoint_tensor_name,
                     install_packed, layer_shards)  # fmt: skip
from .lowbit2 import LowBit2Config

logger = init_logger(f"vllm.{__name__}")  # under "vllm": the logger vLLM configures (INFO shows)

LOWBIT4 = "lowbit4"
#: how errors about a lowbit4 quantization_config name a key
NAMING = Naming(f"{LOWBIT4} quantization_config", "json")
#: lowbit2's keys with these defaults: 4-bit codes with a scale and a zero per group of 64, the best of
#: the 4-bit formats at up to 4.5 bits per weight on the real trained models of bench/results/quality/quality.md
#: (perplexity x1.20 / x1.29 of float on SmolLM2-135M / Gemma-3-270M, where int4 g128 gave x1.53 / x3.11)
DEFAULTS = {"codebook": "affine4", "group_size": 64}
#: the published checkpoints ``--quantization lowbit4`` serves
CHECKPOINT_METHODS = ("gptq", "awq")
#: lowbit2 keys a GPTQ / AWQ quantization_config may carry too (how it is served, not what it stores):
#: ``lm_head`` only as a head format (a string); GPTQ's own ``lm_head`` is a boolean (a quantized head
#: in the checkpoint) and stays GPTQ's
CHECKPOINT_OPTIONS = ("activations", "lm_head")
_SCALE_DTYPES = tuple(SCALE_DTYPES.values())


@register_quantization_config(LOWBIT4)
class LowBit4Config(LowBit2Config):
    """``lowbit2``'s config with 4-bit :attr:`defaults` (quantized on the fly; every lowbit2 key and
    ``--hf-overrides`` as there). :meth:`from_config` builds an :class:`Int4CheckpointConfig` instead for a
    GPTQ / AWQ checkpoint's ``quantization_config``."""

    name = LOWBIT4
    naming = NAMING
    defaults = DEFAULTS

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "LowBit4Config | Int4CheckpointConfig":
        """A GPTQ / AWQ checkpoint's ``quantization_config``, or lowbit2's keys (``quant_method``
        ``lowbit4`` or none) for on-the-fly quantization."""
        method = config.get("quant_method") if isinstance(config, dict) else None
        if isinstance(method, str) and method.lower() in CHECKPOINT_METHODS:
            return Int4CheckpointConfig.from_config(config)
        if method == LOWBIT4:
            config = {k: v for k, v in config.items() if k != "quant_method"}
        return super().from_config(config)

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg, user_quant, hf_config=None) -> Optional[str]:
        """``--quantization lowbit4`` claims a GPTQ or AWQ checkpoint (without it vLLM's own method
        serves the checkpoint); a ``quant_method: lowbit4`` config (``--hf-overrides``) selects it."""
        method = str(hf_quant_cfg.get("quant_method", "")).lower()
        if user_quant == LOWBIT4 and method in CHECKPOINT_METHODS:
            return LOWBIT4
        if method == LOWBIT4 and user_quant in (None, LOWBIT4):
            return LOWBIT4
        return None


class Int4CheckpointConfig(LowBitConfig):
    """``lowbit4`` serving a GPTQ / AWQ checkpoint: its :attr:`spec`, read by
    :func:`aipc_kernels.checkpoints.gptq.parse_quantization_config`, and lowbit2's options for the code book
    the integers are re-laid out into (``int4`` symmetric, else ``affine4``), the checkpoint's group, the
    modules it keeps float, and ``activations`` (:data:`CHECKPOINT_OPTIONS`)."""

    name = LOWBIT4
    naming = NAMING

    def __init__(self, spec: gf.Int4Checkpoint, /, **config: Any) -> None:
        super().__init__(**config)
        self.spec = spec

    def __repr__(self) -> str:
        s, o = self.spec, self.options
        return (f"{type(self).__name__}({s.layout} checkpoint, codebook={o.codebook}, group_size={s.group_size}, "
                f"zero_offset={s.zero_offset}, modules_to_not_convert={o.modules_to_not_convert}, "
                f"lm_head={self.head_label})")  # fmt: skip

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "Int4CheckpointConfig":
        """A GPTQ / AWQ checkpoint's ``quantization_config`` (with :data:`CHECKPOINT_OPTIONS`)."""
        ours = {k: v for k, v in config.items() if k in CHECKPOINT_OPTIONS and not isinstance(v, bool)}
        spec, ignored = gf.parse_quantization_config({k: v for k, v in config.items() if k not in ours})
        if ignored:
            logger.info("lowbit4: %s quantization_config keys %s do not change the weights; ignored",
                        config.get("quant_method"), ignored)  # fmt: skip
        return cls(spec, modules_to_not_convert=list(spec.skipped), group_size=spec.group_size,
                   codebook="int4" if getattr(spec, "sym", False) else "affine4", **ours)  # fmt: skip

    def get_checkpoint_weight_mapper(self):
        """vLLM drops GPTQ's ``g_idx`` on the way in (its kernels ignore activation order); this method
        keeps it to refuse an activation-order checkpoint instead of serving it wrongly."""
        from vllm.model_executor.models.utils import WeightsMapper

        return WeightsMapper()

    def linear_method(self, prefix: str) -> QuantizeMethodBase:
        return Int4CheckpointLinearMethod(self)


@register_weight_loader_v2_supported_method
class Int4CheckpointLinearMethod(LinearMethodBase):
    """A GPTQ / AWQ checkpoint's tensors -> exact ``int4`` / ``affine4`` -> ``aipc::lowbit_linear``."""

    def __init__(self, config: Int4CheckpointConfig):
        self.config = config
        self.spec = config.spec

    def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype, **extra_weight_attrs) -> None:  # fmt: skip
        spec, K, N = self.spec, input_size_per_partition, sum(output_partition_sizes)
        for n in output_partition_sizes:
            gf.check_layer(spec, K, n, layer.prefix)
        check_partition(self.config, layer, K)
        vllm_loader = extra_weight_attrs["weight_loader"]
        layer.int4_loaded = set()
        layer.int4_scale_dtype = None
        pf, groups = gf.PER_INT32, 1 if spec.group_size == -1 else K // spec.group_size

        def loader(pname: str) -> Callable:
            return self._checked_loader(layer, pname, vllm_loader)

        # vLLM's gptq / awq declarations: qweight packed along K (GPTQ) or N (AWQ), qzeros along N
        if spec.layout == "gptq":
            qweight = PackedvLLMParameter(data=torch.empty(K // pf, N, dtype=torch.int32), input_dim=0, output_dim=1,
                                          packed_dim=0, packed_factor=pf, weight_loader=loader("qweight"))  # fmt: skip
        else:
            qweight = PackedvLLMParameter(data=torch.empty(K, N // pf, dtype=torch.int32), input_dim=0, output_dim=1,
                                          packed_dim=1, packed_factor=pf, weight_loader=loader("qweight"))  # fmt: skip
        # scales held in float32 while loading (exact for fp16 and bf16), stored back in the checkpoint's dtype
        if spec.group_size == -1:  # one group per row: the same on every rank of a row-parallel layer
            scales = ChannelQuantScaleParameter(data=torch.empty(1, N, dtype=torch.float32), output_dim=1,
                                                weight_loader=loader("scales"))  # fmt: skip
            qzeros = PackedColumnParameter(data=torch.empty(1, N // pf, dtype=torch.int32), output_dim=1, packed_dim=1,
                                           packed_factor=pf, weight_loader=loader("qzeros"))  # fmt: skip
        else:
            scales = GroupQuantScaleParameter(data=torch.empty(groups, N, dtype=torch.float32), output_dim=1,
                                              input_dim=0, weight_loader=loader("scales"))  # fmt: skip
            qzeros = PackedvLLMParameter(data=torch.empty(groups, N // pf, dtype=torch.int32), input_dim=0,
                                         output_dim=1, packed_dim=1, packed_factor=pf, weight_loader=loader("qzeros"))  # fmt: skip
        layer.register_parameter("qweight", qweight)
        layer.register_parameter("qzeros", qzeros)
        layer.register_parameter("scales", scales)
        if spec.layout == "gptq":
            g_idx = RowvLLMParameter(data=torch.empty(K, dtype=torch.int32), input_dim=0, weight_loader=loader("g_idx"))
            layer.register_parameter("g_idx", g_idx)

    # ------------------------------------------------------------------ checkpoint checks

    def _checked_loader(self, layer: torch.nn.Module, pname: str, vllm_loader: Callable) -> Callable:
        """vLLM's loader for ``pname``, after checking the whole checkpoint tensor (shape, dtype; a
        ``g_idx`` in input order) and recording that it arrived."""
        spec = self.spec
        dtypes = {"scales": _SCALE_DTYPES, "g_idx": (torch.int32, torch.int64)}.get(pname, (torch.int32,))

        def lowbit4_weight_loader(param, loaded_weight: torch.Tensor, loaded_shard_id=None):
            name = checkpoint_tensor_name(self.config, layer, pname, loaded_shard_id)
            shape = gf.tensor_shapes(spec, layer.input_size, checkpoint_rows(layer, loaded_shard_id))[pname]
            what = f"{spec.layout} checkpoint, group_size={spec.group_size}, in_features={layer.input_size}"
            if tuple(loaded_weight.shape) != shape:
                raise ValueError(f"{spec.layout} checkpoint tensor {name} has shape {tuple(loaded_weight.shape)}, "
                                 f"expected {shape} ({what})")  # fmt: skip
            if loaded_weight.dtype not in dtypes:
                raise ValueError(f"{spec.layout} checkpoint tensor {name} has dtype {loaded_weight.dtype}, expected "
                                 f"{' or '.join(map(str, dtypes))} ({what})")  # fmt: skip
            if pname == "scales":
                if layer.int4_scale_dtype not in (None, loaded_weight.dtype):
                    raise ValueError(f"{spec.layout} checkpoint tensor {name} is {loaded_weight.dtype} but the other "
                                     f"scales of layer {layer.prefix} are {layer.int4_scale_dtype}")  # fmt: skip
                layer.int4_scale_dtype = loaded_weight.dtype
            if pname == "g_idx":
                gf.check_g_idx(loaded_weight, spec.group_size, name)
            ids = layer_shards(layer) if loaded_shard_id is None else (
                loaded_shard_id if isinstance(loaded_shard_id, tuple) else (loaded_shard_id,))  # fmt: skip
            layer.int4_loaded.update((pname, s) for s in ids)
            if loaded_shard_id is None:
                return vllm_loader(param, loaded_weight)
            return vllm_loader(param, loaded_weight, loaded_shard_id)

        return lowbit4_weight_loader

    def _check_loaded(self, layer: torch.nn.Module) -> None:
        pnames = ["qweight", "qzeros", "scales"] + (["g_idx"] if self.spec.layout == "gptq" and self.spec.desc_act else [])
        missing = [checkpoint_tensor_name(self.config, layer, p, s) for p in pnames for s in layer_shards(layer)
                   if (p, s) not in layer.int4_loaded]  # fmt: skip
        if missing:
            raise ValueError(
                f"{self.spec.layout} checkpoint is missing tensor {missing[0]}"
                + (f" (and {len(missing) - 1} more of layer {layer.prefix})" if len(missing) > 1 else "")
                + f"; a {self.spec.layout} linear needs {', '.join(pnames)}"
            )

    # ------------------------------------------------------------------ vLLM interface

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if getattr(layer, "_already_called_process_weights_after_loading", False):
            return
        self._check_loaded(layer)
        K = layer.qweight.shape[0] * (gf.PER_INT32 if self.spec.layout == "gptq" else 1)
        tensors = {"qweight": layer.qweight.data, "qzeros": layer.qzeros.data,
                   "scales": layer.scales.data.to(layer.int4_scale_dtype)}  # fmt: skip
        if self.spec.layout == "gptq" and any(p == "g_idx" for p, _ in layer.int4_loaded):
            tensors["g_idx"] = layer.g_idx.data
        k_offset = layer.tp_rank * K if K != layer.input_size else 0  # this rank's slice of a row-parallel layer
        w = gf.read_linear(self.spec, tensors, layer.prefix, k_offset)
        for name in ("qzeros", "g_idx"):
            if name in layer._parameters:
                delattr(layer, name)
        install_packed(layer, w, self.config.options.act_group, self.config.options.activations)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        return apply_lowbit(layer, x, bias)


__all__ = ["Int4CheckpointConfig", "Int4CheckpointLinearMethod", "LowBit4Config"]
