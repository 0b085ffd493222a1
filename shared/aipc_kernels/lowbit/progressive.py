"""The progressive two-level form (QServe's, Lin et al. 2025): weight-side group scales whose levels are int8.

A row ``n`` has one float scale ``s0[n]`` (per output channel) and each group ``g`` a small integer scale
``s1`` and an integer min ``m``, so that every level of the group is an int8::

    W[n, k] = s0[n] * w8[n, k],   w8 = s1[n, g] * c[n, k] + m[n, g]  in [-128, 127] for every code c

so ``y = sx * s0 * sum_k xq[m, k] * w8[n, k]``: a kernel forms the int8 ``w8`` of a weight tile (shared by
all the tile's token rows), accumulates int8 x int8 products in int32 over the whole K and rescales once
per output. The per-group float rescale of the accumulators that the single-level kernels pay (their
cost grows with the tile's token rows) is gone. 2-bit codes allow ``s1 <= 85`` (three steps span 255),
4-bit codes ``s1 <= 17``; with a free integer ``m`` (not ``-s1 * z`` for an integer zero) the group's
range is placed anywhere in [-128, 127].

Stored as the canonical two-level min form (:mod:`~aipc_kernels.lowbit.formats`): ``min2`` / ``min4``,
int8 ``scales`` = s1 and ``zeros`` = m, and ``supers`` = s0 in both sets (``[2, N, K/SB]``, the row's
value repeated per super-block; ``SB`` the largest power-of-two multiple of the group dividing K, the
native kernels' rule). ``s0`` is a float16 value held in float32, so each float32 product of the
canonical dequantization is exact: the dequantized weight is ``s0 * w8`` bit for bit. Every kernel that
takes the two-level min form runs it as such; the Triton ``progressive`` kernel is the one that uses its
int8 levels (:func:`row_scales` says whether a weight qualifies).
"""
from __future__ import annotations

from typing import Optional

import torch

from aipc_kernels.lowbit.formats import LowBitWeight, get_codebook, pack_codes, resolve_group_size
from aipc_kernels.lowbit import quantizers
from aipc_kernels.lowbit.quantizers import QUANTIZERS, check_weight, quantize_optimized

CODEBOOKS = ("min2", "min4")  # the code books of the form (2- and 4-bit codes, a min per group)
INT8_MIN, INT8_MAX = -128, 127
QUANTIZER = "progressive"  # the plugins' name of :func:`quantize_progressive` (``quantizer: progressive``)
#: every quantizer :func:`quantize_layer` takes: the float-scale ones and this form's
LAYER_QUANTIZERS = QUANTIZERS + (QUANTIZER,)


def max_sub_scale(codebook: str) -> int:
    """The largest integer group scale ``s1`` whose levels ``s1 * c + m`` fit the int8 range (2 bits: 85,
    4 bits: 17)."""
    return (INT8_MAX - INT8_MIN) // get_codebook(codebook).max_code


def super_block(in_features: int, group_size: int) -> int:
    """The super-block the canonical form repeats ``s0`` over: the largest power-of-two multiple of
    ``group_size`` that divides ``in_features`` (the native kernels' two-level rule)."""
    sb = group_size
    while in_features % (2 * sb) == 0:
        sb *= 2
    return sb


def _int8_levels(s1: torch.Tensor, m: torch.Tensor, codebook: str) -> bool:
    """Whether every level ``s1 * c + m`` (c in 0 .. max code) of every group is an int8 (with ``s1 >= 0``)."""
    s1, m = s1.to(torch.int32), m.to(torch.int32)
    top = s1 * get_codebook(codebook).max_code + m
    return bool(((s1 >= 0) & (m >= INT8_MIN) & (top <= INT8_MAX)).all())


def row_scales(w: LowBitWeight) -> Optional[torch.Tensor]:
    """``s0`` float32 ``[N]`` if ``w`` is in the progressive form (a two-level ``min2`` / ``min4`` weight whose
    two super scales are one value per row and whose levels ``s1 * c + m`` are all int8), else None."""
    if w.codebook not in CODEBOOKS or w.supers is None or w.supers.shape[0] != 2:
        return None
    s0 = w.supers[0, :, :1]
    if not (torch.equal(w.supers[1], w.supers[0]) and bool((w.supers[0] == s0).all())):
        return None
    if not _int8_levels(w.scales, w.zeros, w.codebook):
        return None
    return s0[:, 0].contiguous()


def from_parts(codes: torch.Tensor, s1: torch.Tensor, m: torch.Tensor, s0: torch.Tensor, codebook: str,
               group_size: int, name: str = "weight") -> LowBitWeight:  # fmt: skip
    """The canonical weight of codes ``[N, K]``, integer ``s1`` and ``m`` ``[N, K/G]`` and ``s0`` ``[N]``
    (float16 values); ValueError naming the part that breaks the form."""
    N, K = codes.shape
    if codebook not in CODEBOOKS:
        raise ValueError(f"codebook={codebook!r}: the progressive form takes {CODEBOOKS}")
    if not _int8_levels(s1, m, codebook):
        raise ValueError(f"{name}: a group's levels s1 * c + m leave the int8 range [-128, 127] (s1 in [0, "
                         f"{max_sub_scale(codebook)}], m >= -128, s1 * {get_codebook(codebook).max_code} + m <= 127)")  # fmt: skip
    s0 = s0.float()
    if not torch.equal(s0.half().float(), s0):
        raise ValueError(f"{name}: s0 must hold float16 values (the dequantized weight is then s0 * w8 exactly)")
    sb = super_block(K, group_size)
    supers = s0[:, None].expand(N, K // sb).contiguous()
    return LowBitWeight(pack_codes(codes.to(torch.uint8), get_codebook(codebook).bits), s1.to(torch.int8).contiguous(),
                        m.to(torch.int8).contiguous(), codebook, group_size, K, name=name,
                        supers=torch.stack([supers, supers.clone()]))  # fmt: skip


def _fit(u: torch.Tensor, s1: torch.Tensor, m: torch.Tensor, max_code: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes of ``u`` [N, ng, G] for integer ``s1``, ``m`` [N, ng, 1] and their squared error [N, ng, 1]."""
    c = torch.clamp(torch.round((u - m) / s1), 0, max_code)
    return c, ((s1 * c + m - u) ** 2).sum(-1, keepdim=True)


def quantize_progressive(w: torch.Tensor, codebook: str = "min2", group_size: int = 64, steps: int = 4,
                         name: str = "weight") -> LowBitWeight:  # fmt: skip
    """Quantizes ``w [N, K]`` to the progressive form. ``s0`` = the row's absmax / 127 (a float16 value);
    per group of ``u = w / s0`` the optimized quantizer's float fit (:func:`~.quantizers.quantize_optimized`,
    its clipping grid and alternating least squares) gives a scale and min, and the integer pair is
    searched around it: ``s1`` in floor-1 .. ceil+1 of the float scale (within [1, max]), for each the
    least-squares min rounded (and its neighbours) within the int8 bounds, ``steps`` rounds of codes then
    min; the pair of least squared error in ``u`` is kept."""
    check_weight(w)
    cb = get_codebook(codebook)
    if codebook not in CODEBOOKS:
        raise ValueError(f"codebook={codebook!r}: the progressive form takes {CODEBOOKS}")
    N, K = w.shape
    G = resolve_group_size(group_size, K)
    amax = w.float().abs().amax(1)
    s0 = (amax / 127).half().float()  # u = w / s0 may pass 127 by a float16 rounding: clamped
    s0 = torch.where(s0 > 0, s0, torch.ones_like(s0))  # an all-zero row: any scale, every level 0
    u = (w.float() / s0[:, None]).clamp(INT8_MIN, INT8_MAX)
    ug = u.reshape(N, K // G, G)
    fl = quantize_optimized(u, codebook, group_size, scale_dtype=torch.float32)  # the float fit of s * c + m
    sf, mf = fl.scales.float()[..., None], fl.zeros.float()[..., None]
    smax, top = max_sub_scale(codebook), cb.max_code
    best_err = best_s = best_m = None
    for ds in (-1, 0, 1, 2):
        s1 = (torch.floor(sf) + ds).clamp(1, smax)
        lo, hi = torch.full_like(s1, INT8_MIN), INT8_MAX - s1 * top
        m = torch.round(mf).clamp(lo, hi)
        for _ in range(steps):
            c, _err = _fit(ug, s1, m, top)
            m = torch.round((ug - s1 * c).mean(-1, keepdim=True)).clamp(lo, hi)
        for dm in (-1, 0, 1):
            mc = (m + dm).clamp(lo, hi)
            _c, err = _fit(ug, s1, mc, top)
            if best_err is None:
                best_err, best_s, best_m = err, s1, mc
            else:
                better = err < best_err
                best_err = torch.where(better, err, best_err)
                best_s, best_m = torch.where(better, s1, best_s), torch.where(better, mc, best_m)
    codes, _ = _fit(ug, best_s, best_m, top)
    return from_parts(codes.reshape(N, K), best_s[..., 0], best_m[..., 0], s0, codebook, G, name=name)


def quantize_layer(w: torch.Tensor, codebook: str, group_size: int, method: str, scale_dtype: torch.dtype,
                   name: str = "weight") -> LowBitWeight:  # fmt: skip
    """A layer's weight ``w [N, K]`` quantized with ``method`` (one of :data:`LAYER_QUANTIZERS`; the plugins'
    entry): :func:`~aipc_kernels.lowbit.quantizers.quantize_rows` a block of ``QUANT_ROW_BLOCK`` rows at a time, with
    :func:`quantize_progressive` for this form (its row scales and groups lie within a row: the same weight as the
    whole matrix at once). ``scale_dtype`` must then be float16 (``s0`` holds float16 values, ``s1`` and the mins
    int8)."""
    if method in QUANTIZERS:
        return quantizers.quantize_rows(w, codebook, group_size, method, scale_dtype, name=name)
    if method != QUANTIZER:
        raise ValueError(f"method={method!r} is unknown; use one of {LAYER_QUANTIZERS}")
    if scale_dtype != torch.float16:
        raise ValueError(f"scale_dtype={scale_dtype}: the {QUANTIZER} quantizer stores float16 row scales and int8 "
                         f"group scales; use float16")  # fmt: skip
    return quantizers.quantize_rows(w, codebook, group_size, method, scale_dtype, name=name,
                                    quantize_block=lambda rows: quantize_progressive(rows, codebook, group_size))  # fmt: skip
