"""``aipc::prologue``: the element-wise pass before a decoder layer's projection, at transformers' rounding
points, in one call (with a fake kernel: usable under torch.compile).

``torch.ops.aipc.prologue(x, prologue, gamma=None, eps=0.0) -> out``, ``prologue`` one of
:data:`PROLOGUES`' codes:

* ``"rmsnorm"`` (1): ``gamma * dt(x / sqrt(mean(x^2) + eps))`` over x's last dimension, as ``LlamaRMSNorm``
  (also Mistral's, Qwen2/3's, Phi-3's): float32 statistics, the normalized row rounded to x's dtype, then
  the product with gamma rounded;
* ``"silu_mul"`` (2): x holds ``[gate | up]`` (``2K`` columns): ``dt(silu(gate)) * up``, the SwiGLU before
  the down projection;
* ``"none"`` (0): x.

The projection that follows is not :mod:`aipc_kernels.decoder.fused_linear`'s (whose kernel applies the prologue
while it copies x for its tiles): the low-bit projections of the fused layer
(:mod:`aipc_kernels.decoder.fused_lowbit`) call this, then ``aipc::lowbit_linear``. CPU: ``aipc_dense_prologue``
(``csrc/generic/dense_linear.c``, the dense kernel's prologue rows, threaded over rows for a prompt) through a
stable-ABI kernel (``csrc/ops/prologue_op.cpp``): one pass where transformers' RMSNorm is seven torch ops
(float32 copy, square, mean, rsqrt, product, rounding copy, gamma product). The kernel adds the float32 sum
of squares in another order than torch and its float32 ``exp`` is not torch's, so its float32 values may differ
from the torch ops' in the last bit; rounded to bf16 / fp16 such a difference survives now and then (on a real
model's hidden states often enough that bf16 logits are no longer bit-equal to the stock layers').
:func:`apply_prologue` takes the kernel for bf16 and fp16 rows (their tests compare logits within 0.1, not bit
for bit) and keeps the torch ops for float32, where the fused low-bit layer promises the stock layer's logits:
there a last-bit difference moves an int8 activation code, and a logit by a scale step. Elsewhere, and without the native build, the torch ops
(:func:`prologue_reference`).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from aipc_kernels.core import native

#: prologue codes (``aipc_prologue`` in csrc/aipc_native.h)
PROLOGUES = native.PROLOGUES
_NAMES = {code: name for name, code in PROLOGUES.items()}
#: dtypes :func:`apply_prologue` gives the native kernel (the op itself takes float32 too)
NATIVE_DTYPES = (torch.bfloat16, torch.float16)

_LIB = torch.library.Library("aipc", "FRAGMENT")
_LIB.define("prologue(Tensor x, int prologue, Tensor? gamma=None, float eps=0.0) -> Tensor")


def rms_norm_like_transformers(x: torch.Tensor, gamma: torch.Tensor, eps: float) -> torch.Tensor:
    """``LlamaRMSNorm.forward`` (also Mistral's, Qwen2/3's, Phi-3's): float32 statistics, the normalized row
    rounded to x's dtype, then multiplied by gamma."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return gamma * h.to(x.dtype)


def prologue_reference(x: torch.Tensor, prologue: str, gamma: Optional[torch.Tensor], eps: float,
                       in_features: int) -> torch.Tensor:  # fmt: skip
    """The prologue in torch ops at transformers' rounding points: ``gamma * rmsnorm(x)``,
    ``silu(gate) * up`` of x's two ``in_features`` halves, or x itself."""
    if prologue == "rmsnorm":
        return rms_norm_like_transformers(x, gamma, eps)
    if prologue == "silu_mul":
        return F.silu(x[..., :in_features]) * x[..., in_features:]
    if prologue != "none":
        raise ValueError(f"prologue must be one of {tuple(PROLOGUES)}, got {prologue!r}")
    return x


def _reference_op(x: torch.Tensor, prologue: int, gamma: Optional[torch.Tensor] = None, eps: float = 0.0):
    name = _NAMES.get(prologue)
    if name is None:
        raise ValueError(f"aipc::prologue: prologue code {prologue} is not one of {PROLOGUES}")
    K = x.shape[-1] // 2 if name == "silu_mul" else x.shape[-1]
    return prologue_reference(x, name, gamma, eps, K).contiguous()


def _fake(x: torch.Tensor, prologue: int, gamma: Optional[torch.Tensor] = None, eps: float = 0.0):
    K = x.shape[-1] // 2 if prologue == PROLOGUES["silu_mul"] else x.shape[-1]
    return x.new_empty(*x.shape[:-1], K)


_LIB.impl("prologue", _reference_op, "CompositeExplicitAutograd")
torch.library.register_fake("aipc::prologue")(_fake)


def apply_prologue(x: torch.Tensor, prologue: str, gamma: Optional[torch.Tensor], eps: float,
                   in_features: int) -> torch.Tensor:  # fmt: skip
    """``prologue(x)`` (see the module docstring) of x's ``in_features`` (``2 * in_features`` for ``silu_mul``)
    columns: the native kernel for bf16 / fp16 CPU tensors (gamma in x's dtype), else the torch ops (float32:
    see the module docstring)."""
    if prologue not in PROLOGUES:
        raise ValueError(f"prologue must be one of {tuple(PROLOGUES)}, got {prologue!r}")
    if prologue == "none":
        return x
    if (_NATIVE and x.device.type == "cpu" and x.dtype in NATIVE_DTYPES and x.dim() >= 1
            and x.shape[-1] == (2 * in_features if prologue == "silu_mul" else in_features)
            and (gamma is None or gamma.dtype == x.dtype)):  # fmt: skip
        return torch.ops.aipc.prologue(x, PROLOGUES[prologue], gamma, float(eps))
    return prologue_reference(x, prologue, gamma, eps, in_features)


_NATIVE = native.ops_library() is not None  # loading the C++ unit registers the CPU kernel of the schema above

__all__ = ["PROLOGUES", "apply_prologue", "prologue_reference", "rms_norm_like_transformers"]
