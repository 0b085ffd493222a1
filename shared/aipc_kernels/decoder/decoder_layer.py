"""The fused pre-norm SwiGLU decoder layer (Llama, Mistral, Qwen2/3, Phi-3) of the segment-KV paper.

One layer is four calls of ``aipc::fused_linear`` (:mod:`aipc_kernels.decoder.fused_linear`) around the rotary
embedding and the attention:

    qkv = [q | k | v](rmsnorm(x))            one call, the three weights read once each, no merged copy
    q, k = rope(q, k)                        one pass over q and k together (aipc::rope on views of qkv)
    a = attend(q, k, v)                      the caller's attention (the segment KV cache and SDPA)
    h = o(a) + x                             residual in the epilogue
    gu = [gate | up](rmsnorm(h))
    y = down(silu(gate) * up) + h            SwiGLU in the prologue, residual in the epilogue

The layer's weights stay its own tensors (:class:`DecoderLayerWeights` holds references). A projection
may instead be a :class:`~aipc_kernels.decoder.fused_lowbit.LowBitProjection` over the layer's low-bit modules
(the same four calls on ``aipc::lowbit_linear``, int8 activations per token). The rounding
points are transformers' (see :mod:`aipc_kernels.decoder.fused_linear`), so float32 outputs match the modules'
to float32 rounding and bf16 ones to bf16 rounding.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

import torch

from aipc_kernels.decoder.fused_linear import fused_linear
from aipc_kernels.decoder.fused_lowbit import LowBitProjection
from aipc_kernels.decoder.rope import apply_rope

#: a projection's weights: the layer's float tensors (read as one by ``aipc::fused_linear``), or its
#: low-bit modules as one :class:`LowBitProjection` (its biases are the modules')
Weights = Union[tuple[torch.Tensor, ...], LowBitProjection]

#: (query [B, Hq, L, D], key [B, Hkv, L, D], value [B, Hkv, L, D]) -> attention output [B, L, Hq, D]
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class DecoderLayerWeights:
    """References to one layer's tensors, in the order the fused calls read them."""

    qkv: Weights  # [q; k; v] as 3 tensors, or 1 merged one (Phi-3's qkv_proj)
    qkv_bias: tuple[Optional[torch.Tensor], ...]
    o: Weights
    o_bias: tuple[Optional[torch.Tensor], ...]
    gate_up: Weights  # [gate; up] as 2 tensors, or 1 merged one (Phi-3's gate_up_proj)
    gate_up_bias: tuple[Optional[torch.Tensor], ...]
    down: Weights
    down_bias: tuple[Optional[torch.Tensor], ...]
    input_norm: torch.Tensor
    input_eps: float
    post_norm: torch.Tensor
    post_eps: float
    heads: int
    kv_heads: int
    head_dim: int
    #: per-head RMSNorm of q and k before the rotary embedding (Qwen3): modules called as they are
    q_norm: Optional[torch.nn.Module] = None
    k_norm: Optional[torch.nn.Module] = None


def project(x: torch.Tensor, weights: Weights, biases: Sequence[Optional[torch.Tensor]], prologue: str = "none",
            gamma: Optional[torch.Tensor] = None, eps: float = 0.0,
            residual: Optional[torch.Tensor] = None) -> torch.Tensor:  # fmt: skip
    """One projection with its prologue and residual, on float or low-bit weights."""
    if isinstance(weights, LowBitProjection):
        return weights(x, prologue, gamma, eps, residual)
    return fused_linear(x, weights, biases, prologue, gamma, eps, residual)


def decoder_layer(
    x: torch.Tensor, w: DecoderLayerWeights, cos: torch.Tensor, sin: torch.Tensor, attend: Attend
) -> torch.Tensor:
    """One decoder layer on ``x [B, L, hidden]`` (see the module docstring); returns ``[B, L, hidden]``."""
    B, L, _ = x.shape
    D, Hq, Hkv = w.head_dim, w.heads, w.kv_heads
    qkv = project(x, w.qkv, w.qkv_bias, "rmsnorm", w.input_norm, w.input_eps)
    nq, nk = Hq * D, Hkv * D
    v = qkv[..., nq + nk :].view(B, L, Hkv, D)
    if w.q_norm is None:  # q and k rotated in one pass
        qk = apply_rope(qkv[..., : nq + nk].view(B, L, Hq + Hkv, D), cos, sin)
        q, k = qk[:, :, :Hq], qk[:, :, Hq:]
    else:
        q = apply_rope(w.q_norm(qkv[..., :nq].view(B, L, Hq, D)), cos, sin)
        k = apply_rope(w.k_norm(qkv[..., nq : nq + nk].view(B, L, Hkv, D)), cos, sin)
    a = attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    h = project(a.reshape(B, L, nq), w.o, w.o_bias, residual=x)
    gu = project(h, w.gate_up, w.gate_up_bias, "rmsnorm", w.post_norm, w.post_eps)
    return project(gu, w.down, w.down_bias, "silu_mul", residual=h)
