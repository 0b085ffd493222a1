"""Device layouts derived from the canonical :class:`~aipc_kernels.lowbit.formats.LowBitWeight`.

``cpu_vnni16`` (native CPU kernels): rows in blocks of 16, K in 64-byte chunks. Byte ``[n][kk]`` of a
chunk holds, in bit-plane ``q``, the code of ``k = chunk*kc + 4q + kk`` (kc = 16 k for 2 bits, 32 for
1 bit). One 64-byte load then a shift and mask per plane gives a [16 rows][4 k] u8 vector, the
operand of one VNNI dot product against four broadcast int8 activations (the paper's
[N/16][K/kc][16][4] blocking with bit-planes instead of a LUT). Scales and zeros become
``[N/16][K/G][16]`` so one 32-byte load feeds a whole row block; the two-level form's super-block
scales ``[S][N/16][K/SB][16]``, the progressive form's one ``s0`` a row as ``[1][N/16][1][16]`` (the native
kernels' integer accumulation, :func:`pack_cpu_supers`). ``triton_k32`` takes the two-level form only as the progressive form
(:mod:`~aipc_kernels.lowbit.progressive`: int8 levels, one ``s0`` per row, supers ``[2, 1, N]``, the
``progressive`` kernel's operands); any other two-level weight is packed for it with its float32 products
(:meth:`~aipc_kernels.lowbit.formats.LowBitWeight.single_level`).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from aipc_kernels.core.huge_pages import on_huge_pages
from aipc_kernels.lowbit.formats import LowBitWeight, dequantize_codes, get_codebook, pack_codes, unpack_codes
from aipc_kernels.lowbit.progressive import row_scales, super_block

BLOCK_N = 16
CPU_LAYOUT = "cpu_vnni16"
CANONICAL_LAYOUT = "canonical"  # the canonical format wrapped as a PackedLowBit (reference path)


def _planes(bits: int) -> int:
    return 8 // bits  # bit-planes per byte; a chunk spans 4 * planes k


def pack_cpu_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes ``[N, K]`` -> ``cpu_vnni16`` bytes ``[ceil(N/16), K/kc, 16, 4]`` (rows past N are zero); 6 bits:
    ``[ceil(N/16), 3K/16, 16, 4]``, per 16 k the low nibbles of k 0-7 and 8-15 as 4-bit chunks, then the high
    two bits of k 0-15 as a 2-bit chunk."""
    if bits == 6:
        c = codes.to(torch.uint8)
        lo, hi = pack_cpu_codes(c & 15, 4), pack_cpu_codes(c >> 4, 2)
        nb, K16 = hi.shape[0], hi.shape[1]
        return torch.cat([lo.view(nb, K16, 2, BLOCK_N, 4), hi.view(nb, K16, 1, BLOCK_N, 4)], 2).view(nb, 3 * K16, BLOCK_N, 4)
    N, K = codes.shape
    planes = _planes(bits)
    Np = -(-N // BLOCK_N) * BLOCK_N
    c = F.pad(codes.to(torch.uint8), (0, 0, 0, Np - N))
    # [nb, n, chunk, plane, kk] -> [nb, chunk, n, kk, plane]
    c = c.view(Np // BLOCK_N, BLOCK_N, K // (4 * planes), planes, 4).permute(0, 2, 1, 4, 3)
    shifts = torch.arange(planes, dtype=torch.uint8, device=codes.device) * bits
    return (c << shifts).sum(-1, dtype=torch.uint8).contiguous()


def unpack_cpu_codes(packed: torch.Tensor, bits: int, n_rows: int) -> torch.Tensor:
    """Inverse of :func:`pack_cpu_codes`: -> codes ``[n_rows, K]``."""
    if bits == 6:
        nb, K16 = packed.shape[0], packed.shape[1] // 3
        units = packed.view(nb, K16, 3, BLOCK_N, 4)
        lo = unpack_cpu_codes(units[:, :, :2].reshape(nb, 2 * K16, BLOCK_N, 4), 4, n_rows)
        return lo | (unpack_cpu_codes(units[:, :, 2].contiguous(), 2, n_rows) << 4)
    nb, chunks = packed.shape[:2]
    planes = _planes(bits)
    shifts = torch.arange(planes, dtype=torch.uint8, device=packed.device) * bits
    c = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [nb, chunk, n, kk, plane]
    c = c.permute(0, 2, 1, 4, 3).reshape(nb * BLOCK_N, chunks * 4 * planes)
    return c[:n_rows].contiguous()


def pack_cpu_groups(t: torch.Tensor) -> torch.Tensor:
    """Per-group tensor ``[N, K/G]`` -> ``[ceil(N/16), K/G, 16]`` (rows past N are zero)."""
    N, ng = t.shape
    Np = -(-N // BLOCK_N) * BLOCK_N
    return F.pad(t, (0, 0, 0, Np - N)).view(Np // BLOCK_N, BLOCK_N, ng).transpose(1, 2).contiguous()


def unpack_cpu_groups(t: torch.Tensor, n_rows: int) -> torch.Tensor:
    """Inverse of :func:`pack_cpu_groups`."""
    return t.transpose(1, 2).reshape(-1, t.shape[1])[:n_rows].contiguous()


@dataclass
class PackedLowBit:
    """A weight in a device layout, with what the kernels need to interpret it."""

    layout: str
    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: Optional[torch.Tensor]
    codebook: str
    group_size: int
    out_features: int
    in_features: int
    supers: Optional[torch.Tensor] = None  # the two-level form's super-block scales (scales int8)

    @property
    def bits(self) -> int:
        return get_codebook(self.codebook).bits

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.qweight, self.scales, self.zeros, self.supers) if t is not None]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def _map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "PackedLowBit":
        """The same weight with ``fn`` applied to each of its tensors (the absent ones stay None)."""
        def apply(t):
            return None if t is None else fn(t)

        return replace(self, qweight=fn(self.qweight), scales=fn(self.scales), zeros=apply(self.zeros),
                       supers=apply(self.supers))  # fmt: skip

    def to(self, device: torch.device | str) -> "PackedLowBit":
        """The same weight with its tensors on ``device``."""
        return self._map(lambda t: t.to(device))

    def clone(self) -> "PackedLowBit":
        """The same weight in tensors of its own (the benches' weight copies that outsize the cache)."""
        return self._map(torch.Tensor.clone)


def pack_for_cpu(w: LowBitWeight) -> PackedLowBit:
    """Canonical -> ``cpu_vnni16``, each tensor the kernels stream on huge pages where it holds one
    (:func:`~aipc_kernels.core.huge_pages.on_huge_pages`)."""
    return PackedLowBit(
        CPU_LAYOUT,
        on_huge_pages(pack_cpu_codes(w.codes(), w.bits)),
        on_huge_pages(pack_cpu_groups(w.scales)),
        on_huge_pages(pack_cpu_groups(w.zeros)) if w.zeros is not None else None,
        w.codebook,
        w.group_size,
        w.out_features,
        w.in_features,
        on_huge_pages(pack_cpu_supers(w)) if w.supers is not None else None,
    )


def pack_cpu_supers(w: LowBitWeight) -> torch.Tensor:
    """A two-level weight's supers in ``cpu_vnni16``: ``[S, N/16, K/SB, 16]``; the progressive form
    (:func:`~aipc_kernels.lowbit.progressive.row_scales`) as its one set of ``s0``, ``[1, N/16, 1, 16]``, which
    the kernels take as the progressive form (int32 accumulation over K with per-token activations)."""
    s0 = row_scales(w)
    if s0 is not None:
        return pack_cpu_groups(s0[:, None])[None]
    return torch.stack([pack_cpu_groups(s) for s in w.supers])


def is_cpu_progressive(p: "PackedLowBit") -> bool:
    """Whether a ``cpu_vnni16`` weight holds the progressive form (:func:`pack_cpu_supers`: a min form with one
    set of super scales)."""
    return p.supers is not None and p.zeros is not None and get_codebook(p.codebook).mins and p.supers.shape[0] == 1


# ------------------------------------------------------------------ triton_k32 (Triton kernels)
# Rows stay K-contiguous ([N, Kp*bits/8] bytes, Kp = K padded to a whole chunk). A chunk is 32 bytes
# holding 32 * planes codes: byte j, bit-plane q holds the code of k = chunk*32*planes + 32*q + j.
# One 32-byte load per row then a shift and mask per plane gives 32 consecutive k of that row (an
# int8 dot operand of K = 32, never straddling a group; 8 bits: one plane, a group spans G/32
# chunks). Scales and zeros are transposed to [K/G, N] so the kernels read one group of a row tile as
# one contiguous vector.
TRITON_LAYOUT = "triton_k32"
TRITON_PLANE = 32  # consecutive k per bit-plane run


def triton_chunk(bits: int) -> int:
    """Codes per 32-byte ``triton_k32`` chunk (128 for 2-bit, 256 for 1-bit, 32 for 8-bit)."""
    return TRITON_PLANE * _planes(bits)


def pack_triton_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes ``[N, K]`` -> ``triton_k32`` bytes ``[N, Kp*bits/8]`` (K zero-padded to a whole chunk)."""
    N, K = codes.shape
    planes, kc = _planes(bits), triton_chunk(bits)
    Kp = -(-K // kc) * kc
    c = F.pad(codes.to(torch.uint8), (0, Kp - K)).view(N, Kp // kc, planes, TRITON_PLANE)
    shifts = (torch.arange(planes, dtype=torch.uint8, device=codes.device) * bits).view(1, 1, planes, 1)
    return (c << shifts).sum(2, dtype=torch.uint8).reshape(N, Kp // planes).contiguous()


def unpack_triton_codes(packed: torch.Tensor, bits: int, in_features: int) -> torch.Tensor:
    """Inverse of :func:`pack_triton_codes`: -> codes ``[N, in_features]``."""
    N, nbytes = packed.shape
    planes = _planes(bits)
    shifts = (torch.arange(planes, dtype=torch.uint8, device=packed.device) * bits).view(1, 1, planes, 1)
    c = (packed.view(N, nbytes // TRITON_PLANE, 1, TRITON_PLANE) >> shifts) & ((1 << bits) - 1)
    return c.reshape(N, nbytes * planes)[:, :in_features].contiguous()


def pack_for_triton(w: LowBitWeight) -> PackedLowBit:
    """Canonical -> ``triton_k32`` (codes re-packed, scales/zeros transposed to ``[K/G, N]``; the progressive
    form with its int8 scales and mins and ``s0`` as supers ``[2, 1, N]``, any other two-level form as its
    float32 products; 6-bit codes as their 8-bit equivalent: :func:`as_eight_bit`)."""
    s0 = row_scales(w)
    if s0 is not None:
        return PackedLowBit(TRITON_LAYOUT, pack_triton_codes(w.codes(), w.bits), w.scales.t().contiguous(),
                            w.zeros.t().contiguous(), w.codebook, w.group_size, w.out_features, w.in_features,
                            s0.view(1, 1, -1).expand(2, 1, -1).contiguous())  # fmt: skip
    w = as_eight_bit(w.single_level())
    return PackedLowBit(
        TRITON_LAYOUT,
        pack_triton_codes(w.codes(), w.bits),
        w.scales.t().contiguous(),
        w.zeros.t().contiguous() if w.zeros is not None else None,
        w.codebook,
        w.group_size,
        w.out_features,
        w.in_features,
    )


def as_eight_bit(w: LowBitWeight) -> LowBitWeight:
    """A 6-bit weight as the same values in 8 bits: ``int5`` / ``int6`` as ``int8``, ``min6`` as ``min8``
    (codes ``c + 128 - z``; scales, mins and super-blocks as they are): the form for kernels without a
    6-bit layout (Triton). Other weights as they are."""
    if w.bits != 6:
        return w
    cb = get_codebook(w.codebook)
    codes = w.codes() + int(128 - cb.zero)  # every 6-bit code book has a fixed zero
    return replace(w, qweight=pack_codes(codes, 8), codebook="min8" if cb.mins else "int8")


LAYOUTS = (CPU_LAYOUT, TRITON_LAYOUT, CANONICAL_LAYOUT)


def super_shape(layout: str, out_features: int, super_blocks: int) -> tuple[int, ...]:
    """Shape of one set of super-block scales (``supers[i]``) with ``super_blocks`` per row in ``layout``
    (the two-level form: ``cpu_vnni16`` and ``canonical``; ``triton_k32``'s progressive supers are checked by
    :func:`~aipc_kernels.lowbit.contract.check_supers` itself)."""
    if layout == CPU_LAYOUT:
        return (-(-out_features // BLOCK_N), super_blocks, BLOCK_N)
    if layout == CANONICAL_LAYOUT:
        return (out_features, super_blocks)
    raise ValueError(f"layout={layout!r} takes no two-level scales (int8 scales with supers); use {CPU_LAYOUT!r} "
                     f"or {CANONICAL_LAYOUT!r}, or pack the weight's single_level() form")  # fmt: skip


def packed_shapes(layout: str, bits: int, out_features: int, in_features: int, group_size: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(qweight shape, scales/zeros shape)`` of an ``[out_features, in_features]`` weight with groups of
    ``group_size`` (effective: ``in_features`` for one group per row) packed in ``layout``."""
    N, K, G = out_features, in_features, group_size
    if layout == CPU_LAYOUT:
        nb = -(-N // BLOCK_N)
        return (nb, K * bits // 32, BLOCK_N, 4), (nb, K // G, BLOCK_N)
    if layout == TRITON_LAYOUT:
        kc = triton_chunk(bits)
        return (N, -(-K // kc) * kc * bits // 8), (K // G, N)
    if layout == CANONICAL_LAYOUT:
        return (N, K * bits // 8), (N, K // G)
    raise ValueError(f"layout={layout!r} is not known to aipc_kernels.lowbit.packing; use one of {LAYOUTS}")


def to_canonical(p: PackedLowBit) -> LowBitWeight:
    """Any supported device layout -> canonical (for the reference path and round-trip tests)."""
    if p.layout == CANONICAL_LAYOUT:
        return LowBitWeight(p.qweight, p.scales, p.zeros, p.codebook, p.group_size, p.in_features, supers=p.supers)
    if p.layout == TRITON_LAYOUT:
        codes = unpack_triton_codes(p.qweight, p.bits, p.in_features)
        zeros = p.zeros.t().contiguous() if p.zeros is not None else None
        return LowBitWeight(pack_codes(codes, p.bits), p.scales.t().contiguous(), zeros, p.codebook, p.group_size,
                            p.in_features, supers=_canonical_supers(p))  # fmt: skip
    if p.layout != CPU_LAYOUT:
        raise ValueError(f"layout={p.layout!r} is not known to aipc_kernels.lowbit.packing")
    N = p.out_features
    codes = unpack_cpu_codes(p.qweight, p.bits, N)
    zeros = unpack_cpu_groups(p.zeros, N) if p.zeros is not None else None
    supers = torch.stack([unpack_cpu_groups(s, N) for s in p.supers]) if p.supers is not None else None
    if is_cpu_progressive(p):  # s0 per row: the canonical [2, N, K/SB]
        supers = _canonical_progressive(supers[0, :, 0], p.in_features, p.group_size)
    return LowBitWeight(pack_codes(codes, p.bits), unpack_cpu_groups(p.scales, N), zeros, p.codebook, p.group_size,
                        p.in_features, supers=supers)  # fmt: skip


def _canonical_supers(p: PackedLowBit) -> Optional[torch.Tensor]:
    """The canonical supers ``[2, N, K/SB]`` of a progressive ``triton_k32`` weight (``s0`` repeated per
    super-block, :func:`~aipc_kernels.lowbit.progressive.super_block`), None for single-level scales."""
    if p.supers is None:
        return None
    return _canonical_progressive(p.supers[0, 0], p.in_features, p.group_size)


def _canonical_progressive(s0: torch.Tensor, in_features: int, group_size: int) -> torch.Tensor:
    """The canonical supers ``[2, N, K/SB]`` of the progressive form's ``s0`` ``[N]`` (repeated per super-block,
    :func:`~aipc_kernels.lowbit.progressive.super_block`, in both sets)."""
    nsb = in_features // super_block(in_features, group_size)
    return s0[None, :, None].expand(2, -1, nsb).contiguous()


def dequantize_rows(p: PackedLowBit, rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows ``rows`` (integer ids ``[M]``) of the weight ``p`` holds, dequantized: ``[M, in_features]`` with
    the values of ``to_canonical(p).dequantize()[rows]`` (the same float32 operations), read from the device
    layout itself, so a token embedding and the tied output projection share one packed tensor. Tensor
    operations only (traceable by torch.compile)."""
    cb = get_codebook(p.codebook)
    bits, K, G = cb.bits, p.in_features, p.group_size
    rows = rows.reshape(-1).long()
    if p.layout == CPU_LAYOUT:
        blk, r = rows // BLOCK_N, rows % BLOCK_N
        q = p.qweight[blk, :, r, :]  # [M, K/kc, 4]: byte kk of a chunk, bit-plane j: k = chunk*4*planes + 4j + kk
        if bits == 6:  # per 16 k: two 4-bit units (k = 8u + 4j + kk), one 2-bit unit (high bits, k = 4j + kk)
            u = q.view(rows.numel(), K // 16, 3, 4)
            lo = (u[:, :, :2].unsqueeze(-1) >> torch.tensor([0, 4], dtype=torch.uint8, device=q.device)) & 15
            hi = (u[:, :, 2].unsqueeze(-1) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=q.device)) & 3
            codes = (lo.transpose(-1, -2).reshape(rows.numel(), K) | (hi.transpose(-1, -2).reshape(rows.numel(), K) << 4))
        else:
            planes, mask = _planes(bits), (1 << bits) - 1
            shifts = torch.arange(planes, dtype=torch.uint8, device=q.device) * bits
            codes = ((q.unsqueeze(-1) >> shifts) & mask).transpose(-1, -2).reshape(rows.numel(), K)
        scales = p.scales[blk, :, r]
        zeros = p.zeros[blk, :, r] if p.zeros is not None else None
        supers = p.supers[:, blk, :, r].transpose(0, 1) if p.supers is not None else None  # [S, M, K/SB]
        if is_cpu_progressive(p):  # one set, one super-block a row: the mins' too
            supers = supers.expand(2, -1, -1)
    elif p.layout == TRITON_LAYOUT:
        codes = unpack_triton_codes(p.qweight[rows], bits, K)
        scales = p.scales[:, rows].t()
        zeros = p.zeros[:, rows].t() if p.zeros is not None else None
        supers = None if p.supers is None else p.supers[:, 0, rows, None]  # progressive: s0 per row
    elif p.layout == CANONICAL_LAYOUT:
        codes = unpack_codes(p.qweight[rows], bits)
        scales = p.scales[rows]
        zeros = p.zeros[rows] if p.zeros is not None else None
        supers = p.supers[:, rows] if p.supers is not None else None
    else:
        raise ValueError(f"layout={p.layout!r} is not known to aipc_kernels.lowbit.packing; use one of {LAYOUTS}")
    return dequantize_codes(codes, scales, zeros, p.codebook, G, dtype, supers)


def as_canonical_packed(w: LowBitWeight) -> PackedLowBit:
    """Wraps a canonical weight as a :class:`PackedLowBit` with layout ``canonical`` (reference path)."""
    return PackedLowBit(CANONICAL_LAYOUT, w.qweight, w.scales, w.zeros, w.codebook, w.group_size, w.out_features,
                        w.in_features, w.supers)  # fmt: skip


__all__ = [
    "BLOCK_N",
    "CPU_LAYOUT",
    "CANONICAL_LAYOUT",
    "LAYOUTS",
    "dequantize_rows",
    "packed_shapes",
    "super_shape",
    "PackedLowBit",
    "pack_cpu_codes",
    "unpack_cpu_codes",
    "pack_cpu_groups",
    "unpack_cpu_groups",
    "pack_for_cpu",
    "TRITON_LAYOUT",
    "TRITON_PLANE",
    "triton_chunk",
    "pack_triton_codes",
    "unpack_triton_codes",
    "pack_for_triton",
    "to_canonical",
    "as_canonical_packed",
]
