"""The canonical low-bit weight format (``lowbit2``, its 1-, 4- and 8-bit siblings).

A weight ``W[N, K]`` is stored as unsigned codes ``c`` packed along K (2 bits: 4 per byte, 1 bit:
8 per byte, 4 bits: 2 per byte, 8 bits: one per byte; element ``k`` at bits ``bits*(k % per_byte)``
of byte ``k // per_byte``, low bits first; 6 bits: four codes in three bytes, :func:`pack_codes`),
per-group scales ``s[N, K/G]`` (fp16 or bf16) and a code book that maps codes to values:

    W[n, k] = s[n, g] * (cmul * c[n, k] - z[n, g]),   g = k // G

========  ====  ==================================  =============================
codebook  bits  levels (cmul * c - z)               zero point z
========  ====  ==================================  =============================
affine    2     {0,1,2,3} - z                        per group, stored (``zeros``)
int2      2     {-2, -1, 0, 1}                       2
sym       2     {-1.5, -0.5, 0.5, 1.5} (ParetoQ)     1.5
ternary   2     {-1, 0, 1} (BitNet b1.58; c <= 2)    1
binary    1     {-1, +1} (cmul = 2)                  1
int4      4     {-8, ..., 7} (GPTQ symmetric)        8
affine4   4     {0, ..., 15} - z (GPTQ/AWQ asym.)    per group, stored (``zeros``)
int5      6     {-16, ..., 15} (GGUF's Q5_0)          16 (codes 0..31 in the 6-bit layout)
int6      6     {-32, ..., 31} (GGUF's Q6_K)          32
int8      8     {-128, ..., 127}                     128 (``c`` is int8 ``w`` XOR 0x80)
e0m4      4     {0, ..., 15} - z (Transformer-Lite)  per group, stored: an integer in [0, 15]
min2      2     {0, 1, 2, 3}, plus a min per group  0; ``zeros`` holds the mins m
min4      4     {0, ..., 15}, plus a min per group   0; ``zeros`` holds the mins m
min6      6     {0, ..., 63}, plus a min per group   0; ``zeros`` holds the mins m
min8      8     {-128, ..., 127}, plus a min         128; ``zeros`` holds the mins m
========  ====  ==================================  =============================

Two-level scales (GGUF's K-quants as the file holds them): ``scales`` (and the min form's mins) are int8
sub-block values and ``supers`` float32 ``[S, N, K/SB]`` super-block scales (``SB``: a power-of-two
multiple of ``G`` dividing ``K``; ``S`` = 1, or 2 in the min form, the mins' super-block scales second).
A group's scale is ``supers[0] * scales`` and its min ``supers[1] * mins``, each one float32 product
(exact for an fp16 ``d`` times a 6- or 8-bit integer), the values the same weight holds with those
products stored as float32 scales: :meth:`LowBitWeight.single_level` turns one form into the other.
A row then reads 1 byte per group for its scale (2 with mins) and 4 (8) per super-block, not 4 (8) per group.
The progressive form (:mod:`aipc_kernels.lowbit.progressive`) is this min form with one super scale per row
in both sets and every level ``s1 * c + m`` an int8: the form of the GPU prefill kernels.

The min form (``min2``, ``min4``, ``min8``): ``W[n, k] = s[n, g] * (cmul * c[n, k] - z) + m[n, g]`` with a fixed
``z`` and a stored min ``m`` per group (in the ``zeros`` slot, same shape and dtype as ``scales``). It
is how GGUF stores Q4_1 / Q5_1 (``w = d * q + m``, fp16 ``d`` and ``m``) and, with float32 scales and
mins, the K-quants Q2_K / Q4_K / Q5_K (``w = d * sc * q - dmin * mn``): no zero point ``z = -m / s``
reproduces those values exactly, a stored min does (:mod:`aipc_kernels.checkpoints.gguf` re-lays GGUF blocks out onto it). The
kernels add ``m * (group sum of the activations)`` to the group's dot product.

``e0m4`` is Transformer-Lite's FP4 (Li et al.): a group is mapped by a scale and a bias into
[1, 2), where every value shares sign and exponent and the code is the top 4 fraction bits, so a code
dequantizes to the float ``as_float(0x3F800000 | c << 19) = 1 + c/16`` with two bit operations (bf16:
``0x3F80 | c << 3``) instead of an int-to-float conversion. The bias ``1 + z/16`` has its fraction bits
below the code's four at zero (the paper's rule, so a zero weight quantizes exactly), which is what an
integer ``z`` in [0, 15] stores: ``W = s * (c - z) = 16 s * (1 + c/16) - s * (16 + z)``. Its grid is
therefore ``affine4``'s with integer zero points, and every W*A8 kernel runs it as such; what differs
is the quantizer (:func:`aipc_kernels.lowbit.quantizers.quantize_rtn`: the paper's mapping, a step of range/16)
and the activation-exact W4A16 kernels (``aipc::lowbit_linear_a16``), whose E0M4 dequantization works
on the codes of every 4-bit code book.

``int8`` is the output projection's format (one group per row: per output channel). Every code book
runs on the same W·A8 kernels: the bits of a byte are its bit-planes (8 of 1 bit ... one of 8).

Device layouts (``aipc_kernels.lowbit.packing``) are derived from this one and never stored.

Whole-row groups and per-token activations have one representation below the configs. A group size
of ``-1`` ("one group per row") exists only in configs (``quantization_config.group_size``) and may
appear in file metadata; :func:`resolve_group_size` turns it into ``K`` (and
:meth:`LowBitWeight.from_state_dict` for metadata), and everything below holds ``K``:
:attr:`LowBitWeight.group_size`, the packed layouts, the op's ``group_size`` and the kernels (a
tuning-cache key may print it as ``row``). ``act_group`` is ``0`` (one int8 activation scale per
token) in configs and in the op; the operand plan
(:func:`aipc_kernels.lowbit.contract.operand_plan`, ``act_span``) is the one place that turns it
into ``K``, for the native kernel.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Optional

import torch

FORMAT_NAME = "lowbit2"
FORMAT_VERSION = 2  # the newest this code reads and writes (1 when a file has no two-level weight)
GROUP_SIZES = (32, 64, 128)  # or -1: one group per row
#: group sizes a weight may also have: GGUF's K-quants scale 16-element sub-blocks (codes of 2 bits and more)
FILE_GROUP_SIZES = (16,) + GROUP_SIZES
#: storage dtypes of scales (and zeros), by the name configs and checkpoints use
SCALE_DTYPES: dict[str, torch.dtype] = {"float16": torch.float16, "bfloat16": torch.bfloat16}
#: ... and what a weight may also hold: float32, for GGUF's K-quants (no 16-bit float holds d * sub-block
#: scale exactly; float32 does). The W*A8 kernels take all three; configs name only SCALE_DTYPES.
WEIGHT_SCALE_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class Codebook:
    """How codes map to values: ``cmul * c - zero`` (``zero`` None: stored per group; ``integer_zero``: the
    stored zero points are integers within the codes; ``mins``: plus a stored min per group, the min form)."""

    name: str
    bits: int
    cmul: float
    zero: Optional[float]
    max_code: int
    integer_zero: bool = False
    mins: bool = False

    @property
    def per_group_tensor(self) -> bool:
        """Whether a weight stores a second per-group tensor (``zeros``: zero points, or the mins)."""
        return self.zero is None or self.mins

    @property
    def levels(self) -> torch.Tensor:
        """The representable values (for zero-point code books: with z = 0)."""
        c = torch.arange(self.max_code + 1, dtype=torch.float32)
        return self.cmul * c - (self.zero or 0.0)

    def integer_form(self) -> tuple[int, int, float]:
        """``(CA, CB, FMUL)`` with ``cmul * c - zero == FMUL * (CA * c - CB)``, CA and CB small integers: the
        form in which integer kernels (the GPU's int8 operands, AMX's signed levels) hold the levels.
        Stored zero points: the raw codes (1, 0, cmul), the zero corrected in float32. ValueError when
        no scaling by 1, 2 or 4 makes the levels integers."""
        if self.zero is None:
            return 1, 0, float(self.cmul)
        for k in (1, 2, 4):
            a, b = self.cmul * k, self.zero * k
            if a == int(a) and b == int(b):
                return int(a), int(b), 1.0 / k
        raise ValueError(f"code book {self.name}: no small integer form of cmul * c - zero")


CODEBOOKS: dict[str, Codebook] = {
    cb.name: cb
    for cb in (
        Codebook("affine", 2, 1.0, None, 3),
        Codebook("int2", 2, 1.0, 2.0, 3),
        Codebook("sym", 2, 1.0, 1.5, 3),
        Codebook("ternary", 2, 1.0, 1.0, 2),
        Codebook("binary", 1, 2.0, 1.0, 1),
        Codebook("int4", 4, 1.0, 8.0, 15),
        Codebook("affine4", 4, 1.0, None, 15),
        Codebook("int5", 6, 1.0, 16.0, 31),
        Codebook("int6", 6, 1.0, 32.0, 63),
        Codebook("int8", 8, 1.0, 128.0, 255),
        Codebook("e0m4", 4, 1.0, None, 15, integer_zero=True),
        Codebook("min2", 2, 1.0, 0.0, 3, mins=True),
        Codebook("min4", 4, 1.0, 0.0, 15, mins=True),
        Codebook("min6", 6, 1.0, 0.0, 63, mins=True),
        Codebook("min8", 8, 1.0, 128.0, 255, mins=True),
    )
}


def get_codebook(name: str) -> Codebook:
    """Looks a code book up by name, with an error listing the known ones."""
    try:
        return CODEBOOKS[name]
    except KeyError:
        raise ValueError(f"codebook={name!r} is unknown; use one of {sorted(CODEBOOKS)}") from None


def resolve_group_size(group_size: int, in_features: int, sizes: tuple[int, ...] = GROUP_SIZES) -> int:
    """Validates ``group_size`` for a row of ``in_features`` and returns the effective size. ``sizes``: the
    groups accepted (:data:`GROUP_SIZES` for quantizing; :data:`FILE_GROUP_SIZES` for stored weights,
    which include GGUF's K-quant sub-blocks of 16)."""
    if group_size == -1:
        group_size = in_features
    elif group_size not in sizes:
        raise ValueError(f"group_size={group_size} is not supported; use one of {sizes} or -1 (whole row)")
    if in_features % group_size:
        raise ValueError(
            f"group_size={group_size} does not divide in_features K={in_features}; "
            f"pick a group size that divides K, or -1 for one group per row"
        )
    if in_features % 32:
        raise ValueError(f"in_features K={in_features} must be a multiple of 32 for low-bit packing")
    return group_size


def fitting_group_size(group_size: int, in_features: int) -> int:
    """``group_size`` when it divides ``in_features``, else the largest supported group below it that
    does (how on-the-fly quantization serves a layer whose K the configured group does not divide,
    e.g. K=576 with group 128 -> 64); -1 stays -1 (one group per row, the spelling the quantizers take).
    Raises as :func:`resolve_group_size` when no supported group fits."""
    if group_size != -1 and group_size in GROUP_SIZES and in_features % group_size:
        smaller = [g for g in GROUP_SIZES if g < group_size and in_features % g == 0]
        if smaller:
            return max(smaller)
        if in_features % 32:  # the reason no group fits
            raise ValueError(f"in_features K={in_features} must be a multiple of 32 for low-bit packing")
    resolve_group_size(group_size, in_features)  # the checks
    return group_size


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Packs codes ``[..., K]`` (uint8, < 2**bits) along K into ``[..., K*bits/8]`` bytes (6 bits: four
    codes in three bytes, a little-endian stream of 24 bits, code ``k % 4`` at bits ``6*(k % 4)``)."""
    if bits == 6:
        c = codes.to(torch.int32).unflatten(-1, (-1, 4))
        v = c[..., 0] | (c[..., 1] << 6) | (c[..., 2] << 12) | (c[..., 3] << 18)
        return torch.stack([v & 255, (v >> 8) & 255, v >> 16], -1).to(torch.uint8).flatten(-2)
    per_byte = 8 // bits
    shifts = torch.arange(per_byte, dtype=torch.uint8, device=codes.device) * bits
    grouped = codes.to(torch.uint8).unflatten(-1, (-1, per_byte))
    return (grouped << shifts).sum(-1, dtype=torch.uint8)


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: bytes ``[..., B]`` -> codes ``[..., B*8/bits]``."""
    if bits == 6:
        b = packed.to(torch.int32).unflatten(-1, (-1, 3))
        v = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)
        return torch.stack([(v >> (6 * i)) & 63 for i in range(4)], -1).to(torch.uint8).flatten(-2)
    per_byte = 8 // bits
    shifts = torch.arange(per_byte, dtype=torch.uint8, device=packed.device) * bits
    return ((packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).flatten(-2)


def grid_values(codes: torch.Tensor, zeros: Optional[torch.Tensor], codebook: str, group_size: int) -> torch.Tensor:
    """Per-element ``cmul * c - z`` in float32 of unpacked codes ``[..., K]`` (``zeros``: ``[..., K/G]``,
    read where the code book stores zero points)."""
    cb = get_codebook(codebook)
    v = cb.cmul * codes.float()
    if cb.zero is not None:
        return v - cb.zero
    return v - zeros.float().repeat_interleave(group_size, dim=-1)


def two_level_values(sub: torch.Tensor, supers: torch.Tensor, group_size: int, in_features: int) -> torch.Tensor:
    """Per-group float32 values ``[..., K/G]`` of the two-level form: ``supers`` ``[..., K/SB]`` (one
    super-block scale) times the int8 sub-block values ``sub`` ``[..., K/G]``, one float32 product each."""
    per_super = in_features // supers.shape[-1] // group_size
    return supers.float().repeat_interleave(per_super, dim=-1) * sub.float()


def dequantize_codes(codes: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor], codebook: str,
                     group_size: int, dtype: torch.dtype = torch.float32,
                     supers: Optional[torch.Tensor] = None) -> torch.Tensor:  # fmt: skip
    """The weight values of unpacked codes ``[..., K]`` with per-group ``scales`` / ``zeros`` ``[..., K/G]``,
    computed in float32 (float64 if asked): ``s * v``, plus ``m`` in the min form (each a float32 rounding,
    as ``gguf.quants.dequantize`` computes GGUF blocks). The one place of this arithmetic: its order
    decides the bits that :mod:`aipc_kernels.checkpoints.gguf` promises. ``supers`` ``[S, ..., K/SB]``: the
    two-level form (``scales`` and ``zeros`` int8), whose float32 products come first."""
    if supers is not None:
        K = codes.shape[-1]
        scales = two_level_values(scales, supers[0], group_size, K)
        zeros = two_level_values(zeros, supers[1], group_size, K) if zeros is not None else None
    work = torch.float64 if dtype == torch.float64 else torch.float32
    s = scales.to(work).repeat_interleave(group_size, dim=-1)
    w = s * grid_values(codes, zeros, codebook, group_size).to(work)
    if get_codebook(codebook).mins:
        w = zeros.to(work).repeat_interleave(group_size, dim=-1) + w  # NaN + NaN keeps gguf's (NumPy's) bits this way
    return w.to(dtype)


@dataclass
class LowBitWeight:
    """A quantized weight in the canonical format. ``zeros`` only for code books with stored zero points
    (affine) or mins (the min form)."""

    qweight: torch.Tensor  # uint8 [N, K*bits/8]
    scales: torch.Tensor  # fp16/bf16/fp32 [N, K/G]; int8 in the two-level form
    zeros: Optional[torch.Tensor]  # like scales: zero points (affine) or mins (min form); else None
    codebook: str
    group_size: int  # effective (K for whole-row)
    in_features: int
    name: str = field(default="weight", compare=False, repr=False)  # for error messages
    supers: Optional[torch.Tensor] = None  # two-level form: float32 [S, N, K/SB] super-block scales (S=2: mins)

    def __post_init__(self) -> None:
        self.validate(self.name)

    @property
    def cb(self) -> Codebook:
        return get_codebook(self.codebook)

    @property
    def bits(self) -> int:
        return self.cb.bits

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    def validate(self, name: str = "weight") -> None:
        """Checks shapes and dtypes; the error names the tensor and what was expected."""
        cb = get_codebook(self.codebook)
        N, K, G = self.qweight.shape[0], self.in_features, self.group_size
        if G == 16 and G != K and cb.bits == 1:  # GGUF's K-quant sub-blocks: 2-bit codes or wider
            raise ValueError(f"{name}: group_size=16 needs codes of 2 bits or more (got {cb.bits}-bit codebook "
                             f"{self.codebook!r})")  # fmt: skip
        if G != K:
            resolve_group_size(G, K, FILE_GROUP_SIZES)
        elif K % 32:
            raise ValueError(f"{name}: in_features K={K} must be a multiple of 32 for low-bit packing")
        expect = {
            f"{name}.qweight": ((N, K * cb.bits // 8), torch.uint8),
            f"{name}.scales": ((N, K // G), None),
        }
        if cb.per_group_tensor:
            if self.zeros is None:
                what = "mins (the min form)" if cb.mins else "zero points"
                raise ValueError(f"{name}.zeros is missing: codebook {self.codebook!r} needs per-group {what}")
            expect[f"{name}.zeros"] = ((N, K // G), self.scales.dtype)
        elif self.zeros is not None:
            raise ValueError(f"{name}.zeros given for codebook={self.codebook!r}, which has a fixed zero point")
        tensors = {f"{name}.qweight": self.qweight, f"{name}.scales": self.scales, f"{name}.zeros": self.zeros}
        for tname, (shape, dtype) in expect.items():
            t = tensors[tname]
            if tuple(t.shape) != shape:
                raise ValueError(f"{tname} has shape {tuple(t.shape)}, expected {shape} (N={N}, K={K}, group={G})")
            if dtype is not None and t.dtype != dtype:
                raise ValueError(f"{tname} has dtype {t.dtype}, expected {dtype}")
        if cb.integer_zero and self.zeros.numel():
            z = self.zeros.float()
            if not bool(((z == z.round()) & (z >= 0) & (z <= cb.max_code)).all()):
                raise ValueError(
                    f"{name}.zeros: codebook {self.codebook!r} stores integer zero points in [0, {cb.max_code}] (its "
                    f"bias 1 + z/16 has no fraction bits below the code's); found {z[(z != z.round()) | (z < 0) | (z > cb.max_code)][:3].tolist()}"
                )
        if self.supers is not None:
            self._validate_supers(name)
        elif self.scales.dtype not in WEIGHT_SCALE_DTYPES:
            raise ValueError(f"{name}.scales has dtype {self.scales.dtype}; use one of {WEIGHT_SCALE_DTYPES} (int8: "
                             f"the two-level form, with supers)")  # fmt: skip

    def _validate_supers(self, name: str) -> None:
        """The two-level form: int8 scales (and mins), float32 supers ``[S, N, K/SB]`` with S = 1 + mins
        and ``SB`` a power-of-two multiple of the group dividing K; no stored zero points."""
        cb, N, K, G, sup = self.cb, self.out_features, self.in_features, self.group_size, self.supers
        S = 2 if cb.mins else 1
        if cb.zero is None:
            raise ValueError(f"{name}.supers: codebook {self.codebook!r} stores zero points; the two-level form takes "
                             f"fixed-zero and min-form code books")  # fmt: skip
        if self.scales.dtype != torch.int8:
            raise ValueError(f"{name}.scales has dtype {self.scales.dtype}; with supers (two-level) they are int8")
        nsb = sup.shape[-1] if sup.dim() == 3 else 0
        sb = K // nsb if nsb and K % nsb == 0 else 0
        if sup.dtype != torch.float32 or tuple(sup.shape[:2]) != (S, N) or not sb or sb % G or (sb // G) & (sb // G - 1):
            raise ValueError(f"{name}.supers has shape {tuple(sup.shape)} and dtype {sup.dtype}: expected float32 "
                             f"[{S}, {N}, K/SB] with K={K} a multiple of SB and SB a power-of-two multiple of the "
                             f"group {G}")  # fmt: skip

    @property
    def super_block(self) -> Optional[int]:
        """Elements per super-block of the two-level form (None: single-level scales)."""
        return None if self.supers is None else self.in_features // self.supers.shape[-1]

    def group_scales(self) -> torch.Tensor:
        """Per-group scales ``[N, K/G]`` as floats (the two-level form's float32 products)."""
        if self.supers is None:
            return self.scales
        return two_level_values(self.scales, self.supers[0], self.group_size, self.in_features)

    def group_mins(self) -> Optional[torch.Tensor]:
        """The min form's per-group mins as floats, else None."""
        if not self.cb.mins:
            return None
        if self.supers is None:
            return self.zeros
        return two_level_values(self.zeros, self.supers[1], self.group_size, self.in_features)

    def single_level(self) -> "LowBitWeight":
        """The same values with one float32 scale (and min) per group: the two-level form's products stored
        (self when it has single-level scales already)."""
        if self.supers is None:
            return self
        return LowBitWeight(self.qweight, self.group_scales(), self.group_mins(), self.codebook, self.group_size,
                            self.in_features, name=self.name)  # fmt: skip

    def codes(self) -> torch.Tensor:
        """Unpacked codes ``[N, K]`` (uint8)."""
        return unpack_codes(self.qweight, self.bits)

    def values(self) -> torch.Tensor:
        """Per-element ``cmul * c - z`` in float32 (the integer grid before scaling)."""
        return grid_values(self.codes(), self.zeros, self.codebook, self.group_size)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight ``[N, K]`` the codes stand for (:func:`dequantize_codes`)."""
        return dequantize_codes(self.codes(), self.scales, self.zeros, self.codebook, self.group_size, dtype,
                                self.supers)  # fmt: skip

    def nbytes(self) -> int:
        """Bytes of codes, scales, zeros and super-block scales."""
        parts = (self.qweight, self.scales, self.zeros, self.supers)
        return sum(t.numel() * t.element_size() for t in parts if t is not None)

    # -------------------------------------------------------------- serialization

    def metadata(self) -> dict[str, str]:
        return {
            "format": FORMAT_NAME,
            "format_version": "1" if self.supers is None else "2",
            "codebook": self.codebook,
            "group_size": str(self.group_size),
            "in_features": str(self.in_features),
        }

    def state_dict(self, prefix: str) -> dict[str, torch.Tensor]:
        """Tensors under ``prefix.qweight``, ``prefix.scales`` (and ``prefix.zeros``, ``prefix.supers``)."""
        out = {f"{prefix}.qweight": self.qweight, f"{prefix}.scales": self.scales}
        if self.zeros is not None:
            out[f"{prefix}.zeros"] = self.zeros
        if self.supers is not None:
            out[f"{prefix}.supers"] = self.supers
        return out

    @classmethod
    def from_state_dict(
        cls, tensors: dict[str, torch.Tensor], prefix: str, codebook: str, group_size: int, in_features: int
    ) -> "LowBitWeight":
        """Rebuilds a weight from :meth:`state_dict` tensors, failing with the missing tensor's name."""
        for part in ("qweight", "scales") + (("zeros",) if get_codebook(codebook).per_group_tensor else ()):
            if f"{prefix}.{part}" not in tensors:
                raise ValueError(f"checkpoint is missing tensor {prefix}.{part}")
        G = in_features if group_size == -1 else group_size
        return cls(
            tensors[f"{prefix}.qweight"],
            tensors[f"{prefix}.scales"],
            tensors.get(f"{prefix}.zeros"),
            codebook,
            G,
            in_features,
            name=prefix,
            supers=tensors.get(f"{prefix}.supers"),
        )


def save_lowbit(path: str, weights: dict[str, LowBitWeight], extra: Optional[dict[str, torch.Tensor]] = None) -> None:
    """Writes weights (and plain tensors) to one safetensors file with the metadata to reload them."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = dict(extra or {})
    layers = {}
    for name, w in weights.items():
        tensors.update({k: v.contiguous() for k, v in w.state_dict(name).items()})
        layers[name] = w.metadata()
    # version 2: two-level weights (int8 scales with supers), which a version-1 reader would misread
    version = 2 if any(w.supers is not None for w in weights.values()) else 1
    meta = {"format": FORMAT_NAME, "format_version": str(version), "lowbit_layers": json.dumps(layers)}
    save_file(tensors, path, metadata=meta)


def load_lowbit(path: str) -> tuple[dict[str, LowBitWeight], dict[str, torch.Tensor]]:
    """Reads a file written by :func:`save_lowbit`: (low-bit weights, other tensors)."""
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        meta = f.metadata() or {}
        if meta.get("format") != FORMAT_NAME:
            raise ValueError(f"{path}: not a {FORMAT_NAME} file (metadata format={meta.get('format')!r})")
        version = int(meta.get("format_version", "0"))
        if version > FORMAT_VERSION:
            raise ValueError(f"{path}: format_version {version} is newer than this aipc-plugins ({FORMAT_VERSION}); upgrade")
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    layers = json.loads(meta["lowbit_layers"])
    weights = {}
    for name, m in layers.items():
        weights[name] = LowBitWeight.from_state_dict(
            tensors, name, m["codebook"], int(m["group_size"]), int(m["in_features"])
        )
        for part in ("qweight", "scales", "zeros", "supers"):
            tensors.pop(f"{name}.{part}", None)
    return weights, tensors
