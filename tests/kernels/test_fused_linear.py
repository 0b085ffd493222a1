"""aipc::fused_linear: a decoder layer's projection with its RMSNorm / SwiGLU prologue, several weights and a
residual epilogue (every ISA this CPU runs, float32 / bf16 / fp16) against float64 references and against
transformers' own modules, on odd shapes, with poisoned outputs."""
import pytest
import torch
import torch.nn.functional as F

from aipc_kernels.core import native
from aipc_kernels.decoder.dense_linear import cpu_max_rows
from aipc_kernels.decoder.fused_linear import fused_linear, fused_linear_reference
from aipc_kernels.decoder.prologue import rms_norm_like_transformers

pytestmark = pytest.mark.skipif(not native.available(), reason="native library not built")

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
OUT_EPS = {torch.float32: 2**-24, torch.bfloat16: 2**-8, torch.float16: 2**-11}
EPS = 1e-5


def kernel(x, weights, biases, prologue="none", gamma=None, residual=None, poison=float("nan")):
    """The native kernel itself (any number of rows), into a poisoned output."""
    y = torch.full((*x.shape[:-1], sum(w.shape[0] for w in weights)), poison, dtype=x.dtype)
    native.dense_linear_fused_into(y, x, weights, biases, prologue, gamma, EPS, residual)
    return y


def operands(M, K, ns, dt, prologue, seed, bias=True, residual=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, 2 * K if prologue == "silu_mul" else K, generator=g).to(dt)
    weights = [(torch.randn(n, K, generator=g) / K**0.5).to(dt) for n in ns]
    biases = [torch.randn(n, generator=g).to(dt) if bias and i % 2 == 0 else None for i, n in enumerate(ns)]
    gamma = (1 + 0.5 * torch.randn(K, generator=g)).to(dt)
    res = torch.randn(M, sum(ns), generator=g).to(dt) if residual else None
    return x, weights, biases, gamma, res


def prologue_in_dtype(x, prologue, gamma, K):
    """The prologue as transformers' modules compute it, in x's dtype (the rounded input of the product)."""
    if prologue == "rmsnorm":
        return rms_norm_like_transformers(x, gamma, EPS)
    if prologue == "silu_mul":
        return F.silu(x[..., :K]) * x[..., K:]
    return x


def assert_close_to_float64(y, h, weights, biases, residual):
    """y against h @ cat(w)^T + bias (+ residual) in float64, from the rounded prologue output h: float32
    accumulation error relative to sum |h w|, then the dtype's rounding of the product and of the sum."""
    w = torch.cat([t.double() for t in weights])
    b = torch.cat([torch.zeros(t.shape[0], dtype=torch.float64) if bb is None else bb.double()
                   for t, bb in zip(weights, biases)])  # fmt: skip
    lin = h.double() @ w.T + b
    ref = lin + (0 if residual is None else residual.double())
    scale = h.double().abs() @ w.abs().T + b.abs() + 1e-30
    bound = 4e-7 * h.shape[-1] ** 0.5 * scale + 2e-7 * scale + OUT_EPS[y.dtype] * (lin.abs() + ref.abs())
    # the prologue's own rounding (bf16 / fp16 h computed in float32 then rounded): one unit of h's dtype
    bound = bound + 2 * OUT_EPS[y.dtype] * scale
    err = (y.double() - ref).abs()
    assert (err <= bound).all(), f"max err {err.max().item():.3g} at {divmod(int(err.argmax()), y.shape[-1])}"


@pytest.mark.parametrize("M", [1, 3, 4, 8, 16])
@pytest.mark.parametrize("K, ns", [(100, (36, 12, 12)), (64, (40,)), (37, (5, 3)), (2048, (8, 4, 4, 8))])
@pytest.mark.parametrize("prologue", ["none", "rmsnorm", "silu_mul"])
@pytest.mark.parametrize("dt", DTYPES)
def test_matches_float64_reference(isa, M, K, ns, prologue, dt):
    x, weights, biases, gamma, res = operands(M, K, ns, dt, prologue, seed=M * 131 + K + len(ns))
    y = kernel(x, weights, biases, prologue, gamma, res)
    assert not y.isnan().any(), "an output was not written"
    h = prologue_in_dtype(x, prologue, gamma, K)
    assert_close_to_float64(y, h, weights, biases, res)
    # the op: the kernel up to cpu_max_rows rows, else the torch reference; both close to the modules' math
    op = fused_linear(x, weights, biases, prologue, gamma, EPS, res)
    with torch.no_grad():  # the direct call of the CPU implementation (no dispatcher) gives the same
        assert torch.equal(fused_linear(x, weights, biases, prologue, gamma, EPS, res), op)
    if M <= cpu_max_rows(dt, dt):
        assert torch.equal(op, y)
    else:
        assert torch.equal(op, fused_linear_reference(x, weights, biases, prologue, gamma, EPS, res))


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("prologue", ["rmsnorm", "silu_mul"])
def test_prologue_rounds_where_transformers_rounds(isa, dt, prologue):
    """The kernel's prologue output is transformers' (LlamaRMSNorm / SiLU x up in the model's dtype): with an
    identity weight, y is that output itself: equal for nearly every element (the float32 statistics and exp
    differ in their last bits, which moves a rounding now and then) and never more than one unit apart."""
    K = 512
    x, _, _, gamma, _ = operands(8, K, (K,), dt, prologue, seed=7)
    eye = torch.eye(K, dtype=dt)
    y = kernel(x, [eye], [None], prologue, gamma)
    h = prologue_in_dtype(x, prologue, gamma, K)
    diff = (y.double() - h.double()).abs()
    if dt == torch.float32:  # nothing rounded: only the statistics' and exp's last bits
        assert (diff <= 1e-6 * h.double().abs() + 1e-30).all()
        return
    assert (diff <= 2 * OUT_EPS[dt] * h.double().abs()).all()
    assert (diff == 0).double().mean() >= 0.98


def test_rows_do_not_depend_on_each_other_or_on_threads(isa):
    x, weights, biases, gamma, res = operands(8, 300, (20, 9), torch.float32, "rmsnorm", seed=3)
    full = kernel(x, weights, biases, "rmsnorm", gamma, res)
    for M in (1, 3, 5):
        assert torch.equal(kernel(x[:M], weights, biases, "rmsnorm", gamma, res[:M]), full[:M])
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(kernel(x, weights, biases, "rmsnorm", gamma, res), full)
    finally:
        torch.set_num_threads(saved)


def test_segments_equal_one_merged_weight(isa):
    """q, k and v read as three tensors give what their concatenation gives, bit for bit."""
    x, weights, biases, gamma, _ = operands(4, 200, (64, 16, 16), torch.bfloat16, "rmsnorm", seed=11, bias=False)
    merged = kernel(x, [torch.cat(weights)], [None], "rmsnorm", gamma)
    assert torch.equal(kernel(x, weights, [None] * 3, "rmsnorm", gamma), merged)


def test_residual_may_be_the_output(isa):
    x, weights, biases, _, res = operands(4, 64, (64,), torch.float32, "none", seed=5)
    expected = kernel(x, weights, biases, residual=res)
    native.dense_linear_fused_into(res, x, weights, biases, "none", None, EPS, res)  # y aliases residual
    assert torch.equal(res, expected)


def test_extreme_activations_as_in_torch(isa):
    """SiLU of large and tiny gates, a NaN row and an all-zero RMSNorm row (eps keeps it finite)."""
    K = 48
    x = torch.randn(4, 2 * K)
    x[0, :K] = torch.linspace(-120, 120, K)
    x[1, 3] = float("nan")
    w = torch.randn(5, K) / K**0.5
    y = kernel(x, [w], [None], "silu_mul")
    ref = fused_linear_reference(x, [w], [None], "silu_mul")
    assert torch.equal(y.isnan(), ref.isnan()) and y[1].isnan().all()
    torch.testing.assert_close(y[[0, 2, 3]], ref[[0, 2, 3]], atol=1e-4, rtol=1e-4)
    z = torch.zeros(2, K)
    out = kernel(z, [w], [None], "rmsnorm", torch.ones(K))
    assert torch.equal(out, torch.zeros_like(out))


def test_large_prompts_and_mixed_dtypes_take_the_reference():
    x, weights, biases, gamma, res = operands(40, 64, (32, 16), torch.float32, "rmsnorm", seed=9)
    out = fused_linear(x, weights, biases, "rmsnorm", gamma, EPS, res)
    assert torch.equal(out, fused_linear_reference(x, weights, biases, "rmsnorm", gamma, EPS, res))
    batched = fused_linear(x.view(4, 10, 64), weights, biases, "rmsnorm", gamma, EPS, res.view(4, 10, 48))
    assert torch.equal(batched.view(40, 48), out)
    half_gamma = gamma.to(torch.bfloat16)  # gamma in another dtype: torch promotes, so does the reference
    torch.testing.assert_close(fused_linear(x[:2], weights, biases, "rmsnorm", half_gamma, EPS),
                               fused_linear_reference(x[:2], weights, biases, "rmsnorm", half_gamma, EPS))


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(prologue="gelu"), "prologue must be one of"),
        (dict(weights=[]), "weights is empty"),
        (dict(biases=[None]), "one entry .* per weight"),
        (dict(weights=[torch.randn(8, 32), torch.randn(4, 16)]), r"weights\[1\] must be 2-D \[N, 32\]"),
        (dict(x=torch.randn(2, 31)), "must have 32 = in_features columns"),
        (dict(prologue="silu_mul"), "64 = 2 x in_features"),
        (dict(prologue="rmsnorm", gamma=None), r"needs gamma of shape \(32,\)"),
        (dict(residual=torch.randn(2, 11)), r"residual must have shape \(2, 12\)"),
        (dict(x=torch.ones(2, 32, dtype=torch.int32)), "x must be a float tensor"),
    ],
)
def test_bad_input_is_refused_naming_the_parameter(change, match):
    kw = dict(x=torch.randn(2, 32), weights=[torch.randn(8, 32), torch.randn(4, 32)], biases=[None, None],
              prologue="rmsnorm", gamma=torch.ones(32), residual=None)  # fmt: skip
    kw.update(change)
    with pytest.raises(ValueError, match=match):
        fused_linear(kw["x"], kw["weights"], kw["biases"], kw["prologue"], kw["gamma"], EPS, kw["residual"])


def test_fake_kernel_and_torch_compile():
    x, weights, biases, gamma, res = operands(4, 64, (32, 16), torch.float32, "rmsnorm", seed=13)

    def step(x, res):
        return fused_linear(x, weights, biases, "rmsnorm", gamma, EPS, res)

    eager = step(x, res)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(x, res)
    assert torch.equal(compiled, eager)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fx = mode.from_tensor(x)
        out = torch.ops.aipc.fused_linear(fx, [mode.from_tensor(w) for w in weights],
                                          [None if b is None else mode.from_tensor(b) for b in biases], "rmsnorm",
                                          mode.from_tensor(gamma), EPS, None)  # fmt: skip
        assert out.shape == (4, 48)


@pytest.mark.parametrize("dt", DTYPES)
def test_rms_norm_is_transformers_bit_for_bit(dt):
    """The torch-ops prologue (what the low-bit layers quantize) equals LlamaRMSNorm's forward bit for bit,
    in each dtype, with an all-zero row and large / small values, and leaves its input as it was."""
    modeling_llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    K = 200
    norm = modeling_llama.LlamaRMSNorm(K, eps=EPS).to(dt)
    x, _, _, gamma, _ = operands(5, K, (K,), dt, "rmsnorm", seed=13)
    x[1] = 0  # eps keeps an all-zero row finite
    x[2, :7] = torch.tensor([1e4, -1e4, 1e-3, 0.5, -0.25, 3.0, 7.0]).to(dt)
    keep = x.clone()
    with torch.no_grad():
        norm.weight.copy_(gamma)
        for xs in (x, x.reshape(1, 5, K)):  # rows, and a decoder layer's [batch, tokens, hidden]
            got, want = rms_norm_like_transformers(xs, norm.weight, EPS), norm(xs)
            assert got.dtype == want.dtype and torch.equal(got, want)
    assert torch.equal(x, keep)
