"""``lowbit_linear_triton``: the GPU implementation of ``aipc::lowbit_linear`` (validation, config, launch)."""
from __future__ import annotations

from typing import Optional

import torch

from aipc_kernels.lowbit.formats import get_codebook
from aipc_kernels.lowbit.contract import check_operands
from aipc_kernels.lowbit.packing import TRITON_LAYOUT, PackedLowBit, triton_chunk
from aipc_kernels.gpu.triton.lowbit.common import dense_call
from aipc_kernels.gpu.triton.lowbit.registry import batch_invariant, heuristic_config, invariant_config, launch, runs
from aipc_kernels.gpu.triton.lowbit.tuning import select_config

MAX_G_8BIT = 65536  # 8-bit codes: |dot| <= G * 128 * 127 stays below 2**31 (the native kernels' bound)
MAX_G_4BIT_ZEROS = 8192  # 4-bit codes with stored zeros: |dot| <= G * 15 * 127 below 2**24, u exact (native bound)


def _validate(x: torch.Tensor, weight: PackedLowBit, bias: Optional[torch.Tensor], act_group: int,
              act_amax: Optional[torch.Tensor]) -> None:  # fmt: skip
    """The Triton kernels' own limits, then every operand against the others (``lowbit_contract.check_operands``)."""
    if weight.layout != TRITON_LAYOUT:
        raise ValueError(
            f"weight.layout={weight.layout!r}: the Triton kernels need {TRITON_LAYOUT!r}; "
            f"pack it with aipc_kernels.lowbit.packing.pack_for_triton"
        )
    if act_group > 0:
        raise ValueError(f"act_group={act_group}: the Triton kernels quantize activations per token; use act_group=0")
    if x.dim() and x.shape[-1] != weight.in_features:
        raise ValueError(f"lowbit_linear: weight of in_features={weight.in_features} does not match x's K={x.shape[-1]}")
    check_operands(x, weight.qweight, weight.scales, weight.zeros, bias, weight.layout, weight.codebook,
                   weight.group_size, weight.out_features, act_group, act_amax, supers=weight.supers)  # fmt: skip
    K, G, chunk = x.shape[-1], weight.group_size, triton_chunk(weight.bits)
    if G == 16 and G != K and weight.bits == 1:
        raise ValueError(f"group_size=16 takes codes of 2 bits or more (GGUF's K-quants), not {weight.codebook!r}")
    if G != K and chunk % G and G % chunk:  # 4/8 bits: a group may span G // chunk chunks (16: half a plane)
        raise ValueError(f"group_size={G} must divide {chunk}, be a multiple of it or be the whole row for {TRITON_LAYOUT}")
    if weight.bits == 8 and G > MAX_G_8BIT:
        raise ValueError(f"group_size={G}: 8-bit codes take groups of at most {MAX_G_8BIT} (int32 dots); use group_size=128")
    if weight.bits == 4 and weight.zeros is not None and not get_codebook(weight.codebook).mins and G > MAX_G_4BIT_ZEROS:
        raise ValueError(
            f"group_size={G}: 4-bit codes with stored zeros take groups of at most {MAX_G_4BIT_ZEROS} "
            f"(exact fp32 zero correction); use group_size=128"
        )


def lowbit_linear_triton(
    x: torch.Tensor,
    weight: PackedLowBit,
    bias: Optional[torch.Tensor] = None,
    act_group: int = 0,
    config: Optional[dict] = None,
    out: Optional[torch.Tensor] = None,
    act_amax: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``x @ W^T + bias`` with int8 activations on the Triton kernels (batch-invariant under
    :func:`~.registry.batch_invariant`).

    ``config`` overrides the tuned tile configuration (and the batch-invariant choice); ``out`` (contiguous, ``x``'s dtype, ``[..., N]``)
    receives the result instead of a new tensor; ``act_amax`` (float32, one per token): the absmax each
    token's activations are quantized with instead of its own (the op's ``act_amax``)."""
    _validate(x, weight, bias, act_group, act_amax)
    K, N = x.shape[-1], weight.out_features
    x2, weight, bias, y = dense_call(x, weight, bias, out)
    M = x2.shape[0]
    if M == 0:
        return y.view(*x.shape[:-1], N)
    if config is not None:
        cfg = config
    else:
        cfg = select_config(x2, weight, bias, y)
        if not runs(cfg, x2, weight):  # a cached config (keyed by shape, group and bits) of a kernel that refuses
            # this weight's form (e.g. a CUDA C kernel and GGUF's min form or float32 scales): the portable one
            cfg = heuristic_config(M, N, K, weight.bits, x.device, progressive=weight.supers is not None)
        if batch_invariant():
            cfg = invariant_config(cfg, M, N, K, weight.bits, x.device)
    launch(x2, weight, bias, y, cfg, None if act_amax is None else act_amax.reshape(-1).contiguous())
    return y.view(*x.shape[:-1], N)
