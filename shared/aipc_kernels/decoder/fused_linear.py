"""``torch.ops.aipc.fused_linear``: one projection of a decoder layer with its element-wise neighbours, in one
call, with a fake kernel (usable under torch.compile).

    y = prologue(x) @ cat(weights)^T + cat(biases)  (+ residual)

* ``weights``: the layer's own ``[N_s, K]`` tensors (q, k and v; gate and up; or one), each read once, their
  outputs in consecutive columns of ``y``: a merged projection without a merged copy of the weights;
* ``prologue``: ``"none"``; ``"rmsnorm"`` (``gamma * rmsnorm(x)``, the RMSNorm before the projection);
  ``"silu_mul"`` (x holds ``[gate | up]``, ``2K`` columns: ``silu(gate) * up``, the SwiGLU before the down
  projection);
* ``residual``: added after the product, as ``residual + linear(x)``.

Each step rounds to x's dtype where transformers' modules round (``LlamaRMSNorm``: the normalized row, then
its product with the weight; ``silu``, then the product with ``up``; the linear output, then the residual sum).

Dispatch: CPU with at most :func:`aipc_kernels.decoder.dense_linear.cpu_max_rows` rows, one dtype for x, gamma,
biases and residual, at most 4 weights -> ``aipc_dense_linear_fused`` (``csrc/generic/dense_linear.c``: the prologue is
the pass that copies x for the tiles, so the normalized / activated row never goes to memory); anything else
(a prompt, GPUs, other dtypes) -> the same math in torch ops (:func:`fused_linear_reference`), where a prompt's
GEMMs are what torch is good at.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from aipc_kernels.core import native
from aipc_kernels.decoder.dense_linear import DTYPES, cpu_max_rows
from aipc_kernels.decoder.prologue import PROLOGUES, prologue_reference


def check_fused_operands(
    x: torch.Tensor,
    weights: Sequence[torch.Tensor],
    biases: Sequence[Optional[torch.Tensor]],
    prologue: str,
    gamma: Optional[torch.Tensor],
    residual: Optional[torch.Tensor],
) -> None:
    """ValueError naming the operand of :func:`fused_linear` that does not fit."""
    if prologue not in PROLOGUES:
        raise ValueError(f"fused_linear: prologue must be one of {tuple(PROLOGUES)}, got {prologue!r}")
    if not weights:
        raise ValueError("fused_linear: weights is empty; pass at least one [N, K] weight")
    if len(biases) != len(weights):
        raise ValueError(f"fused_linear: biases must have one entry (a tensor or None) per weight: {len(weights)} "
                         f"weights, {len(biases)} biases")  # fmt: skip
    K = weights[0].shape[-1]
    for i, (w, b) in enumerate(zip(weights, biases)):
        if w.dim() != 2 or w.shape[1] != K:
            raise ValueError(f"fused_linear: weights[{i}] must be 2-D [N, {K}] (all weights share in_features), got "
                             f"shape {tuple(w.shape)}")  # fmt: skip
        if b is not None and tuple(b.shape) != (w.shape[0],):
            raise ValueError(f"fused_linear: biases[{i}] must have shape ({w.shape[0]},), got {tuple(b.shape)}")
    in_cols = 2 * K if prologue == "silu_mul" else K
    if x.dim() == 0 or x.shape[-1] != in_cols:
        what = "2 x in_features (the gate and up halves)" if prologue == "silu_mul" else "in_features"
        raise ValueError(f"fused_linear: x of shape {tuple(x.shape)} must have {in_cols} = {what} columns for "
                         f"prologue={prologue!r}")  # fmt: skip
    if prologue == "rmsnorm" and (gamma is None or tuple(gamma.shape) != (K,)):
        got = None if gamma is None else tuple(gamma.shape)
        raise ValueError(f"fused_linear: prologue='rmsnorm' needs gamma of shape ({K},), got {got}")
    N = sum(w.shape[0] for w in weights)
    if residual is not None and tuple(residual.shape) != (*x.shape[:-1], N):
        raise ValueError(f"fused_linear: residual must have shape {(*x.shape[:-1], N)} (x's rows, the summed "
                         f"out_features), got {tuple(residual.shape)}")  # fmt: skip
    for name, t in (("x", x), ("gamma", gamma), ("residual", residual), *((f"weights[{i}]", w) for i, w in
                    enumerate(weights)), *((f"biases[{i}]", b) for i, b in enumerate(biases))):  # fmt: skip
        if t is None:
            continue
        if not t.dtype.is_floating_point:
            raise ValueError(f"fused_linear: {name} must be a float tensor, got {t.dtype}")
        if t.device != x.device:
            raise ValueError(f"fused_linear: {name} is on {t.device}, x on {x.device}; move them to one device")


def fused_linear_reference(x, weights, biases, prologue="none", gamma=None, eps=0.0, residual=None):
    """The op in torch ops (the path for prompts, GPUs and what the native kernel does not take)."""
    check_fused_operands(x, weights, biases, prologue, gamma, residual)
    x = prologue_reference(x, prologue, gamma, eps, weights[0].shape[1])
    outs = [F.linear(x, w.to(x.dtype), None if b is None else b.to(x.dtype)) for w, b in zip(weights, biases)]
    y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
    return y if residual is None else residual + y


def _native_fits(x, weights, biases, gamma, residual) -> bool:
    M = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if not (native.available() and 0 < M and len(weights) <= native.MAX_SEGMENTS and x.dtype in DTYPES):
        return False
    if any(M > cpu_max_rows(x.dtype, w.dtype) for w in weights):
        return False
    return all(t is None or t.dtype == x.dtype for t in (gamma, residual, *biases))


def _fused_cpu(x, weights, biases, prologue="none", gamma=None, eps=0.0, residual=None):
    """CPU: ``aipc_dense_linear_fused`` for the few rows of a decode step, else the torch reference."""
    if not _native_fits(x, weights, biases, gamma, residual):
        return fused_linear_reference(x, weights, biases, prologue, gamma, eps, residual)
    check_fused_operands(x, weights, biases, prologue, gamma, residual)
    dense = [t if t is None or t.is_contiguous() else t.contiguous() for t in (x, gamma, residual)]
    weights = [w if w.is_contiguous() else w.contiguous() for w in weights]
    biases = [b if b is None or b.is_contiguous() else b.contiguous() for b in biases]
    x, gamma, residual = dense
    y = torch.empty((*x.shape[:-1], sum(w.shape[0] for w in weights)), dtype=x.dtype)
    native.dense_linear_fused_into(y, x, weights, biases, prologue, gamma, eps, residual)
    return y


_LIB = torch.library.Library("aipc", "FRAGMENT")
_LIB.define(
    "fused_linear(Tensor x, Tensor[] weights, Tensor?[] biases, str prologue='none', Tensor? gamma=None, "
    "float eps=0.0, Tensor? residual=None) -> Tensor"
)
_LIB.impl("fused_linear", fused_linear_reference, "CompositeExplicitAutograd")
_LIB.impl("fused_linear", _fused_cpu, "CPU")


@torch.library.register_fake("aipc::fused_linear")
def _fused_fake(x, weights, biases, prologue="none", gamma=None, eps=0.0, residual=None):
    return x.new_empty(*x.shape[:-1], sum(w.shape[0] for w in weights))


def fused_linear(
    x: torch.Tensor,
    weights: Sequence[torch.Tensor],
    biases: Optional[Sequence[Optional[torch.Tensor]]] = None,
    prologue: str = "none",
    gamma: Optional[torch.Tensor] = None,
    eps: float = 0.0,
    residual: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``aipc::fused_linear`` (see the module docstring); ``biases`` None means no bias on any weight.

    On the CPU without autograd and outside ``torch.compile`` the op's CPU implementation is called
    directly: the dispatcher's ~20 us a call were 4% of a llama-150m beam-search decode step (48 calls)."""
    biases = [None] * len(weights) if biases is None else list(biases)
    if x.device.type == "cpu" and not torch.is_grad_enabled() and not torch.compiler.is_compiling():
        return _fused_cpu(x, list(weights), biases, prologue, gamma, float(eps), residual)
    return torch.ops.aipc.fused_linear(x, list(weights), biases, prologue, gamma, float(eps), residual)
