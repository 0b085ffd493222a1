"""aipc::prologue: a decoder layer's RMSNorm or SwiGLU product in one pass, against a float64 reference at
transformers' rounding points and against transformers' torch ops (float32 / bf16 / fp16; odd widths, prompt
and decode sizes, strided x, a zero row, NaN and infinities; under every ISA), its errors, its fake kernel
under torch.compile, and which dtypes :func:`apply_prologue` gives it."""
import pytest
import torch
import torch.nn.functional as F

from aipc_kernels.decoder.prologue import NATIVE_DTYPES, PROLOGUES, apply_prologue, prologue_reference

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
EPS = 1e-6
RMS, SILU = PROLOGUES["rmsnorm"], PROLOGUES["silu_mul"]


def native_built() -> bool:
    from aipc_kernels.core import native

    return native.ops_library() is not None


needs_native = pytest.mark.skipif(not native_built(), reason="native ops not built")


def float64_reference(x: torch.Tensor, code: int, gamma=None) -> torch.Tensor:
    """The prologue in float64, rounded to x's dtype only where transformers' modules round."""
    dt = x.dtype
    h = x.double()
    if code == RMS:
        normed = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)).to(dt).double()
        return (gamma.double() * normed).to(dt)
    K = x.shape[-1] // 2
    return (F.silu(h[..., :K]).to(dt).double() * h[..., K:]).to(dt)


def ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in units of the last place of b's dtype at b's magnitude."""
    mant = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}[b.dtype]
    exp = torch.frexp(b.double().abs().clamp_min(torch.finfo(b.dtype).tiny))[1]
    return (a.double() - b.double()).abs() / torch.ldexp(torch.ones_like(b, dtype=torch.float64), exp - 1 - mant)


def operands(M: int, K: int, dt: torch.dtype, seed: int, code: int, extra: int = 0):
    g = torch.Generator().manual_seed(seed)
    cols = 2 * K if code == SILU else K
    wide = (3 * torch.randn(M, cols + extra, generator=g)).to(dt)
    gamma = (1 + torch.randn(K, generator=g)).to(dt) if code == RMS else None
    return wide[:, :cols], gamma


@needs_native
@pytest.mark.parametrize("dt", DTYPES, ids=str)
@pytest.mark.parametrize("code", [RMS, SILU], ids=["rmsnorm", "silu_mul"])
@pytest.mark.parametrize("M,K", [(1, 576), (4, 768), (5, 17), (300, 96), (1024, 64), (2, 2051)])
def test_within_rounding_of_the_float64_reference_and_of_transformers_ops(dt, code, M, K, isa):
    """bf16 / fp16: within one unit in the last place of the float64 reference's two roundings, and equal to the
    torch ops' but for a few last-bit ones (the float32 sum-of-squares order and exp). float32: within the
    float32 sum of K squares' relative error (the portable build adds them in order) of both."""
    x, gamma = operands(M, K, dt, seed=M * 7 + K, code=code)
    got = torch.ops.aipc.prologue(x, code, gamma, EPS)
    assert got.dtype == dt and got.shape == (M, K) and got.is_contiguous()
    ref = prologue_reference(x, "rmsnorm" if code == RMS else "silu_mul", gamma, EPS, K)
    if dt == torch.float32:
        for want in (float64_reference(x, code, gamma), ref):
            torch.testing.assert_close(got, want, rtol=2e-5, atol=1e-30)
        return
    assert ulps(got, float64_reference(x, code, gamma)).max() <= 2
    assert ulps(got, ref).max() <= 1 and (got != ref).float().mean().item() <= 0.01


def assert_same_specials_and_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """NaN where want has NaN, the same infinities, finite values within rounding (see the test above)."""
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.isinf(), want.isinf()) and torch.equal(got[got.isinf()], want[want.isinf()])
    finite = want.isfinite()
    if want.dtype == torch.float32:
        torch.testing.assert_close(got[finite], want[finite], rtol=2e-5, atol=1e-30)
    else:
        assert ulps(got[finite], want[finite]).max() <= 1


@needs_native
@pytest.mark.parametrize("dt", DTYPES, ids=str)
def test_strided_and_batched_x_zero_row_nan_and_infinities(dt, isa):
    x, gamma = operands(6, 40, dt, seed=3, code=RMS, extra=9)  # rows 49 elements apart
    got = torch.ops.aipc.prologue(x.reshape(2, 3, 40), RMS, gamma, EPS)
    assert got.shape == (2, 3, 40)
    assert_same_specials_and_close(got.reshape(6, 40), prologue_reference(x, "rmsnorm", gamma, EPS, 40))
    y = x.clone()
    y[1] = 0  # a zero row: zeros, as transformers' (x * rsqrt(eps))
    y[2, 5], y[3, 0], y[4, 7] = float("nan"), float("inf"), -float("inf")  # NaN: its row; inf: inf * 0, zeros
    out = torch.ops.aipc.prologue(y, RMS, gamma, EPS)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert out[2].isnan().all() and out[3, 0].isnan() and out[4, 7].isnan() and not out[[0, 1, 5]].isnan().any()
    assert_same_specials_and_close(out, prologue_reference(y, "rmsnorm", gamma, EPS, 40))
    s, _ = operands(3, 33, dt, seed=4, code=SILU)
    s = s.clone()
    s[0, 2], s[1, 40], s[2, 1] = float("nan"), float("inf"), float("-inf")  # a NaN gate, an infinite up, -inf gate
    assert_same_specials_and_close(torch.ops.aipc.prologue(s, SILU), prologue_reference(s, "silu_mul", None, 0.0, 33))


@needs_native
def test_errors_name_the_operand():
    x, gamma = operands(2, 8, torch.bfloat16, seed=5, code=RMS)
    with pytest.raises(RuntimeError, match=r"aipc::prologue: prologue code 7 is not one of"):
        torch.ops.aipc.prologue(x, 7, gamma)
    with pytest.raises(RuntimeError, match=r"rmsnorm needs gamma of shape \(8,\)"):
        torch.ops.aipc.prologue(x, RMS, None)
    with pytest.raises(RuntimeError, match=r"rmsnorm needs gamma of shape \(8,\)"):
        torch.ops.aipc.prologue(x, RMS, gamma[:5])
    with pytest.raises(RuntimeError, match=r"gamma must have x's dtype"):
        torch.ops.aipc.prologue(x, RMS, gamma.float())
    with pytest.raises(RuntimeError, match=r"silu_mul needs x's \[gate \| up\] halves, an even number of columns; "
                                           r"got 7"):
        torch.ops.aipc.prologue(x[:, :7], SILU)
    with pytest.raises(RuntimeError, match=r"x must be float32, bfloat16 or float16"):
        torch.ops.aipc.prologue(x.double(), SILU)
    with pytest.raises(ValueError, match=r"prologue must be one of \('none', 'rmsnorm', 'silu_mul'\), got 'gelu'"):
        apply_prologue(x, "gelu", None, 0.0, 8)


def test_fake_kernel_and_torch_compile():
    x, gamma = operands(3, 16, torch.bfloat16, seed=6, code=RMS)
    eager = torch.ops.aipc.prologue(x, RMS, gamma, EPS)
    compiled = torch.compile(lambda a, g: torch.ops.aipc.prologue(a, RMS, g, EPS) * 2, fullgraph=True,
                             backend="aot_eager")  # fmt: skip
    assert torch.equal(compiled(x, gamma), eager * 2)
    s, _ = operands(3, 16, torch.bfloat16, seed=7, code=SILU)
    silu = torch.compile(lambda a: torch.ops.aipc.prologue(a, SILU), fullgraph=True, backend="aot_eager")
    assert torch.equal(silu(s), torch.ops.aipc.prologue(s, SILU))


def test_apply_prologue_native_for_half_dtypes_torch_ops_for_float32(monkeypatch):
    """bf16 / fp16 rows go to the op; float32 rows (the fused low-bit layer's exactness promise) and a gamma
    of another dtype go to transformers' torch ops, bit for bit; "none" returns x itself."""
    import aipc_kernels.decoder.prologue as pro

    reference = []
    real = pro.prologue_reference
    monkeypatch.setattr(pro, "prologue_reference", lambda x, *a: reference.append(x.dtype) or real(x, *a))
    for dt in DTYPES:
        x, gamma = operands(4, 24, dt, seed=8, code=RMS)
        got = apply_prologue(x, "rmsnorm", gamma, EPS, 24)
        assert torch.equal(got, real(x, "rmsnorm", gamma, EPS, 24)) or dt in NATIVE_DTYPES
    assert reference == ([torch.float32] if native_built() else list(DTYPES))
    x, gamma = operands(4, 24, torch.bfloat16, seed=9, code=RMS)
    assert torch.equal(apply_prologue(x, "rmsnorm", gamma.float(), EPS, 24), real(x, "rmsnorm", gamma.float(), EPS, 24))
    assert apply_prologue(x, "none", None, 0.0, 24) is x
