"""lowbit_linear: native CPU kernels (every ISA this CPU has) against float64 references."""
import importlib.util
import math
from pathlib import Path

import pytest
import torch

from aipc_kernels.core import native
from aipc_kernels.lowbit import ops, packing
from aipc_kernels.lowbit.formats import CODEBOOKS, LowBitWeight, pack_codes
from aipc_kernels.lowbit.quantizers import quantize_rtn

NAN = math.nan  # the C entry's "zero points stored per group" (affine); a finite zero with zeros is the min form

pytestmark = pytest.mark.skipif(not native.available(), reason="native library not built")


def _case(N, K, codebook, group, seed, scale_dtype=torch.float16):
    g = torch.Generator().manual_seed(seed)
    w = quantize_rtn(torch.randn(N, K, generator=g), codebook, group, scale_dtype=scale_dtype)
    return w, packing.pack_for_cpu(w)


@pytest.mark.parametrize("codebook", sorted(CODEBOOKS))
@pytest.mark.parametrize("M, N, K, group", [(1, 37, 256, 32), (1, 19, 1536, -1), (1, 23, 640, 128), (3, 16, 128, 64), (6, 21, 128, 64), (8, 50, 384, 128), (13, 33, 192, -1), (40, 17, 256, 64)])
def test_matches_exact_integer_math(isa, codebook, M, N, K, group):
    w, p = _case(N, K, codebook, group, seed=M * 1000 + N)
    x = torch.randn(M, K)
    bias = torch.randn(N)
    y = ops.lowbit_linear(x, p, bias)
    ref = ops.reference_linear_w8(x, w, bias)
    assert y.shape == (M, N) and y.dtype == x.dtype
    torch.testing.assert_close(y.double(), ref, rtol=2e-5, atol=2e-5 * ref.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("lead", [(2, 5), (1,)], ids=["2x5", "decode"])
def test_dtypes_against_float64_dequantized_weights(isa, dtype, scale_dtype, lead):
    N, K = 70, 512
    w, p = _case(N, K, "affine", 64, seed=7, scale_dtype=scale_dtype)
    x = torch.randn(*lead, K).to(dtype)  # leading batch dims are flattened
    bias = torch.randn(N).to(dtype)
    y = ops.lowbit_linear(x, p, bias)
    assert y.shape == (*lead, N) and y.dtype == dtype
    exact = ops.reference_linear_w8(x, w, bias)
    tol = {torch.float32: 2e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}[dtype]
    torch.testing.assert_close(y.double(), exact, rtol=tol, atol=tol * exact.abs().max().item())
    # against unquantized activations: the int8 activation error only (absmax/127 per token)
    weight_only = x.double() @ w.dequantize(torch.float64).T + bias.double()
    rel = ((y.double() - weight_only).norm() / weight_only.norm()).item()
    assert rel < 0.02, rel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act_group", [0, 64])
def test_activation_rounding_ties_to_even(isa, dtype, act_group):
    """Activations that are exact ties (half-integers with absmax 127: scale 1), so each ISA's quantizer
    must round half to even like the reference; one code off moves an output by a whole weight."""
    M, N, K = 3, 20, 256
    w, p = _case(N, K, "affine", 64, seed=11)
    g = torch.Generator().manual_seed(5)
    x = torch.randint(-126, 126, (M, K), generator=g) + 0.5  # exact in float32 and bfloat16
    x[:, ::64] = 127.0  # each span's absmax
    x = x.to(dtype)
    y = ops.lowbit_linear(x, p, act_group=act_group)
    ref = ops.reference_linear_w8(x, w, act_group=act_group)
    tol = 1e-6 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(y.double(), ref, rtol=tol, atol=tol * ref.abs().max().item())


@pytest.mark.parametrize("M", [1, 6])  # M=1: the decode kernels with per-group activation scales
def test_per_group_activation_scales(isa, M):
    w, p = _case(24, 256, "sym", 32, seed=3)
    x = torch.randn(M, 256)
    x[:, :32] *= 100  # one outlier group: per-group scales keep the rest precise
    y = ops.lowbit_linear(x, p, act_group=32)
    torch.testing.assert_close(y.double(), ops.reference_linear_w8(x, w, act_group=32), rtol=2e-5, atol=1e-3)
    exact = x.double() @ w.dequantize(torch.float64).T
    err_group = (y.double() - exact).norm()
    err_token = (ops.lowbit_linear(x, p).double() - exact).norm()
    assert err_group < err_token


@pytest.mark.parametrize("M", [1, 4, 6, 9])  # 256-bit tiles of 4 tokens: remainders 2 and 1
def test_every_output_written_and_nothing_past_it(isa, M):
    N, K = 35, 128
    w, p = _case(N, K, "int2", 32, seed=11)
    x = torch.randn(M, K)
    for dtype in (torch.float32, torch.bfloat16):
        buf = torch.full((M * N + 64,), float("nan"), dtype=dtype)
        y = buf[: M * N].view(M, N)
        native.lowbit_linear_into(y, x.to(dtype), p.qweight, p.scales, None, None, 2, 32, 1.0, 2.0, K)
        assert not torch.isnan(y).any()
        assert torch.isnan(buf[M * N :]).all()


def test_zero_activations_and_zero_rows():
    w, p = _case(16, 64, "affine", 32, seed=0)
    assert ops.lowbit_linear(torch.zeros(2, 64), p).abs().max() == 0
    assert ops.lowbit_linear(torch.zeros(0, 64), p).shape == (0, 16)


def test_kernel_errors_name_the_parameter():
    """The C entry point's own checks (reached through the packed argument vector) come back as errors
    that name the bad value, for M = 1 (decode path) and M > 1."""
    _, p = _case(16, 128, "affine", 32, seed=0)
    for M in (1, 3):
        y = torch.empty(M, 16)
        with pytest.raises(RuntimeError, match=r"bad group size .*group_size=48"):
            native.lowbit_linear_into(y, torch.randn(M, 128), p.qweight, p.scales, p.zeros, None, 2, 48, 1.0, NAN, 128)
        with pytest.raises(RuntimeError, match=r"bits must be 1, 2, 4 or 8"):
            native.lowbit_linear_into(y, torch.randn(M, 128), p.qweight, p.scales, p.zeros, None, 3, 32, 1.0, NAN, 128)


def test_isa_override_is_validated():
    with pytest.raises(ValueError, match="AIPC_ISA / isa='sse9' is unknown"):
        native.set_isa("sse9")


def test_supported_isas_are_exactly_those_set_isa_accepts():
    """Not every ISA ranked below the best one (an AVX-512 CPU may lack AVX-VNNI); the query leaves the
    ISA in use as it was."""
    native.set_isa("scalar")
    try:
        supported = native.supported_isas()
        assert native.get_isa() == "scalar"
        assert "scalar" in supported and native.best_isa() in supported
        for isa in native.ISAS:
            try:
                native.set_isa(isa)
                accepted = True
            except ValueError:
                accepted = False
            assert accepted == (isa in supported), isa
    finally:
        native.set_isa(native.best_isa())


def test_reference_path_for_canonical_layout():
    w, _ = _case(20, 128, "ternary", 64, seed=5)
    x = torch.randn(3, 128)
    y = ops.lowbit_linear(x, packing.as_canonical_packed(w))
    torch.testing.assert_close(y, ops.reference_linear(x, w))


def test_mismatched_weight_is_refused():
    _, p = _case(16, 128, "affine", 32, seed=0)
    with pytest.raises(ValueError, match="does not match x's K=64"):
        ops.lowbit_linear(torch.randn(1, 64), p)


def test_fake_kernel_and_torch_compile():
    w, p = _case(48, 256, "affine", 64, seed=2)
    x = torch.randn(4, 256)
    torch.library.opcheck(
        torch.ops.aipc.lowbit_linear.default,
        (x, p.qweight, p.scales, p.zeros, None, p.layout, p.codebook, p.group_size, p.out_features, 0),
    )
    eager = ops.lowbit_linear(x, p)
    compiled = torch.compile(lambda t: ops.lowbit_linear(t, p) * 2, fullgraph=True)(x)
    torch.testing.assert_close(compiled, eager * 2)


def test_strided_operands_are_read_correctly(isa):
    """The kernel reads raw pointers: strided views (bias, weights) must not be misread."""
    w, p = _case(32, 128, "affine", 32, seed=9)
    x = torch.randn(3, 128)
    bias_store = torch.randn(32, 2)
    bias = bias_store[:, 1]  # stride 2
    scales = torch.cat([p.scales, p.scales], dim=1)[:, : p.scales.shape[1]]  # non-contiguous view
    strided = packing.PackedLowBit(p.layout, p.qweight, scales, p.zeros, p.codebook, p.group_size, p.out_features, p.in_features)
    assert not bias.is_contiguous() and not scales.is_contiguous()
    y = ops.lowbit_linear(x, strided, bias)
    ref = ops.reference_linear_w8(x, w, bias)
    torch.testing.assert_close(y.double(), ref, rtol=2e-5, atol=2e-5 * ref.abs().max().item())


def test_native_entry_refuses_strided_buffers():
    _, p = _case(16, 64, "affine", 32, seed=0)
    y = torch.empty(1, 16)
    with pytest.raises(ValueError, match="must be contiguous"):
        native.lowbit_linear_into(y, torch.randn(1, 64), p.qweight, p.scales.transpose(1, 2).contiguous().transpose(1, 2), p.zeros, None, 2, 32, 1.0, NAN, 64)


def _bench_probes():
    """``bench/native_probes.py``, the benchmarks' loader of the probe library."""
    spec = importlib.util.spec_from_file_location("native_probes", Path(__file__).parents[2] / "bench" / "native_probes.py")
    probes = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probes)
    return probes


def test_timing_helpers_run_the_kernel_and_report_errors():
    """The benchmarks' C-timed loops (``bench/native_probes.py``: ``time_lowbit_linear``,
    ``time_stream_read``): each vector's call really runs (its poisoned output is the kernel's result
    afterwards), a time per call comes back, and a failing call is an error, not a time."""
    probes = _bench_probes()
    sets = [_case(21, 128, "affine", 32, seed=s) for s in (1, 2)]
    x = torch.randn(1, 128)
    ys = [torch.full((1, 21), float("nan")) for _ in sets]
    vectors = [native.lowbit_linear_args(y, x, p.qweight, p.scales, p.zeros, None, 2, 32, 1.0, NAN, 128)
               for y, (_, p) in zip(ys, sets)]
    t = probes.time_lowbit_linear(vectors, calls=3, min_seconds=0.0)
    assert 0 < t < 1
    for y, (w, p) in zip(ys, sets):
        torch.testing.assert_close(y, ops.lowbit_linear(x, p), rtol=0, atol=0)
    bad = [native.lowbit_linear_args(ys[0], x, sets[0][1].qweight, sets[0][1].scales, sets[0][1].zeros, None, 2, 48, 1.0, NAN, 128)]
    with pytest.raises(RuntimeError, match="bad group size"):
        probes.time_lowbit_linear(bad, calls=1, min_seconds=0.0)
    assert 0 < probes.time_stream_read([torch.ones(4096, dtype=torch.uint8)] * 2, calls=2, min_seconds=0.0) < 1
    with pytest.raises(ValueError, match="vectors is empty"):
        probes.time_lowbit_linear([], calls=1)
    with pytest.raises(ValueError, match="one size"):
        probes.time_stream_read([torch.ones(64, dtype=torch.uint8), torch.ones(128, dtype=torch.uint8)], calls=1)


def _cpu_flags() -> set[str]:
    """The CPU's feature flags as the kernel lists them (/proc/cpuinfo)."""
    return set(next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "").split())


def _rate_or_named_error(has: bool, probe, match: str) -> None:
    """A probe of instructions the CPU has answers a positive, finite rate; one it lacks raises a RuntimeError
    matching ``match`` (what is missing)."""
    if has:
        assert 0 < probe() < math.inf
    else:
        with pytest.raises(RuntimeError, match=match):
            probe()


def test_fma_peak_probe_answers_or_names_what_is_missing():
    """The float32 FMA peak probe (``fma_peak``, the W4A16 / dense rows' compute bound in bench/gemv_cpu.py):
    a positive rate for each width this CPU has, a clear error for one it lacks or a width that is none."""
    probes = _bench_probes()
    flags = _cpu_flags()
    for bits, needs in ((256, {"avx2", "fma"}), (512, {"avx512f"})):
        _rate_or_named_error(needs <= flags, lambda: probes.fma_peak(bits, threads=1, iters=1000), f"no {bits}-bit FMA")
    with pytest.raises(ValueError, match="bits=128"):
        probes.fma_peak(128)
    with pytest.raises(ValueError, match="iters=0"):
        probes.fma_peak(256, threads=1, iters=0)


def test_instruction_mix_probes_answer_or_name_what_is_missing():
    """The compute bounds bench/gemv_cpu.py puts rows against: the W4A16 int dequantization mix
    (``dequant_fma_peak``, AVX2 + FMA) and the int8 dot product of each ISA (``int8_dot_peak``): a positive
    rate where the CPU has the instructions, a clear error naming the ISA where it does not, and ValueErrors
    for an unknown ISA or no iterations."""
    probes = _bench_probes()
    flags = _cpu_flags()
    _rate_or_named_error({"avx2", "fma"} <= flags, lambda: probes.dequant_fma_peak(threads=1, iters=1000), "needs AVX2")
    for isa, needs in (("avx2", {"avx2"}), ("avx_vnni", {"avx2", "avx_vnni"}), ("avx512_vnni", {"avx512bw", "avx512_vnni"})):
        _rate_or_named_error(needs <= flags, lambda: probes.int8_dot_peak(isa, threads=1, iters=1000),
                             f"no {isa} dot product")
    with pytest.raises(ValueError, match="isa='amx_int8'"):
        probes.int8_dot_peak("amx_int8")
    with pytest.raises(ValueError, match="iters=0"):
        probes.int8_dot_peak("avx2", threads=1, iters=0)
    with pytest.raises(ValueError, match="iters=0"):
        probes.dequant_fma_peak(threads=1, iters=0)


@pytest.mark.parametrize("codebook, K, top", [("int8", 4096, 127), ("int4", 32768, 7)])
@pytest.mark.parametrize("M", [1, 3, 9])
def test_wide_codes_cancel_exactly(isa, M, codebook, K, top):
    """4- and 8-bit codes, one group per row: the dot of the codes passes float32's 2^24 (~6.7e7 and
    ~3.2e7 here) while the output is small; the zero correction is taken in integers, so the output is
    the exact integer math, not the rounding of two large floats."""
    N = 19
    sign = torch.ones(N, K, dtype=torch.int64)
    sign[:, K // 2 :] = -1  # a small surplus of +top levels: u stays small, the dot of the codes is huge
    sign[:, K // 2 : K // 2 + 26] = 1
    w = quantize_rtn(float(top) * sign.float(), codebook, -1)
    assert int(w.values().sum(1)[0]) == 2 * 26 * top
    x = torch.full((M, K), 3.0)  # absmax scale: every activation quantizes to 127
    y = ops.lowbit_linear(x, packing.pack_for_cpu(w))
    ref = ops.reference_linear_w8(x, w)
    torch.testing.assert_close(y.double(), ref, rtol=1e-6, atol=1e-3)


@pytest.mark.parametrize("codebook", sorted(CODEBOOKS))
@pytest.mark.parametrize("sign", [-1.0, 1.0])
@pytest.mark.parametrize("M", [1, 5])  # decode (both halves of a chunk); a tile of tokens (one half at a time)
def test_largest_codes_times_largest_activations(isa, codebook, sign, M):
    """Every code at its largest and every activation at +-127, one group per long row: AVX2's 16-bit sums of
    planes (vpmaddubsw + vpaddw over up to 4 chunks of 4-bit codes or 8 of 2- and 1-bit ones, widened once)
    must stay within int16 there: a kernel that summed three times as many planes in 16 bits before widening
    fails this test."""
    cb = CODEBOOKS[codebook]
    N, K = 21, 2048
    codes = torch.full((N, K), cb.max_code, dtype=torch.uint8)
    scales = torch.full((N, 1), 0.01, dtype=torch.float16)
    zeros = torch.zeros(N, 1, dtype=torch.float16) if cb.mins or cb.zero is None else None
    w = LowBitWeight(pack_codes(codes, cb.bits), scales, zeros, codebook, K, K)
    x = torch.full((M, K), 3.0 * sign)  # absmax scale: every activation quantizes to +-127
    y = ops.lowbit_linear(x, packing.pack_for_cpu(w))
    ref = ops.reference_linear_w8(x, w)
    assert ref.abs().min() > 0
    torch.testing.assert_close(y.double(), ref, rtol=1e-6, atol=1e-6 * ref.abs().max().item())


# ---------------------------------------------------------------------- act_amax: a given per-token absmax


@pytest.mark.parametrize("codebook, group", [("ternary", -1), ("affine", 64), ("int8", -1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M", [1, 5, 40])  # decode; on-the-fly tiles (one of 5 tokens, five of 8) / AMX at 40
def test_act_amax_matches_reference(isa, codebook, group, dtype, M):
    """A given absmax above each token's own (coarser codes), below it (codes clamped to +-127) or zero
    (zero activations: bias only): every ISA's kernel equals ``reference_linear_w8`` with the same
    ``act_amax``; the token's own absmax gives the bits of the kernel's own quantization."""
    N, K = 33, 256
    w, p = _case(N, K, codebook, group, seed=M)
    g = torch.Generator().manual_seed(M + 1)
    x = torch.randn(M, K, generator=g).to(dtype)
    bias = torch.randn(N, generator=g).to(dtype)
    own = x.float().abs().amax(-1)
    coarser = own * (1 + 3 * torch.rand(M, generator=g))
    clamped = own * 0.5
    zero_row = coarser.clone()
    zero_row[0] = 0.0
    tol = 2e-5 if dtype == torch.float32 else 8e-3
    for amax in (coarser, clamped, zero_row):
        y = ops.lowbit_linear(x, p, bias, act_amax=amax)
        ref = ops.reference_linear_w8(x, w, bias, act_amax=amax)
        torch.testing.assert_close(y.double(), ref, rtol=tol, atol=tol * ref.abs().max().item())
    assert torch.equal(ops.lowbit_linear(x, p, bias, act_amax=zero_row)[0], bias)
    assert torch.equal(ops.lowbit_linear(x, p, bias, act_amax=own), ops.lowbit_linear(x, p, bias))
    # the coarser scale loses precision against unquantized activations: it is in use, not ignored
    exact = x.double() @ w.dequantize(torch.float64).T + bias.double()
    err_own, err_x4 = ((ops.lowbit_linear(x, p, bias, act_amax=a).double() - exact).norm() for a in (own, own * 4))
    assert err_x4 > 2 * err_own, (err_x4, err_own)


def test_act_amax_slices_reproduce_the_whole_row(isa):
    """A row-parallel layer under tensor parallelism: each rank holds a K slice of x and W. Quantized with
    the whole row's absmax (act_amax), the slices get the whole row's int8 codes, so their outputs sum to
    the whole row's (up to float rounding); with each slice's own absmax they do not."""
    M, N, K = 6, 40, 512
    g = torch.Generator().manual_seed(9)
    halves = [quantize_rtn(torch.randn(N, K // 2, generator=g), "ternary", 64) for _ in range(2)]
    whole = type(halves[0])(torch.cat([h.qweight for h in halves], 1), torch.cat([h.scales for h in halves], 1), None,
                            "ternary", 64, K)  # fmt: skip
    x = torch.randn(M, K, generator=g)
    x[:, : K // 2] *= 4  # the halves' own absmax values differ
    y_whole = ops.lowbit_linear(x, packing.pack_for_cpu(whole))
    amax = x.abs().amax(-1)
    parts = [(x[:, i * K // 2 : (i + 1) * K // 2], packing.pack_for_cpu(h)) for i, h in enumerate(halves)]
    y_given = sum(ops.lowbit_linear(xs, ph, act_amax=amax) for xs, ph in parts)
    y_own = sum(ops.lowbit_linear(xs, ph) for xs, ph in parts)
    scale = y_whole.abs().max().item()
    torch.testing.assert_close(y_given, y_whole, rtol=1e-5, atol=1e-5 * scale)
    assert (y_own - y_whole).abs().max().item() > 1e-3 * scale


def test_act_amax_fake_kernel_and_torch_compile():
    """The schema's ``Tensor? act_amax=None``: opcheck with and without it, and a compiled graph that
    computes the absmax and passes it (as vLLM's compiled TP model does)."""
    w, p = _case(48, 256, "ternary", -1, seed=2)
    x = torch.randn(4, 256)
    amax = x.abs().amax(-1) * 2
    base = (x, p.qweight, p.scales, p.zeros, None, p.layout, p.codebook, p.group_size, p.out_features, 0)
    torch.library.opcheck(torch.ops.aipc.lowbit_linear.default, (*base, amax))
    torch.library.opcheck(torch.ops.aipc.lowbit_linear.default, base, {"act_amax": None})
    eager = ops.lowbit_linear(x, p, act_amax=amax)
    fn = torch.compile(lambda t: ops.lowbit_linear(t, p, act_amax=t.abs().amax(-1) * 2) * 2, fullgraph=True)
    torch.testing.assert_close(fn(x), eager * 2)


def _random_weight(N, K, codebook, group, scale_dtype, seed):
    """Random codes, scales and zeros / mins of ``codebook`` (any group the format allows, 16 included)."""
    cb = CODEBOOKS[codebook]
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, cb.max_code + 1, (N, K), generator=g, dtype=torch.uint8)
    scales = (torch.rand(N, K // group, generator=g) * 0.02 + 1e-3).to(scale_dtype)
    zeros = None
    if cb.mins:
        zeros = (torch.randn(N, K // group, generator=g) * 0.05).to(scale_dtype)
    elif cb.zero is None:
        zeros = torch.randint(0, cb.max_code + 1, (N, K // group), generator=g).to(scale_dtype)
    return LowBitWeight(pack_codes(codes, cb.bits), scales, zeros, codebook, group, K)


@pytest.mark.parametrize("codebook", sorted(n for n, c in CODEBOOKS.items() if c.bits >= 2))
@pytest.mark.parametrize("group, scale_dtype", [(16, torch.float32), (16, torch.float16), (32, torch.float32)],
                         ids=["g16-fp32", "g16-fp16", "g32-fp32"])
@pytest.mark.parametrize("M", [1, 5, 36])  # decode, a 256-bit / AVX-512 tile, AMX's tiles (16 tokens on, 32 with g16)
def test_gguf_k_quant_groups_and_float32_scales(isa, codebook, group, scale_dtype, M):
    """GGUF's K-quants: 16-element sub-blocks and float32 scales (d * sub-block scale) on every kernel."""
    N, K = 37, 256
    w = _random_weight(N, K, codebook, group, scale_dtype, seed=M + group)
    x = torch.randn(M, K)
    bias = torch.randn(N)
    y = ops.lowbit_linear(x, packing.pack_for_cpu(w), bias)
    ref = ops.reference_linear_w8(x, w, bias)
    torch.testing.assert_close(y.double(), ref, rtol=2e-5, atol=2e-5 * ref.abs().max().item())
    if M == 36:  # and per-group activation scales over 16-element groups
        y = ops.lowbit_linear(x, packing.pack_for_cpu(w), bias, act_group=group)
        ref = ops.reference_linear_w8(x, w, bias, act_group=group)
        torch.testing.assert_close(y.double(), ref, rtol=2e-5, atol=2e-5 * ref.abs().max().item())
