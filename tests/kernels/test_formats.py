"""Canonical format and device packing: exact round trips, serialization, clear errors."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from aipc_kernels.lowbit import formats, packing
from aipc_kernels.lowbit.formats import CODEBOOKS, LowBitWeight, load_lowbit, pack_codes, save_lowbit, unpack_codes
from aipc_kernels.lowbit.quantizers import quantize_rtn

shapes = st.tuples(st.integers(1, 67), st.sampled_from([32, 64, 96, 128, 192, 256]))


@settings(max_examples=60, deadline=None)
@given(shape=shapes, bits=st.sampled_from([1, 2, 4, 6, 8]), seed=st.integers(0, 2**31 - 1))
def test_canonical_and_cpu_packing_round_trip(shape, bits, seed):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, shape, generator=g, dtype=torch.uint8)
    packed = pack_codes(codes, bits)
    assert packed.shape == (shape[0], shape[1] * bits // 8)
    assert torch.equal(unpack_codes(packed, bits), codes)
    cpu = packing.pack_cpu_codes(codes, bits)
    assert cpu.shape == (-(-shape[0] // 16), shape[1] * bits // 32, 16, 4)
    assert torch.equal(packing.unpack_cpu_codes(cpu, bits, shape[0]), codes)


def test_six_bit_layouts_put_each_code_where_the_kernels_read_it():
    """Canonical: four codes in three bytes, little-endian, code k % 4 at bits 6 * (k % 4). cpu_vnni16: per
    16 k three 64-byte units, unit u < 2 the low nibbles of k = 16c + 8u + 4j + kk at bits 4j of byte
    [n][kk], unit 2 the high two bits of k = 16c + 4j + kk at bits 2j (csrc/lowbit_kernels.h)."""
    g = torch.Generator().manual_seed(5)
    codes = torch.randint(0, 64, (21, 64), generator=g, dtype=torch.uint8)
    canon = pack_codes(codes, 6).long()
    stream = canon[:, 0::3] | canon[:, 1::3] << 8 | canon[:, 2::3] << 16
    for i in range(4):
        assert torch.equal((stream >> (6 * i)) & 63, codes[:, i::4].long())
    cpu = packing.pack_cpu_codes(codes, 6)  # [2 row blocks, 12 units, 16, 4]
    assert cpu.shape == (2, 12, 16, 4)
    for k in (0, 5, 13, 17, 38, 63):
        c, r = divmod(k, 16)
        u, jk = divmod(r, 8)
        j, kk = divmod(jk, 4)
        lo = (cpu[:, 3 * c + u, :, kk] >> (4 * j)) & 15
        hj, hkk = divmod(r, 4)
        hi = (cpu[:, 3 * c + 2, :, hkk] >> (2 * hj)) & 3
        got = (lo | hi << 4).reshape(32)[:21]
        assert torch.equal(got, codes[:, k]), k


@settings(max_examples=40, deadline=None)
@given(shape=shapes, codebook=st.sampled_from(sorted(CODEBOOKS)), group=st.sampled_from([32, -1]),
       dtype=st.sampled_from([torch.float16, torch.bfloat16]), seed=st.integers(0, 2**31 - 1))
def test_weight_round_trips_through_cpu_layout(shape, codebook, group, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    w = quantize_rtn(torch.randn(shape, generator=g), codebook, group, scale_dtype=dtype)
    back = packing.to_canonical(packing.pack_for_cpu(w))
    for a, b in ((w.qweight, back.qweight), (w.scales, back.scales), (w.zeros, back.zeros)):
        assert (a is None and b is None) or torch.equal(a, b)
    assert torch.equal(w.dequantize(), back.dequantize())


def test_levels_match_the_documented_code_books():
    assert CODEBOOKS["int2"].levels.tolist() == [-2, -1, 0, 1]
    assert CODEBOOKS["sym"].levels.tolist() == [-1.5, -0.5, 0.5, 1.5]
    assert CODEBOOKS["ternary"].levels.tolist() == [-1, 0, 1]
    assert CODEBOOKS["binary"].levels.tolist() == [-1, 1]


def test_dequantize_is_scale_times_level():
    codes = torch.tensor([[0, 1, 2, 3] * 8], dtype=torch.uint8)
    w = LowBitWeight(pack_codes(codes, 2), torch.tensor([[0.5]], dtype=torch.float16), None, "sym", 32, 32)
    assert w.dequantize()[0, :4].tolist() == [-0.75, -0.25, 0.25, 0.75]


def test_safetensors_round_trip(tmp_path):
    torch.manual_seed(0)
    ws = {
        "layers.0.q_proj": quantize_rtn(torch.randn(48, 64), "affine", 32),
        "layers.0.o_proj": quantize_rtn(torch.randn(64, 128), "ternary", -1, scale_dtype=torch.bfloat16),
    }
    path = tmp_path / "w.safetensors"
    save_lowbit(str(path), ws, extra={"norm.weight": torch.ones(64)})
    loaded, rest = load_lowbit(str(path))
    assert set(loaded) == set(ws) and set(rest) == {"norm.weight"}
    for name, w in ws.items():
        assert loaded[name].codebook == w.codebook and loaded[name].group_size == w.group_size
        assert torch.equal(loaded[name].dequantize(), w.dequantize())


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(group_size=48), "group_size=48 is not supported"),
        (dict(group_size=128, K=192), "does not divide in_features K=192"),
        (dict(codebook="int3"), "codebook='int3' is unknown"),
        (dict(K=40, group_size=-1), "multiple of 32"),
    ],
)
def test_bad_parameters_fail_early_with_the_parameter_named(kw, match):
    K = kw.pop("K", 128)
    with pytest.raises(ValueError, match=match):
        quantize_rtn(torch.randn(8, K), **kw)


def test_corrupt_checkpoint_errors_name_the_tensor(tmp_path):
    w = quantize_rtn(torch.randn(16, 64), "affine", 32)
    with pytest.raises(ValueError, match=r"l\.scales has shape \(16, 1\), expected \(16, 2\)"):
        LowBitWeight(w.qweight, w.scales[:, :1], w.zeros, "affine", 32, 64, name="l")
    with pytest.raises(ValueError, match=r"l\.zeros has shape \(3, 2\)"):
        LowBitWeight.from_state_dict({"l.qweight": w.qweight, "l.scales": w.scales, "l.zeros": w.zeros[:3]}, "l", "affine", 32, 64)
    with pytest.raises(ValueError, match="l.zeros is missing"):
        LowBitWeight(w.qweight, w.scales, None, "affine", 32, 64, name="l")
    with pytest.raises(ValueError, match="checkpoint is missing tensor x.scales"):
        LowBitWeight.from_state_dict({"x.qweight": w.qweight}, "x", "affine", 32, 64)
    path = tmp_path / "plain.safetensors"
    from safetensors.torch import save_file

    save_file({"a": torch.zeros(1)}, str(path))
    with pytest.raises(ValueError, match="not a lowbit2 file"):
        load_lowbit(str(path))


def test_quantizer_rejects_non_finite_weights():
    w = torch.randn(4, 32)
    w[1, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize_rtn(w)


@pytest.mark.parametrize("group, K, want", [
    (64, 576, 64), (128, 576, 64), (128, 1536, 128), (128, 480, 32), (64, 480, 32), (32, 96, 32), (-1, 576, -1),
])  # fmt: skip
def test_fitting_group_size_falls_back_to_the_largest_that_divides(group, K, want):
    """On-the-fly quantization's group per layer: the configured one, else the largest supported below
    it that divides K (SmolLM2's K=576 with 128 -> 64); -1 stays -1, the quantizers' whole-row spelling."""
    from aipc_kernels.lowbit.formats import fitting_group_size

    assert fitting_group_size(group, K) == want


@pytest.mark.parametrize("group, K, match", [
    (64, 496, "in_features K=496 must be a multiple of 32"), (48, 576, "group_size=48 is not supported"),
])  # fmt: skip
def test_fitting_group_size_refuses_what_no_group_fits(group, K, match):
    from aipc_kernels.lowbit.formats import fitting_group_size

    with pytest.raises(ValueError, match=match):
        fitting_group_size(group, K)
