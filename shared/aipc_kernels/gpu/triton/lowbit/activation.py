"""The activation pass: x [M, K] float -> int8 codes, a per-token scale and 32-k code sums.

Per token: absmax, scale ``absmax / 127``, codes ``rne(x * 127 / absmax)`` (the rounding of
:func:`aipc_kernels.lowbit.quantizers.quantize_activations`), zero past K up to the padded ``Kp``. With
``act_amax`` (float32 [M]) each token's absmax is read from it instead (codes clamped to [-127, 127]):
the op's ``act_amax``, a tensor-parallel rank quantizing its slice with the whole row's absmax.
Two kernels: :func:`quantize_rows` for the ``group`` kernel (any M, rows split in K slices) and
:func:`quantize_row_packed` for the M == 1 ``stream`` GEMV (many programs per row, optionally a
programmatic-dependent-launch primary).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from aipc_kernels.gpu.triton.lowbit.common import GEMV_MAX_M, act_scales, quantize, round_to


@triton.jit
def _row_scales(x_ptr, amax_ptr, row, row_mask, K, BLOCK_AMAX: tl.constexpr, HAS_AMAX: tl.constexpr):
    """(127 / absmax or 0, absmax / 127) of rows ``row`` [1]: their own absmax (``act_scales``), or
    with ``HAS_AMAX`` the given ``amax[row]`` (same arithmetic)."""
    if HAS_AMAX:
        amax = tl.load(amax_ptr + row, mask=row_mask, other=0.0)
        safe = tl.where(amax > 0, amax, 1.0)
        inv = tl.where(amax > 0, tl.math.div_rn(tl.full([1], 127.0, tl.float32), safe), 0.0)
        sx = tl.math.div_rn(amax, tl.full([1], 127.0, tl.float32))
    else:
        inv, sx = act_scales(x_ptr, row, row_mask, K, 1, BLOCK_AMAX)
    return inv, sx


@triton.jit
def _codes(xv, inv, HAS_AMAX: tl.constexpr):
    """int8 codes (as fp32) of ``xv``; a given absmax may be below the row's own: clamped to [-127, 127]
    (after the rounding, which gives the same codes as clamping before it)."""
    q = quantize(xv, inv)
    if HAS_AMAX:
        q = tl.minimum(tl.maximum(q, -127.0), 127.0)
    return q


@triton.jit
def quant_row_slice(x_ptr, amax_ptr, xq_ptr, sx_ptr, xsum_ptr, m, j, K, Kp, SLICE, BLOCK_KX: tl.constexpr,
                    WRITE_SUMS: tl.constexpr, BLOCK_AMAX: tl.constexpr, HAS_AMAX: tl.constexpr, FAKE: tl.constexpr = False,
                    PERM: tl.constexpr = False):  # fmt: skip
    """Row ``m``'s k in [j * SLICE, (j + 1) * SLICE): :func:`_quant_act_kernel`'s program (m, j), callable from another
    kernel's programs."""
    row = tl.full([1], 0, tl.int64) + m
    inv, sx = _row_scales(x_ptr, amax_ptr, row, row >= 0, K, BLOCK_AMAX, HAS_AMAX)
    if not FAKE:
        if j == 0:
            tl.store(sx_ptr + row, sx)
    offs = tl.arange(0, BLOCK_KX)
    offs32 = tl.arange(0, BLOCK_KX // 32)
    for k0 in range(j * SLICE, tl.minimum(j * SLICE + SLICE, Kp), BLOCK_KX):
        k = k0 + offs
        xv = tl.load(x_ptr + m * K + k, mask=k < K, other=0.0).to(tl.float32)
        xqf = _codes(xv, inv, HAS_AMAX)
        if FAKE:  # the codes times the scale, rounded once to the output's dtype, [M, K]
            tl.store(xq_ptr + m * K + k, round_to(xqf * sx, xq_ptr.dtype.element_ty), mask=k < K)
        elif PERM:
            kq = (k & ~127) | (((k >> 3) & 3) << 5) | (((k >> 5) & 3) << 3) | (k & 7)
            tl.store(xq_ptr + m * Kp + kq, xqf.to(tl.int8), mask=k < Kp)
        else:
            tl.store(xq_ptr + m * Kp + k, xqf.to(tl.int8), mask=k < Kp)
        if WRITE_SUMS:
            sums = tl.sum(tl.reshape(xqf, [BLOCK_KX // 32, 32]), axis=1).to(tl.int32)
            tl.store(xsum_ptr + m * (Kp // 32) + k0 // 32 + offs32, sums, mask=(k0 + offs32 * 32) < Kp)


@triton.jit
def _quant_act_kernel(x_ptr, amax_ptr, xq_ptr, sx_ptr, xsum_ptr, K, Kp, SLICE, BLOCK_KX: tl.constexpr,
                      WRITE_SUMS: tl.constexpr, BLOCK_AMAX: tl.constexpr, HAS_AMAX: tl.constexpr,
                      FAKE: tl.constexpr = False, PDL: tl.constexpr = False, PERM: tl.constexpr = False):
    """Program (m, j) quantizes row m's k in [j * SLICE, (j + 1) * SLICE) (``SLICE`` a multiple of
    BLOCK_KX; every program of a row finds the row's absmax itself, from L2): int8 codes [M, Kp] (zero
    past K), scale [M] (written by j == 0), 32-k sums [M, Kp/32] (``WRITE_SUMS``: only zero-point
    corrections need them; ``BLOCK_AMAX``: the absmax loop's block). Several programs per row keep
    the few rows of a decode batch from serialising on a few SMs; ``HAS_AMAX``: absmax read from amax;
    ``FAKE``: ``xq_ptr`` is a float [M, K] that receives ``code * scale`` instead of the codes; ``PDL``:
    the GEMM that follows may launch at once, this grid waits for its own predecessor before reading x;
    ``PERM``: in each 128 k, code k = 32 q + 8 t + i is stored at 32 t + 8 q + i, the bytes a
    ``cuda_mma`` lane reads for its 4 planes made contiguous)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    quant_row_slice(x_ptr, amax_ptr, xq_ptr, sx_ptr, xsum_ptr, tl.program_id(0).to(tl.int64), tl.program_id(1), K, Kp,
                    SLICE, BLOCK_KX, WRITE_SUMS, BLOCK_AMAX, HAS_AMAX, FAKE, PERM)  # fmt: skip


@triton.jit
def _quant_act_pack_kernel(x_ptr, amax_ptr, xq_ptr, xs_ptr, sx_ptr, K, Kp, PDL: tl.constexpr, BLOCK_Q: tl.constexpr,
                           BLOCK_KX: tl.constexpr, HAS_AMAX: tl.constexpr):
    """M == 1 activation pre-pass, many programs: each finds the row absmax (one whole-row load, L2)
    and writes its BLOCK_Q slice of the int8 codes ``xq[Kp]`` (zero past K) and 32-k sums
    ``xs[Kp/32]``; program 0 writes the scale. With ``PDL`` it lets the GEMV launch at once (the
    GEMV prefetches weights, then waits for this grid) and waits itself before reading x."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    pid = tl.program_id(0)
    row = tl.full([1], 0, tl.int32)
    inv, sx = _row_scales(x_ptr, amax_ptr, row, row == 0, K, BLOCK_KX, HAS_AMAX)
    if pid == 0:
        tl.store(sx_ptr + row, sx)
    k = pid * BLOCK_Q + tl.arange(0, BLOCK_Q)
    xqf = _codes(tl.load(x_ptr + k, mask=k < K, other=0.0).to(tl.float32), inv, HAS_AMAX)
    tl.store(xq_ptr + k, xqf.to(tl.int8), mask=k < Kp)
    sums = tl.sum(tl.reshape(xqf, [BLOCK_Q // 32, 32]), axis=1).to(tl.int32)
    kk = pid * (BLOCK_Q // 32) + tl.arange(0, BLOCK_Q // 32)
    tl.store(xs_ptr + kk, sums, mask=kk < Kp // 32)


def row_program(Kp: int) -> tuple[int, int]:
    """``(BLOCK_KX, num_warps)`` of :func:`quantize_rows`' programs for M > 16: one program a token row."""
    bkx = min(triton.next_power_of_2(Kp), 4096)
    return bkx, 8 if bkx >= 2048 else 4


def quantize_rows(
    x2: torch.Tensor, Kp: int, sums: bool, act_amax: Optional[torch.Tensor] = None, pdl: bool = False, perm: bool = False
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """``(xq int8 [M, Kp], sx fp32 [M], xsum int32 [M, Kp/32] or None)`` of ``x2 [M, K]``; ``sums``:
    write the 32-k code sums (only affine code books' zero-point correction reads them); ``act_amax``:
    None or the dense float32 [M] absmax of each row to scale by; ``pdl``: launched as the primary of a
    programmatic dependent launch (sm_90+, :func:`~.interpret.pdl_ok`); ``perm``: the codes in
    ``cuda_mma``'s order (each 128 k: the two 2-bit fields of k's bits 3-6 swapped; Kp % 128 == 0)."""
    M, K = x2.shape
    xq = torch.empty(M, Kp, dtype=torch.int8, device=x2.device)
    sx = torch.empty(M, dtype=torch.float32, device=x2.device)
    xsum = torch.empty(M, Kp // 32, dtype=torch.int32, device=x2.device) if sums else None
    if M <= GEMV_MAX_M:  # few rows: 1024-k slices, each program's absmax in one load of the whole row
        bkx, bam = 1024, min(triton.next_power_of_2(K), 16384)
        slices, nw = triton.cdiv(Kp, bkx), 8
    else:
        (bkx, nw), slices = row_program(Kp), 1
        bam = bkx
    _quant_act_kernel[(M, slices)](
        x_ptr=x2, amax_ptr=sx if act_amax is None else act_amax, xq_ptr=xq, sx_ptr=sx,
        xsum_ptr=sx if xsum is None else xsum, K=K, Kp=Kp, SLICE=bkx * triton.cdiv(Kp, bkx * slices),
        BLOCK_KX=bkx, WRITE_SUMS=sums, BLOCK_AMAX=bam, HAS_AMAX=act_amax is not None, PDL=pdl, PERM=perm,
        num_warps=nw, **({"launch_pdl": True} if pdl else {}),
    )  # fmt: skip
    return xq, sx, xsum


def fake_quantize_rows(x2: torch.Tensor, act_amax: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The activations the W*A8 contract computes with, for a float GEMM: ``x2 [M, K]``'s int8 codes
    times their per-token scale (:func:`quantize_rows`' codes and scales), rounded once to x2's dtype."""
    M, K = x2.shape
    xd = torch.empty_like(x2)
    bkx = bam = min(triton.next_power_of_2(K), 4096)
    _quant_act_kernel[(M, 1)](
        x_ptr=x2, amax_ptr=x2 if act_amax is None else act_amax, xq_ptr=xd, sx_ptr=xd, xsum_ptr=xd, K=K, Kp=K,
        SLICE=bkx * triton.cdiv(K, bkx), BLOCK_KX=bkx, WRITE_SUMS=False, BLOCK_AMAX=bam,
        HAS_AMAX=act_amax is not None, FAKE=True, num_warps=8 if bkx >= 2048 else 4,
    )  # fmt: skip
    return xd


def quantize_row_packed(
    x2: torch.Tensor, Kp: int, pdl: bool, act_amax: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(xq int8 [Kp], xs int32 [Kp/32], sx fp32 [1])`` of the one row ``x2 [1, K]``, in 1024-k
    programs of 8 warps (each reads the whole row for the absmax: 8 warps cut the pass from 2.86 to 2.23 us
    at K = 14336 on an H100, 2, 4 and 16 were slower, bench/results/gpu/prepass_warps_h100.md); ``pdl``:
    launched as the primary of a programmatic dependent launch (sm_90+); ``act_amax``: None or the float32
    [1] absmax to scale by."""
    K = x2.shape[1]
    bq = 1024
    xq = torch.empty(Kp, dtype=torch.int8, device=x2.device)
    xs = torch.empty(Kp // 32, dtype=torch.int32, device=x2.device)
    sx = torch.empty(1, dtype=torch.float32, device=x2.device)
    _quant_act_pack_kernel[(triton.cdiv(Kp, bq),)](
        x_ptr=x2, amax_ptr=sx if act_amax is None else act_amax, xq_ptr=xq, xs_ptr=xs, sx_ptr=sx, K=K, Kp=Kp, PDL=pdl,
        BLOCK_Q=bq, BLOCK_KX=min(triton.next_power_of_2(K), 16384), HAS_AMAX=act_amax is not None, num_warps=8,
        **({"launch_pdl": True} if pdl else {}),
    )  # fmt: skip
    return xq, xs, sx
