"""The shipped kernels by name (a config's ``KERNEL``), and the untuned and batch-invariant choices.

Each kernel module exports ``NAME``, ``space(M)`` (its tuning configs), ``heuristic(M, N, K, bits,
device)`` and ``launch(x2, weight, bias, y, cfg, act_amax=None)``, and optionally ``FIELDS`` (the config
fields it needs, default: its path's, :data:`~.common.CONFIG_FIELDS`), ``usable(device)`` and ``config_usable(cfg,
device)`` (default: always). Adding a kernel: a module with
those, an entry in :data:`KERNELS`, and (if it should run untuned) a branch in :func:`heuristic_config`.
"""
from __future__ import annotations

import os
from types import ModuleType
from typing import Optional

import torch

from aipc_kernels.lowbit.packing import PackedLowBit
from aipc_kernels.gpu.cuda import gemm as cuda_gemm, mma as cuda_mma, stream as cuda_stream
from aipc_kernels.gpu.triton.lowbit import dequant, expand, group, stream
from aipc_kernels.gpu.triton.lowbit import progressive as progressive_kernel
from aipc_kernels.gpu.triton.lowbit.common import GEMV_MAX_M, check_config
from aipc_kernels.gpu.triton.lowbit.interpret import interpreter_scope

KERNELS: dict[str, ModuleType] = {stream.NAME: stream, group.NAME: group, dequant.NAME: dequant, cuda_stream.NAME: cuda_stream,
                                 cuda_mma.NAME: cuda_mma, cuda_gemm.NAME: cuda_gemm, progressive_kernel.NAME: progressive_kernel,
                                 expand.NAME: expand}


def takes(kernel: ModuleType, weight: PackedLowBit) -> bool:
    """Whether ``kernel`` takes ``weight``'s form: ``"progressive"`` (the two-level form with supers in
    ``triton_k32``) or ``"single"``, as listed in the module's ``FORMS`` (default: single-level only)."""
    return ("progressive" if weight.supers is not None else "single") in getattr(kernel, "FORMS", ("single",))


def kernel_of(cfg: dict) -> ModuleType:
    """The kernel module that runs ``cfg`` (its ``KERNEL``), or a ValueError naming the known ones."""
    name = cfg.get("KERNEL")
    if name is None:
        raise ValueError(f"config={cfg} lacks 'KERNEL'; give one of {sorted(KERNELS)}")
    if name not in KERNELS:
        raise ValueError(f"config={cfg}: KERNEL={name!r} is unknown; use one of {sorted(KERNELS)}")
    return KERNELS[name]


def check_kernel_config(cfg: dict, M: int) -> ModuleType:
    """The kernel module of ``cfg`` after checking that ``cfg`` gives the fields it needs at ``M``
    (a ValueError naming the missing ones otherwise)."""
    kernel = kernel_of(cfg)
    check_config(cfg, M, getattr(kernel, "FIELDS", None))
    return kernel


def launch(x2: torch.Tensor, weight: PackedLowBit, bias: Optional[torch.Tensor], y: torch.Tensor, cfg: dict,
           act_amax: Optional[torch.Tensor] = None) -> None:  # fmt: skip
    """Runs one configuration on contiguous operands, writing ``y [M, N]`` (``act_amax``: None or dense
    float32 [M], the per-token activation absmax to quantize with)."""
    kernel = check_kernel_config(cfg, x2.shape[0])
    with interpreter_scope():
        kernel.launch(x2, weight, bias, y, cfg, act_amax)


def usable(cfg: dict, device: torch.device) -> bool:
    """Whether ``cfg`` can run on ``device`` (a kernel module's optional ``usable(device)``, and its optional
    ``config_usable(cfg, device)`` for configs that need more than the kernel does; an unknown kernel is not: a
    cache written by another version)."""
    kernel = KERNELS.get(cfg.get("KERNEL"))
    return (kernel is not None and getattr(kernel, "usable", lambda d: True)(device)
            and getattr(kernel, "config_usable", lambda c, d: True)(cfg, device))


def runs(cfg: dict, x2: torch.Tensor, weight: PackedLowBit) -> bool:
    """Whether ``cfg``'s kernel takes this weight and ``x2`` (a kernel module's optional ``check(x2, weight,
    cfg)``, which raises a ValueError naming what it refuses): the CUDA C kernels take 2-bit codes with
    16-bit scales and no min form; every Triton kernel's heuristic config takes every valid weight."""
    kernel = KERNELS.get(cfg.get("KERNEL"))
    if kernel is None or not takes(kernel, weight):
        return False
    check = getattr(kernel, "check", None)
    if check is None:
        return True
    try:
        check(x2, weight, cfg)
    except ValueError:
        return False
    return True


def heuristic_config(M: int, N: int, K: int, bits: int, device: torch.device, progressive: bool = False) -> dict:
    """The untuned default: ``stream`` at M == 1, ``dequant`` from M = ``dequant.MIN_M``, ``group``
    otherwise (each module's own rule); ``progressive`` (a weight in the progressive two-level form): that
    form's kernels at M > 16 (``expand`` from ``expand.MIN_M`` tokens, ``progressive`` below), ``stream`` /
    ``group`` at M <= 16 as for every weight."""
    if progressive:  # decode on today's M <= 16 kernels, prompts on the form's own
        if M <= GEMV_MAX_M:
            return (stream if M == 1 else group).heuristic(M, N, K, bits, device)
        return (expand if M >= expand.MIN_M else progressive_kernel).heuristic(M, N, K, bits, device)
    if M == 1:
        return stream.heuristic(M, N, K, bits, device)
    return dequant.heuristic(M, N, K, bits, device) or group.heuristic(M, N, K, bits, device)


def batch_invariant() -> bool:
    """``AIPC_BATCH_INVARIANT=1`` (or vLLM's own ``VLLM_BATCH_INVARIANT=1``): every M runs the ``group``
    kernel unsplit, so a row's output bits do not depend on the batch it is computed in (see
    :func:`invariant_config`). Off by default: M <= 16 then loses the stream kernel and split-K."""
    flag = os.environ.get("AIPC_BATCH_INVARIANT") or os.environ.get("VLLM_BATCH_INVARIANT") or "0"
    return flag not in ("0", "false", "False")


def invariant_config(cfg: dict, M: int, N: int, K: int, bits: int, device: torch.device) -> dict:
    """The batch-invariant form of a selected config: the ``group`` kernel, one K range per program
    (no split-K). Each output element is then the same sequence of operations whatever the tile or M:
    an exact int32 dot per group, ``acc += dot * s`` (``- s * z * xsum``) in group order, ``* sx +
    bias``; and every M uses the same row-wise activation pass. A tuned group tile is kept, another
    kernel's config becomes the heuristic's group tile (M = 1 takes the M <= 16 one). The ``progressive``
    kernel (its own form) stays, unsplit: one exact int32 sum per output whatever the tile."""
    if cfg.get("KERNEL") not in (group.NAME, progressive_kernel.NAME):
        cfg = group.heuristic(max(M, 2), N, K, bits, device)
    return dict({k: v for k, v in cfg.items() if k != "ATOMIC"}, SPLIT_K=1)
