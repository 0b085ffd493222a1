"""GGUF files (llama.cpp) read, and their tensors re-laid out exactly onto the canonical low-bit format.

A GGUF weight ``W[N, K]`` is stored row by row, each row a run of K-contiguous blocks; the reader
(``gguf.GGUFReader``, the maintained ``gguf`` package) gives a quantized tensor as uint8
``[N, row_bytes]``. :func:`relayout` decodes the blocks (numpy, vectorised) and repacks them into a
:class:`~aipc_kernels.lowbit.formats.LowBitWeight` whose :meth:`~aipc_kernels.lowbit.formats.LowBitWeight.dequantize`
is bit-identical to ``gguf.quants.dequantize`` (same float32 operations in the same order):

=======  ==================================  ========  =====  =========================================
type     GGUF value (fp16 d, m, dmin)        codebook  group  codes c, scales s, zeros
=======  ==================================  ========  =====  =========================================
Q8_0     d * q, q int8                       int8      32     c = q XOR 0x80, s = d
Q4_0     d * (q - 8), q 0..15                int4      32     c = q, s = d
Q4_1     d * q + m, q 0..15                  min4      32     c = q, s = d, zeros = m
Q5_0     d * (q - 16), q 0..31               int5      32     c = q, s = d
Q5_1     d * q + m, q 0..31                  min6      32     c = q, s = d, zeros = m
TQ2_0    d * (q - 1), q 0..2, d per 256      ternary   128    c = q, s = d (each d in its two groups)
TQ1_0    as TQ2_0, base-3 packed             ternary   128    c = q, s = d (each d in its two groups)
Q2_K     (d*sc) * q - (dmin*mn), q 0..3,     min2      16     c = q, s = d x sc, zeros = -dmin x mn
         sc, mn 4-bit per 16
Q3_K     (d*(sc - 32)) * (q - 4), q 0..7,    int4      16     c = q + 4, s = d x (sc - 32)
         sc 6-bit per 16, q's bit 2 hmask
Q4_K     (d*sc) * q - (dmin*mn), q 0..15,    min4      32     c = q, s = d x sc, zeros = -dmin x mn
         sc, mn 6-bit per 32
Q5_K     as Q4_K, q 0..31                    min6      32     c = q, s = d x sc, zeros = -dmin x mn
Q6_K     (d*sc) * (q - 32), q 0..63,         int6      16     c = q, s = d x sc
         sc int8 per 16
=======  ==================================  ========  =====  =========================================

The first seven keep the file's fp16 ``d`` (and ``m``) as fp16 scales (and mins). The K-quants (256-element
super-blocks of 16 or 8 sub-blocks) keep the file's two levels (``d x sc``: the two-level form of
:mod:`aipc_kernels.lowbit.formats`): int8 sub-block scales ``sc`` (and mins ``mn``) and the super-block's
``float32(d)`` (and ``-float32(dmin)``) in ``supers``, so a row reads 4.75 bits a weight for Q4_K, not
the 6 of float32 scales and mins per 32. The group's scale is then the float32 product ``d * sc``, gguf's
own first multiplication (exact: an fp16 times a small integer fits float32), and the remaining
``s * (c - z)`` gguf's second. gguf's ``x - dm`` (``dm = dmin * mn``) becomes the min ``(-dmin) * mn``,
computed ``((-dmin) * mn) + x``: the same IEEE result for every non-NaN operand (signed zeros included,
as ``(-dmin) * mn`` is ``-dm`` exactly; the sign sits on the float, which has a negative zero). NaNs (a
corrupt file) keep gguf's bit patterns too: a NaN ``dmin`` is stored unflipped and passes on through the
product, as through gguf's subtraction, and where both operands are NaN, torch's CPU add passes its
second operand's on (``x``'s), as NumPy's subtraction its first.
:meth:`~aipc_kernels.lowbit.formats.LowBitWeight.single_level` gives the same values with float32 scales.

F32 / F16 / BF16 tensors come back as float tensors in the file's dtype. Every other type (IQ*, Q8_K,
MXFP4, ...) is refused naming the tensor and its type. :class:`GGUFCheckpoint`
opens a file (refusing non-GGUF, unsupported versions, truncated files and split GGUFs with errors
that name the file and the fix) and loads its tensors one at a time from the reader's memory map; it
never writes anything. :func:`llama_unpermute` and :func:`permute_rows` undo the row order that
llama.cpp's converter gives the q / k projections of llama-family models.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Optional, Union

import gguf
import numpy as np
import torch

from aipc_kernels.lowbit.formats import LowBitWeight, get_codebook, pack_codes

T = gguf.GGMLQuantizationType
FLOAT_TYPES: frozenset[T] = frozenset({T.F32, T.F16, T.BF16})
#: GGML type -> (code book, group size) of its re-layout
LOWBIT_TYPES: dict[T, tuple[str, int]] = {
    T.Q8_0: ("int8", 32),
    T.Q4_0: ("int4", 32),
    T.Q4_1: ("min4", 32),
    T.Q5_0: ("int5", 32),
    T.Q5_1: ("min6", 32),
    T.TQ2_0: ("ternary", 128),
    T.TQ1_0: ("ternary", 128),
    T.Q2_K: ("min2", 16),
    T.Q3_K: ("int4", 16),
    T.Q4_K: ("min4", 32),
    T.Q5_K: ("min6", 32),
    T.Q6_K: ("int6", 16),
}
SUPPORTED_TYPES: frozenset[T] = frozenset(LOWBIT_TYPES) | FLOAT_TYPES
#: the K-quants re-laid out: 256-element super-blocks, whose weights get float32 scales (and mins)
#: ``float32(d) * sub-block scale`` (Q8_K, llama.cpp's activation type, is no weight type: refused)
K_QUANTS: frozenset[T] = frozenset({T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K})
_FLOAT_NP = {T.F32: np.float32, T.F16: np.float16, T.BF16: np.int16}
#: llama.cpp's shard names: ``<prefix>-00001-of-00003.gguf``
_SPLIT_NAME = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)
_MERGE_HINT = "merge the shards into one file with llama.cpp's `llama-gguf-split --merge FIRST-SHARD.gguf OUT.gguf`"
#: the first transformers whose GGUF tokenizer conversion keeps a SentencePiece vocabulary without merges
#: (``tokenizer.ggml.model`` "llama": Gemma, Llama 2, Mistral v0.1) as the model's own: 5.16 / 5.17 split
#: Gemma-3-270M's text (Python's pydoc topics) into 2.29 characters a token, 5.18 - 5.25 into 4.12 as
#: llama.cpp does (GPT-2-style BPE vocabularies, e.g. SmolLM2's: the same 4.09 on every one of them)
SPM_TOKENIZER_TRANSFORMERS = (5, 18)


def _type_names(types) -> str:
    return ", ".join(t.name for t in sorted(types, key=int))


def _ggml_type(ggml_type: Union[int, T], name: str) -> T:
    try:
        return T(int(ggml_type))
    except ValueError:
        raise ValueError(f"GGUF tensor {name!r}: ggml_type={ggml_type} is no GGML type known to gguf "
                         f"{_gguf_version()}; supported are {_type_names(SUPPORTED_TYPES)}") from None  # fmt: skip


def _gguf_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gguf")
    except PackageNotFoundError:  # pragma: no cover - a source checkout
        return "(unknown version)"


def unsupported_type_error(name: str, qtype: T) -> ValueError:
    """The refusal of a tensor whose GGML type has no exact re-layout (yet)."""
    return ValueError(
        f"GGUF tensor {name!r} has type {qtype.name}, which aipc-plugins does not yet support; supported "
        f"types are {_type_names(SUPPORTED_TYPES)}: re-quantize the model to one of them with llama.cpp's "
        f"`llama-quantize` (e.g. Q4_K_M, Q5_K_M, Q6_K, Q8_0 or Q4_0), or serve this file with llama.cpp"
    )


def _bytes(raw: Union[np.ndarray, torch.Tensor]) -> np.ndarray:
    """The raw tensor as one flat uint8 array (no copy when it is contiguous, e.g. the reader's memmap)."""
    if isinstance(raw, torch.Tensor):
        t = raw.detach().cpu().contiguous()
        raw = (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()
    return np.ascontiguousarray(raw).reshape(-1).view(np.uint8)


def _float_tensor(raw, qtype: T, shape: tuple[int, ...], name: str) -> torch.Tensor:
    data = _bytes(raw)
    itemsize = np.dtype(_FLOAT_NP[qtype]).itemsize
    numel = int(np.prod(shape, dtype=np.int64))
    if data.size != numel * itemsize:
        raise ValueError(f"GGUF tensor {name!r} ({qtype.name}, shape {tuple(shape)}) needs {numel * itemsize} bytes, "
                         f"got {data.size}; pass the reader's tensor data unchanged")  # fmt: skip
    out = torch.from_numpy(data.view(_FLOAT_NP[qtype]).copy()).reshape(tuple(shape))
    return out.view(torch.bfloat16) if qtype == T.BF16 else out


def _blocks(raw, qtype: T, shape: tuple[int, ...], name: str) -> np.ndarray:
    """The blocks of a 2-D quantized tensor as uint8 ``[N, K/block, type_size]`` (a view when possible)."""
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    if len(shape) != 2:
        raise ValueError(f"GGUF tensor {name!r} ({qtype.name}) has shape {tuple(shape)}: only 2-D quantized "
                         f"tensors [out_features, in_features] are re-laid out (3-D expert tensors are not yet "
                         f"supported)")  # fmt: skip
    N, K = (int(x) for x in shape)
    if K % block:
        raise ValueError(f"GGUF tensor {name!r} ({qtype.name}): in_features K={K} is not a multiple of the "
                         f"block size {block}; the file is corrupt")  # fmt: skip
    data = _bytes(raw)
    if data.size != N * (K // block) * type_size:
        raise ValueError(f"GGUF tensor {name!r} ({qtype.name}, shape {(N, K)}) needs {N * (K // block) * type_size} "
                         f"bytes, got {data.size}; pass the reader's tensor data (uint8 [N, row_bytes]) "
                         f"unchanged")  # fmt: skip
    return data.reshape(N, K // block, type_size)


def _f16(blocks: np.ndarray, at: int) -> torch.Tensor:
    """The fp16 field at byte ``at`` of every block: ``[N, K/block]``."""
    return torch.from_numpy(np.ascontiguousarray(blocks[..., at:at + 2]).view(np.float16)[..., 0])


def _f32(blocks: np.ndarray, at: int) -> np.ndarray:
    """The fp16 field at byte ``at`` of every block as float32 ``[N, K/block, 1]``, converted as gguf does."""
    return np.ascontiguousarray(blocks[..., at:at + 2]).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """GGUF's 4-bit layout: byte i of a 32-block holds element i (low) and i + 16 (high)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """Q5's fifth bits: bit j of the little-endian uint32 belongs to element j, as 0 or 16."""
    return np.unpackbits(qh, axis=-1, bitorder="little") << 4


def _weight(codes: np.ndarray, scales, zeros, qtype: T, name: str, groups_per_scale: int = 1,
            supers: Optional[list[np.ndarray]] = None) -> LowBitWeight:  # fmt: skip
    """Codes ``[N, K/block, block]`` and per-block fp16 fields (a torch tensor ``[N, K/block]``), or the
    K-quants' int8 sub-block scales and mins (numpy ``[N, K/block, block/group]``) with their super-block
    float32 ``d`` (and ``dmin``) ``[N, K/block, 1]`` in ``supers`` -> the :class:`LowBitWeight`."""
    codebook, group = LOWBIT_TYPES[qtype]
    N = codes.shape[0]
    codes_t = torch.from_numpy(np.ascontiguousarray(codes).reshape(N, -1))
    bits = get_codebook(codebook).bits
    qweight = codes_t if bits == 8 else pack_codes(codes_t, bits)  # 5- and 6-bit codes: 6 bits a code

    def per_group(t):
        if t is None:
            return None
        t = torch.from_numpy(np.ascontiguousarray(t)) if isinstance(t, np.ndarray) else t
        t = t.reshape(N, -1)
        return (t.repeat_interleave(groups_per_scale, dim=1) if groups_per_scale > 1 else t).contiguous()

    sup = None if supers is None else torch.from_numpy(np.stack([np.ascontiguousarray(d)[..., 0] for d in supers]))
    return LowBitWeight(qweight, per_group(scales), per_group(zeros), codebook, group, codes_t.shape[1], name=name,
                        supers=sup)  # fmt: skip


def _q8_0(b, name):
    return _weight(b[..., 2:] ^ np.uint8(0x80), _f16(b, 0), None, T.Q8_0, name)


def _q4_0(b, name):
    return _weight(_nibbles(b[..., 2:]), _f16(b, 0), None, T.Q4_0, name)


def _q4_1(b, name):
    return _weight(_nibbles(b[..., 4:]), _f16(b, 0), _f16(b, 2), T.Q4_1, name)


def _q5_0(b, name):
    q = _nibbles(b[..., 6:]) | _high_bits(b[..., 2:6])
    return _weight(q, _f16(b, 0), None, T.Q5_0, name)


def _q5_1(b, name):
    q = _nibbles(b[..., 8:]) | _high_bits(b[..., 4:8])
    return _weight(q, _f16(b, 0), _f16(b, 2), T.Q5_1, name)


def _tq2_0(b, name):
    # 64 bytes = 2 halves of 32; element 128*h + 32*j + i at bits 2j of byte 32*h + i; then fp16 d
    qs = b[..., :64].reshape(*b.shape[:2], 2, 1, 32)
    q = (qs >> (2 * np.arange(4, dtype=np.uint8)).reshape(4, 1)) & np.uint8(3)
    if (q == 3).any():
        raise ValueError(f"GGUF tensor {name!r} (TQ2_0) holds the 2-bit code 3, which is no ternary value "
                         f"(llama.cpp never writes it); the file is corrupt: fetch it again")  # fmt: skip
    return _weight(q, _f16(b, 64), None, T.TQ2_0, name, groups_per_scale=2)


_POW3 = np.array([1, 3, 9, 27, 81], dtype=np.uint8)


def _tq1_0(b, name):
    # base-3 digits: byte * 3**j (mod 256) keeps digit j at the top, read as (x * 3) >> 8. 32 bytes hold
    # elements 32*j + i, the next 16 hold 160 + 16*j + i, the 4 qh bytes 240 + 4*j + i (j < 4); then fp16 d
    lead = b.shape[:2]
    parts = [
        b[..., :32].reshape(*lead, 1, 32) * _POW3.reshape(5, 1),
        b[..., 32:48].reshape(*lead, 1, 16) * _POW3.reshape(5, 1),
        b[..., 48:52].reshape(*lead, 1, 4) * _POW3[:4].reshape(4, 1),
    ]
    x = np.concatenate([p.reshape(*lead, -1) for p in parts], axis=-1)
    q = ((x.astype(np.uint16) * 3) >> 8).astype(np.uint8)
    return _weight(q, _f16(b, 52), None, T.TQ1_0, name, groups_per_scale=2)


# ---------------------------------------------------------------- K-quants (256-element super-blocks)
#
# Each decoder takes the blocks ``[N, nb, type_size]`` and returns codes ``[N, nb, 256]`` in element order
# with float32 scales (and mins) ``[N, nb, 256/group]``. Element ``e`` of a super-block: where gguf's
# reshapes put it, spelled out below with ``e = 128*h + 32*j + i`` (h < 2, j < 4, i < 32) for the
# 2-bit fields and ``e = 64*j + 32*t + i`` (j < 4, t < 2) for the nibbles.

_SHIFT2 = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)
_SHIFT4 = np.array([0, 4], dtype=np.uint8).reshape(2, 1)
_BITS8 = np.arange(8, dtype=np.uint8).reshape(8, 1)


def _crumbs(qs: np.ndarray) -> np.ndarray:
    """2-bit fields of 64 bytes: element 128*h + 32*j + i at bits 2j of byte 32*h + i."""
    return ((qs.reshape(*qs.shape[:-1], 2, 1, 32) >> _SHIFT2) & np.uint8(3)).reshape(*qs.shape[:-1], 256)


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """4-bit fields of 128 bytes: element 64*j + 32*t + i at bits 4t of byte 32*j + i."""
    return ((qs.reshape(*qs.shape[:-1], 4, 1, 32) >> _SHIFT4) & np.uint8(0x0F)).reshape(*qs.shape[:-1], 256)


def _bitplanes(qh: np.ndarray) -> np.ndarray:
    """1-bit fields of 32 bytes: element 32*j + i at bit j of byte i."""
    return ((qh.reshape(*qh.shape[:-1], 1, 32) >> _BITS8) & np.uint8(1)).reshape(*qh.shape[:-1], 256)


def _scale_min_k4(sm: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 bytes -> the 8 sub-blocks' 6-bit scales and mins (llama.cpp's ``get_scale_min_k4``):
    bytes 0-3 hold scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7, bytes 4-7 the same for the
    mins, bytes 8-11 the low 4 bits of scales 4-7 (low nibble) and of mins 4-7 (high nibble)."""
    d, m, md = sm[..., 0:4], sm[..., 4:8], sm[..., 8:12]
    sc = np.concatenate([d & np.uint8(0x3F), (md & np.uint8(0x0F)) | ((d >> 2) & np.uint8(0x30))], axis=-1)
    mn = np.concatenate([m & np.uint8(0x3F), (md >> 4) | ((m >> 2) & np.uint8(0x30))], axis=-1)
    return sc, mn


def _min_super(dmin: np.ndarray) -> np.ndarray:
    """The super-block scale of the mins of gguf's ``x - dmin * mn``: ``-dmin`` (a sign flip, so that
    ``(-dmin) * mn`` is ``-(dmin * mn)`` bit for bit, signed zeros included), except a NaN ``dmin``, kept
    as it is: the NaN that gguf's subtraction passes on is ``dmin``'s own, sign included."""
    return np.where(np.isnan(dmin), dmin, -dmin)


def _q2_k(b, name):
    # 16 bytes scales (low nibble sc, high nibble mn, per 16), 64 bytes 2-bit q, fp16 d, fp16 dmin
    sm = b[..., :16]
    sc, mn = (sm & np.uint8(0x0F)).astype(np.int8), sm >> 4
    return _weight(_crumbs(b[..., 16:80]), sc, mn.astype(np.int8), T.Q2_K, name,
                   supers=[_f32(b, 80), _min_super(_f32(b, 82))])  # fmt: skip


def _q3_k(b, name):
    # 32 bytes hmask (bit 1: + 4), 64 bytes low 2 bits, 12 bytes 6-bit scales (biased by 32), fp16 d
    # scales: byte j < 8 holds the low 4 bits of sub-blocks j (low nibble) and j + 8 (high nibble);
    # byte 8 + j the top 2 bits of sub-blocks j, j + 4, j + 8, j + 12 (bits 0, 2, 4, 6)
    sm = b[..., 96:108]
    low = (sm[..., :8].reshape(*sm.shape[:-1], 1, 8) >> _SHIFT4) & np.uint8(0x0F)
    high = (sm[..., 8:].reshape(*sm.shape[:-1], 1, 4) >> _SHIFT2) & np.uint8(0x03)
    sc = low.reshape(*sm.shape[:-1], 16) | (high.reshape(*sm.shape[:-1], 16) << np.uint8(4))
    q = _crumbs(b[..., 32:96]) | (_bitplanes(b[..., :32]) << np.uint8(2))  # gguf's q - 4 = c - 8
    return _weight(q + np.uint8(4), sc.astype(np.int8) - np.int8(32), None, T.Q3_K, name, supers=[_f32(b, 108)])


def _q4_k(b, name):
    # fp16 d, fp16 dmin, 12 bytes 6-bit scales and mins, 128 bytes nibbles
    sc, mn = _scale_min_k4(b[..., 4:16])
    return _weight(_k_nibbles(b[..., 16:144]), sc.astype(np.int8), mn.astype(np.int8), T.Q4_K, name,
                   supers=[_f32(b, 0), _min_super(_f32(b, 2))])  # fmt: skip


def _q5_k(b, name):
    # as Q4_K, with 32 bytes of fifth bits (bitplanes) before the 128 bytes of nibbles
    sc, mn = _scale_min_k4(b[..., 4:16])
    q = _k_nibbles(b[..., 48:176]) | (_bitplanes(b[..., 16:48]) << np.uint8(4))
    return _weight(q, sc.astype(np.int8), mn.astype(np.int8), T.Q5_K, name,
                   supers=[_f32(b, 0), _min_super(_f32(b, 2))])  # fmt: skip


def _q6_k(b, name):
    # 128 bytes low nibbles, 64 bytes high 2 bits, 16 int8 scales (per 16), fp16 d.
    # Element e = 128*h + 64*u + 32*v + i (u, v < 2): low nibble at bits 4u of byte 64*h + 32*v + i,
    # high bits at bits 2*(2u + v) of byte 32*h + i.
    lead = b.shape[:-1]
    ql = (b[..., :128].reshape(*lead, 2, 1, 64) >> _SHIFT4) & np.uint8(0x0F)
    qh = (b[..., 128:192].reshape(*lead, 2, 1, 32) >> _SHIFT2) & np.uint8(0x03)
    q = ql.reshape(*lead, 256) | (qh.reshape(*lead, 256) << np.uint8(4))
    return _weight(q, b[..., 192:208].view(np.int8), None, T.Q6_K, name, supers=[_f32(b, 208)])


_DECODERS = {T.Q8_0: _q8_0, T.Q4_0: _q4_0, T.Q4_1: _q4_1, T.Q5_0: _q5_0, T.Q5_1: _q5_1, T.TQ2_0: _tq2_0,
             T.TQ1_0: _tq1_0, T.Q2_K: _q2_k, T.Q3_K: _q3_k, T.Q4_K: _q4_k, T.Q5_K: _q5_k, T.Q6_K: _q6_k}  # fmt: skip


def relayout(raw: Union[np.ndarray, torch.Tensor], ggml_type: int, shape: tuple[int, ...],
             name: str) -> Union[LowBitWeight, torch.Tensor]:  # fmt: skip
    """One GGUF tensor -> a :class:`LowBitWeight` (``name=name``) whose dequantization is bit-identical to
    ``gguf.quants.dequantize(raw, ggml_type)``, or for F32 / F16 / BF16 a float tensor of ``shape`` in
    that dtype. ``raw`` is the tensor as ``GGUFReader`` gives it (uint8 ``[N, row_bytes]`` for quantized
    types), ``shape`` the logical ``(N, K)``; other types raise a ValueError naming ``name``."""
    qtype = _ggml_type(ggml_type, name)
    shape = tuple(int(x) for x in shape)
    if qtype in FLOAT_TYPES:
        return _float_tensor(raw, qtype, shape, name)
    if qtype not in _DECODERS:
        raise unsupported_type_error(name, qtype)
    return _DECODERS[qtype](_blocks(raw, qtype, shape, name), name)


def permute_rows(w: Union[LowBitWeight, torch.Tensor], perm: torch.Tensor) -> Union[LowBitWeight, torch.Tensor]:
    """``w`` with its output rows in the order ``perm`` (row ``i`` of the result is row ``perm[i]``):
    codes, scales and zeros move together, so the values are exactly those of ``w.dequantize()[perm]``."""
    n = w.out_features if isinstance(w, LowBitWeight) else w.shape[0]
    name = w.name if isinstance(w, LowBitWeight) else "tensor"
    perm = torch.as_tensor(perm)
    if perm.dim() != 1 or perm.dtype.is_floating_point or perm.numel() != n or not torch.equal(
        perm.sort().values.long(), torch.arange(n)
    ):
        raise ValueError(f"{name}: perm must be a 1-D integer permutation of its {n} rows, got {perm.dtype} "
                         f"{tuple(perm.shape)}; build it with llama_unpermute(n_rows, n_head)")  # fmt: skip
    perm = perm.long()
    if not isinstance(w, LowBitWeight):
        return w[perm]
    zeros = None if w.zeros is None else w.zeros[perm]
    supers = None if w.supers is None else w.supers[:, perm]
    return LowBitWeight(w.qweight[perm], w.scales[perm], zeros, w.codebook, w.group_size, w.in_features, name=w.name,
                        supers=supers)  # fmt: skip


def as_min8(w: LowBitWeight, group_size: int) -> LowBitWeight:
    """``w`` (a fixed-zero or min-form code book, e.g. any re-laid-out GGUF type) as ``min8`` with groups
    of ``group_size`` (dividing ``w``'s) and float32 scales and mins, exactly: the one form that holds
    every GGUF type, so that tensors of different types can be one merged layer (Q4_K_M's Q4_K q / k
    with a Q6_K v). Codes ``c`` become ``c - z + 128``; a group's scale and min repeat over its parts.
    A two-level weight stays two-level (int8 scales and mins, a zero min's super-block scale 0).
    Costs 8-bit codes: use it only where the types differ."""
    cb = w.cb
    if cb.zero is None or cb.cmul != 1.0:
        raise ValueError(f"{w.name}: codebook {w.codebook!r} has no exact min8 form (stored zero points or a level "
                         f"multiplier); as_min8 takes fixed-zero and min-form code books")  # fmt: skip
    if w.group_size % group_size:
        raise ValueError(f"{w.name}: group_size={group_size} must divide the weight's group {w.group_size}")
    codes = w.codes().to(torch.int16) - int(cb.zero) + 128
    rep = w.group_size // group_size
    if w.supers is not None:
        mins = w.zeros if cb.mins else torch.zeros_like(w.scales)
        supers = w.supers if cb.mins else torch.cat([w.supers, torch.zeros_like(w.supers)])
        return LowBitWeight(codes.to(torch.uint8), w.scales.repeat_interleave(rep, dim=1),
                            mins.repeat_interleave(rep, dim=1), "min8", group_size, w.in_features, name=w.name,
                            supers=supers)  # fmt: skip
    scales = w.scales.to(torch.float32).repeat_interleave(rep, dim=1)
    mins = (w.zeros.to(torch.float32) if cb.mins else torch.zeros_like(w.scales, dtype=torch.float32))
    return LowBitWeight(codes.to(torch.uint8), scales, mins.repeat_interleave(rep, dim=1).contiguous(), "min8",
                        group_size, w.in_features, name=w.name)  # fmt: skip


def as_int8(w: LowBitWeight) -> LowBitWeight:
    """``w`` (a fixed-zero code book with levels ``c - z``, e.g. Q5_0's ``int5`` or Q4_0's ``int4``) as ``int8``
    with codes ``c - z + 128``, scales (and super-block scales) as they are: the same values exactly."""
    cb = w.cb
    if cb.zero is None or cb.mins or cb.cmul != 1.0:
        raise ValueError(f"{w.name}: codebook {w.codebook!r} has no exact int8 form (stored zero points, mins or a "
                         f"level multiplier); use as_min8")  # fmt: skip
    codes = (w.codes().to(torch.int16) - int(cb.zero) + 128).to(torch.uint8)
    return LowBitWeight(codes, w.scales, None, "int8", w.group_size, w.in_features, name=w.name, supers=w.supers)


def common_form(ws: list[LowBitWeight]) -> list[LowBitWeight]:
    """The re-laid-out tensors of one merged layer (vLLM's q / k / v or gate / up) in one stored form,
    exactly: fixed-zero code books of one group become ``int8`` (:func:`as_int8`), other mixes of code books
    or groups ``min8`` with groups of their gcd (:func:`as_min8`),
    scales (and mins) of different dtypes float32 (e.g. Q4_1's fp16 with Q4_K's float32). Two-level
    weights stay two-level where all are, with one super-block size; else they become single-level."""
    import math

    if any(w.supers is not None for w in ws) and len({w.super_block for w in ws}) > 1:
        ws = [w.single_level() for w in ws]
    if len({(w.codebook, w.group_size) for w in ws}) > 1:
        if len({w.group_size for w in ws}) == 1 and all(w.cb.zero is not None and not w.cb.mins for w in ws):
            ws = [as_int8(w) for w in ws]  # one group, fixed zeros (a Q5_0 q / k with a Q8_0 v): int8, no mins
        else:
            group = math.gcd(*(w.group_size for w in ws))
            ws = [as_min8(w, group) for w in ws]
    if len({w.scales.dtype for w in ws}) > 1:
        ws = [LowBitWeight(w.qweight, w.scales.float(), None if w.zeros is None else w.zeros.float(), w.codebook,
                           w.group_size, w.in_features, name=w.name) for w in ws]  # fmt: skip
    return ws


def form_runs(ws: list[LowBitWeight]) -> list[list[int]]:
    """The indices of ``ws`` (one merged layer's re-laid-out parts, in row order) in runs of consecutive parts
    of one stored form (code book and group size): each run stacks with :func:`cat_rows` without widening a
    code (Q4_K_M's Q4_K q / k: one run, its Q6_K v: another), where :func:`common_form` makes every part of a
    mixed layer ``min8`` or ``int8``."""
    runs: list[list[int]] = []
    for i, w in enumerate(ws):
        if runs and (ws[runs[-1][0]].codebook, ws[runs[-1][0]].group_size) == (w.codebook, w.group_size):
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


def stack_runs(ws: list[LowBitWeight], name: str = "weight") -> list[tuple[list[int], LowBitWeight]]:
    """``ws`` (one merged layer's parts, in row order) stacked per :func:`form_runs` run with :func:`cat_rows`:
    each run's part indices and its weight, named ``name`` where all parts make one run, else ``name[j]`` (a run
    of one part is that part, with its own name)."""
    runs = form_runs(ws)
    return [(run, cat_rows([ws[i] for i in run], name if len(runs) == 1 else f"{name}[{j}]"))
            for j, run in enumerate(runs)]  # fmt: skip


def cat_rows(ws: list[LowBitWeight], name: str = "weight") -> LowBitWeight:
    """Weights of one merged layer (vLLM's q / k / v or gate / up shards) stacked along N, in their common
    stored form (:func:`common_form`: scales of different dtypes, e.g. a Q4_1 part's fp16 and a Q4_K part's
    float32, held in float32, exactly)."""
    if len(ws) == 1:
        return ws[0]
    ws = common_form(ws)
    zeros = None if ws[0].zeros is None else torch.cat([w.zeros for w in ws])
    supers = None if ws[0].supers is None else torch.cat([w.supers for w in ws], dim=1)
    return LowBitWeight(torch.cat([w.qweight for w in ws]), torch.cat([w.scales for w in ws]), zeros,
                        ws[0].codebook, ws[0].group_size, ws[0].in_features, name=name, supers=supers)  # fmt: skip


def llama_unpermute(n_rows: int, n_head: int) -> torch.LongTensor:
    """The row order that undoes llama.cpp's ``convert_hf_to_gguf`` ``LlamaModel.permute`` of a q (``n_head``
    heads) or k (``n_head_kv`` heads) projection with ``n_rows`` output rows: GGUF stores each head's rows
    interleaved (pairs ``i, i + d/2`` adjacent); ``w_hf = w_gguf[llama_unpermute(...)]`` is HF's rotate-half
    order. Use it with :func:`permute_rows` (on weights and biases)."""
    if n_head <= 0 or n_rows <= 0 or n_rows % (2 * n_head):
        raise ValueError(f"llama_unpermute: n_rows={n_rows} must be a positive multiple of 2 * n_head "
                         f"(n_head={n_head}); pass the head count of this projection (n_head_kv for k)")  # fmt: skip
    half = n_rows // n_head // 2
    return torch.arange(n_rows).reshape(n_head, half, 2).transpose(1, 2).reshape(-1)


class _Truncated(Exception):
    def __init__(self, what: str, end: int, size: int):
        super().__init__(what, end, size)
        self.what, self.end, self.size = what, end, size


class _BoundedReader(gguf.GGUFReader):
    """``GGUFReader`` whose reads past the end of the file raise :class:`_Truncated` (the reader's
    own symptom is a numpy reshape error)."""

    def _get(self, offset, dtype, count=1, *args, **kwargs):
        end = int(offset) + np.dtype(dtype).itemsize * int(count)
        if end > len(self.data):
            what = "tensor data" if hasattr(self, "data_offset") else "header (metadata / tensor list)"
            raise _Truncated(what, end, len(self.data))
        return super()._get(offset, dtype, count, *args, **kwargs)


def _truncated(path: Path, what: str, end: int, size: int) -> ValueError:
    return ValueError(f"GGUF file {str(path)!r} is truncated: its {what} needs {end} bytes but the file has "
                      f"{size}; the download or copy was cut short: fetch the file again")  # fmt: skip


class GGUFCheckpoint:
    """One GGUF file, open for reading: metadata, tensor list, and tensors re-laid out one at a time
    (:meth:`load`). Open it with :meth:`open`."""

    def __init__(self, path: Path, reader: gguf.GGUFReader):
        self.path = path
        self._reader = reader
        self._tensors = {t.name: t for t in reader.tensors}
        arch = self.field("general.architecture")
        if not isinstance(arch, str) or not arch:
            raise ValueError(f"GGUF file {str(path)!r} has no general.architecture; it is no model file "
                             f"(a LoRA adapter or a vocabulary?)")  # fmt: skip
        self.architecture: str = arch

    @classmethod
    def open(cls, path: Union[str, Path]) -> "GGUFCheckpoint":
        """Opens ``path`` (memory-mapped, read-only), refusing with a ValueError that names the file: not
        a file, no GGUF magic, an unsupported version or byte order, a truncated file, a split GGUF."""
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"GGUF file {str(p)!r} does not exist or is not a file; pass the path of a .gguf file")
        split = _SPLIT_NAME.search(p.name)
        if split and int(split.group(2)) > 1:
            raise ValueError(f"GGUF file {str(p)!r} is shard {int(split.group(1))} of a split GGUF of "
                             f"{int(split.group(2))} files; {_MERGE_HINT} and open that")  # fmt: skip
        with open(p, "rb") as f:
            head = f.read(8)
        if head[:4] != b"GGUF":
            raise ValueError(f"{str(p)!r} is not a GGUF file (it starts with {head[:4]!r}, not b'GGUF'); pass a "
                             f"llama.cpp .gguf model, or use the loader of its own format")  # fmt: skip
        size = p.stat().st_size
        if len(head) < 8:
            raise _truncated(p, "header (metadata / tensor list)", 8, size)
        version = int.from_bytes(head[4:8], "little")
        if version & 0xFFFF == 0:
            raise ValueError(f"GGUF file {str(p)!r} is big-endian (version {int.from_bytes(head[4:8], 'big')}); "
                             f"aipc-plugins reads little-endian GGUF: convert it with llama.cpp")  # fmt: skip
        supported = list(gguf.READER_SUPPORTED_VERSIONS)
        if version not in supported:
            raise ValueError(f"GGUF file {str(p)!r} has version {version}; this gguf package "
                             f"({_gguf_version()}) reads versions {supported}: re-convert the model with a "
                             f"current llama.cpp, or upgrade the gguf package")  # fmt: skip
        try:
            reader = _BoundedReader(str(p))
        except _Truncated as e:
            raise _truncated(p, e.what, e.end, e.size) from None
        except Exception as e:  # the reader's own errors (corrupt metadata, duplicate tensors, ...)
            raise ValueError(f"GGUF file {str(p)!r} cannot be read ({type(e).__name__}: {e}); the file is "
                             f"corrupt: fetch it again") from None  # fmt: skip
        for t in reader.tensors:  # the same check, should the reader read lazily one day
            if t.data_offset + t.n_bytes > size or t.data.nbytes != t.n_bytes:
                raise _truncated(p, f"tensor {t.name!r}", t.data_offset + t.n_bytes, size)
        count = reader.get_field(gguf.Keys.Split.LLM_KV_SPLIT_COUNT)
        if count is not None and int(count.contents()) > 1:
            raise ValueError(f"GGUF file {str(p)!r} is one shard of a split GGUF ({gguf.Keys.Split.LLM_KV_SPLIT_COUNT}"
                             f"={int(count.contents())}); {_MERGE_HINT} and open that")  # fmt: skip
        return cls(p, reader)

    def __repr__(self) -> str:
        return f"GGUFCheckpoint({str(self.path)!r}, architecture={self.architecture!r}, tensors={len(self._tensors)})"

    def check_tokenizer_conversion(self, transformers_version: Optional[str] = None) -> None:
        """Refuses, naming the file and the fix, a transformers (``transformers_version``, default the installed
        one) whose GGUF tokenizer conversion would give this file's vocabulary a tokenizer that is not the
        model's (:data:`SPM_TOKENIZER_TRANSFORMERS`): call it before ``AutoTokenizer.from_pretrained(...,
        gguf_file=...)``."""
        if self.field("tokenizer.ggml.model") != "llama" or self._reader.get_field("tokenizer.ggml.merges") is not None:
            return
        if transformers_version is None:
            import transformers

            transformers_version = transformers.__version__
        have = tuple(int(x) for x in re.findall(r"\d+", transformers_version)[:2])
        if have < SPM_TOKENIZER_TRANSFORMERS:
            need = ".".join(map(str, SPM_TOKENIZER_TRANSFORMERS))
            raise ValueError(f"GGUF file {str(self.path)!r} has a SentencePiece vocabulary (tokenizer.ggml.model "
                             f"'llama', no merges), which transformers {transformers_version} converts into a "
                             f"tokenizer that splits text far finer than the model's own (Gemma-3: 2.29 characters "
                             f"a token against 4.12); install transformers>={need}")  # fmt: skip

    def field(self, key: str, default: Any = None) -> Any:
        """Metadata value ``key`` as a Python value (str, int, float, bool or list), else ``default``."""
        f = self._reader.get_field(key)
        return default if f is None else f.contents()

    def tensor_names(self) -> list[str]:
        """The tensors' names, in file order."""
        return list(self._tensors)

    def _tensor(self, name: str):
        try:
            return self._tensors[name]
        except KeyError:
            raise ValueError(f"GGUF file {str(self.path)!r} has no tensor {name!r}; its names look like "
                             f"{list(self._tensors)[:3]} (see tensor_names())") from None  # fmt: skip

    def tensor_type(self, name: str) -> T:
        """The GGML type of tensor ``name``."""
        return T(int(self._tensor(name).tensor_type))

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        """The logical shape of tensor ``name``, PyTorch order (``(rows, cols)`` for a weight)."""
        return tuple(int(x) for x in reversed(self._tensor(name).shape.tolist()))

    def raw(self, name: str) -> np.ndarray:
        """Tensor ``name`` as the reader gives it: a read-only view of the memory map (uint8
        ``[N, row_bytes]`` for quantized types), nothing copied."""
        return self._tensor(name).data

    def load(self, name: str) -> Union[LowBitWeight, torch.Tensor]:
        """Tensor ``name`` re-laid out (:func:`relayout`); errors name the file and the tensor."""
        raw, qtype, shape = self.raw(name), self.tensor_type(name), self.tensor_shape(name)
        try:
            return relayout(raw, qtype, shape, name)
        except ValueError as e:
            raise ValueError(f"GGUF file {str(self.path)!r}: {e}") from None


__all__ = [
    "FLOAT_TYPES", "GGUFCheckpoint", "K_QUANTS", "LOWBIT_TYPES", "SPM_TOKENIZER_TRANSFORMERS", "SUPPORTED_TYPES", "as_min8", "cat_rows", "common_form",
    "form_runs", "llama_unpermute", "permute_rows", "relayout", "stack_runs", "unsupported_type_error",
]  # fmt: skip
