"""``aipc::rope``: transformers' rotary position embedding (``apply_rotary_pos_emb``) in one pass.

``torch.ops.aipc.rope(x, cos, sin) -> out``: ``x [B, L, heads, head_dim]`` (any strides, last dimension
dense: a view into a merged q/k/v output), ``cos`` / ``sin`` ``[B or 1, L, R]`` in x's dtype (what the
model's rotary embedding returns), ``R <= head_dim`` (a partial rotary, as Phi-3's, leaves the last
``head_dim - R`` dimensions as they are); ``out`` dense ``[B, L, heads, head_dim]``:

    out = x * cos + rotate_half(x) * sin      rotate_half(x) = cat(-x[..., R/2:R], x[..., :R/2])

with each product and the sum rounded to x's dtype, as transformers' three torch ops round them: the
output is bit-identical to theirs. CPU: ``csrc/generic/rope.c`` through a stable-ABI kernel (``csrc/ops/rope_op.cpp``),
one call where the torch ops cost a decode step about 30 us a layer and a prefill several milliseconds;
elsewhere, and without the native build, the torch ops (:func:`rope_reference`).
"""
from __future__ import annotations

import torch

from aipc_kernels.core import native

_LIB = torch.library.Library("aipc", "FRAGMENT")
_LIB.define("rope(Tensor x, Tensor cos, Tensor sin) -> Tensor")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """transformers' ``rotate_half``: ``cat(-x2, x1)`` of the two halves of the last dimension."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The op in torch ops: the element-wise operations of transformers' ``apply_rotary_pos_emb`` in its
    order, on ``x [B, L, H, D]`` and ``cos`` / ``sin`` ``[B or 1, L, R]``."""
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    R = cos.shape[-1]
    if R == x.shape[-1]:
        return (x * cos) + (rotate_half(x) * sin)
    rot = x[..., :R]
    return torch.cat([(rot * cos) + (rotate_half(rot) * sin), x[..., R:]], dim=-1)


def _rope_fake(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape)


_LIB.impl("rope", lambda x, cos, sin: rope_reference(x, cos, sin).contiguous(), "CompositeExplicitAutograd")
torch.library.register_fake("aipc::rope")(_rope_fake)


def native_rope() -> bool:
    """Whether ``aipc::rope`` has its native CPU kernel (the C++ unit and the C library were built)."""
    return native.ops_library() is not None


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [B, L, H, D]`` rotated by ``cos`` / ``sin`` ``[B, L, R]`` (see the module docstring): the native
    kernel for CPU tensors of one of its dtypes with a dense last dimension, else the torch ops."""
    if (x.device.type == "cpu" and x.dtype in native.DTYPE_CODES and cos.dtype == x.dtype and sin.dtype == x.dtype
            and x.dim() == 4 and x.stride(-1) == 1 and _NATIVE):  # fmt: skip
        return torch.ops.aipc.rope(x, cos, sin)
    return rope_reference(x, cos, sin)


_NATIVE = native_rope()  # loading the C++ unit registers the CPU kernel of the schema above
