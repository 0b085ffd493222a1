"""lowbit_linear_a16: the activation-exact W4A16 kernels (every ISA this CPU runs, both dequantizations)
against float64 references, and the ``e0m4`` code book they were built for."""
import pytest
import torch

from aipc_kernels.core import native
from aipc_kernels.lowbit import ops, packing
from aipc_kernels.lowbit.formats import CODEBOOKS, LowBitWeight
from aipc_kernels.lowbit.contract import A16_DEQUANTS
from aipc_kernels.lowbit.quantizers import quantize_rtn, quantize_weight

pytestmark = pytest.mark.skipif(not native.available(), reason="native library not built")

FOUR_BIT = sorted(name for name, cb in CODEBOOKS.items() if cb.bits == 4 and not cb.mins)  # the min form: W*A8 only


def _case(N, K, codebook, group, seed, scale_dtype=torch.float16):
    g = torch.Generator().manual_seed(seed)
    w = quantize_rtn(torch.randn(N, K, generator=g), codebook, group, scale_dtype=scale_dtype)
    return w, packing.pack_for_cpu(w)


def _assert_exact(y, x, w, bias):
    """y against x @ W^T + bias in float64: float32 accumulation error (relative to the sum of |x w|, the
    e0m4 form carries terms up to 31 s |x| that cancel), then the output dtype's rounding."""
    W = w.dequantize(torch.float64)
    ref = x.double() @ W.T + (0 if bias is None else bias.double())
    scale = (x.double().abs() @ W.abs().T).max().item() + 1e-30
    out_eps = {torch.float32: 0.0, torch.bfloat16: 2**-8, torch.float16: 2**-11}[y.dtype]
    err = (y.double() - ref).abs()
    assert (err <= 8e-6 * scale + out_eps * ref.abs()).all(), f"max err {err.max().item():.3g}, scale {scale:.3g}"


@pytest.mark.parametrize("codebook", FOUR_BIT)
@pytest.mark.parametrize("dequant", A16_DEQUANTS)
@pytest.mark.parametrize("M, N, K, group", [(1, 37, 256, 32), (3, 16, 128, 64), (5, 50, 384, 128), (9, 33, 192, -1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_float64_reference(isa, codebook, dequant, M, N, K, group, dtype):
    w, p = _case(N, K, codebook, group, seed=M * 1000 + N)
    x = torch.randn(M, K).to(dtype)
    bias = torch.randn(N).to(dtype)
    y = ops.lowbit_linear_a16(x, p, bias, dequant)
    assert y.shape == (M, N) and y.dtype == dtype
    _assert_exact(y, x, w, bias)


@pytest.mark.parametrize("dequant", A16_DEQUANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activations_are_not_quantized(isa, dtype, dequant):
    """One activation 1000x the others: int8 per-token scales would zero the small ones; W4A16 keeps them
    (also where the AVX2 kernel's int dequantization scales x by up to 2^-24)."""
    w, p = _case(24, 256, "int4", 128, seed=3)
    x = torch.randn(2, 256).to(dtype) * 1e-3
    x[:, 7] = 1.0
    _assert_exact(ops.lowbit_linear_a16(x, p, None, dequant), x, w, None)


def test_fastest_dequantization_follows_the_kernel(isa):
    """int where the AVX2 kernel runs (a mask and a conversion per 8 codes against E0M4's three bit
    operations), E0M4 where AVX-512's ternary logic makes it two: what W4A16 layers on the CPU layout take;
    the GPU layout takes E0M4."""
    expected = "int" if isa in ("avx2", "avx_vnni") else "e0m4"
    assert native.fastest_a16_dequant() == ops.a16_dequant() == ops.a16_dequant(packing.CPU_LAYOUT) == expected
    assert ops.a16_dequant(packing.TRITON_LAYOUT) == "e0m4"


def test_e0m4_and_int_dequantization_agree(isa):
    """The two strategies compute the same products: equal to float32 accumulation rounding."""
    w, p = _case(64, 512, "e0m4", 64, seed=4, scale_dtype=torch.bfloat16)
    x = torch.randn(3, 512).to(torch.bfloat16)
    a, b = (ops.lowbit_linear_a16(x.float(), p, None, dq) for dq in A16_DEQUANTS)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("M", [1, 4, 6, 9])  # tiles of 4 tokens: remainders 2 and 1
def test_every_output_written_and_nothing_past_it(isa, M):
    N, K = 35, 128
    w, p = _case(N, K, "affine4", 32, seed=11)
    x = torch.randn(M, K)
    for dtype in (torch.float32, torch.bfloat16):
        for dequant in A16_DEQUANTS:
            buf = torch.full((M * N + 64,), float("nan"), dtype=dtype)
            y = buf[: M * N].view(M, N)
            native.lowbit_linear_a16_into(y, x.to(dtype), p.qweight, p.scales, p.zeros, None, 32, float("nan"), dequant)
            assert not torch.isnan(y).any()
            assert torch.isnan(buf[M * N :]).all()
            _assert_exact(y, x.to(dtype), w, None)


def test_strided_and_batched_operands(isa):
    w, p = _case(32, 128, "int4", 32, seed=9)
    x = torch.randn(2, 3, 256)[..., ::2]  # leading dims flattened, a strided view
    bias = torch.randn(32, 2)[:, 1]
    y = ops.lowbit_linear_a16(x, p, bias)
    assert y.shape == (2, 3, 32)
    _assert_exact(y.reshape(6, 32), x.reshape(6, 128), w, bias)


def test_bad_input_is_refused_naming_the_parameter():
    _, p2 = _case(16, 128, "affine", 32, seed=0)
    with pytest.raises(ValueError, match=r"codebook='affine' has 2-bit codes.*use lowbit_linear"):
        ops.lowbit_linear_a16(torch.randn(1, 128), p2)
    _, p = _case(16, 128, "int4", 32, seed=0)
    with pytest.raises(ValueError, match=r"dequant='fp4' is unknown"):
        ops.lowbit_linear_a16(torch.randn(1, 128), p, None, "fp4")
    with pytest.raises(ValueError, match="does not match x's K=64"):
        ops.lowbit_linear_a16(torch.randn(1, 64), p)
    with pytest.raises(RuntimeError, match=r"bad group size .*group_size=48"):  # the C entry's own check
        native.lowbit_linear_a16_into(torch.empty(1, 16), torch.randn(1, 128), p.qweight, p.scales, None, None, 48, 8.0, "int")
    with pytest.raises(ValueError, match=r"dequant='fp4' is unknown"):
        native.lowbit_linear_a16_into(torch.empty(1, 16), torch.randn(1, 128), p.qweight, p.scales, None, None, 32, 8.0, "fp4")
    _, pm = _case(16, 128, "min4", 32, seed=0)  # the min form: the W*A8 kernels only, refused here and in C
    with pytest.raises(ValueError, match=r"codebook='min4' is a min form.*use lowbit_linear"):
        ops.lowbit_linear_a16(torch.randn(1, 128), pm)
    with pytest.raises(RuntimeError, match=r"aipc_lowbit_linear_a16 failed"):
        native.lowbit_linear_a16_into(torch.empty(1, 16), torch.randn(1, 128), pm.qweight, pm.scales, pm.zeros, None, 32, 0.0, "int")


def test_reference_path_and_fake_kernel_under_torch_compile():
    w, p = _case(48, 256, "e0m4", 64, seed=2)
    x = torch.randn(4, 256)
    y_ref = ops.lowbit_linear_a16(x, packing.as_canonical_packed(w))
    torch.testing.assert_close(y_ref, ops.reference_linear(x, w))
    torch.library.opcheck(
        torch.ops.aipc.lowbit_linear_a16.default,
        (x, p.qweight, p.scales, p.zeros, None, p.layout, p.codebook, p.group_size, p.out_features, "e0m4"),
    )
    eager = ops.lowbit_linear_a16(x, p)
    compiled = torch.compile(lambda t: ops.lowbit_linear_a16(t, p) * 2, fullgraph=True)(x)
    torch.testing.assert_close(compiled, eager * 2)


# ------------------------------------------------------------------ the e0m4 code book


def test_e0m4_rtn_is_the_papers_mapping():
    """Transformer-Lite: the group's range (holding 0) onto [1, 2): step range/16, bias 1 + z/16 with its
    fraction bits below the code's zeroed (z = floor(-lo / step)), codes rounded and clamped to 15."""
    w = torch.tensor([[-1.0, -0.25, 0.0, 0.5, 1.0, 2.0, 0.125, -0.5] * 4])
    q = quantize_rtn(w, "e0m4", -1)
    step = 3.0 / 16
    assert q.scales.item() == pytest.approx(step, rel=1e-3)
    assert q.zeros.item() == 5.0  # floor(1 / (3/16)) = floor(5.33)
    expect = torch.clamp(torch.round(w / q.scales.float() + 5), 0, 15)
    assert torch.equal(q.codes().float(), expect)
    assert q.dequantize()[0, 2] == 0  # zero is exact
    # the bias 1 + z/16 as a bf16 E0M4 value: no fraction bits below the top four
    bias_bits = torch.tensor(1 + q.zeros.float().item() / 16).to(torch.bfloat16).view(torch.int16).item()
    assert bias_bits & 0x7 == 0 and bias_bits >> 7 == 0x7F


def test_e0m4_zero_points_must_be_integers_in_range():
    w = quantize_rtn(torch.randn(8, 64), "e0m4", 32)
    with pytest.raises(ValueError, match=r"w\.zeros: codebook 'e0m4' stores integer zero points in \[0, 15\]"):
        LowBitWeight(w.qweight, w.scales, w.zeros + 0.5, "e0m4", 32, 64, name="w")
    with pytest.raises(ValueError, match=r"integer zero points"):
        LowBitWeight(w.qweight, w.scales, w.zeros + 16, "e0m4", 32, 64, name="w")


@pytest.mark.parametrize("method", ["rtn", "optimized"])
def test_e0m4_quantizers_keep_integer_zeros_and_beat_symmetric_int4(method):
    w = torch.randn(128, 256)
    q = quantize_weight(w, "e0m4", 64, method=method)
    assert torch.equal(q.zeros, q.zeros.round())
    err = lambda cb: (quantize_weight(w, cb, 64, method=method).dequantize() - w).abs().mean()  # noqa: E731
    assert err("e0m4") < err("int4")
