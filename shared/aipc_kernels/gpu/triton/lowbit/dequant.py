"""``dequant``: for prompts (M > 16), the weight dequantized to x's dtype by one Triton pass, then the
vendor GEMM (``torch.mm``/``addmm``: cuBLAS on CUDA, oneDNN on XPU).

The op's contract is kept: the activations are the same int8 codes and per-token scales as the
fused kernels', handed to the GEMM as ``codes * scale`` rounded once to x's dtype
(:func:`~.activation.fake_quantize_rows`); the weight is ``scale * (cmul * c - zero)`` computed in fp32
and rounded once to x's dtype (bit for bit :meth:`LowBitWeight.dequantize` then ``.to(dtype)``). So against the fused
kernels' exact int32 dots it adds two roundings to x's dtype per product, below the output's own
rounding for bf16/fp16 (fp32: the GEMM's precision, TF32 where the user allowed it).

Cost: the weight is written and read back once in x's dtype (2 bytes per weight for bf16: 8x the
2-bit codes), so this path only wins where the GEMM's time hides that traffic, a long prompt on a
GPU whose fused int8 kernel is slower than its float GEMM. The tuner times it beside the fused
kernels for every M > 16 and keeps whichever is faster; untuned, it serves M >= :data:`MIN_M` (where it
beat the fused kernel on 15 of the 16 Llama shape x M cases of M = 1024 and 4096 on both an H100 and
an H200: bench/results/gpu/tune_gpu_h100.log, tune_gpu_h200.log; the vendor GEMM is also the part an
untuned GPU is likeliest to run well).

Config: ``BLOCK_N`` (weight rows per program), ``CHUNKS`` (32-byte chunks per program), ``num_warps``.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from aipc_kernels.lowbit.formats import get_codebook
from aipc_kernels.lowbit.packing import PackedLowBit
from aipc_kernels.gpu.triton.lowbit.activation import fake_quantize_rows
from aipc_kernels.gpu.triton.lowbit.common import path, round_to

NAME = "dequant"
MIN_M = 1024  # the untuned heuristic's threshold
FIELDS = ("BLOCK_N", "CHUNKS", "num_warps")
SPACE = [
    {"KERNEL": NAME, "BLOCK_N": bn, "CHUNKS": ch, "num_warps": nw}
    for bn, ch, nw in ((32, 4, 4), (64, 2, 4), (16, 8, 4), (64, 4, 8))
]


@triton.jit
def _dequant_kernel(w_ptr, s_ptr, z_ptr, out_ptr, N, K, KB, G, n_chunks,
                    BITS: tl.constexpr, CMUL: tl.constexpr, ZERO: tl.constexpr, HAS_ZEROS: tl.constexpr,
                    BLOCK_N: tl.constexpr, CHUNKS: tl.constexpr, MINS: tl.constexpr = False):  # fmt: skip
    """Program (n, c) writes rows [n * BLOCK_N, +BLOCK_N) of ``out [N, K]`` over chunks [c * CHUNKS,
    +CHUNKS): per bit-plane q of a chunk's 32 bytes, ``k = chunk * 32P + 32q + j``, the value
    ``s[k // G, n] * (CMUL * code - zero)`` in fp32 (``zero``: the stored ``z[k // G, n]`` or ``ZERO``;
    ``MINS``: ``ZERO``, and the stored ``z`` is the min form's min, added after the product),
    rounded to out's dtype; nothing is written past K (the padded codes) or N."""
    P: tl.constexpr = 8 // BITS
    KC: tl.constexpr = 32 * P
    pid_n = tl.program_id(0)
    pid_c = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    j = tl.arange(0, 32)
    rows = offs_n[:, None].to(tl.int64)
    for cc in tl.static_range(CHUNKS):
        c = pid_c * CHUNKS + cc
        col = c * 32 + j  # bytes past the row's last chunk are not read
        wb = tl.load(w_ptr + rows * KB + col[None, :], mask=n_mask[:, None] & (col < KB)[None, :], other=0).to(tl.int32)
        for q in tl.static_range(P):
            k = c * KC + q * 32 + j
            mask = n_mask[:, None] & (k < K)[None, :]
            sg = (k // G)[None, :] * N + offs_n[:, None]
            code = ((wb >> (BITS * q)) & ((1 << BITS) - 1)).to(tl.float32)
            s = tl.load(s_ptr + sg, mask=mask, other=0.0).to(tl.float32)
            if HAS_ZEROS and not MINS:
                v = code * CMUL - tl.load(z_ptr + sg, mask=mask, other=0.0).to(tl.float32)
            else:
                v = code * CMUL - ZERO
            w = s * v
            if MINS:
                w = w + tl.load(z_ptr + sg, mask=mask, other=0.0).to(tl.float32)
            tl.store(out_ptr + rows * K + k[None, :], round_to(w, out_ptr.dtype.element_ty), mask=mask)


def dequantize(weight: PackedLowBit, dtype: torch.dtype, cfg: Optional[dict] = None,
               out: Optional[torch.Tensor] = None) -> torch.Tensor:  # fmt: skip
    """The weight ``[N, K]`` of a ``triton_k32`` pack in ``dtype`` (on the pack's device; into ``out``, a
    contiguous ``[N, K]`` tensor of that dtype, if given), one Triton pass; equal to
    ``to_canonical(weight).dequantize().to(dtype)`` bit for bit."""
    cfg = cfg or SPACE[0]
    cb = get_codebook(weight.codebook)
    N, K = weight.out_features, weight.in_features
    KB = weight.qweight.shape[1]
    n_chunks = KB // 32
    if out is None:
        out = torch.empty(N, K, dtype=dtype, device=weight.qweight.device)
    elif out.shape != (N, K) or out.dtype != dtype or not out.is_contiguous() or out.device != weight.qweight.device:
        raise ValueError(f"out must be a contiguous {dtype} tensor of shape {(N, K)} on {weight.qweight.device}")
    grid = (triton.cdiv(N, cfg["BLOCK_N"]), triton.cdiv(n_chunks, cfg["CHUNKS"]))
    _dequant_kernel[grid](
        weight.qweight, weight.scales, weight.scales if weight.zeros is None else weight.zeros, out,
        N, K, KB, weight.group_size, n_chunks, BITS=cb.bits, CMUL=float(cb.cmul), ZERO=float(cb.zero or 0.0),
        HAS_ZEROS=weight.zeros is not None, BLOCK_N=cfg["BLOCK_N"], CHUNKS=cfg["CHUNKS"], num_warps=cfg["num_warps"],
        MINS=cb.mins,
    )  # fmt: skip
    return out


def space(M: int) -> list[dict]:
    """The configs the tuner times for ``M`` tokens: prompts only (at M <= 16 writing the weight in
    x's dtype costs more than a fused kernel's whole call)."""
    return list(SPACE) if path(M) == "gemm" else []


def launch(x2: torch.Tensor, weight: PackedLowBit, bias: Optional[torch.Tensor], y: torch.Tensor, cfg: dict,
           act_amax: Optional[torch.Tensor] = None) -> None:  # fmt: skip
    """The activation pass (the fused kernels' codes and scales), the weight in x's dtype, then
    the vendor GEMM into ``y [M, N]``."""
    xd = fake_quantize_rows(x2, act_amax)
    wd = dequantize(weight, x2.dtype, cfg)
    if bias is None:
        torch.mm(xd, wd.t(), out=y)
    else:  # the GEMM adds the bias to its fp32 sums (a bias of another dtype is first rounded to y's)
        torch.addmm(bias.to(y.dtype), xd, wd.t(), out=y)


def heuristic(M: int, N: int, K: int, bits: int, device: torch.device) -> Optional[dict]:
    """The untuned config from M = :data:`MIN_M` on, else None."""
    return dict(SPACE[0]) if M >= MIN_M else None
