"""``cuda_mma``: the 1 < M <= 64 W2A8 linear on the int8 tensor cores in CUDA C (NVIDIA sm_80+), beside
the portable Triton ``group``.

Issue 20 allows a vendor kernel behind the same op. After the Triton activation pass
(:func:`~.activation.quantize_rows`: int8 codes in this kernel's order, per-token scales, 32-k sums),
each block streams NT tiles of 8 weight rows over its chunk range, its warps taking the chunks in turn,
D chunks of loads ahead of the math: per bit-plane one ``mma.sync.m16n8k32`` of the masked codes (u8) against the
activation codes (s8) per 16 tokens, no shared memory on the way (``cuda_mma.cu`` says how). 2-bit code
books with groups of 32, 64 or 128 (fixed or stored zeros, fp16/bf16 scales; not the min form), N % 8 == 0, and the
progressive two-level form (:mod:`~aipc_kernels.lowbit.progressive`, ``min2``: int8 group scales and mins, each
group's ``s1 * dot + m * xsum`` exact in fp32, the row's ``s0`` at the end; ``NT >= 2``, ``N % 16 == 0`` with ``NT = 8``);
anything else raises a ValueError naming the Triton ``group`` kernel. Compiled at first use by NVRTC through ``torch.cuda._compile_kernel``
(no CUDA toolkit needed, one compile per variant and process); never runs in the Triton interpreter:
its tests need a GPU.

Config: ``NT`` (8-row tiles per block; ``BLOCK_N`` = 8 NT), ``num_warps`` (the block's warps, each a
share of its chunks), ``D`` (chunks in flight per warp), ``SPLIT_K`` (chunk ranges over the grid's y,
their partials added in split order by the last block of each row block). The 16-token tiles per block
follow from M (up to 4).
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from aipc_kernels.lowbit.formats import get_codebook
from aipc_kernels.lowbit.packing import PackedLowBit
from aipc_kernels.gpu.triton.lowbit.activation import quantize_rows
from aipc_kernels.gpu.triton.lowbit.common import split_plan
from aipc_kernels.gpu.cuda.build import KINDS, bias_operand, check_w2_operands, compiled, float_literal, nvrtc_available

NAME = "cuda_mma"
FORMS = ("single", "progressive")  # registry.takes: the progressive form's int8 scales and mins too, times s0
# the variant key's fields, in order (cuda_build.compiled)
_MACROS = ("IN_KIND", "SCALE_KIND", "G", "NT", "MT", "NW", "D", "SPLIT", "HAS_ZEROS", "HAS_BIAS", "CMUL", "ZERO", "PROG")
INT8_SCALES = 3  # SCALE_KIND of the progressive form's int8 group scales (cuda_common.cuh)
SOURCE = Path(__file__).with_name("cuda_mma.cu")
MAX_M = 64  # four 16-token tiles per block
MAX_SHARED = 48 * 1024  # static shared memory of a block
FIELDS = ("BLOCK_N", "SPLIT_K", "num_warps", "D")


def _space(mt: int) -> list[dict]:
    """The configs for MT 16-token tiles: at most 8 (token tile x row tile) accumulators per lane, one row
    tile only with several token tiles, the warps' sums within 48 KiB of shared memory."""
    return [
        {"KERNEL": NAME, "BLOCK_N": 8 * nt, "NT": nt, "SPLIT_K": sk, "D": d, "num_warps": nw, "num_stages": 1}
        for nt in (1, 2, 4, 8)
        for nw in (4, 8, 16)
        for d in (1, 2, 4)
        for sk in (1, 2, 4, 8)
        if mt * nt <= 8 and (nt > 1 or mt > 1) and shared_bytes(nw, nt, mt) <= MAX_SHARED
    ]


def shared_bytes(num_warps: int, nt: int, mt: int) -> int:
    """Static shared memory of the warps' sums: num_warps x mt x nt x 4 fp32 values per lane."""
    return num_warps * mt * nt * 4 * 32 * 4


def available(device: torch.device) -> bool:
    """Compiled CUDA (not the interpreter) on sm_80+ (int8 ``mma.sync.m16n8k32``) with torch's NVRTC entry."""
    return nvrtc_available(device) and torch.cuda.get_device_capability(device) >= (8, 0)


def usable(device: torch.device) -> bool:
    """Whether a cached or shipped config of this kernel may run on ``device`` (else the heuristic's)."""
    return available(device)


def space(M: int) -> list[dict]:
    """The configs the tuner times for ``M`` tokens: 1 < M <= 64 on CUDA sm_80+ (the tuner skips the ones a weight refuses)."""
    if not 1 < M <= MAX_M or not torch.cuda.is_available() or not available(torch.device("cuda")):
        return []
    return _space(-(-M // 16))


def heuristic(M: int, N: int, K: int, bits: int, device: torch.device) -> Optional[dict]:
    """No untuned default: the Triton ``group`` kernel serves untuned problems."""
    return None


def check(x2: torch.Tensor, weight: PackedLowBit, cfg: dict) -> None:
    """A ValueError naming the fix when this kernel cannot run ``weight`` (or ``cfg``)."""
    M = x2.shape[0]
    if not 1 < M <= MAX_M:
        raise ValueError(f"config {cfg}: the cuda_mma kernel takes 1 < M <= {MAX_M} (M={M}); use KERNEL='group'")
    nt, nw = cfg.get("NT", 1), cfg["num_warps"]
    check_w2_operands(NAME, x2, weight, cfg, available(x2.device), progressive=True)
    if weight.supers is not None and (nt < 2 or (nt == 8 and weight.out_features % 16)):
        raise ValueError(f"config {cfg}: {NAME} takes the progressive form's int8 scales with NT >= 2 (NT = 8: N % 16 == 0, "
                         f"N={weight.out_features}); use a smaller NT or KERNEL='group'")
    if nt not in (1, 2, 4, 8) or cfg["BLOCK_N"] != 8 * nt or cfg.get("D", 1) not in (1, 2, 4) or nw not in (1, 2, 4, 8, 16):
        raise ValueError(f"config {cfg}: cuda_mma takes NT in (1, 2, 4, 8) with BLOCK_N = 8 NT, D in (1, 2, 4), num_warps in (1, 2, 4, 8, 16)")
    if shared_bytes(nw, nt, -(-M // 16)) > MAX_SHARED:
        raise ValueError(f"config {cfg}: cuda_mma's warp sums at M={M} need {shared_bytes(nw, nt, -(-M // 16))} bytes of shared "
                         f"memory, more than {MAX_SHARED}: fewer warps or a smaller NT")


def launch(x2: torch.Tensor, weight: PackedLowBit, bias: Optional[torch.Tensor], y: torch.Tensor, cfg: dict,
           act_amax: Optional[torch.Tensor] = None) -> None:  # fmt: skip
    """The activation pass and the kernel for ``x2 [M, K]``, writing ``y [M, N]``."""
    check(x2, weight, cfg)
    cb = get_codebook(weight.codebook)
    M, N = x2.shape[0], weight.out_features
    Kp = weight.qweight.shape[1] * 4
    nt, nw, d = cfg.get("NT", 1), cfg["num_warps"], cfg.get("D", 1)
    xq, sx, xsum = quantize_rows(x2, Kp, sums=True, act_amax=act_amax, perm=True)
    row_blocks = -(-N // cfg["BLOCK_N"])
    split, per_split, ws, locks, _ = split_plan(Kp // 128, cfg.get("SPLIT_K", 1), row_blocks, M, N, y)  # ticket path
    prog = weight.supers is not None
    key = (KINDS[x2.dtype], INT8_SCALES if prog else KINDS[weight.scales.dtype], weight.group_size, nt, -(-M // 16), nw,
           d, split, int(weight.zeros is not None), int(bias is not None),
           float_literal(cb.cmul), float_literal(cb.zero or 0.0), int(prog))  # fmt: skip
    kern = compiled(SOURCE, "lowbit_mma_w2", _MACROS, key)
    args = [xq, sx, xsum, weight.qweight, weight.scales, weight.scales if weight.zeros is None else weight.zeros,
            bias_operand(bias, x2, weight.scales), y, ws, locks, weight.supers if prog else sx,
            M, N, Kp, weight.scales.shape[0], per_split]  # fmt: skip
    with torch.cuda.device(x2.device):
        kern(grid=(row_blocks, split, 1), block=(32 * nw, 1, 1), args=args)
