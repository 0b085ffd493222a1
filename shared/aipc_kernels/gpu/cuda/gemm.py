"""``cuda_gemm``: the M > 16 W2A8 linear on the int8 tensor cores in CUDA C (NVIDIA sm_80+), beside the
portable Triton ``group`` and ``dequant``.

Issue 20 allows a vendor kernel behind the same op. On the H100 the peer, ``torch._int_mm``, runs an
Ampere-form ``mma.sync`` GEMM at 72% tensor-pipe activity where ``group`` reaches 17-27%, instruction-bound
(``bench/results/gpu/ncu_gemm_h100.log``). This kernel is that form for 2-bit weights: after the Triton
activation pass (:func:`~.activation.quantize_rows`, k order), each block computes a
BM x BN tile of y, its warps' fragments read from a ring of STAGES chunks in shared memory filled by
``cp.async`` (``cuda_gemm.cu`` says how), the codes as the int8 levels of ``group`` (the fixed zero point
folded in), one FADD and one FFMA per output and group (one FFMA more with stored zeros). 2-bit code
books with groups of 32, 64 or 128 (fixed or stored zeros, fp16/bf16 scales; not the min form), N % 8 == 0; anything else raises a ValueError
naming the Triton ``group`` kernel. Compiled at first use by NVRTC (``cuda_build.compiled``); never runs in
the Triton interpreter: its tests need a GPU.

Config: ``BLOCK_M`` / ``BLOCK_N`` (the block's tile), ``WM`` x ``WN`` warps over it (``num_warps`` their
product; a warp's tile BLOCK_M / WM tokens x BLOCK_N / WN rows), ``num_stages`` (chunks in the ring).
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from aipc_kernels.lowbit.formats import get_codebook
from aipc_kernels.lowbit.packing import PackedLowBit
from aipc_kernels.gpu.triton.lowbit.activation import quantize_rows
from aipc_kernels.gpu.cuda.build import KINDS, bias_operand, check_w2_operands, compiled, float_literal, nvrtc_available

NAME = "cuda_gemm"
# the variant key's fields, in order (cuda_build.compiled)
_MACROS = ("IN_KIND", "SCALE_KIND", "G", "BM", "BN", "WM", "WN", "STAGES", "HAS_ZEROS", "HAS_BIAS", "CA", "CB", "FMUL")
SOURCE = Path(__file__).with_name("cuda_gemm.cu")
MIN_M = 17  # M <= 16: the GEMV kernels
FIELDS = ("BLOCK_M", "BLOCK_N", "WM", "WN", "num_warps", "num_stages")
# (BLOCK_M, BLOCK_N, WM, WN): warp tiles of 2-4 16-token x 4 8-row tiles (at most 16 per lane)
_TILES = [(64, 64, 2, 2), (64, 128, 2, 4), (128, 64, 4, 2), (128, 128, 2, 4), (128, 128, 4, 2), (64, 256, 1, 8)]
SPACE = [
    {"KERNEL": NAME, "BLOCK_M": bm, "BLOCK_N": bn, "WM": wm, "WN": wn, "num_warps": wm * wn, "num_stages": s}
    for bm, bn, wm, wn in _TILES
    for s in (2, 3, 4)
]


def stage_bytes(bm: int, bn: int, group: int, scale_bytes: int, zeros: bool) -> int:
    """Shared memory of one ring stage: token codes, weight codes, scales (with zeros: zeros, token sums)."""
    return bm * 128 + bn * 32 + (4 // (group // 32)) * bn * scale_bytes * (2 if zeros else 1) + (bm * 16 if zeros else 0)


def available(device: torch.device) -> bool:
    """Compiled CUDA (not the interpreter) on sm_80+ (int8 ``mma.sync.m16n8k32``, ``cp.async``) with torch's NVRTC entry."""
    return nvrtc_available(device) and torch.cuda.get_device_capability(device) >= (8, 0)


def usable(device: torch.device) -> bool:
    """Whether a cached or shipped config of this kernel may run on ``device`` (else the heuristic's)."""
    return available(device)


def space(M: int) -> list[dict]:
    """The configs the tuner times for ``M`` tokens: M > 16 on CUDA sm_80+ (the tuner skips the ones a weight refuses)."""
    if M < MIN_M or not torch.cuda.is_available() or not available(torch.device("cuda")):
        return []
    return [dict(c) for c in SPACE]


def heuristic(M: int, N: int, K: int, bits: int, device: torch.device) -> Optional[dict]:
    """No untuned default: ``group`` and ``dequant`` serve untuned problems."""
    return None


def _shared_limit(device: torch.device) -> int:
    props = torch.cuda.get_device_properties(device)
    return getattr(props, "shared_memory_per_block_optin", 48 * 1024)


def check(x2: torch.Tensor, weight: PackedLowBit, cfg: dict) -> None:
    """A ValueError naming the fix when this kernel cannot run ``weight`` (or ``cfg``)."""
    M = x2.shape[0]
    if M < MIN_M:
        raise ValueError(f"config {cfg}: the cuda_gemm kernel takes M >= {MIN_M} (M={M}); use KERNEL='group'")
    check_w2_operands(NAME, x2, weight, cfg, available(x2.device))
    bm, bn, wm, wn = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["WM"], cfg["WN"]
    if (bm, bn, wm, wn) not in _TILES or cfg["num_warps"] != wm * wn or cfg["num_stages"] not in (2, 3, 4):
        raise ValueError(f"config {cfg}: cuda_gemm takes (BLOCK_M, BLOCK_N, WM, WN) in {_TILES}, num_warps = WM * WN "
                         f"and num_stages in (2, 3, 4)")
    need = cfg["num_stages"] * stage_bytes(bm, bn, weight.group_size, weight.scales.element_size(), weight.zeros is not None)
    limit = _shared_limit(x2.device)
    if need > limit:
        raise ValueError(f"config {cfg}: cuda_gemm's ring needs {need} bytes of shared memory, more than this GPU's "
                         f"{limit}: fewer num_stages or a smaller tile")


def launch(x2: torch.Tensor, weight: PackedLowBit, bias: Optional[torch.Tensor], y: torch.Tensor, cfg: dict,
           act_amax: Optional[torch.Tensor] = None) -> None:  # fmt: skip
    """The activation pass and the kernel for ``x2 [M, K]``, writing ``y [M, N]``."""
    check(x2, weight, cfg)
    cb = get_codebook(weight.codebook)
    M, N = x2.shape[0], weight.out_features
    Kp = weight.qweight.shape[1] * 4
    bm, bn, wm, wn, st = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["WM"], cfg["WN"], cfg["num_stages"]
    xq, sx, xsum = quantize_rows(x2, Kp, sums=weight.zeros is not None, act_amax=act_amax)
    ca, cbias, fmul = cb.integer_form()
    key = (KINDS[x2.dtype], KINDS[weight.scales.dtype], weight.group_size, bm, bn, wm, wn, st,
           int(weight.zeros is not None), int(bias is not None), ca, cbias, float_literal(fmul))  # fmt: skip
    smem = st * stage_bytes(bm, bn, weight.group_size, weight.scales.element_size(), weight.zeros is not None)
    kern = compiled(SOURCE, "lowbit_gemm_w2", _MACROS, key, shared_mem=smem)  # the key decides smem
    args = [xq, sx, sx if xsum is None else xsum, weight.qweight, weight.scales, weight.scales if weight.zeros is None else weight.zeros,
            bias_operand(bias, x2, weight.scales), y, M, N, Kp, weight.scales.shape[0]]  # fmt: skip
    with torch.cuda.device(x2.device):
        kern(grid=(-(-N // bn), -(-M // bm), 1), block=(32 * wm * wn, 1, 1), args=args, shared_mem=smem)
