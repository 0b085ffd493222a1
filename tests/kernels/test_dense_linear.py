"""aipc::dense_linear: the small-M dense kernels (every ISA this CPU runs, float32 / bf16 / fp16 weights and
activations) against float64 references, on odd shapes, with poisoned outputs."""
import pytest
import torch
import torch.nn.functional as F

from aipc_kernels.core import native
from aipc_kernels.decoder.dense_linear import MAX_M, cpu_max_rows, dense_linear

pytestmark = pytest.mark.skipif(not native.available(), reason="native library not built")

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
OUT_EPS = {torch.float32: 2**-24, torch.bfloat16: 2**-8, torch.float16: 2**-11}


def kernel(x: torch.Tensor, w: torch.Tensor, bias=None) -> torch.Tensor:
    """The native kernel itself, for any number of rows (the op sends rows past cpu_max_rows to F.linear)."""
    y = torch.empty(*x.shape[:-1], w.shape[0], dtype=x.dtype)
    native.dense_linear_into(y, x.contiguous(), w.contiguous(), bias)
    return y


def _assert_close_to_float64(y, x, w, bias):
    """y against x @ w^T + bias in float64 (from the rounded operands): float32 accumulation error relative
    to the sum of |x w| over K and |bias|, then the output dtype's rounding."""
    ref = x.double() @ w.double().T + (0 if bias is None else bias.double())
    scale = x.double().abs() @ w.double().abs().T + (0 if bias is None else bias.double().abs()) + 1e-30
    err = (y.double() - ref).abs()
    bound = 4e-7 * x.shape[-1] ** 0.5 * scale + 2e-7 * scale + OUT_EPS[y.dtype] * ref.abs()
    assert (err <= bound).all(), f"max err {err.max().item():.3g} at {divmod(int(err.argmax()), y.shape[-1])}"


@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 9, 16, 32])
@pytest.mark.parametrize("N, K", [(37, 100), (4, 16), (1, 1), (130, 263), (8, 2048)])
@pytest.mark.parametrize("wdt", DTYPES)
@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
def test_matches_float64_reference(isa, M, N, K, wdt, dt):
    g = torch.Generator().manual_seed(M * 7919 + N * 31 + K)
    x = torch.randn(M, K, generator=g).to(dt)
    w = torch.randn(N, K, generator=g).to(wdt)
    bias = torch.randn(N, generator=g).to(dt)
    y = kernel(x, w, bias)
    assert y.shape == (M, N) and y.dtype == dt
    _assert_close_to_float64(y, x, w, bias)
    op = dense_linear(x, w, bias)  # the op: the kernel up to cpu_max_rows rows, else F.linear
    assert torch.equal(op, y if M <= cpu_max_rows(dt, wdt) else F.linear(x, w.to(dt), bias))


@pytest.mark.parametrize("dt", DTYPES)
def test_fp16_activations_and_no_bias(isa, dt):
    x = torch.randn(6, 200).to(dt)
    w = torch.randn(21, 200).to(dt)
    _assert_close_to_float64(kernel(x, w), x, w, None)


def test_each_row_is_the_same_for_any_number_of_rows(isa):
    """A token's output does not depend on how many rows share the call (beams, batch): bit for bit."""
    for dt in (torch.float32, torch.bfloat16):  # bf16 x and weights: the AVX512-BF16 path where the CPU has it
        x = torch.randn(MAX_M, 333).to(dt)
        for wdt in DTYPES:
            w = torch.randn(45, 333).to(wdt)
            full = kernel(x, w)
            for M in (1, 2, 3, 5, 8, 17):
                assert torch.equal(kernel(x[:M], w), full[:M]), (dt, wdt, M)


def test_threads_do_not_change_the_result(isa):
    w = torch.randn(77, 300).to(torch.bfloat16)
    for x in (torch.randn(5, 300), torch.randn(5, 300).to(torch.bfloat16)):
        saved = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            one = kernel(x, w)
        finally:
            torch.set_num_threads(saved)
        assert torch.equal(kernel(x, w), one)


@pytest.mark.parametrize("M", [1, 4, 5, 9])
def test_every_output_written_and_nothing_past_it(isa, M):
    N, K = 35, 71
    x, w = torch.randn(M, K), torch.randn(N, K)
    for dt in DTYPES:
        buf = torch.full((M * N + 64,), float("nan"), dtype=dt)
        y = buf[: M * N].view(M, N)
        native.dense_linear_into(y, x.to(dt), w.to(dt), None)
        assert not torch.isnan(y).any()
        assert torch.isnan(buf[M * N :]).all()
        _assert_close_to_float64(y, x.to(dt), w.to(dt), None)


def test_nan_and_inf_reach_the_output_as_in_torch(isa):
    x, w = torch.randn(3, 40), torch.randn(9, 40)
    w[2, 5], w[4, 39] = float("inf"), float("nan")
    x[1, 7] = float("nan")
    y, ref = dense_linear(x, w), F.linear(x, w)
    assert torch.equal(torch.isnan(y), torch.isnan(ref)) and torch.equal(torch.isinf(y), torch.isinf(ref))


def test_strided_and_batched_operands(isa):
    x = torch.randn(2, 3, 256)[..., ::2]  # leading dims flattened, a strided view
    w = torch.randn(40, 256)[:, ::2]  # a strided weight view: copied by the op
    bias = torch.randn(40, 2)[:, 1]
    y = dense_linear(x, w, bias)
    assert y.shape == (2, 3, 40)
    _assert_close_to_float64(y.reshape(6, 40), x.reshape(6, 128), w, bias)


def test_many_rows_and_other_dtypes_are_f_linear():
    """A prompt (more than cpu_max_rows rows) and float64 run torch's own F.linear: identical to it."""
    x, w, b = torch.randn(MAX_M + 1, 96), torch.randn(24, 96), torch.randn(24)
    assert cpu_max_rows(torch.float32, torch.float32) < MAX_M + 1 and cpu_max_rows(torch.float64, torch.float32) == 0
    assert torch.equal(dense_linear(x, w, b), F.linear(x, w, b))
    assert torch.equal(dense_linear(x[:3].double(), w.double()), F.linear(x[:3].double(), w.double()))
    assert dense_linear(torch.empty(0, 96), w).shape == (0, 24)


def test_bad_input_is_refused_naming_the_parameter():
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match=r"weight must be 2-D"):
        dense_linear(x, torch.randn(64))
    with pytest.raises(ValueError, match=r"does not match weight's in_features=32"):
        dense_linear(x, torch.randn(8, 32))
    with pytest.raises(ValueError, match=r"bias must have shape \(8,\)"):
        dense_linear(x, torch.randn(8, 64), torch.randn(9))
    with pytest.raises(ValueError, match=r"weight must be a float tensor"):
        dense_linear(x, torch.ones(8, 64, dtype=torch.int8))
    with pytest.raises(RuntimeError, match=r"aipc_dense_linear failed: bad shape"):  # the C entry's own check
        native.dense_linear_into(torch.empty(2, 0), x, torch.randn(0, 64), None)


def test_fake_kernel_and_torch_compile():
    x, w, b = torch.randn(4, 96), torch.randn(24, 96).to(torch.bfloat16), torch.randn(24)
    torch.library.opcheck(torch.ops.aipc.dense_linear.default, (x, w, b))
    eager = dense_linear(x, w, b)
    compiled = torch.compile(lambda t: dense_linear(t, w, b) * 2, fullgraph=True)(x)
    torch.testing.assert_close(compiled, eager * 2)
