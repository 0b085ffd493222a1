"""``BitNetForCausalLM`` (BitNet b1.58, e.g. microsoft/bitnet-b1.58-2B-4T) on vLLM's own Llama.

transformers' ``modeling_bitnet`` is Llama with a relu2 MLP and two extra RMSNorms (eps
``rms_norm_eps``), each just before a row-parallel projection::

    o_proj(attn_sub_norm(attention(x)))
    down_proj(ffn_sub_norm(relu2(gate_proj(x)) * up_proj(x)))

Everything else (merged ``qkv_proj`` / ``gate_up_proj``, rotary, attention, tied embeddings, the
weight loader's q/k/v and gate/up stacking) is vLLM's Llama, and every linear gets ``quant_config``
and its prefix exactly as there, so a quantization method picks its layers by name. Registered by
``vllm_lowbit.register`` (``ModelRegistry``) when vLLM has no model of that name.

Tensor parallelism: both sub-norms normalize a dimension that is split over the ranks (the heads
under ``attn_sub_norm``, the intermediate size under ``ffn_sub_norm``): each rank holds its slice
of the weight and all-reduces the sum of squares, so the mean is over the full dimension.
"""
from __future__ import annotations

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.distributed import (
    divide,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_reduce,
)
from vllm.model_executor.layers.activation import ReLUSquaredActivation
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from vllm.model_executor.layers.quantization import QuantizationConfig
from vllm.model_executor.model_loader.weight_utils import sharded_weight_loader
from vllm.model_executor.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM
from vllm.model_executor.utils import set_weight_attrs
from vllm.v1.attention.backend import AttentionType

HIDDEN_ACT = "relu2"


class ShardedRMSNorm(RMSNorm):
    """RMSNorm over a dimension of ``hidden_size`` that tensor parallelism splits evenly over the
    ranks (the input of a ``RowParallelLinear``): each rank holds its contiguous slice of the weight
    (loaded from the full tensor) and of the activations; the sum of squares is all-reduced. With
    one rank it is vLLM's ``RMSNorm``."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        self.tp_size = get_tensor_model_parallel_world_size()
        super().__init__(divide(hidden_size, self.tp_size), eps=eps)
        self.full_size = hidden_size
        if self.tp_size > 1:
            set_weight_attrs(self.weight, {"weight_loader": sharded_weight_loader(0)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return super().forward(x)
        # vllm.ir.ops.rms_norm's arithmetic, with the mean taken over all ranks' slices
        orig_dtype = x.dtype
        x = x.to(torch.float32)
        sum_sq = tensor_model_parallel_all_reduce(x.pow(2).sum(dim=-1, keepdim=True))
        x = x * torch.rsqrt(sum_sq / self.full_size + self.variance_epsilon)
        return (x.to(self.weight.dtype) * self.weight).to(orig_dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, full_size={self.full_size}, tp_size={self.tp_size}"


class BitNetAttention(LlamaAttention):
    """``LlamaAttention`` with ``attn_sub_norm`` on the ``o_proj`` input."""

    def __init__(self, config, **kwargs) -> None:
        super().__init__(config, **kwargs)
        self.attn_sub_norm = ShardedRMSNorm(self.total_num_heads * self.head_dim, eps=config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        attn_output = self.attn(q, k, v)
        output, _ = self.o_proj(self.attn_sub_norm(attn_output))
        return output


class BitNetMLP(nn.Module):
    """``LlamaMLP`` with relu2 instead of SiLU and ``ffn_sub_norm`` on the ``down_proj`` input."""

    def __init__(self, hidden_size: int, intermediate_size: int, eps: float,
                 quant_config: QuantizationConfig | None = None, bias: bool = False, prefix: str = "") -> None:  # fmt: skip
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            input_size=hidden_size, output_sizes=[intermediate_size] * 2, bias=bias,
            quant_config=quant_config, prefix=f"{prefix}.gate_up_proj",
        )  # fmt: skip
        self.down_proj = RowParallelLinear(
            input_size=intermediate_size, output_size=hidden_size, bias=bias,
            quant_config=quant_config, prefix=f"{prefix}.down_proj",
        )  # fmt: skip
        self.act_fn = ReLUSquaredActivation()
        self.ffn_sub_norm = ShardedRMSNorm(intermediate_size, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up, _ = self.gate_up_proj(x)
        gate, up = gate_up.chunk(2, dim=-1)
        x, _ = self.down_proj(self.ffn_sub_norm(self.act_fn(gate) * up))
        return x


class BitNetDecoderLayer(LlamaDecoderLayer):
    """``LlamaDecoderLayer`` (its ``forward`` and ``get_quant_config``) holding the BitNet attention
    and MLP; built here because Llama's constructor accepts only a SiLU MLP."""

    def __init__(self, vllm_config: VllmConfig, prefix: str = "", config=None) -> None:
        nn.Module.__init__(self)
        config = config or vllm_config.model_config.hf_config
        quant_config = self.get_quant_config(vllm_config)
        self.hidden_size = config.hidden_size
        bias = getattr(config, "attention_bias", False)
        self.self_attn = BitNetAttention(
            config=config, hidden_size=self.hidden_size, num_heads=config.num_attention_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", config.num_attention_heads),
            max_position_embeddings=getattr(config, "max_position_embeddings", 8192),
            quant_config=quant_config, bias=bias, bias_o_proj=bias, cache_config=vllm_config.cache_config,
            prefix=f"{prefix}.self_attn", attn_type=AttentionType.DECODER,
        )  # fmt: skip
        self.mlp = BitNetMLP(config.hidden_size, config.intermediate_size, config.rms_norm_eps, quant_config,
                             bias=getattr(config, "mlp_bias", False), prefix=f"{prefix}.mlp")  # fmt: skip
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class BitNetForCausalLM(LlamaForCausalLM):
    """vLLM's ``LlamaForCausalLM`` with BitNet decoder layers; weights load with Llama's loader
    (``q/k/v_proj`` -> ``qkv_proj``, ``gate/up_proj`` -> ``gate_up_proj``; the sub-norms by name)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        act = getattr(vllm_config.model_config.hf_config, "hidden_act", None)
        if act != HIDDEN_ACT:
            raise ValueError(f"BitNetForCausalLM: config.json hidden_act={act!r} is not supported: this model "
                             f"class implements BitNet b1.58, whose MLP uses {HIDDEN_ACT!r} (relu(x)**2)")  # fmt: skip
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=BitNetDecoderLayer)
