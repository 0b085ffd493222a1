"""``cuda_stream``: the M == 1 W2A8 GEMV in CUDA C (NVIDIA only), beside the portable Triton ``stream``.

Issue 20 allows a vendor kernel behind the same op. This one is a single launch: every block quantizes
the activation row into shared memory itself (the pre-pass's codes, bit for bit), then its warps stream
blocks of RW rows, each lane one row and every (32 / RW)-th 16-byte unit of it, D units of loads ahead of
the ``dp4a``s (``cuda_stream.cu`` says how). 2-bit code books with groups of 32, 64 or 128 (fixed or
stored zeros, fp16/bf16 scales; not the min form); anything else raises a ValueError naming the Triton ``stream`` kernel. The source is
compiled at first use by NVRTC through ``torch.cuda._compile_kernel`` (no CUDA toolkit needed, one
compile per variant and process) and never runs in the Triton interpreter: its tests need a GPU.

Config: ``RW`` (rows per warp, 1-32), ``D`` (units in flight per lane), ``num_warps`` (per block),
``BPS`` (blocks per SM of the grid), ``BLOCK_N`` (= RW) and ``SPLIT_K`` (1): the GEMV path's fields.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from aipc_kernels.lowbit.formats import get_codebook
from aipc_kernels.lowbit.packing import PackedLowBit
from aipc_kernels.gpu.triton.lowbit.common import sm_count
from aipc_kernels.gpu.cuda.build import KINDS, bias_operand, compiled, float_literal, nvrtc_available

NAME = "cuda_stream"
# the variant key's fields, in order (cuda_build.compiled)
_MACROS = ("IN_KIND", "SCALE_KIND", "G", "RW", "D", "U", "NWARPS", "XV", "HAS_ZEROS", "HAS_BIAS", "HAS_AMAX", "VEC", "CMUL", "ZERO")
SOURCE = Path(__file__).with_name("cuda_stream.cu")
MAX_KP = 32768  # codes and 16-k sums in static shared memory: 1.25 Kp bytes, below 48 KiB
SPACE = [
    {"KERNEL": NAME, "BLOCK_N": rw, "SPLIT_K": 1, "RW": rw, "D": d, "num_warps": nw, "num_stages": 1, "BPS": bps}
    for rw in (1, 2, 4, 8, 16)
    for d in (2, 4, 8)
    for nw in (4, 8)
    for bps in (1, 2)
]


def available(device: torch.device) -> bool:
    """Compiled CUDA (not the interpreter) with torch's NVRTC entry (``torch.cuda._compile_kernel``)."""
    return nvrtc_available(device)


def usable(device: torch.device) -> bool:
    """Whether a cached or shipped config of this kernel may run on ``device`` (else the op takes the
    heuristic's config: an older torch without NVRTC's entry must not fail on the shipped H100 configs)."""
    return available(device)


def space(M: int) -> list[dict]:
    """The configs the tuner times for ``M`` tokens: M == 1 on CUDA (the tuner skips the ones a weight refuses)."""
    return list(SPACE) if M == 1 and torch.cuda.is_available() and available(torch.device("cuda")) else []


def heuristic(M: int, N: int, K: int, bits: int, device: torch.device) -> Optional[dict]:
    """No untuned default: the Triton ``stream`` kernel serves untuned M == 1 problems."""
    return None


def check(x2: torch.Tensor, weight: PackedLowBit, cfg: dict) -> None:
    """A ValueError naming the fix when this kernel cannot run ``weight`` (or ``cfg``)."""
    cb = get_codebook(weight.codebook)
    K, G = x2.shape[1], weight.group_size
    Kp = weight.qweight.shape[1] * 4
    if x2.shape[0] != 1:
        raise ValueError(f"config {cfg}: the cuda_stream kernel takes M == 1 only (M={x2.shape[0]})")
    if not available(x2.device):
        raise ValueError(f"config {cfg}: cuda_stream needs compiled CUDA with torch.cuda._compile_kernel; use KERNEL='stream'")
    if cb.bits != 2 or G not in (32, 64, 128) or G == K:
        raise ValueError(f"config {cfg}: cuda_stream takes 2-bit codes in groups of 32, 64 or 128 "
                         f"({weight.codebook}, {cb.bits} bits, group {G}); use KERNEL='stream'")
    if cb.mins or weight.scales.dtype == torch.float32:
        raise ValueError(f"config {cfg}: cuda_stream takes neither the min form nor float32 scales (GGUF's Q4_1 / K-quants: "
                         f"{weight.codebook}, scales {weight.scales.dtype}); use KERNEL='stream'")
    if Kp > MAX_KP:
        raise ValueError(f"config {cfg}: cuda_stream keeps the activation codes in shared memory, K <= {MAX_KP} (K={K}); use KERNEL='stream'")
    if weight.qweight.data_ptr() % 16 or x2.dtype not in KINDS or weight.scales.dtype not in KINDS:
        raise ValueError(f"config {cfg}: cuda_stream needs 16-byte aligned codes and fp32/fp16/bf16 x and scales; use KERNEL='stream'")
    if cfg.get("RW", 8) not in (1, 2, 4, 8, 16, 32) or cfg.get("D", 4) not in (1, 2, 4, 8) or cfg.get("SPLIT_K", 1) != 1:
        raise ValueError(f"config {cfg}: cuda_stream takes RW in (1, 2, 4, 8, 16, 32), D in (1, 2, 4, 8) and SPLIT_K=1")


def launch(x2: torch.Tensor, weight: PackedLowBit, bias: Optional[torch.Tensor], y: torch.Tensor, cfg: dict,
           act_amax: Optional[torch.Tensor] = None) -> None:  # fmt: skip
    """The whole op for ``x2 [1, K]`` (activation pass included), writing ``y [1, N]``."""
    check(x2, weight, cfg)
    cb = get_codebook(weight.codebook)
    K, N = x2.shape[1], weight.out_features
    Kp = weight.qweight.shape[1] * 4
    rw, d, nw = cfg.get("RW", 8), cfg.get("D", 4), cfg["num_warps"]
    vec = int(x2.data_ptr() % 16 == 0 and K % 8 == 0)
    key = (KINDS[x2.dtype], KINDS[weight.scales.dtype], weight.group_size, rw, d, Kp // 64, nw, -(-Kp // (8 * 32 * nw)),
           int(weight.zeros is not None), int(bias is not None), int(act_amax is not None), vec,
           float_literal(cb.cmul), float_literal(cb.zero or 0.0))  # fmt: skip
    row_blocks = -(-N // rw)
    blocks = max(1, min(-(-row_blocks // nw), cfg.get("BPS", 1) * sm_count(x2.device)))
    kern = compiled(SOURCE, "lowbit_gemv_w2", _MACROS, key)
    with torch.cuda.device(x2.device):
        kern(grid=(blocks, 1, 1), block=(32 * nw, 1, 1), args=[
            x2, weight.scales if act_amax is None else act_amax, weight.qweight, weight.scales,
            weight.scales if weight.zeros is None else weight.zeros, bias_operand(bias, x2, weight.scales), y,
            N, K, weight.scales.shape[0],
        ])  # fmt: skip
