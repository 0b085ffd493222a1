"""Weights that already lie on a low-bit grid (quantization-aware-trained checkpoints stored as
floats, e.g. ParetoQ's fake-quantized bf16 weights), recovered as ``lowbit2`` weights.

ParetoQ (facebookresearch/ParetoQ, ``models/utils_quant.py``) keeps one clip value ``alpha`` per
output row; its weights are ``alpha * q`` rounded to the storage dtype, with ``q`` in

* 1 bit: ``{-1, +1}`` (``sign``; a latent weight of exactly 0 gives 0)  -> ``binary``, scale ``alpha``;
* ternary (``w_bits=0``): ``{-2/3, 0, 2/3}``                            -> ``ternary``, scale ``2/3 alpha``;
* 2 bits (SEQ): ``{-0.75, -0.25, 0.25, 0.75}``                          -> ``sym`` ({±0.5, ±1.5}), scale ``alpha/2``.

:func:`detect_grid` decides per layer whether every row holds at most these magnitudes: one (binary;
ternary when some row also holds zeros) or two whose ratio is 3 within the rounding of a bf16 store
(``|hi - 3 lo| <= 1.01 * eps_bf16 * hi``: both levels are ``alpha * level`` rounded once, so they are
off a 1:3 ratio by at most one bf16 unit of ``hi``). It returns the whole-row (or ``group_size``,
scales repeated) weight with per-row scales, or None (not on a grid, an all-zero layer, non-finite
values, K not a multiple of 32). Rows of zeros fit any grid. Other grids (int2, affine, ParetoQ's 3-
and 4-bit LSQ) are not detected: they are not whole-row ParetoQ grids at 2 bits or less.

Exactness. Binary and ternary rows have one magnitude ``m``, stored as the scale: exact whenever ``m``
is representable in the scale dtype (always for bf16 sources with bf16 scales, for fp16 within its
range). SEQ rows store ``lo = r(alpha/4)`` and ``hi = r(3 alpha/4)``; the uniform code book
reproduces both exactly only when ``hi == 3 lo`` (often not: ``r(3a/4) != 3 r(a/4)`` for about half
of bf16 alphas). Otherwise the scale minimising the larger of the two level errors is kept (among
``2 lo``, ``(lo + hi)/2``, ``2 hi/3`` in the chosen dtype), an error of at most ``|hi - 3 lo| / 4``
plus 1.5x the scale's rounding: <= ``2^-9 + 2^-11`` (0.25 %) of ``hi`` with fp16 scales, <=
``2^-9 + 2^-8`` with bf16 scales (bf16 sources). The scale dtype is the one of ``scale_dtype`` and the
other 16-bit dtype with the smaller largest error (``scale_dtype`` on a tie); :attr:`GridWeight.max_error`
is the largest reconstruction error of the layer (0.0: exact).

Cost: a layer that is not on a grid is rejected from a sample of 8 rows (one pass over them); a grid
layer takes two passes (statistics, codes), ``QUANT_ROW_BLOCK`` rows at a time.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from aipc_kernels.lowbit.formats import SCALE_DTYPES, LowBitWeight, get_codebook, pack_codes, resolve_group_size
from aipc_kernels.lowbit.quantizers import QUANT_ROW_BLOCK

GRID_CODEBOOKS = ("binary", "ternary", "sym")
SAMPLE_ROWS = 8  # rows checked first: a layer that is not on a grid is rejected from these
#: tolerance of the 1:3 ratio of SEQ levels, in units of ``hi``: one bf16 rounding of each level
SEQ_RATIO_TOL = 1.01 * torch.finfo(torch.bfloat16).eps


@dataclass(frozen=True)
class GridWeight:
    """A layer recovered from a grid: the ``lowbit2`` weight and its largest reconstruction error."""

    weight: LowBitWeight
    max_error: float  # max |dequantize() - source| over the layer, in weight units
    max_rel_error: float  # max over rows of that error / the row's largest |w|

    @property
    def codebook(self) -> str:
        return self.weight.codebook

    @property
    def exact(self) -> bool:
        return self.max_error == 0.0


@dataclass
class _RowStats:
    hi: torch.Tensor  # float32 [N]: largest |w| of the row
    lo: torch.Tensor  # float32 [N]: smallest non-zero |w| (0 for a zero row)
    on: torch.Tensor  # bool [N]: every |w| is 0, lo or hi
    has_zero: torch.Tensor  # bool [N]


_INT_OF_SIZE = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def _magnitude_bits(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the bits of ``|w|`` as integers, the sign bits): IEEE magnitudes order and compare like their
    bit patterns, and integer compares are several times faster than bf16 ones on the CPU."""
    b = w.view(_INT_OF_SIZE[w.element_size()])
    return b & torch.iinfo(b.dtype).max, b < 0


def _as_float(bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return bits.view(dtype).float()


def _row_stats(w: torch.Tensor) -> _RowStats:
    m, _ = _magnitude_bits(w)
    top = torch.iinfo(m.dtype).max
    hi = m.amax(1)
    lo = ((m - 1) & top).amin(1) + 1  # smallest non-zero magnitude (a zero wraps to the top)
    lo = torch.where(hi > 0, lo, torch.zeros_like(lo))
    on = (m * (m < hi[:, None])).amax(1) <= lo  # nothing strictly between lo and hi
    return _RowStats(_as_float(hi, w.dtype), _as_float(lo, w.dtype), on, m.amin(1) == 0)


def _cat_stats(parts: list[_RowStats]) -> _RowStats:
    return _RowStats(*(torch.cat([getattr(p, f) for p in parts]) for f in ("hi", "lo", "on", "has_zero")))


def _scale_candidates(codebook: str, st: _RowStats, two: torch.Tensor) -> torch.Tensor:
    """Per-row scales to try ``[C, N]`` (float32, before rounding to the scale dtype)."""
    if codebook != "sym":
        return st.hi[None]
    lo, hi = st.lo, st.hi
    one = 2 * lo  # a single magnitude is coded as +-0.5
    return torch.stack([one, torch.where(two, (lo + hi) / 2, one), torch.where(two, hi * (2.0 / 3.0), one)])


def _level_error(codebook: str, s: torch.Tensor, st: _RowStats, two: torch.Tensor) -> torch.Tensor:
    """Largest |reconstructed level - stored level| of each row for scales ``s`` ``[C, N]``."""
    if codebook != "sym":
        return (s - st.hi).abs()
    small = (0.5 * s - st.lo).abs()
    return torch.maximum(small, torch.where(two, (1.5 * s - st.hi).abs(), torch.zeros_like(small)))


def _fit_scales(codebook: str, st: _RowStats, two: torch.Tensor, prefer: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(scales [N] in the chosen dtype, row errors [N]): per row the best candidate, per layer the
    16-bit dtype with the smaller largest error (``prefer`` on a tie)."""
    cand = _scale_candidates(codebook, st, two)
    best = None
    for dtype in [prefer] + [d for d in SCALE_DTYPES.values() if d != prefer]:
        s = cand.to(dtype).float()
        err = _level_error(codebook, s, st, two)
        err = torch.where(torch.isfinite(err), err, torch.full_like(err, float("inf")))
        row_err, pick = err.min(0)
        fit = (s.gather(0, pick[None])[0].to(dtype), row_err)
        if best is None or row_err.max() < best[1].max():
            best = fit
    return best


def _choose_codebook(st: _RowStats) -> Optional[tuple[str, torch.Tensor]]:
    """The code book every row fits (and the rows holding two magnitudes), or None."""
    if not bool(st.on.all()) or not bool(torch.isfinite(st.hi).all()) or not bool((st.hi > 0).any()):
        return None
    two = st.lo < st.hi
    if bool(two.any()):
        seq = (st.hi - 3 * st.lo).abs() <= SEQ_RATIO_TOL * st.hi
        if not bool(seq[two].all()) or bool((st.has_zero & (st.hi > 0)).any()):
            return None  # two magnitudes off a 1:3 ratio, or zeros beside them: no code book holds them
        return "sym", two
    return ("ternary" if bool((st.has_zero & (st.hi > 0)).any()) else "binary"), two


def _codes(w: torch.Tensor, codebook: str, hi: torch.Tensor, two: torch.Tensor) -> torch.Tensor:
    """uint8 codes of one block of rows for the chosen code book (``hi``: the rows' largest |w|)."""
    m, neg = _magnitude_bits(w)
    neg = neg.to(torch.uint8)
    if codebook == "binary":
        return 1 - neg
    if codebook == "ternary":  # 0, 1, 2 = -1, 0, +1
        nz = (m != 0).to(torch.uint8)
        return 1 + nz - 2 * (nz & neg)
    hi_bits = hi.to(w.dtype).view(m.dtype)  # sym: codes 0..3 = -1.5, -0.5, 0.5, 1.5
    big = ((m == hi_bits[:, None]) & two[:, None]).to(torch.uint8)
    return 2 + big - neg * (1 + 2 * big)


def detect_grid(
    weight: torch.Tensor, name: str = "weight", group_size: int = -1, scale_dtype: torch.dtype = torch.float16
) -> Optional[GridWeight]:
    """The ``lowbit2`` weight that reproduces ``weight[N, K]`` when every row lies on one supported
    grid (see the module docstring), else None. ``group_size``: -1 (one scale per row) or a group
    size that divides K (the row's scale repeated per group, e.g. for ``act_group``);
    ``scale_dtype``: the preferred scale dtype (kept unless the other one is more exact)."""
    if weight.dim() != 2 or not weight.is_floating_point() or weight.shape[1] % 32 or weight.shape[0] == 0:
        return None
    N, K = weight.shape
    w = weight.detach()
    k = min(N, SAMPLE_ROWS)  # k rows spread evenly, in integers (vLLM may set a bf16 default dtype)
    sample = w[(torch.arange(k, dtype=torch.int64) * (N - 1)) // max(k - 1, 1)]
    if not bool(_row_stats(sample).on.all()):
        return None
    st = _cat_stats([_row_stats(w[i : i + QUANT_ROW_BLOCK]) for i in range(0, N, QUANT_ROW_BLOCK)])
    chosen = _choose_codebook(st)
    if chosen is None:
        return None
    codebook, two = chosen
    G = resolve_group_size(group_size, K)
    scales, row_err = _fit_scales(codebook, st, two, scale_dtype)
    codes = torch.cat([_codes(w[i : i + QUANT_ROW_BLOCK], codebook, st.hi[i : i + QUANT_ROW_BLOCK],
                              two[i : i + QUANT_ROW_BLOCK]) for i in range(0, N, QUANT_ROW_BLOCK)])  # fmt: skip
    lw = LowBitWeight(
        pack_codes(codes, get_codebook(codebook).bits), scales[:, None].expand(N, K // G).contiguous(), None,
        codebook, G, K, name=name,
    )  # fmt: skip
    rel = torch.where(st.hi > 0, row_err / torch.where(st.hi > 0, st.hi, torch.ones_like(st.hi)), row_err)
    return GridWeight(lw, float(row_err.max()), float(rel.max()))


def split_rows(w: LowBitWeight, sizes: list[int], names: list[str]) -> list[LowBitWeight]:
    """``w`` cut along its rows into weights of ``sizes`` rows (a merged layer back into its parts)."""
    if sum(sizes) != w.out_features:
        raise ValueError(f"{w.name}: row sizes {sizes} do not add up to its {w.out_features} rows")
    cut = lambda t: None if t is None else t.split(sizes)  # noqa: E731
    q, s, z = cut(w.qweight), cut(w.scales), cut(w.zeros)
    return [
        LowBitWeight(q[i].contiguous(), s[i].contiguous(), None if z is None else z[i].contiguous(), w.codebook,
                     w.group_size, w.in_features, name=names[i])  # fmt: skip
        for i in range(len(sizes))
    ]


def recovered_summary(codebooks: list[str], exact: list[bool], worst: float) -> str:
    """One line for the layers recovered from a grid (their code books, whether each is exact, the
    largest relative error): ``binary 2, ternary 1; all exact`` or ``...; 1 exact, 2 within ...``."""
    counts = {b: codebooks.count(b) for b in sorted(set(codebooks))}
    books = ", ".join(f"{b} {n}" for b, n in counts.items())
    n, ok = len(exact), sum(exact)
    if ok == n:
        return f"{books}; all exact"
    return (f"{books}; {ok} exact, {n - ok} within the scale's rounding (largest error {100 * worst:.3g}% of a "
            f"row's largest weight)")  # fmt: skip


__all__ = ["GRID_CODEBOOKS", "GridWeight", "detect_grid", "recovered_summary", "split_rows"]
