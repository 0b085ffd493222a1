"""detect_grid: weights fake-quantized by ParetoQ's own quantizers (bf16, random per-row clip values)
come back as lowbit2 weights with ParetoQ's integer grid as codes; binary and ternary values exactly,
2-bit SEQ values exactly where the bf16 store kept the 1:3 ratio and otherwise within the documented
bound; everything that is not on one whole-row grid -> None."""
import pytest
import torch

from aipc_kernels.checkpoints.grid_detect import detect_grid, split_rows
from tests.helpers.paretoq import paretoq_weight, random_clip_val

CODEBOOK = {1: "binary", 0: "ternary", 2: "sym"}
#: lowbit2 value (cmul*c - z) per ParetoQ level q (w = alpha * q): binary sign, ternary 1.5 q, sym 2 q
LEVEL_TO_VALUE = {1: 1.0, 0: 1.5, 2: 2.0}
SHAPES = [(37, 96), (5, 160), (1, 32), (130, 64)]


def _paretoq(shape, w_bits, seed, dtype=torch.bfloat16):
    """(stored weight, clip values, ParetoQ's level per weight as a lowbit2 value)."""
    g = torch.Generator().manual_seed(seed)
    w = 0.02 * torch.randn(shape, generator=g) * torch.rand(shape[0], 1, generator=g).add(0.5)
    alpha = random_clip_val(w, w_bits, g)
    wq = paretoq_weight(w, alpha, w_bits)  # float32, as ParetoQ computes it
    q = wq.sign() if w_bits == 1 else (wq / alpha * LEVEL_TO_VALUE[w_bits] * 2).round() / 2
    return wq.to(dtype), alpha, q


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("w_bits", [1, 0, 2])
def test_paretoq_grids_round_trip(w_bits, shape):
    wq, _, q = _paretoq(shape, w_bits, seed=shape[0] + w_bits)
    got = detect_grid(wq, "layer")
    assert got is not None and got.codebook == CODEBOOK[w_bits]
    w = got.weight
    assert w.group_size == shape[1] and w.scales.shape == (shape[0], 1)
    assert torch.equal(w.values(), q)  # the codes are ParetoQ's own levels
    src, err = wq.float(), (w.dequantize() - wq.float()).abs()
    assert got.max_error == err.max().item()
    hi = src.abs().amax(1)
    if w_bits != 2:
        assert got.exact and torch.equal(w.dequantize(), src)
        return
    # SEQ: exact on rows whose stored levels keep the 1:3 ratio, else within the module's bound
    lo = torch.where(src != 0, src.abs(), torch.inf).amin(1)
    exact_rows = (hi == 3 * lo) | (lo == hi)
    assert (err[exact_rows] == 0).all()
    bound = (2**-9 + 2**-11) * hi if w.scales.dtype == torch.float16 else (2**-9 + 2**-8) * hi
    assert (err.amax(1) <= bound).all(), (err.amax(1) / hi).max()
    assert got.max_rel_error <= 2**-9 + 2**-8


def test_seq_is_exact_where_the_store_keeps_the_ratio():
    """Clip values of a few significant bits make bf16(0.75 alpha) == 3 bf16(0.25 alpha): exact."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(16, 64, generator=g)
    alpha = (torch.randint(4, 8, (16, 1), generator=g) * 2.0 ** torch.randint(-8, -2, (16, 1), generator=g)).float()
    wq = paretoq_weight(w, alpha, 2).to(torch.bfloat16)
    got = detect_grid(wq)
    assert got.codebook == "sym" and got.exact and torch.equal(got.weight.dequantize(), wq.float())


def test_scale_dtype_is_the_exact_one():
    """A magnitude below fp16's range is exact only in bf16: the preferred fp16 is given up."""
    wq = torch.tensor([[1e-6, -1e-6] * 16, [0.5, -0.5] * 16], dtype=torch.bfloat16)
    got = detect_grid(wq, scale_dtype=torch.float16)
    assert got.codebook == "binary" and got.weight.scales.dtype == torch.bfloat16 and got.exact
    got = detect_grid(wq[1:], scale_dtype=torch.float16)
    assert got.weight.scales.dtype == torch.float16 and got.exact  # a tie keeps the preferred dtype


def test_mixed_binary_and_ternary_rows_are_ternary():
    b, _, qb = _paretoq((20, 96), 1, seed=5)
    t, _, qt = _paretoq((30, 96), 0, seed=6)
    got = detect_grid(torch.cat([b, t]), "qkv")
    assert got.codebook == "ternary" and got.exact
    assert torch.equal(got.weight.values(), torch.cat([qb, qt]))
    parts = split_rows(got.weight, [20, 30], ["q", "k"])
    assert [p.name for p in parts] == ["q", "k"]
    assert torch.equal(parts[0].dequantize(), b.float()) and torch.equal(parts[1].dequantize(), t.float())


def test_a_one_bit_zero_is_ternary():
    """ParetoQ's 1-bit ``sign`` maps a latent 0 to 0: the row is then ternary, still exact."""
    w = 0.02 * torch.randn(8, 64)
    w[3, 5] = 0.0
    wq = paretoq_weight(w, random_clip_val(w, 1, torch.Generator().manual_seed(0)), 1).to(torch.bfloat16)
    got = detect_grid(wq)
    assert got.codebook == "ternary" and torch.equal(got.weight.dequantize(), wq.float())


def test_zero_rows_fit_any_grid():
    wq, _, _ = _paretoq((12, 64), 2, seed=7)
    wq[[0, 7]] = 0
    got = detect_grid(wq)
    assert got.codebook == "sym" and torch.equal(got.weight.dequantize()[[0, 7]], torch.zeros(2, 64))
    assert detect_grid(torch.zeros(4, 64, dtype=torch.bfloat16)) is None  # nothing says it is a grid


def test_group_size_repeats_the_row_scale():
    wq, _, _ = _paretoq((9, 128), 0, seed=8)
    got = detect_grid(wq, group_size=32)
    assert got.weight.group_size == 32 and got.weight.scales.shape == (9, 4)
    assert torch.equal(got.weight.dequantize(), wq.float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_other_source_dtypes(dtype):
    """A bf16 grid loaded as float32 (vLLM --dtype float32) or a float16 store is found alike."""
    for w_bits in (1, 0, 2):
        wq, _, q = _paretoq((24, 96), w_bits, seed=9, dtype=torch.bfloat16)
        got = detect_grid(wq.to(dtype))
        assert got.codebook == CODEBOOK[w_bits] and torch.equal(got.weight.values(), q)
        wq, _, q = _paretoq((24, 96), w_bits, seed=9, dtype=dtype)
        got = detect_grid(wq)
        assert got.codebook == CODEBOOK[w_bits] and torch.equal(got.weight.values(), q)


def test_not_on_a_grid_is_none():
    g = torch.Generator().manual_seed(10)
    w = torch.randn(64, 128, generator=g)
    assert detect_grid(w.to(torch.bfloat16)) is None and detect_grid(w) is None
    for w_bits in (3, 4):  # ParetoQ's LSQ grids have more levels than a 2-bit code book
        assert detect_grid(paretoq_weight(w, random_clip_val(w, w_bits, g), w_bits).to(torch.bfloat16)) is None
    int2 = (torch.randint(-2, 2, (8, 64), generator=g) * 0.125).to(torch.bfloat16)  # {-2s, -s, 0, s}
    assert detect_grid(int2) is None
    ratio2 = torch.tensor([[0.25, -0.5] * 32] * 4, dtype=torch.bfloat16)  # two magnitudes, not 1:3
    assert detect_grid(ratio2) is None
    assert detect_grid(torch.ones(4, 48)) is None  # K not a multiple of 32
    assert detect_grid(torch.tensor([[float("inf"), 1.0] * 16])) is None


@pytest.mark.parametrize("w_bits", [1, 0, 2])
@pytest.mark.parametrize("row", [0, 21, 36])  # a sampled row (0) and rows the sample skips
def test_one_perturbed_value_is_none(w_bits, row):
    wq, _, _ = _paretoq((37, 96), w_bits, seed=11)
    assert detect_grid(wq) is not None
    bad = wq.clone()
    bad.view(torch.int16)[row, 17] += 1  # one bf16 unit away from the grid value
    assert detect_grid(bad) is None


def test_detect_grid_under_a_bf16_default_dtype():
    """vLLM sets torch's default dtype to the model's while it loads (bf16 here): the row sampling must
    not depend on it (a bf16 linspace rounded row 1023 of 1024 to 1024, out of bounds)."""
    w = torch.randn(1024, 64, generator=torch.Generator().manual_seed(5))
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        assert detect_grid(w.to(torch.bfloat16), "w") is None
    finally:
        torch.set_default_dtype(old)
