"""Triton W2A8 ``lowbit_linear`` for CUDA and Intel XPU (the Xe2 design of Georganas et al., III-E).

``y = x @ W^T + bias`` for a low-bit ``W`` in the ``triton_k32`` layout (:mod:`aipc_kernels.packing`):
activations are quantized to int8 (absmax per token, the rounding of
:func:`aipc_kernels.quantizers.quantize_activations`), the matrix units do int8 x int8 -> int32
(``tl.dot``: mma on NVIDIA, DPAS on Xe), and each 32-k bit-plane's int32 dot is dequantized in fp32::

    y[m, n] = sx[m] * sum_g s[g, n] * (cmul * sum_{k in g} xq[m, k] c[n, k] - z[g, n] * sum_{k in g} xq[m, k])

Two paths, both computing ``y^T`` tiles ``[BLOCK_N, BLOCK_M]`` (weights are the dot's A operand, so
a decode step pads M to 16 and not the weight tile):

* GEMV (M == 1), ``stream`` (the H200 default): an activation pre-pass writes int8 codes once (read
  as int32 words they are the ``dp4a`` partners of the weight words), chained to the weight-streaming
  GEMV by programmatic dependent launch on sm_90+ (``XPACK=0``: quantization fused instead).
* GEMV (M <= 16), ``mma``: activation pre-pass + one int8 ``tl.dot`` per weight group.
* GEMV (M <= 16), ``dp4a``: weight streaming on the integer units (int32 words of packed codes x int8
  activations packed 4 per word, one ``dp4a`` per 4 codes, exact), one fp32 rescale per group; the
  tuner picks it or the two kernels below.
* GEMV (M <= 16), ``dot``: one kernel; each program finds its rows' absmax, quantizes activations in
  registers, streams its weight rows once. Split-K (``SPLIT_K`` programs per output tile) when
  there are too few tiles to fill the GPU; the last program of a tile (atomic ticket) sums the fp32
  partials, so it is still one launch with no zero-fill (CUDA-graph friendly).
* GEMM (M > 16), ``group`` (the default): a quantization pass writes int8 activations and per-token
  scales (32-k sums only for the affine zero-point correction); int8 tiles chain one K=32 dot per
  bit-plane in int32 over a weight group (fixed zero points folded into the int8 weight operand) and
  rescale once per group in fp32 (the int32 -> fp32 conversion is a subtract: see the kernel). A
  config without ``KERNEL`` runs the older per-plane-rescale GEMM.

Tile configurations are autotuned per (path, M bucket, N, K, group, bits) and cached per device
name under ``$AIPC_CACHE_DIR/triton/``; ``lowbit_linear_configs.json`` next to this file ships the
tuned defaults of the GPUs we measured. Runs on CPU tensors under ``TRITON_INTERPRET=1`` (tests).
"""
from __future__ import annotations

import json
import os
import re
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import torch
import triton
import triton.language as tl

from ..formats import get_codebook
from ..packing import TRITON_LAYOUT, PackedLowBit, triton_chunk

GEMV_MAX_M = 16  # M up to this runs the fused-quantization GEMV kernel
_LOCK_SLOTS = 16384  # split-K tickets (output tiles) per device
_SUMS_MIN = 1 << 20  # fp32 elements of the atomic split-K buffer allocated at first use (M=16 x N=65536)


# ----------------------------------------------------------------------------------- kernels


@triton.jit
def _rne(v):
    """Round half to even for |v| < 2**22 (torch.round's rounding, no libdevice needed)."""
    return (v + 12582912.0) - 12582912.0


@triton.jit
def _quantize(xv, inv):
    """int8 code (as fp32) of ``xv``: rne(fp32(xv * inv)). The product goes through an fma with 0 so
    the compiler cannot contract it into the rounding add (that would skip the product's rounding)."""
    return _rne(tl.fma(xv, inv, 0.0))


@triton.jit
def _act_scales(x_ptr, offs_m, m_mask, K, BLOCK_M: tl.constexpr, BLOCK_KX: tl.constexpr):
    """Per-row absmax of x[M, K] -> (127 / absmax or 0, absmax / 127), both fp32 [BLOCK_M]."""
    offs = tl.arange(0, BLOCK_KX)
    amax = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_KX):
        k = k0 + offs
        xv = tl.load(x_ptr + offs_m[:, None] * K + k[None, :], mask=m_mask[:, None] & (k[None, :] < K), other=0.0)
        amax = tl.maximum(amax, tl.max(tl.abs(xv.to(tl.float32)), axis=1))
    safe = tl.where(amax > 0, amax, 1.0)
    inv = tl.where(amax > 0, tl.math.div_rn(tl.full([BLOCK_M], 127.0, tl.float32), safe), 0.0)
    return inv, tl.math.div_rn(amax, tl.full([BLOCK_M], 127.0, tl.float32))


@triton.jit
def _quant_act_kernel(x_ptr, xq_ptr, sx_ptr, xsum_ptr, K, Kp, SLICE, BLOCK_KX: tl.constexpr, WRITE_SUMS: tl.constexpr,
                      BLOCK_AMAX: tl.constexpr):
    """Program (m, j) quantizes row m's k in [j * SLICE, (j + 1) * SLICE) (``SLICE`` a multiple of
    BLOCK_KX; every program of a row finds the row's absmax itself, from L2): int8 codes [M, Kp] (zero
    past K), scale [M] (written by j == 0), 32-k sums [M, Kp/32] (``WRITE_SUMS``: only zero-point
    corrections need them; ``BLOCK_AMAX``: the absmax loop's block). Several programs per row keep
    the few rows of a decode batch from serialising on a few SMs."""
    m = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    row = tl.full([1], 0, tl.int64) + m
    inv, sx = _act_scales(x_ptr, row, row >= 0, K, 1, BLOCK_AMAX)
    if j == 0:
        tl.store(sx_ptr + row, sx)
    offs = tl.arange(0, BLOCK_KX)
    offs32 = tl.arange(0, BLOCK_KX // 32)
    for k0 in range(j * SLICE, tl.minimum(j * SLICE + SLICE, Kp), BLOCK_KX):
        k = k0 + offs
        xv = tl.load(x_ptr + m * K + k, mask=k < K, other=0.0).to(tl.float32)
        xqf = _quantize(xv, inv)
        tl.store(xq_ptr + m * Kp + k, xqf.to(tl.int8), mask=k < Kp)
        if WRITE_SUMS:
            sums = tl.sum(tl.reshape(xqf, [BLOCK_KX // 32, 32]), axis=1).to(tl.int32)
            tl.store(xsum_ptr + m * (Kp // 32) + k0 // 32 + offs32, sums, mask=(k0 + offs32 * 32) < Kp)


@triton.jit
def _group_scaled(dot, xsum, s_ptr, z_ptr, row_off, offs_n, n_mask, CMUL: tl.constexpr, ZERO: tl.constexpr,
                  HAS_ZEROS: tl.constexpr):
    """[BLOCK_N, BM] fp32 contribution of one weight group: ``s * (cmul * dot - z * xsum)`` per row, from
    the int32 dot products ``dot`` [BLOCK_N, BM] and the activation code sums ``xsum`` [BM]; the group's
    scales (and zeros) are ``s_ptr[row_off + offs_n]`` (``row_off`` = g * N, 0 for a whole-row group)."""
    sc = tl.load(s_ptr + row_off + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    if HAS_ZEROS:
        zp = tl.load(z_ptr + row_off + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        corr = zp[:, None] * xsum[None, :].to(tl.float32)
    else:
        corr = ZERO * xsum[None, :].to(tl.float32)
    return sc[:, None] * (CMUL * dot.to(tl.float32) - corr)


@triton.jit
def _fence_gpu(v):
    """``v``, after a GPU-scope fence by every thread: its writes (atomic adds included) are visible
    device-wide before the barrier and ticket that follow (CUDA only: PTX)."""
    return tl.inline_asm_elementwise("fence.acq_rel.gpu; mov.b32 $0, $1;", "=r,r", [v], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _store_or_reduce(acc, bias, y_ptr, ws_ptr, lock_ptr, offs, mask, split_stride, pid_k, lock_idx,
                     SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, ATOMIC: tl.constexpr = False,
                     FENCE: tl.constexpr = False):
    """Writes the fp32 tile ``acc`` (+ ``bias``, broadcast like ``acc``) to ``y[offs]``. With split-K:
    this program's partial goes to the workspace (``ws[pid_k * split_stride + offs]``) and the last
    program of the tile (atomic ticket ``lock[lock_idx]``) sums the partials, adds the bias, stores y and
    re-arms the ticket (one launch, no zero-fill: CUDA-graph safe). ``ATOMIC``: the partials are
    instead added (fp32 atomics, in arrival order: not bit-reproducible) into one zeroed ``ws[offs]``
    tile, which the last program takes (atomic exchange with 0: the buffer is zero again) and stores
    to y. ``FENCE`` (compiled CUDA): every thread fences its partial writes before the ticket, the
    CUDA pattern for a last-block reduction."""
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += bias
        tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        if ATOMIC:
            tl.atomic_add(ws_ptr + offs, acc, mask=mask, sem="relaxed")
        else:
            tl.store(ws_ptr + pid_k * split_stride + offs, acc, mask=mask)
        if FENCE:
            lock_idx = _fence_gpu(lock_idx)
        tl.debug_barrier()
        ticket = tl.atomic_add(lock_ptr + lock_idx, 1, sem="acq_rel")
        if ticket == SPLIT_K - 1:
            if ATOMIC:  # read and zero in one atomic (a load then a store raced between threads), on the
                # int32 bits: the interpreter has no fp32 exchange
                bits = tl.atomic_xchg(ws_ptr.to(tl.pointer_type(tl.int32)) + offs, tl.zeros_like(acc).to(tl.int32, bitcast=True), mask=mask, sem="relaxed")
                tot = bits.to(tl.float32, bitcast=True)
            else:
                tot = tl.zeros_like(acc)
                for s in tl.static_range(SPLIT_K):
                    tot += tl.load(ws_ptr + s * split_stride + offs, mask=mask, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                tot += bias
            tl.store(y_ptr + offs, tot.to(y_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(lock_ptr + lock_idx, 0)


@triton.jit
def _lowbit_dot_kernel(
    x_ptr, xq_ptr, sx_ptr, xsum_ptr,  # FUSED: x [M, K] float; else xq int8 [M, Kp], sx fp32 [M], xsum int32 [M, Kp/32]
    w_ptr, s_ptr, z_ptr, b_ptr, y_ptr, ws_ptr, lock_ptr,
    M, N, K, Kp, NG, KB, CHUNKS_PER_SPLIT,
    BITS: tl.constexpr, CMUL: tl.constexpr, ZERO: tl.constexpr, G: tl.constexpr, WHOLE_ROW: tl.constexpr,
    HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr, FUSED: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_KX: tl.constexpr,
):
    P: tl.constexpr = 8 // BITS  # bit-planes per byte
    KC: tl.constexpr = 32 * P  # k per 32-byte chunk
    MASK: tl.constexpr = (1 << BITS) - 1
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_mask = offs_n < N
    m_mask = offs_m < M
    j = tl.arange(0, 32)

    if FUSED:
        inv, sx = _act_scales(x_ptr, offs_m, m_mask, K, BLOCK_M, BLOCK_KX)
    else:
        sx = tl.load(sx_ptr + offs_m, mask=m_mask, other=0.0)

    c_begin = pid_k * CHUNKS_PER_SPLIT
    c_end = tl.minimum(c_begin + CHUNKS_PER_SPLIT, Kp // KC)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    row_dot = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.int32)  # WHOLE_ROW: int32 over all of K
    row_xs = tl.zeros([BLOCK_M], dtype=tl.int32)
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * KB + j[None, :]
    for c in range(c_begin, c_end):
        wb = tl.load(w_rows + c * 32, mask=n_mask[:, None], other=0)  # [BLOCK_N, 32] bytes, P planes
        gdot = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.int32)
        gxs = tl.zeros([BLOCK_M], dtype=tl.int32)
        for q in tl.static_range(P):
            k = c * KC + q * 32 + j  # the 32 k of this plane
            if FUSED:
                xv = tl.load(
                    x_ptr + offs_m[None, :] * K + k[:, None], mask=m_mask[None, :] & (k[:, None] < K), other=0.0
                ).to(tl.float32)
                xqf = _quantize(xv, inv[None, :])  # [32, BLOCK_M], integers in [-127, 127]
                xq = xqf.to(tl.int8)
                xs = tl.sum(xqf, axis=0).to(tl.int32)
            else:
                xq = tl.load(xq_ptr + offs_m[None, :].to(tl.int64) * Kp + k[:, None], mask=m_mask[None, :], other=0)
                xs = tl.load(xsum_ptr + offs_m * (Kp // 32) + (c * P + q), mask=m_mask, other=0)
            codes = ((wb >> (BITS * q)) & MASK).to(tl.int8)
            gdot += tl.dot(codes, xq, out_dtype=tl.int32)
            gxs += xs
            if not WHOLE_ROW:
                if ((q + 1) * 32) % G == 0 or q == P - 1:  # end of a group (or of a chunk inside one)
                    g = (c * KC + q * 32) // G
                    gmask = n_mask & ((offs_n * 0 + g) < NG)
                    acc += _group_scaled(gdot, gxs, s_ptr, z_ptr, g * N, offs_n, gmask, CMUL, ZERO, HAS_ZEROS)
                    gdot = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.int32)
                    gxs = tl.zeros([BLOCK_M], dtype=tl.int32)
        if WHOLE_ROW:
            row_dot += gdot
            row_xs += gxs
    if WHOLE_ROW:
        acc = _group_scaled(row_dot, row_xs, s_ptr, z_ptr, 0, offs_n, n_mask, CMUL, ZERO, HAS_ZEROS)

    acc = acc * sx[None, :]
    out_offs = offs_m[None, :].to(tl.int64) * N + offs_n[:, None]
    omask = n_mask[:, None] & m_mask[None, :]
    tile = pid_m * tl.num_programs(0) + pid_n
    bias = tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None] if HAS_BIAS else 0.0
    _store_or_reduce(acc, bias, y_ptr, ws_ptr, lock_ptr, out_offs, omask, M * N, pid_k, tile, SPLIT_K, HAS_BIAS)


@triton.jit
def _lowbit_gemv_fma_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, y_ptr, ws_ptr, lock_ptr,
    N, K, Kp, NG, KB, CHUNKS_PER_SPLIT,
    BITS: tl.constexpr, CMUL: tl.constexpr, ZERO: tl.constexpr, G: tl.constexpr, WHOLE_ROW: tl.constexpr,
    HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_KX: tl.constexpr,
):
    """M == 1 without the matrix units: codes -> fp32 (exponent trick, no int->float convert),
    fp32 FMA against the int8-valued activations (exact: |partial sums| < 2**24), row reductions."""
    P: tl.constexpr = 8 // BITS
    KC: tl.constexpr = 32 * P
    MASK: tl.constexpr = (1 << BITS) - 1
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    j = tl.arange(0, 32)
    offs = tl.arange(0, BLOCK_KX)
    amax = tl.zeros([BLOCK_KX], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_KX):
        amax = tl.maximum(amax, tl.abs(tl.load(x_ptr + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)))
    amax1 = tl.max(amax, axis=0)
    inv = tl.where(amax1 > 0, tl.math.div_rn(127.0, tl.where(amax1 > 0, amax1, 1.0)), 0.0)
    sx = tl.math.div_rn(amax1, 127.0)

    c_begin = pid_k * CHUNKS_PER_SPLIT
    c_end = tl.minimum(c_begin + CHUNKS_PER_SPLIT, Kp // KC)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    row_dot = tl.zeros([BLOCK_N], dtype=tl.float32)
    row_xs = tl.sum(tl.zeros([32], dtype=tl.float32), axis=0)
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * KB + j[None, :]
    for c in range(c_begin, c_end):
        wb = tl.load(w_rows + c * 32, mask=n_mask[:, None], other=0).to(tl.int32)
        gdot = tl.zeros([BLOCK_N], dtype=tl.float32)
        gxs = tl.sum(tl.zeros([32], dtype=tl.float32), axis=0)
        for q in tl.static_range(P):
            k = c * KC + q * 32 + j
            xqf = _quantize(tl.load(x_ptr + k, mask=k < K, other=0.0).to(tl.float32), inv)
            # code c as fp32: bits 0x4B000000 | c are 2**23 + c exactly
            cf = (((wb >> (BITS * q)) & MASK) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
            gdot += tl.sum(cf * xqf[None, :], axis=1)
            gxs += tl.sum(xqf, axis=0)
            if not WHOLE_ROW:
                if ((q + 1) * 32) % G == 0 or q == P - 1:
                    g = (c * KC + q * 32) // G
                    gmask = n_mask & ((offs_n * 0 + g) < NG)
                    sc = tl.load(s_ptr + g * N + offs_n, mask=gmask, other=0.0).to(tl.float32)
                    if HAS_ZEROS:
                        zp = tl.load(z_ptr + g * N + offs_n, mask=gmask, other=0.0).to(tl.float32)
                        acc += sc * (CMUL * gdot - zp * gxs)
                    else:
                        acc += sc * (CMUL * gdot - ZERO * gxs)
                    gdot = tl.zeros([BLOCK_N], dtype=tl.float32)
                    gxs = tl.sum(tl.zeros([32], dtype=tl.float32), axis=0)
        if WHOLE_ROW:
            row_dot += gdot
            row_xs += gxs
    if WHOLE_ROW:
        sc = tl.load(s_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        if HAS_ZEROS:
            zp = tl.load(z_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
            acc = sc * (CMUL * row_dot - zp * row_xs)
        else:
            acc = sc * (CMUL * row_dot - ZERO * row_xs)
    acc = acc * sx
    bias = tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32) if HAS_BIAS else 0.0
    _store_or_reduce(acc, bias, y_ptr, ws_ptr, lock_ptr, offs_n, n_mask, N, pid_k, pid_n, SPLIT_K, HAS_BIAS)


@triton.jit
def _dp4a(a, b, c, HW: tl.constexpr):
    """c + sum of the 4 signed byte products of int32 words a and b: one ``dp4a`` on NVIDIA
    (``HW``), a shift/multiply emulation elsewhere (the interpreter, XPU)."""
    if HW:
        return tl.inline_asm_elementwise(
            "dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32, is_pure=True, pack=1
        )
    else:
        r = c
        for i in tl.static_range(4):
            r += ((a << (24 - 8 * i)) >> 24) * ((b << (24 - 8 * i)) >> 24)
        return r


@triton.jit
def _lowbit_gemv_dp4a_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, y_ptr, ws_ptr, lock_ptr,
    M, N, K, NG, KW, CHUNKS_PER_SPLIT,
    BITS: tl.constexpr, CMUL: tl.constexpr, ZERO: tl.constexpr, G: tl.constexpr, WHOLE_ROW: tl.constexpr,
    HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr, HW_DP4A: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_KX: tl.constexpr,
):
    """Weight-streaming GEMV (M <= 16) on the integer units: each program streams BLOCK_N rows x
    BLOCK_C 32-byte chunks per step as int32 words (16-byte loads); a plane's 4 codes of a word
    (``(w >> BITS*q) & 0x0303..``) meet 4 int8 activations packed the same way in one ``dp4a``
    (exact int32), chained over the planes of a group; one fp32 rescale per group and row.
    Activations: per-row absmax once per program over the whole row, codes packed per step."""
    P: tl.constexpr = 8 // BITS  # bit-planes per byte
    KC: tl.constexpr = 32 * P  # k per 32-byte chunk
    GE: tl.constexpr = KC if WHOLE_ROW else (G if G < KC else KC)  # k of one rescale step
    GPC: tl.constexpr = KC // GE  # rescale steps per chunk
    PPG: tl.constexpr = P // GPC  # planes per rescale step
    MASK: tl.constexpr = (1 << BITS) - 1
    PMASK: tl.constexpr = MASK | (MASK << 8) | (MASK << 16) | (MASK << 24)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    n_mask = offs_n < N
    m_mask = offs_m < M
    oc = tl.arange(0, BLOCK_C)
    ow = tl.arange(0, 8)
    ob = tl.arange(0, 4)
    inv, sx = _act_scales(x_ptr, offs_m, m_mask, K, BLOCK_M, BLOCK_KX)
    inv4 = inv[:, None, None, None]
    bshift = (ob * 8)[None, None, None, :]

    c_begin = pid_k * CHUNKS_PER_SPLIT
    c_end = tl.minimum(c_begin + CHUNKS_PER_SPLIT, KW // 8)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    w_rows = w_ptr + offs_n[:, None, None].to(tl.int64) * KW + ow[None, None, :]
    x_rows = x_ptr + offs_m[:, None, None, None].to(tl.int64) * K
    for c0 in range(c_begin, c_end, BLOCK_C):
        c = c0 + oc
        c_mask = c < c_end
        wv = tl.load(w_rows + c[None, :, None] * 8, mask=n_mask[:, None, None] & c_mask[None, :, None], other=0)
        for gi in tl.static_range(GPC):
            gd = tl.zeros([BLOCK_N, BLOCK_M, BLOCK_C, 8], dtype=tl.int32)
            gxs = tl.zeros([BLOCK_M, BLOCK_C], dtype=tl.float32)
            for qq in tl.static_range(PPG):
                q = gi * PPG + qq
                # activations of plane q: k = c*KC + 32q + 4w + b -> [BLOCK_M, BLOCK_C, 8, 4]
                k = (c * KC + 32 * q)[None, :, None, None] + (ow * 4)[None, None, :, None] + ob[None, None, None, :]
                xmask = m_mask[:, None, None, None] & c_mask[None, :, None, None] & (k < K)
                xqf = _quantize(tl.load(x_rows + k, mask=xmask, other=0.0).to(tl.float32), inv4)
                xw = tl.sum((xqf.to(tl.int32) & 0xFF) << bshift, axis=3)  # [BLOCK_M, BLOCK_C, 8] packed int8x4
                gxs += tl.sum(tl.sum(xqf, axis=3), axis=2)
                codes = (wv >> (BITS * q)) & PMASK  # [BLOCK_N, BLOCK_C, 8]: 4 codes per word
                gd = _dp4a(codes[:, None, :, :], xw[None, :, :, :], gd, HW_DP4A)
            dot = tl.sum(gd, axis=3).to(tl.float32)  # [BLOCK_N, BLOCK_M, BLOCK_C]
            if WHOLE_ROW:
                g = c * 0
            else:
                g = (c * KC + gi * GE) // G
            gmask = n_mask[:, None] & c_mask[None, :] & (g < NG)[None, :]
            sc = tl.load(s_ptr + g[None, :] * N + offs_n[:, None], mask=gmask, other=0.0).to(tl.float32)
            if HAS_ZEROS:
                zp = tl.load(z_ptr + g[None, :] * N + offs_n[:, None], mask=gmask, other=0.0).to(tl.float32)
                part = CMUL * dot - zp[:, None, :] * gxs[None, :, :]
            else:
                part = CMUL * dot - ZERO * gxs[None, :, :]
            acc += tl.sum(sc[:, None, :] * part, axis=2)

    acc = acc * sx[None, :]
    out_offs = offs_m[None, :].to(tl.int64) * N + offs_n[:, None]
    omask = n_mask[:, None] & m_mask[None, :]
    bias = tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None] if HAS_BIAS else 0.0
    _store_or_reduce(acc, bias, y_ptr, ws_ptr, lock_ptr, out_offs, omask, M * N, pid_k, pid_n, SPLIT_K, HAS_BIAS)


@triton.jit
def _lowbit_gemv_stream_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, y_ptr, ws_ptr, lock_ptr,
    N, K, NG, KW, CHUNKS_PER_SPLIT,
    BITS: tl.constexpr, CMUL: tl.constexpr, ZERO: tl.constexpr, G: tl.constexpr, WHOLE_ROW: tl.constexpr,
    HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr, HW_DP4A: tl.constexpr, PDL: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_KX: tl.constexpr,
    XPACK: tl.constexpr, xw_ptr, xs_ptr, sx_ptr, FULLX: tl.constexpr = False,
):
    """M == 1 weight streaming on the integer units. Each program owns BLOCK_N rows and (a split of)
    K; per step it holds [BLOCK_N, BLOCK_C chunks, 8 words] of packed codes (16-byte loads) and
    prefetches the next step's tile before using this one, the first tile before the activation
    absmax, so the weight stream never waits on the activation chain. A plane's 4 codes of a word
    meet 4 int8 activations packed the same way in one ``dp4a`` (exact int32); the packed
    activation words are built from x (L1-resident) once per program and step, shared by all rows.
    With ``PDL`` (programmatic dependent launch) the weight prefetch is issued before waiting for
    the previous kernel, which is what writes x."""
    P: tl.constexpr = 8 // BITS
    KC: tl.constexpr = 32 * P
    GE: tl.constexpr = KC if WHOLE_ROW else (G if G < KC else KC)
    GPC: tl.constexpr = KC // GE
    PPG: tl.constexpr = P // GPC
    MASK: tl.constexpr = (1 << BITS) - 1
    PMASK: tl.constexpr = MASK | (MASK << 8) | (MASK << 16) | (MASK << 24)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    oc = tl.arange(0, BLOCK_C)
    ow = tl.arange(0, 8)
    c_begin = pid_k * CHUNKS_PER_SPLIT
    c_end = tl.minimum(c_begin + CHUNKS_PER_SPLIT, KW // 8)
    w_rows = w_ptr + offs_n[:, None, None].to(tl.int64) * KW + ow[None, None, :]
    c = c_begin + oc
    wv = tl.load(w_rows + c[None, :, None] * 8, mask=n_mask[:, None, None] & (c < c_end)[None, :, None], other=0)
    if PDL:
        tl.extra.cuda.gdc_wait()
    if XPACK:  # activations from _quant_act_pack_kernel: int8 codes read as int32 words (k = 4 * word + byte)
        sx = tl.load(sx_ptr)
        inv = sx  # unused
    else:
        ox = tl.arange(0, BLOCK_KX)
        amax = tl.zeros([BLOCK_KX], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_KX):
            amax = tl.maximum(amax, tl.abs(tl.load(x_ptr + k0 + ox, mask=k0 + ox < K, other=0.0).to(tl.float32)))
        a = tl.max(amax, axis=0)
        inv = tl.where(a > 0, tl.math.div_rn(127.0, tl.where(a > 0, a, 1.0)), 0.0)
        sx = tl.math.div_rn(a, 127.0)

    acc = tl.zeros([BLOCK_N, BLOCK_C], dtype=tl.float32)
    for c0 in range(c_begin, c_end, BLOCK_C):
        c = c0 + oc
        c_mask = c < c_end
        cn = c + BLOCK_C
        wn = tl.load(w_rows + cn[None, :, None] * 8, mask=n_mask[:, None, None] & (cn < c_end)[None, :, None], other=0)
        for gi in tl.static_range(GPC):
            d = tl.zeros([BLOCK_N, BLOCK_C, 8], dtype=tl.int32)
            xs = tl.zeros([BLOCK_C, 8], dtype=tl.float32)
            for qq in tl.static_range(PPG):
                q = gi * PPG + qq
                if FULLX:  # activation words loaded as [BLOCK_N, BLOCK_C, 8] like the weights: no layout conversion
                    xoff = (c * P + q)[None, :, None] * 8 + ow[None, None, :] + (offs_n * 0)[:, None, None]
                    xwf = tl.load(xw_ptr + xoff, mask=c_mask[None, :, None], other=0)
                    d = _dp4a((wv >> (BITS * q)) & PMASK, xwf, d, HW_DP4A)
                    xs += tl.load(xs_ptr + c * P + q, mask=c_mask, other=0).to(tl.float32)[:, None] * (ow == 0)[None, :]
                elif XPACK:
                    xw = tl.load(xw_ptr + (c * P + q)[:, None] * 8 + ow[None, :], mask=c_mask[:, None], other=0)
                    xs += tl.load(xs_ptr + c * P + q, mask=c_mask, other=0).to(tl.float32)[:, None] * (ow == 0)[None, :]
                else:
                    kb = (c * KC + 32 * q)[:, None] + (ow * 4)[None, :]  # [BLOCK_C, 8]: first k of each word
                    xw = tl.zeros([BLOCK_C, 8], dtype=tl.int32)
                    for b in tl.static_range(4):
                        xv = tl.load(x_ptr + kb + b, mask=c_mask[:, None] & (kb + b < K), other=0.0).to(tl.float32)
                        xq = _quantize(xv, inv)
                        xs += xq
                        xw = xw | ((xq.to(tl.int32) & 0xFF) << (8 * b))
                if not FULLX:
                    codes = (wv >> (BITS * q)) & PMASK
                    d = _dp4a(codes, xw[None, :, :], d, HW_DP4A)
            dot = tl.sum(d, axis=2).to(tl.float32)  # [BLOCK_N, BLOCK_C]
            gx = tl.sum(xs, axis=1)  # [BLOCK_C]
            if WHOLE_ROW:
                g = c * 0
            else:
                g = (c * KC + gi * GE) // G
            gmask = n_mask[:, None] & (c_mask & (g < NG))[None, :]
            sc = tl.load(s_ptr + g[None, :] * N + offs_n[:, None], mask=gmask, other=0.0).to(tl.float32)
            if HAS_ZEROS:
                zp = tl.load(z_ptr + g[None, :] * N + offs_n[:, None], mask=gmask, other=0.0).to(tl.float32)
                acc += sc * (CMUL * dot - zp * gx[None, :])
            else:
                acc += sc * (CMUL * dot - ZERO * gx[None, :])
        wv = wn
    res = tl.sum(acc, axis=1) * sx
    bias = tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32) if HAS_BIAS else 0.0
    _store_or_reduce(res, bias, y_ptr, ws_ptr, lock_ptr, offs_n, n_mask, N, pid_k, pid_n, SPLIT_K, HAS_BIAS)


@triton.jit
def _quant_act_pack_kernel(x_ptr, xq_ptr, xs_ptr, sx_ptr, K, Kp, PDL: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_KX: tl.constexpr):
    """M == 1 activation pre-pass, many programs: each finds the row absmax (one whole-row load, L2)
    and writes its BLOCK_Q slice of the int8 codes ``xq[Kp]`` (zero past K) and 32-k sums
    ``xs[Kp/32]``; program 0 writes the scale. With ``PDL`` it lets the GEMV launch at once (the
    GEMV prefetches weights, then waits for this grid) and waits itself before reading x."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    pid = tl.program_id(0)
    row = tl.full([1], 0, tl.int32)
    inv, sx = _act_scales(x_ptr, row, row == 0, K, 1, BLOCK_KX)
    if pid == 0:
        tl.store(sx_ptr + row, sx)
    k = pid * BLOCK_Q + tl.arange(0, BLOCK_Q)
    xqf = _quantize(tl.load(x_ptr + k, mask=k < K, other=0.0).to(tl.float32), inv)
    tl.store(xq_ptr + k, xqf.to(tl.int8), mask=k < Kp)
    sums = tl.sum(tl.reshape(xqf, [BLOCK_Q // 32, 32]), axis=1).to(tl.int32)
    kk = pid * (BLOCK_Q // 32) + tl.arange(0, BLOCK_Q // 32)
    tl.store(xs_ptr + kk, sums, mask=kk < Kp // 32)


@triton.jit
def _quant_act_t_kernel(x_ptr, xq_ptr, xs_ptr, sx_ptr, M, K, Kp, BM: tl.constexpr, BLOCK_KX: tl.constexpr):
    """Activation pre-pass of the matrix-unit GEMV: program m writes column m of the int8 codes
    ``xq[Kp, BM]`` (k-major, zero past K and for m >= M), of the 32-k sums ``xs[Kp/32, BM]`` and its
    scale ``sx[m]``, so each GEMV program reads whole [k, BM] tiles."""
    m = tl.program_id(0)
    row = tl.full([1], 0, tl.int32) + m
    valid = row < M
    inv, sx = _act_scales(x_ptr, row, valid, K, 1, BLOCK_KX)
    tl.store(sx_ptr + row, sx)
    offs = tl.arange(0, BLOCK_KX)
    offs32 = tl.arange(0, BLOCK_KX // 32)
    for k0 in range(0, Kp, BLOCK_KX):
        k = k0 + offs
        xv = tl.load(x_ptr + m * K + k, mask=(k < K) & ((k * 0 + m) < M), other=0.0).to(tl.float32)
        xqf = _quantize(xv, inv)
        tl.store(xq_ptr + k * BM + m, xqf.to(tl.int8), mask=k < Kp)
        sums = tl.sum(tl.reshape(xqf, [BLOCK_KX // 32, 32]), axis=1).to(tl.int32)
        kk = k0 // 32 + offs32
        tl.store(xs_ptr + kk * BM + m, sums, mask=kk < Kp // 32)


@triton.jit
def _lowbit_gemv_mma_kernel(
    xq_ptr, xs_ptr, sx_ptr, w_ptr, s_ptr, z_ptr, b_ptr, y_ptr, ws_ptr, lock_ptr,
    M, N, NG, KB, CHUNKS_PER_SPLIT,
    BITS: tl.constexpr, CMUL: tl.constexpr, ZERO: tl.constexpr, G: tl.constexpr, WHOLE_ROW: tl.constexpr,
    HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr, BM: tl.constexpr, SPLIT_K: tl.constexpr,
):
    """GEMV for 1 < M <= 16 on the int8 matrix units, activations from :func:`_quant_act_t_kernel`.
    Per 32-byte chunk of BLOCK_N rows: the planes of one group are unpacked in registers into an
    int8 [BLOCK_N, group] operand in natural k order (one ``tl.dot`` of K = group, not one per
    32-k plane) against the pre-quantized [group, BM] activation tile."""
    P: tl.constexpr = 8 // BITS
    KC: tl.constexpr = 32 * P
    GE: tl.constexpr = KC if WHOLE_ROW else (G if G < KC else KC)
    GPC: tl.constexpr = KC // GE
    PPG: tl.constexpr = P // GPC
    MASK: tl.constexpr = (1 << BITS) - 1
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    om = tl.arange(0, BM)
    m_mask = om < M
    j = tl.arange(0, 32)
    og = tl.arange(0, GE)
    op = tl.arange(0, PPG)
    sx = tl.load(sx_ptr + om)
    c_begin = pid_k * CHUNKS_PER_SPLIT
    c_end = tl.minimum(c_begin + CHUNKS_PER_SPLIT, KB // 32)
    acc = tl.zeros([BLOCK_N, BM], dtype=tl.float32)
    row_dot = tl.zeros([BLOCK_N, BM], dtype=tl.int32)
    row_xs = tl.zeros([BM], dtype=tl.int32)
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * KB + j[None, :]
    for c in range(c_begin, c_end):
        wb = tl.load(w_rows + c * 32, mask=n_mask[:, None], other=0)  # [BLOCK_N, 32] bytes
        for gi in tl.static_range(GPC):
            sh = (BITS * (gi * PPG + op))[None, :, None]
            codes = tl.reshape(((wb[:, None, :] >> sh) & MASK).to(tl.int8), [BLOCK_N, GE])
            k0 = c * KC + gi * GE
            xt = tl.load(xq_ptr + (k0 + og)[:, None] * BM + om[None, :])  # [GE, BM] int8
            d = tl.dot(codes, xt, out_dtype=tl.int32)
            gxs = tl.sum(tl.load(xs_ptr + (k0 // 32 + op)[:, None] * BM + om[None, :]), axis=0)  # [BM]
            if WHOLE_ROW:
                row_dot += d
                row_xs += gxs
            else:
                g = k0 // G
                gmask = n_mask & ((offs_n * 0 + g) < NG)
                acc += _group_scaled(d, gxs, s_ptr, z_ptr, g * N, offs_n, gmask, CMUL, ZERO, HAS_ZEROS)
    if WHOLE_ROW:
        acc = _group_scaled(row_dot, row_xs, s_ptr, z_ptr, 0, offs_n, n_mask, CMUL, ZERO, HAS_ZEROS)
    acc = acc * sx[None, :]
    out_offs = om[None, :].to(tl.int64) * N + offs_n[:, None]
    omask = n_mask[:, None] & m_mask[None, :]
    bias = tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None] if HAS_BIAS else 0.0
    _store_or_reduce(acc, bias, y_ptr, ws_ptr, lock_ptr, out_offs, omask, M * N, pid_k, pid_n, SPLIT_K, HAS_BIAS)


@triton.jit
def _plane_codes(wb, q: tl.constexpr, BITS: tl.constexpr, CA: tl.constexpr, CB: tl.constexpr, HW_ASM: tl.constexpr, ASM: tl.constexpr):
    """int8 weight operand of bit-plane ``q`` of the bytes ``wb``: ``CA * c - CB`` (an integer form of
    the code book's ``cmul * c - zero``). With ``HW_ASM`` four codes per 32-bit register (shift, mask,
    byte-wise bias and sign flip: 3-4 instructions per 4 codes); else one code per element."""
    if HW_ASM:
        return tl.inline_asm_elementwise(ASM, "=r,r", [wb], dtype=tl.int8, is_pure=True, pack=4)
    else:
        return (((wb >> (BITS * q)) & ((1 << BITS) - 1)).to(tl.int32) * CA - CB).to(tl.int8)


@triton.jit
def _lowbit_gemm_kernel(
    xq_ptr, sx_ptr, xsum_ptr, w_ptr, s_ptr, z_ptr, b_ptr, y_ptr, ws_ptr, lock_ptr,
    M, N, Kp, NG, KB, CHUNKS_PER_SPLIT,
    BITS: tl.constexpr, CA: tl.constexpr, CB: tl.constexpr, FMUL: tl.constexpr, G: tl.constexpr,
    WHOLE_ROW: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr, WA: tl.constexpr, HW_ASM: tl.constexpr,
    ASM0: tl.constexpr, ASM1: tl.constexpr, ASM2: tl.constexpr, ASM3: tl.constexpr,
    ASM4: tl.constexpr, ASM5: tl.constexpr, ASM6: tl.constexpr, ASM7: tl.constexpr,
    SPLIT_K: tl.constexpr = 1, ATOMIC: tl.constexpr = False,
):
    """GEMM (M > 16) on the int8 matrix units (wgmma on Hopper), activations from
    :func:`_quant_act_kernel`. Per 32-byte weight chunk: one [BLOCK_N, 32] byte load, each bit-plane
    unpacked in registers to the int8 operand ``CA * c - CB`` (the fixed zero point folded in: no
    zero-point correction for fixed code books), one K=32 ``tl.dot`` per plane chained in int32 over
    the group, then one fp32 rescale per group. The int32 accumulator starts at 0x4B400000 (the bits
    of 1.5 * 2**23), so its bits read as fp32 are exactly 12582912 + dot (|dot| < 2**22): the group's
    int32 -> fp32 conversion is one fp32 subtract instead of a slow I2F. ``WA``: weights are the dot's
    A operand ([BLOCK_N, BLOCK_M] tiles) instead of B. ``SPLIT_K``: program_id(1) takes a range of
    CHUNKS_PER_SPLIT chunks, partials reduced by the last program of the tile (small M: few tiles)."""
    P: tl.constexpr = 8 // BITS
    KC: tl.constexpr = 32 * P
    RP: tl.constexpr = P if WHOLE_ROW else G // 32  # planes per rescale (the whole row: per chunk)
    MAGIC: tl.constexpr = 0x4B400000
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    gsz = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % gsz
    pid_n = (pid % width) // gsz
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    rm = tl.where(m_mask, offs_m, 0)  # clamped rows: unmasked (vector) loads, results dropped at the store
    rn = tl.where(n_mask, offs_n, 0)
    j = tl.arange(0, 32)
    x_rows = xq_ptr + rm[:, None].to(tl.int64) * Kp + j[None, :]
    w_rows = w_ptr + rn[:, None].to(tl.int64) * KB + j[None, :]
    if WA:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        d0 = tl.full([BLOCK_N, BLOCK_M], MAGIC, tl.int32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        d0 = tl.full([BLOCK_M, BLOCK_N], MAGIC, tl.int32)
    # The group scales (zeros, activation sums) of chunk c + 1 are loaded during chunk c: a load's
    # latency is only paid where its value is first used. [BLOCK_N, NGC] / [BLOCK_M, P] tiles.
    NGC: tl.constexpr = P // RP  # rescales per chunk
    og = tl.arange(0, NGC)
    op = tl.arange(0, P)
    last_g = NG - 1
    s_tile = s_ptr + rn[:, None]
    z_tile = z_ptr + rn[:, None]
    xs_tile = xsum_ptr + rm[:, None] * (Kp // 32) + op[None, :]
    n_chunks = Kp // KC
    if SPLIT_K == 1:  # the whole K from 0: the loop the pipeliner saw before split-K existed
        c_begin = 0
        c_end = n_chunks
    else:
        c_begin = pid_k * CHUNKS_PER_SPLIT
        c_end = tl.minimum(c_begin + CHUNKS_PER_SPLIT, n_chunks)
    if WHOLE_ROW:
        sc_row = tl.load(s_ptr + rn).to(tl.float32) * FMUL
        if HAS_ZEROS:
            zs_row = sc_row * tl.load(z_ptr + rn).to(tl.float32)
    else:
        sc_nxt = tl.load(s_tile + tl.minimum(c_begin * NGC + og, last_g)[None, :] * N)
        if HAS_ZEROS:
            z_nxt = tl.load(z_tile + tl.minimum(c_begin * NGC + og, last_g)[None, :] * N)
    if HAS_ZEROS:
        xs_nxt = tl.load(xs_tile + c_begin * P)
    for c in range(c_begin, c_end):
        wb = tl.load(w_rows + c * 32)  # [BLOCK_N, 32] bytes, P planes
        cn = tl.minimum(c + 1, n_chunks - 1)
        if not WHOLE_ROW:
            sc_cur = sc_nxt.to(tl.float32) * FMUL
            sc_nxt = tl.load(s_tile + tl.minimum(cn * NGC + og, last_g)[None, :] * N)
            if HAS_ZEROS:
                z_cur = z_nxt.to(tl.float32)
                z_nxt = tl.load(z_tile + tl.minimum(cn * NGC + og, last_g)[None, :] * N)
        if HAS_ZEROS:
            xs_cur = xs_nxt.to(tl.float32)
            xs_nxt = tl.load(xs_tile + cn * P)
        d = d0
        for q in tl.static_range(P):
            if q == 0:
                code = _plane_codes(wb, 0, BITS, CA, CB, HW_ASM, ASM0)
            elif q == 1:
                code = _plane_codes(wb, 1, BITS, CA, CB, HW_ASM, ASM1)
            elif q == 2:
                code = _plane_codes(wb, 2, BITS, CA, CB, HW_ASM, ASM2)
            elif q == 3:
                code = _plane_codes(wb, 3, BITS, CA, CB, HW_ASM, ASM3)
            elif q == 4:
                code = _plane_codes(wb, 4, BITS, CA, CB, HW_ASM, ASM4)
            elif q == 5:
                code = _plane_codes(wb, 5, BITS, CA, CB, HW_ASM, ASM5)
            elif q == 6:
                code = _plane_codes(wb, 6, BITS, CA, CB, HW_ASM, ASM6)
            else:
                code = _plane_codes(wb, 7, BITS, CA, CB, HW_ASM, ASM7)
            xt = tl.load(x_rows + (c * KC + q * 32))  # [BLOCK_M, 32] int8
            if WA:
                d = tl.dot(code, tl.trans(xt), d, out_dtype=tl.int32)
            else:
                d = tl.dot(xt, tl.trans(code), d, out_dtype=tl.int32)
            if (q + 1) % RP == 0:  # end of a group (whole row: of a chunk)
                gi = q // RP
                df = d.to(tl.float32, bitcast=True) - 12582912.0  # exact: the int32 dot as fp32
                if WHOLE_ROW:
                    sc = sc_row
                else:
                    sc = tl.sum(tl.where(og[None, :] == gi, sc_cur, 0.0), axis=1)
                if WA:
                    acc += df * sc[:, None]
                else:
                    acc += df * sc[None, :]
                if HAS_ZEROS:  # affine: - s * z * (sum of the group's int8 activations)
                    gxs = tl.sum(tl.where((op[None, :] // RP) == gi, xs_cur, 0.0), axis=1)
                    if WHOLE_ROW:
                        zs = zs_row
                    else:
                        zs = sc * tl.sum(tl.where(og[None, :] == gi, z_cur, 0.0), axis=1)
                    if WA:
                        acc -= zs[:, None] * gxs[None, :]
                    else:
                        acc -= gxs[:, None] * zs[None, :]
                d = d0
    sx = tl.load(sx_ptr + rm)
    if WA:
        acc = acc * sx[None, :]
        bias = tl.load(b_ptr + rn).to(tl.float32)[:, None] if HAS_BIAS else 0.0
        out_offs = offs_m[None, :].to(tl.int64) * N + offs_n[:, None]
        omask = n_mask[:, None] & m_mask[None, :]
    else:
        acc = acc * sx[:, None]
        bias = tl.load(b_ptr + rn).to(tl.float32)[None, :] if HAS_BIAS else 0.0
        out_offs = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
        omask = m_mask[:, None] & n_mask[None, :]
    _store_or_reduce(acc, bias, y_ptr, ws_ptr, lock_ptr, out_offs, omask, M * N, pid_k, pid, SPLIT_K, HAS_BIAS, ATOMIC, HW_ASM)


def _int_codebook(cb) -> tuple[int, int, float]:
    """(CA, CB, FMUL) with ``cmul * c - zero == FMUL * (CA * c - CB)`` and integer CA, CB (affine: the
    raw codes, the zero point corrected in fp32)."""
    if cb.zero is None:
        return 1, 0, float(cb.cmul)
    for k in (1, 2, 4):
        a, b = cb.cmul * k, cb.zero * k
        if a == int(a) and b == int(b):
            return int(a), int(b), 1.0 / k
    raise ValueError(f"code book {cb.name}: no small integer form of cmul * c - zero")


def _plane_asm(bits: int, q: int, ca: int, cb: int) -> str:
    """PTX of :func:`_plane_codes` for four packed bytes: ((b >> bits*q) & mask) * CA - CB per byte.
    The bias add cannot carry across bytes (CA * c + 128 - CB stays in [125, 134])."""
    mask = 0x01010101 * ((1 << bits) - 1)
    s = [f"shr.u32 t, $1, {bits * q};" if q else "mov.b32 t, $1;", f"and.b32 t, t, {mask:#010x};"]
    if ca != 1:
        s.append(f"mul.lo.u32 t, t, {ca};")
    if cb:
        s += [f"add.u32 t, t, {0x01010101 * (128 - cb):#010x};", "xor.b32 $0, t, 0x80808080;"]
    else:
        s.append("mov.b32 $0, t;")
    return "{ .reg .b32 t; " + " ".join(s) + " }"


# ----------------------------------------------------------------------------- configurations

# GEMV: (KERNEL, BLOCK_N, SPLIT_K, num_warps, num_stages[, BLOCK_C]); GEMM: (BLOCK_N, BLOCK_M, num_warps, num_stages)
GEMV_SPACE = [  # int8 matrix units, M padded to 16
    ("dot", bn, sk, nw, ns)
    for bn in (64, 128)
    for sk in (2, 4, 8)
    for nw, ns in ((4, 3),)
]
GEMV_FMA_SPACE = [("fma", 128, 8, 4, 3), ("fma", 64, 8, 8, 3)]  # M == 1 only (the first H200 winners)
GEMV_DP4A_SPACE = [  # integer-unit weight streaming; BLOCK_C 32-byte chunks per row and step
    ("dp4a", bn, sk, 4 if bn <= 128 else 8, 3, bc)
    for bn in (32, 64, 128, 256)
    for sk in (1, 2, 4, 8, 16)
    for bc in (2, 4)
]
GEMV_STREAM_SPACE = [  # M == 1: packed-activation pre-pass + weight streaming (PDL on sm_90+)
    ("stream", bn, sk, nw, 1, bc)
    for bn in (8, 16, 32)
    for sk in (1, 2, 4)
    for bc in (4, 8, 16, 32)
    for nw in (2, 4, 8)
    if 32 * nw <= bn * bc * 8 <= 64 * 32 * nw and (sk == 1 or bn >= 16)
]
GEMV_GROUP_SPACE = [  # 1 < M <= 16: the GEMM's group kernel with 16 token columns, split over K
    ("group", bn, sk, nw, ns) for bn in (32, 64, 128, 256) for sk in (2, 4, 8, 16) for nw, ns in ((2, 3), (4, 3), (8, 3), (4, 4))
    if (nw == 2 and bn <= 64) or (nw == 4 and 64 <= bn <= 128) or (nw == 8 and bn >= 128)
]
GEMV_GROUP_ATOMIC_SPLITS = (4, 8, 16, 32)  # the same tiles with atomic split-K (ATOMIC=1) at these splits
GEMV_MMA_SPACE = [  # 1 < M <= 16: activation pre-pass + one int8 tl.dot per group
    ("mma", bn, sk, nw, ns) for bn in (32, 64, 128) for sk in (4, 8) for nw, ns in ((4, 3), (8, 3)) if nw == 4 or bn >= 64
]
_DP4A_MAX_TILE = 8192  # BLOCK_N * BLOCK_M * BLOCK_C * 8 int32 words per step: larger tiles spill
GEMM_SPACE = [  # the 'group' kernel (int8 dot per plane, one rescale per group): (BLOCK_N, BLOCK_M, warps, stages, WA)
    (128, 64, 4, 3, 1), (128, 64, 4, 4, 1), (64, 128, 4, 3, 1), (256, 64, 8, 3, 1), (128, 128, 8, 3, 1),
    (128, 64, 8, 3, 1), (128, 64, 4, 3, 0),
]  # the older kernel (a config without KERNEL) stays selectable explicitly
_CONFIG_FIELDS = {"gemv": ("BLOCK_N", "SPLIT_K", "num_warps", "num_stages"), "gemm": ("BLOCK_N", "BLOCK_M", "num_warps", "num_stages")}
# GEMV configs also name their kernel: "dot" (int8 matrix units, M padded to 16) or "fma" (M == 1)
SHIPPED_CONFIGS = Path(__file__).with_name("lowbit_linear_configs.json")
_mem_cache: dict[str, dict[str, dict]] = {}
_cache_lock = threading.Lock()


def _path(M: int) -> str:
    return "gemv" if M <= GEMV_MAX_M else "gemm"


def _m_bucket(M: int) -> int:
    if M <= 1:
        return 1
    if M <= GEMV_MAX_M:
        return GEMV_MAX_M
    return min(1 << (M - 1).bit_length(), 4096)


def config_key(M: int, N: int, K: int, group_size: int, bits: int) -> str:
    """The autotune cache key of a problem (path, M bucket, N, K, group, bits)."""
    g = "row" if group_size == K else group_size
    return f"{_path(M)}:m{_m_bucket(M)}:n{N}:k{K}:g{g}:b{bits}"


def device_name(device: torch.device) -> str:
    """The name configs are cached under (``torch.cuda/xpu.get_device_name``)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "xpu":
        return torch.xpu.get_device_name(device)
    return f"{device.type}-interpreter"


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_")


def cache_file(name: str) -> Path:
    """Where tuned configs of device ``name`` are cached (``$AIPC_CACHE_DIR/triton/``)."""
    root = Path(os.environ.get("AIPC_CACHE_DIR", Path.home() / ".cache" / "aipc-plugins"))
    return root / "triton" / f"lowbit_linear-{_slug(name)}.json"


def _configs_for(name: str) -> dict[str, dict]:
    with _cache_lock:
        if name not in _mem_cache:
            cfgs: dict[str, dict] = {}
            if SHIPPED_CONFIGS.exists():
                cfgs.update(json.loads(SHIPPED_CONFIGS.read_text()).get(name, {}))
            f = cache_file(name)
            if f.exists():
                try:
                    cfgs.update(json.loads(f.read_text()))
                except json.JSONDecodeError:
                    pass  # a torn write from a crashed process: re-tune
            _mem_cache[name] = cfgs
        return _mem_cache[name]


def _save_config(name: str, key: str, cfg: dict) -> None:
    with _cache_lock:
        _mem_cache.setdefault(name, {})[key] = cfg
        f = cache_file(name)
        f.parent.mkdir(parents=True, exist_ok=True)
        on_disk = json.loads(f.read_text()) if f.exists() else {}
        on_disk[key] = cfg
        tmp = f.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(on_disk, indent=1, sort_keys=True))
        tmp.replace(f)


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    if device.type == "xpu":
        return getattr(torch.xpu.get_device_properties(device), "gpu_subslice_count", 64)
    return 4


def heuristic_config(M: int, N: int, K: int, bits: int, device: torch.device) -> dict:
    """The untuned default: enough programs to fill the device, then the largest tiles."""
    chunks = -(-K // triton_chunk(bits))
    if _path(M) == "gemm":
        return {"KERNEL": "group", "BLOCK_N": 128, "BLOCK_M": 64, "num_warps": 4, "num_stages": 3, "WA": 1}
    sms = _sm_count(device)
    if M == 1:  # packed-activation pre-pass + weight streaming (the H200 winners: 8 rows, wide K tiles)
        bn, bc = 8, min(32, max(1, chunks))
        split = 1
        while split < 4 and -(-N // bn) * split < 2 * sms and chunks >= 2 * split * bc:
            split *= 2
        return {"KERNEL": "stream", "XPACK": 1, "PDL": 1, "BLOCK_N": bn, "BLOCK_C": bc, "SPLIT_K": split, "num_warps": 4, "num_stages": 1}
    # 1 < M <= 16: the group GEMM kernel with 16 token columns, split over K until the device is full
    # (the H200 winners: 128 rows, split 4-8)
    bn = 128 if N >= 2048 else 64
    tiles = -(-N // bn)
    split = 1
    while split < 16 and tiles * split < 2 * sms and chunks >= 2 * split:
        split *= 2
    return {"KERNEL": "group", "BLOCK_N": bn, "BLOCK_M": GEMV_MAX_M, "WA": 1, "SPLIT_K": split, "num_warps": 4, "num_stages": 3}


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
    kernel's config becomes the heuristic's group tile (M = 1 takes the M <= 16 one)."""
    if cfg.get("KERNEL") != "group":
        cfg = heuristic_config(max(M, 2), N, K, bits, device)
    return dict({k: v for k, v in cfg.items() if k != "ATOMIC"}, SPLIT_K=1)


def autotune_enabled(device: torch.device) -> bool:
    """``AIPC_TRITON_AUTOTUNE`` (default: on for GPUs, off in the interpreter)."""
    default = "0" if device.type == "cpu" else "1"
    return os.environ.get("AIPC_TRITON_AUTOTUNE", default) not in ("0", "", "false", "False")


# ----------------------------------------------------------------------------- launching

_locks: dict[torch.device, torch.Tensor] = {}


def _lock_buffer(device: torch.device) -> torch.Tensor:
    if device not in _locks:
        _locks[device] = torch.zeros(_LOCK_SLOTS, dtype=torch.int32, device=device)
    return _locks[device]


def _check_config(cfg: dict, path: str) -> dict:
    need = _CONFIG_FIELDS[path]
    missing = [f for f in need if f not in cfg]
    if missing:
        raise ValueError(f"config={cfg} lacks {missing} for the {path} kernel; give {need}")
    return cfg


# Kernels decorated under TRITON_INTERPRET=1 (tests on CPU) also need it set while they run.
_INTERPRETED = type(_lowbit_dot_kernel).__name__ == "InterpretedFunction"


@contextmanager
def _interpreter_scope():
    if not _INTERPRETED:
        yield
        return
    # triton.language's own @jit helpers (tl.zeros, tl.sum, ...) were decorated when triton was first
    # imported; if that was without TRITON_INTERPRET, interpret them too while our kernels run.
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    saved_env, saved_call = os.environ.get("TRITON_INTERPRET"), JITFunction.__call__
    os.environ["TRITON_INTERPRET"] = "1"
    JITFunction.__call__ = lambda self, *a, **kw: InterpretedFunction(self.fn)(*a, **kw)
    try:
        yield
    finally:
        JITFunction.__call__ = saved_call
        if saved_env is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved_env


def _launch(x2, weight: PackedLowBit, bias, y, cfg: dict) -> None:
    """Runs one configuration, writing ``y[M, N]``."""
    with _interpreter_scope():
        _launch_kernels(x2, weight, bias, y, cfg)


def _pdl_ok(device: torch.device) -> bool:
    """Programmatic dependent launch (griddepcontrol): compiled CUDA on sm_90+ only."""
    return device.type == "cuda" and not _INTERPRETED and torch.cuda.get_device_capability(device)[0] >= 9


_sums: dict[torch.device, torch.Tensor] = {}


def _zeroed_sums(device: torch.device, numel: int) -> Optional[torch.Tensor]:
    """The device's zeroed fp32 buffer that atomic split-K adds partials into (the reducing program
    zeroes its tile again), grown to ``numel``; ``None`` where it would have to grow during a CUDA graph
    capture (memory allocated there belongs to the graph)."""
    buf = _sums.get(device)
    if buf is None or buf.numel() < numel:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        buf = _sums[device] = torch.zeros(max(numel, _SUMS_MIN), dtype=torch.float32, device=device)
    return buf


def _split_plan(chunks: int, split: int, tiles: int, M: int, N: int, dummy: torch.Tensor, atomic: bool = False):
    """``(splits, chunks per split, partials workspace, tickets, atomic)`` for ``split`` requested
    K-splits of ``chunks`` chunks over ``tiles`` output tiles: no empty splits, no split when the tiles
    outnumber the split-K tickets; unsplit, the workspace and tickets are ``dummy`` (never touched).
    ``atomic`` (partials added by fp32 atomics into one zeroed buffer) holds unless
    ``torch.use_deterministic_algorithms`` is on, the device is an XPU (not run there) or the buffer
    would grow inside a graph capture."""
    if tiles > _LOCK_SLOTS:
        split = 1
    per_split = -(-chunks // split)
    split = -(-chunks // per_split)  # no empty splits
    if split == 1:
        return 1, chunks, dummy, dummy, False
    if atomic and dummy.device.type != "xpu" and not torch.are_deterministic_algorithms_enabled():
        sums = _zeroed_sums(dummy.device, M * N)
        if sums is not None:
            return split, per_split, sums, _lock_buffer(dummy.device), True
    ws = torch.empty(split * M * N, dtype=torch.float32, device=dummy.device)
    return split, per_split, ws, _lock_buffer(dummy.device), False


def _launch_kernels(x2, weight: PackedLowBit, bias, y, cfg: dict) -> None:
    if cfg.get("KERNEL") == "group":  # any M; at M <= 16 with BLOCK_M (16) tokens, split over K
        _check_config(cfg, _path(x2.shape[0]))
        _launch_group(x2, weight, bias, y, dict(cfg, BLOCK_M=cfg.get("BLOCK_M", GEMV_MAX_M)))
        return
    M, K = x2.shape
    N = weight.out_features
    cb = get_codebook(weight.codebook)
    kc = triton_chunk(cb.bits)
    Kp = weight.qweight.shape[1] * (8 // cb.bits)
    G = weight.group_size
    whole = G == K
    common = dict(
        BITS=cb.bits, CMUL=float(cb.cmul), ZERO=float(cb.zero or 0.0), G=K if whole else G, WHOLE_ROW=whole,
        HAS_ZEROS=weight.zeros is not None, HAS_BIAS=bias is not None,
    )  # fmt: skip
    s, z = weight.scales, weight.zeros if weight.zeros is not None else weight.scales
    b = bias if bias is not None else weight.scales
    dummy = y
    if _path(M) == "gemv":
        _check_config(cfg, "gemv")
        bn = cfg["BLOCK_N"]
        tiles_n, tiles_m = triton.cdiv(N, bn), triton.cdiv(M, GEMV_MAX_M)
        split, per_split, ws, locks, _ = _split_plan(Kp // kc, cfg["SPLIT_K"], tiles_n * tiles_m, M, N, dummy)
        grid = (tiles_n, tiles_m, split)
        kernel = cfg.get("KERNEL", "dot")
        if kernel == "stream":
            if M != 1:
                raise ValueError(f"config {cfg}: the stream GEMV kernel takes M == 1 only (M={M})")
            bc = cfg.get("BLOCK_C", 8)
            pdl = bool(cfg.get("PDL", 0)) and _pdl_ok(x2.device)
            xpack = bool(cfg.get("XPACK", 0))
            xw, xs, sx = dummy, dummy, dummy
            if xpack:
                bq = 1024
                xq = torch.empty(Kp, dtype=torch.int8, device=x2.device)
                xs = torch.empty(Kp // 32, dtype=torch.int32, device=x2.device)
                sx = torch.empty(1, dtype=torch.float32, device=x2.device)
                _quant_act_pack_kernel[(triton.cdiv(Kp, bq),)](
                    x2, xq, xs, sx, K, Kp, PDL=pdl, BLOCK_Q=bq, BLOCK_KX=min(triton.next_power_of_2(K), 16384),
                    num_warps=4, **({"launch_pdl": True} if pdl else {}),
                )  # fmt: skip
                xw = xq.view(torch.int32)
            _lowbit_gemv_stream_kernel[(grid[0], split)](
                x2, weight.qweight.view(torch.int32), s, z, b, y, ws, locks,
                N, K, s.shape[0], weight.qweight.shape[1] // 4, per_split,
                HW_DP4A=x2.device.type == "cuda" and not _INTERPRETED, PDL=pdl,
                BLOCK_N=bn, BLOCK_C=bc, SPLIT_K=split, BLOCK_KX=min(triton.next_power_of_2(K), 16384),
                XPACK=xpack, xw_ptr=xw, xs_ptr=xs, sx_ptr=sx, FULLX=xpack and bool(cfg.get("FULLX", 0)),
                num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
                **({"launch_pdl": True} if pdl else {}), **common,
            )  # fmt: skip
            return
        if kernel == "mma":
            xq = torch.empty(Kp, GEMV_MAX_M, dtype=torch.int8, device=x2.device)
            xs = torch.empty(Kp // 32, GEMV_MAX_M, dtype=torch.int32, device=x2.device)
            sx = torch.empty(GEMV_MAX_M, dtype=torch.float32, device=x2.device)
            _quant_act_t_kernel[(GEMV_MAX_M,)](
                x2, xq, xs, sx, M, K, Kp, BM=GEMV_MAX_M, BLOCK_KX=min(triton.next_power_of_2(Kp), 4096), num_warps=4
            )  # fmt: skip
            _lowbit_gemv_mma_kernel[(grid[0], split)](
                xq, xs, sx, weight.qweight, s, z, b, y, ws, locks,
                M, N, s.shape[0], weight.qweight.shape[1], per_split,
                BLOCK_N=bn, BM=GEMV_MAX_M, SPLIT_K=split,
                num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **common,
            )  # fmt: skip
            return
        if kernel == "dp4a":
            bc = cfg.get("BLOCK_C", 4)
            _lowbit_gemv_dp4a_kernel[(grid[0], split)](
                x2, weight.qweight.view(torch.int32), s, z, b, y, ws, locks,
                M, N, K, s.shape[0], weight.qweight.shape[1] // 4, per_split,
                HW_DP4A=x2.device.type == "cuda" and not _INTERPRETED,
                BLOCK_N=bn, BLOCK_M=max(1, triton.next_power_of_2(M)), BLOCK_C=bc, SPLIT_K=split,
                BLOCK_KX=min(triton.next_power_of_2(K), 16384 // max(1, triton.next_power_of_2(M))),  # absmax: 1 load
                num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **common,
            )  # fmt: skip
            return
        if cfg.get("KERNEL", "dot") == "fma":
            if M != 1:
                raise ValueError(f"config {cfg}: the fma GEMV kernel takes M == 1 only (M={M})")
            _lowbit_gemv_fma_kernel[(grid[0], split)](
                x2, weight.qweight, s, z, b, y, ws, locks,
                N, K, Kp, s.shape[0], weight.qweight.shape[1], per_split,
                BLOCK_N=bn, SPLIT_K=split, BLOCK_KX=1024,
                num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **common,
            )  # fmt: skip
            return
        _lowbit_dot_kernel[grid](
            x2, dummy, dummy, dummy, weight.qweight, s, z, b, y, ws, locks,
            M, N, K, Kp, s.shape[0], weight.qweight.shape[1], per_split,
            FUSED=True, BLOCK_N=bn, BLOCK_M=GEMV_MAX_M, SPLIT_K=split, BLOCK_KX=512,
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **common,
        )  # fmt: skip
        return
    _check_config(cfg, "gemm")
    xq = torch.empty(M, Kp, dtype=torch.int8, device=x2.device)
    sx = torch.empty(M, dtype=torch.float32, device=x2.device)
    xsum = torch.empty(M, Kp // 32, dtype=torch.int32, device=x2.device)
    _quant_act_kernel[(M, 1)](x2, xq, sx, xsum, K, Kp, Kp, BLOCK_KX=512, WRITE_SUMS=True, BLOCK_AMAX=512, num_warps=4)
    bn, bm = cfg["BLOCK_N"], cfg["BLOCK_M"]
    grid = (triton.cdiv(N, bn), triton.cdiv(M, bm), 1)
    _lowbit_dot_kernel[grid](
        dummy, xq, sx, xsum, weight.qweight, s, z, b, y, dummy, dummy,
        M, N, K, Kp, s.shape[0], weight.qweight.shape[1], Kp // kc,
        FUSED=False, BLOCK_N=bn, BLOCK_M=bm, SPLIT_K=1, BLOCK_KX=512,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **common,
    )  # fmt: skip


def _launch_group(x2, weight: PackedLowBit, bias, y, cfg: dict) -> None:
    """The activation pass and the ``group`` kernel (int8 dot per bit-plane, one rescale per group),
    split over K in ``SPLIT_K`` ranges of chunks where the config asks (small M: few output tiles)."""
    M, K = x2.shape
    N = weight.out_features
    cb = get_codebook(weight.codebook)
    Kp = weight.qweight.shape[1] * (8 // cb.bits)
    whole = weight.group_size == K
    s, z = weight.scales, weight.zeros if weight.zeros is not None else weight.scales
    b = bias if bias is not None else weight.scales
    sums = weight.zeros is not None
    xq = torch.empty(M, Kp, dtype=torch.int8, device=x2.device)
    sx = torch.empty(M, dtype=torch.float32, device=x2.device)
    xsum = torch.empty(M, Kp // 32, dtype=torch.int32, device=x2.device) if sums else sx
    if M <= GEMV_MAX_M:  # few rows: 1024-k slices, each program's absmax in one load of the whole row
        bkx, bam = 1024, min(triton.next_power_of_2(K), 16384)
        slices, nw = triton.cdiv(Kp, bkx), 8
    else:
        bkx = bam = min(triton.next_power_of_2(Kp), 4096)
        slices, nw = 1, 8 if bkx >= 2048 else 4
    _quant_act_kernel[(M, slices)](
        x2, xq, sx, xsum, K, Kp, bkx * triton.cdiv(Kp, bkx * slices), BLOCK_KX=bkx, WRITE_SUMS=sums, BLOCK_AMAX=bam,
        num_warps=nw,
    )  # fmt: skip
    bn, bm = cfg["BLOCK_N"], cfg["BLOCK_M"]
    tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
    split, per_split, ws, locks, atomic = _split_plan(
        Kp // triton_chunk(cb.bits), cfg.get("SPLIT_K", 1), tiles, M, N, y, atomic=bool(cfg.get("ATOMIC", 0))
    )
    ca, cbias, fmul = _int_codebook(cb)
    hw = x2.device.type == "cuda" and not _INTERPRETED
    asm = {f"ASM{q}": _plane_asm(cb.bits, q, ca, cbias) if hw and q < 8 // cb.bits else "" for q in range(8)}
    _lowbit_gemm_kernel[(tiles, split)](
        xq, sx, xsum, weight.qweight, s, z, b, y, ws, locks,
        M, N, Kp, s.shape[0], weight.qweight.shape[1], per_split,
        BITS=cb.bits, CA=ca, CB=cbias, FMUL=fmul, G=K if whole else weight.group_size, WHOLE_ROW=whole,
        HAS_ZEROS=weight.zeros is not None, HAS_BIAS=bias is not None,
        BLOCK_M=bm, BLOCK_N=bn, GROUP_M=cfg.get("GROUP_M", 8), WA=bool(cfg.get("WA", 0)), HW_ASM=hw,
        SPLIT_K=split, ATOMIC=atomic,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **asm,
    )  # fmt: skip


def _space(path: str, M: int) -> list[dict]:
    if path == "gemm":
        return [dict(zip(_CONFIG_FIELDS[path], c[:4]), KERNEL="group", WA=c[4]) for c in GEMM_SPACE]
    fields = ("KERNEL",) + _CONFIG_FIELDS[path] + ("BLOCK_C",)
    bm = max(1, triton.next_power_of_2(M))
    dp4a = [c for c in GEMV_DP4A_SPACE if c[1] * bm * c[5] * 8 <= _DP4A_MAX_TILE]
    if M == 1:
        stream = [dict(zip(fields, c), XPACK=1, PDL=1) for c in GEMV_STREAM_SPACE]
        return stream + [dict(zip(fields, c)) for c in dp4a]
    group = [dict(zip(fields, c), BLOCK_M=GEMV_MAX_M, WA=1) for c in GEMV_GROUP_SPACE]
    tiles = {(c["BLOCK_N"], c["num_warps"], c["num_stages"]): c for c in group}
    group += [dict(c, SPLIT_K=sk, ATOMIC=1) for c in tiles.values() for sk in GEMV_GROUP_ATOMIC_SPLITS]
    return group + [dict(zip(fields, c)) for c in GEMV_MMA_SPACE + GEMV_SPACE + dp4a]


def _time(fn, device: torch.device) -> float:
    """Median ms of ``fn``'s GPU work. On CUDA through graph replays: a plain timing loop would
    measure the Python launch path (~10 us), not kernels of a few us."""
    if device.type == "cuda":
        fn()  # compile and allocate outside the capture
        return triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median")
    return triton.testing.do_bench(fn, warmup=5, rep=20, return_mode="median")


def tune(x2: torch.Tensor, weight: PackedLowBit, bias: Optional[torch.Tensor], y: torch.Tensor) -> dict:
    """Times every configuration of the problem's path on these operands; returns the fastest."""
    M, K = x2.shape
    chunks = weight.qweight.shape[1] * 8 // weight.bits // triton_chunk(weight.bits)
    best, best_t = None, float("inf")
    for cfg in _space(_path(M), M):
        if cfg.get("SPLIT_K", 1) > chunks or cfg["BLOCK_N"] > max(16, 2 * weight.out_features):
            continue
        try:
            t = _time(lambda: _launch(x2, weight, bias, y, cfg), x2.device)
        except Exception:  # noqa: BLE001 - a config the device cannot compile (shared memory, registers)
            continue
        if t < best_t:
            best, best_t = cfg, t
    if best is None:
        raise RuntimeError(f"lowbit_linear: no Triton configuration ran for {config_key(M, weight.out_features, K, weight.group_size, weight.bits)}")
    return dict(best, us=round(best_t * 1e3, 2))


def select_config(x2: torch.Tensor, weight: PackedLowBit, bias: Optional[torch.Tensor], y: torch.Tensor) -> dict:
    """Cached config for this device and problem; tunes (and caches) on a miss when enabled."""
    M, K = x2.shape
    dev = x2.device
    name = device_name(dev)
    key = config_key(M, weight.out_features, K, weight.group_size, weight.bits)
    cfgs = _configs_for(name)
    if key in cfgs:
        return cfgs[key]
    capturing = dev.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if not autotune_enabled(dev) or capturing:
        return heuristic_config(M, weight.out_features, K, weight.bits, dev)
    cfg = tune(x2, weight, bias, y)
    _save_config(name, key, cfg)
    return cfg


def _validate(x: torch.Tensor, weight: PackedLowBit, bias: Optional[torch.Tensor], act_group: int) -> None:
    """The Triton kernels' own limits, then every operand against the others (``ops.check_operands``)."""
    from ..ops import check_operands  # the op's module imports this one lazily

    if weight.layout != TRITON_LAYOUT:
        raise ValueError(
            f"weight.layout={weight.layout!r}: the Triton kernels need {TRITON_LAYOUT!r}; "
            f"pack it with aipc_kernels.packing.pack_for_triton"
        )
    if act_group > 0:
        raise ValueError(f"act_group={act_group}: the Triton kernels quantize activations per token; use act_group=0")
    if x.dim() and x.shape[-1] != weight.in_features:
        raise ValueError(f"lowbit_linear: weight of in_features={weight.in_features} does not match x's K={x.shape[-1]}")
    check_operands(x, weight.qweight, weight.scales, weight.zeros, bias, weight.layout, weight.codebook,
                   weight.group_size, weight.out_features, act_group)  # fmt: skip
    K, G, chunk = x.shape[-1], weight.group_size, triton_chunk(weight.bits)
    if G != K and chunk % G:
        raise ValueError(f"group_size={G} must divide {chunk} (or be the whole row) for {TRITON_LAYOUT}")


def lowbit_linear_triton(
    x: torch.Tensor,
    weight: PackedLowBit,
    bias: Optional[torch.Tensor] = None,
    act_group: int = 0,
    config: Optional[dict] = None,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``x @ W^T + bias`` with int8 activations on the Triton kernels (batch-invariant under
    :func:`batch_invariant`).

    ``config`` overrides the tuned tile configuration (and the batch-invariant choice); ``out`` (contiguous, ``x``'s dtype, ``[..., N]``)
    receives the result instead of a new tensor."""
    _validate(x, weight, bias, act_group)
    K, N = x.shape[-1], weight.out_features
    x2 = x.reshape(-1, K).contiguous()
    M = x2.shape[0]
    if out is None:
        y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    elif out.dtype != x.dtype or out.numel() != M * N or not out.is_contiguous() or out.device != x.device:
        raise ValueError(f"out must be a contiguous {x.dtype} tensor of {M * N} elements on {x.device}")
    else:
        y = out.view(M, N)
    if M == 0:
        return y.view(*x.shape[:-1], N)
    bias = None if bias is None else bias.contiguous()
    weight = PackedLowBit(
        weight.layout, weight.qweight.contiguous(), weight.scales.contiguous(),
        None if weight.zeros is None else weight.zeros.contiguous(),
        weight.codebook, weight.group_size, weight.out_features, weight.in_features,
    )  # fmt: skip
    if config is not None:
        cfg = config
    else:
        cfg = select_config(x2, weight, bias, y)
        if batch_invariant():
            cfg = invariant_config(cfg, M, N, K, weight.bits, x.device)
    _launch(x2, weight, bias, y, cfg)
    return y.view(*x.shape[:-1], N)


__all__ = [
    "GEMV_MAX_M",
    "lowbit_linear_triton",
    "select_config",
    "heuristic_config",
    "batch_invariant",
    "invariant_config",
    "config_key",
    "cache_file",
    "device_name",
    "tune",
]
