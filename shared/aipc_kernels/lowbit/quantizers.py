"""Weight quantizers to the canonical low-bit format, and the int8 activation quantizer.

* :func:`quantize_rtn` - min-max round-to-nearest (affine, and the min form: the same fit, stored as a
  min per group) / absmax (fixed code books) / Transformer-Lite's
  mapping for ``e0m4`` (the group's range, widened to hold 0, onto [1, 2): a step of range/16, the bias
  truncated to the code's fraction bits, the top code clamped at 15).
* :func:`quantize_optimized` - fits scale (and zero) per group by alternating least squares: codes
  given the scale, then the least-squares scale (and zero) given the codes, starting from a grid of
  clipping ratios and keeping the best per group. Monotone in the group's squared error.
* :func:`quantize_rows` - a named method over a large matrix, a block of rows at a time (bounded memory).
* :func:`quantize_activations` - absmax int8 per token (or per K-group), the kernels' exact rounding.

All are vectorised torch over every group at once; computation in float32.
"""
from __future__ import annotations

from functools import partial
from typing import Callable, Optional

import torch

from aipc_kernels.lowbit.formats import Codebook, LowBitWeight, get_codebook, pack_codes, resolve_group_size

QUANTIZERS = ("rtn", "optimized")
QUANT_ROW_BLOCK = 4096  # rows quantized at once by quantize_rows (bounds the float32 temporaries)


def _grouped(w: torch.Tensor, group_size: int) -> torch.Tensor:
    N, K = w.shape
    return w.float().reshape(N, K // group_size, group_size)


def _codes(wg: torch.Tensor, s: torch.Tensor, z: torch.Tensor, cb: Codebook) -> torch.Tensor:
    """Nearest code for ``w = s*(cmul*c - z)``, clamped to the code book."""
    safe = torch.where(s == 0, torch.ones_like(s), s)
    return torch.clamp(torch.round((wg / safe + z) / cb.cmul), 0, cb.max_code)


def _rtn_params(wg: torch.Tensor, cb: Codebook) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero per group from the group's range (shape [N, ng, 1])."""
    lo, hi = wg.amin(-1, keepdim=True), wg.amax(-1, keepdim=True)
    if cb.integer_zero:  # e0m4: w1 = w / range + b in [1, 2), b = 1 - lo / range with its low fraction bits zeroed
        lo, hi = lo.clamp_max(0), hi.clamp_min(0)
        s = (hi - lo) / (cb.max_code + 1)
        z = torch.floor(-lo / torch.where(s > 0, s, torch.ones_like(s))).clamp(0, cb.max_code)
        return s, z
    if cb.zero is None or cb.mins:  # affine (the min form too): map [lo, hi] onto [0, max_code]
        # a constant group has no range: scale |lo| and zero -sign(lo) store it exactly with code 0
        s = torch.where(hi > lo, (hi - lo) / cb.max_code, lo.abs())
        z = torch.where(s > 0, -lo / torch.where(s > 0, s, torch.ones_like(s)), torch.zeros_like(s))
        return s, z
    if cb.max_code == 1:  # sign quantization: mean |w| is the least-squares scale (XNOR-Net)
        return wg.abs().mean(-1, keepdim=True), torch.full_like(lo, cb.zero)
    levels = cb.levels
    # the scale that makes the extreme levels reach the extreme weights (both sides fit)
    s = torch.maximum(hi / levels.max(), lo / levels.min()).clamp_min(0)
    return s, torch.full_like(s, cb.zero)


def _store(s: torch.Tensor, z: torch.Tensor, cb: Codebook, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Rounds scale/zero to their storage dtype (codes are then chosen for the stored values). The min form
    stores ``m = s * (z0 - z)`` (its fixed zero ``z0``): ``z`` becomes the effective zero of the stored min."""
    s = s.to(dtype).float()
    if cb.mins:
        m = _mins(s, z, cb, dtype)
        return s, torch.where(s > 0, cb.zero - m / torch.where(s > 0, s, torch.ones_like(s)), torch.full_like(s, cb.zero))
    if cb.integer_zero:
        z = torch.round(z).clamp(0, cb.max_code)
    z = z.to(dtype).float() if cb.zero is None else z
    return s, z


def _mins(s: torch.Tensor, z: torch.Tensor, cb: Codebook, dtype: torch.dtype) -> torch.Tensor:
    """The min form's stored min ``m = s * (z0 - z)`` of a group with effective zero point ``z``."""
    return (s * (cb.zero - z)).to(dtype).float()


def _finish(codes: torch.Tensor, s: torch.Tensor, z: torch.Tensor, cb: Codebook, G: int, K: int, dtype: torch.dtype) -> LowBitWeight:
    N = codes.shape[0]
    return LowBitWeight(
        pack_codes(codes.reshape(N, K).to(torch.uint8), cb.bits),
        s.squeeze(-1).to(dtype).contiguous(),
        _mins(s, z, cb, dtype).squeeze(-1).to(dtype).contiguous() if cb.mins
        else z.squeeze(-1).to(dtype).contiguous() if cb.zero is None else None,
        cb.name,
        G,
        K,
    )


def check_weight(w: torch.Tensor) -> None:
    if w.dim() != 2:
        raise ValueError(f"weight must be 2-D [out_features, in_features], got shape {tuple(w.shape)}")
    if not torch.isfinite(w).all():
        raise ValueError("weight contains NaN or Inf; refusing to quantize")


def quantize_rtn(
    w: torch.Tensor, codebook: str = "affine", group_size: int = 64, scale_dtype: torch.dtype = torch.float16
) -> LowBitWeight:
    """Min-max round-to-nearest quantization of ``w[N, K]``."""
    check_weight(w)
    cb = get_codebook(codebook)
    G = resolve_group_size(group_size, w.shape[1])
    wg = _grouped(w, G)
    s, z = _store(*_rtn_params(wg, cb), cb, scale_dtype)
    return _finish(_codes(wg, s, z, cb), s, z, cb, G, w.shape[1], scale_dtype)


def _lstsq_params(
    wg: torch.Tensor, v: torch.Tensor, cb: Codebook, s_prev: torch.Tensor, z_prev: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Least-squares scale (and zero) of ``w ~ s*(v - z)`` for fixed codes (v = cmul*c); groups
    where the fit is degenerate (all codes equal, non-positive scale) keep ``s_prev, z_prev``."""
    if cb.zero is None or cb.mins:  # w ~ a*v + b with a = s, b = -s*z
        mv, mw = v.mean(-1, keepdim=True), wg.mean(-1, keepdim=True)
        var = ((v - mv) ** 2).sum(-1, keepdim=True)
        a = ((v - mv) * (wg - mw)).sum(-1, keepdim=True) / var.clamp_min(1e-12)
        ok = (var > 0) & (a > 0)
        a_safe = torch.where(ok, a, torch.ones_like(a))
        return torch.where(ok, a, s_prev), torch.where(ok, -(mw - a * mv) / a_safe, z_prev)
    vv = v - cb.zero
    s = (vv * wg).sum(-1, keepdim=True) / (vv * vv).sum(-1, keepdim=True).clamp_min(1e-12)
    return torch.where(s > 0, s, s_prev), z_prev


def quantize_optimized(
    w: torch.Tensor,
    codebook: str = "affine",
    group_size: int = 64,
    scale_dtype: torch.dtype = torch.float16,
    steps: int = 10,
    clip_ratios: tuple[float, ...] = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6, 0.55, 0.5),
) -> LowBitWeight:
    """Alternating least-squares fit of scale (and zero) per group, from the best of several clipping
    ratios of the RTN range. Never worse than RTN (ratio 1.0 is its starting point)."""
    check_weight(w)
    cb = get_codebook(codebook)
    G = resolve_group_size(group_size, w.shape[1])
    wg = _grouped(w, G)
    best_err = best_s = best_z = None
    s0, z0 = _rtn_params(wg, cb)
    for ratio in clip_ratios:
        if ratio == 1.0:  # RTN's own parameters (e0m4's zero is not the centred range's)
            s, z = s0, z0
        elif cb.zero is None or cb.mins:  # shrink the range around its centre
            lo = wg.amin(-1, keepdim=True)
            mid = lo + s0 * cb.max_code / 2
            s = s0 * ratio
            z = torch.where(s > 0, -(mid - s * cb.max_code / 2) / torch.where(s > 0, s, torch.ones_like(s)), z0)
        else:
            s, z = s0 * ratio, z0
        for step in range(steps + 1):
            s, z = _store(s, z, cb, scale_dtype)
            c = _codes(wg, s, z, cb)
            err = ((s * (cb.cmul * c - z) - wg) ** 2).sum(-1, keepdim=True)
            if best_err is None:
                best_err, best_s, best_z = err, s, z
            else:
                better = err < best_err
                best_err = torch.where(better, err, best_err)
                best_s, best_z = torch.where(better, s, best_s), torch.where(better, z, best_z)
            if step < steps:
                s, z = _lstsq_params(wg, cb.cmul * c, cb, s, z)
    c = _codes(wg, best_s, best_z, cb)
    return _finish(c, best_s, best_z, cb, G, w.shape[1], scale_dtype)


def quantize_weight(
    w: torch.Tensor, codebook: str = "affine", group_size: int = 64, method: str = "optimized", **kw
) -> LowBitWeight:
    """Quantizes ``w`` with the named method (``rtn`` or ``optimized``)."""
    if method == "rtn":
        return quantize_rtn(w, codebook, group_size, **kw)
    if method == "optimized":
        return quantize_optimized(w, codebook, group_size, **kw)
    raise ValueError(f"method={method!r} is unknown; use one of {QUANTIZERS}")


def quantize_rows(
    w: torch.Tensor, codebook: str, group_size: int, method: str, scale_dtype: torch.dtype, name: str = "weight",
    quantize_block: Optional[Callable[[torch.Tensor], LowBitWeight]] = None,
) -> LowBitWeight:
    """Quantizes ``w[N, K]`` with the quantizer ``method``, ``QUANT_ROW_BLOCK`` rows at a time; or with
    ``quantize_block`` (float32 rows -> their weight, e.g. the progressive form's quantizer) in its place.
    Every group and row scale lies within one row, so the result equals quantizing the whole matrix at once."""
    if quantize_block is None:
        quantize_block = partial(quantize_weight, codebook=codebook, group_size=group_size, method=method,
                                 scale_dtype=scale_dtype)  # fmt: skip
    parts = [quantize_block(w[i : i + QUANT_ROW_BLOCK].float()) for i in range(0, w.shape[0], QUANT_ROW_BLOCK)]
    cat = lambda ts, dim=0: None if ts[0] is None else torch.cat(ts, dim)  # noqa: E731
    return LowBitWeight(
        cat([p.qweight for p in parts]), cat([p.scales for p in parts]), cat([p.zeros for p in parts]),
        codebook, parts[0].group_size, w.shape[1], name=name,
        supers=cat([p.supers for p in parts], 1),  # [S, N, K/SB]: rows are dim 1
    )  # fmt: skip


def quantize_activations(
    x: torch.Tensor, group_size: Optional[int] = None, amax: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absmax int8 quantization of ``x[..., K]`` per token (``group_size`` None) or per K-group.

    Returns ``(xq int8 [..., K], scale float32 [..., K/group])`` with ``x ~ xq * scale``; the rounding
    is the native kernels' (float32 ``x * (127/absmax)``, round half to even, clamped to [-127, 127]).
    ``amax`` (per token only): each token's absmax to use instead of its own, ``x.numel() / K`` values
    (e.g. a whole row's when ``x`` is a tensor-parallel slice of it)."""
    K = x.shape[-1]
    g = K if group_size is None else group_size
    if K % g:
        raise ValueError(f"activation group_size={g} does not divide K={K}")
    if amax is not None and g != K:
        raise ValueError(f"amax is per token: use group_size=None, not {group_size}")
    xg = x.float().unflatten(-1, (K // g, g))
    if amax is None:
        amax = xg.abs().amax(-1, keepdim=True)
    else:
        amax = amax.float().reshape(*x.shape[:-1], 1, 1)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    xq = torch.round(xg * inv).clamp(-127, 127).to(torch.int8).flatten(-2)
    return xq, (amax / 127.0).squeeze(-1)
