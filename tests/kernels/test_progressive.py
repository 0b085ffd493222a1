"""The progressive two-level form (per-channel float scale, int8 levels ``s1 * c + m`` per group): its
quantizer, its layouts, the Triton ``progressive`` kernel (compiled on a CUDA GPU, interpreted on CPU
tensors otherwise) and the native CPU kernels against a float64 reference of the dequantized weight with
the op's int8 activations; the kernel choice and the refusals."""
from __future__ import annotations

import pytest
import torch

from aipc_kernels.lowbit import ops, packing, progressive
from aipc_kernels.lowbit.contract import check_operands
from aipc_kernels.lowbit.quantizers import quantize_activations, quantize_optimized

pytest.importorskip("triton")

from tests.helpers.triton_kernels import import_kernels  # noqa: E402

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
tlin, registry, tuning, pkernel = import_kernels(
    "aipc_kernels.gpu.triton.lowbit", "aipc_kernels.gpu.triton.lowbit.registry", "aipc_kernels.gpu.triton.lowbit.tuning",
    "aipc_kernels.gpu.triton.lowbit.progressive",
)
TOL = 2e-5  # the W*A8 tests' fp32 tolerance (test_triton_lowbit._close)
GEMM = {"KERNEL": "progressive", "BLOCK_N": 32, "BLOCK_M": 32, "num_warps": 4, "num_stages": 2}
GEMM_B = dict(GEMM, WA=0)  # the levels as the dot's B operand
GEMM_CAT = dict(GEMM, KCAT=1, WA=0)  # a chunk's planes joined: one dot of K = 128 (2 bits) / 64 (4 bits)
GEMV = {"KERNEL": "progressive", "BLOCK_N": 16, "BLOCK_M": 16, "num_warps": 4, "num_stages": 2, "SPLIT_K": 3}
PRE = {"SPRE": 1}  # each chunk's group scales and mins loaded a chunk ahead
EXPAND = {"KERNEL": "expand", "BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 64, "num_warps": 4, "num_stages": 2}
# today's kernels on the form (int8 group scales and mins like 16-bit ones, times the row's s0)
STREAM = {"KERNEL": "stream", "XPACK": 1, "PDL": 1, "BLOCK_N": 8, "BLOCK_C": 2, "SPLIT_K": 2, "num_warps": 4, "num_stages": 1}
STREAM_RB = dict(STREAM, RB=3, SPLIT_K=1)
GROUP16 = {"KERNEL": "group", "BLOCK_N": 16, "BLOCK_M": 16, "num_warps": 4, "num_stages": 2, "WA": 1, "SPLIT_K": 2}
GROUP = {"KERNEL": "group", "BLOCK_N": 32, "BLOCK_M": 32, "num_warps": 4, "num_stages": 2, "WA": 0}


@pytest.fixture(autouse=True)
def _no_tuning(tmp_path, monkeypatch):
    monkeypatch.setenv("AIPC_TRITON_AUTOTUNE", "0")
    monkeypatch.setenv("AIPC_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tuning, "_mem_cache", {})


def _weight(N: int, K: int, codebook: str, group: int, seed: int, outliers: bool = True):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) * 0.02
    if outliers:  # a few input channels 10x the rest: many groups then span a small part of the int8 range
        w[:, torch.randperm(K, generator=g)[:3]] *= 10
    return w, progressive.quantize_progressive(w, codebook, group)


def _reference(x: torch.Tensor, q, bias=None) -> torch.Tensor:
    """float64: the op's int8 activations (per token) times the dequantized weight (+ bias)."""
    xq, sx = quantize_activations(x.double())
    y = (xq.double() @ q.dequantize(torch.float64).t()) * sx.double()
    return y if bias is None else y + bias.double()


def _close(y, ref, rtol=TOL):
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y.double().cpu(), ref, rtol=rtol, atol=rtol * ref.abs().max().item())


def _qserve_rtn(w: torch.Tensor, codebook: str, G: int) -> float:
    """Squared error of the plain progressive rounding (QServe's): s0 = absmax / 127, per group
    s1 = ceil(range / max code) and m = round(min), codes rounded: the baseline the search must beat."""
    top = progressive.get_codebook(codebook).max_code
    s0 = (w.abs().amax(1, keepdim=True) / 127).half().float()
    u = (w / s0).clamp(-128, 127).reshape(w.shape[0], -1, G)
    lo, hi = u.amin(-1, keepdim=True), u.amax(-1, keepdim=True)
    s1 = torch.ceil((hi - lo) / top).clamp(1, progressive.max_sub_scale(codebook))
    m = torch.minimum(torch.round(lo).clamp_min(-128), 127 - s1 * top)
    c = torch.clamp(torch.round((u - m) / s1), 0, top)
    return (((s1 * c + m) * s0[:, :, None] - w.reshape(u.shape)) ** 2).sum().item()


@pytest.mark.parametrize("codebook", progressive.CODEBOOKS)
@pytest.mark.parametrize("N,K,group", [(37, 576, 64), (16, 4096, 128), (24, 384, 32), (9, 256, -1)])
def test_quantizer_gives_the_form(codebook, N, K, group):
    w, q = _weight(N, K, codebook, group, seed=N + K)
    s0 = progressive.row_scales(q)
    assert s0 is not None and torch.equal(s0.half().float(), s0)
    w8 = q.dequantize(torch.float64) / s0.double()[:, None]
    assert torch.equal(w8, w8.round()) and w8.min() >= -128 and w8.max() <= 127  # s0 * an int8, exactly
    G = K if group == -1 else group
    assert q.super_block == progressive.super_block(K, G) and (q.super_block // G) & (q.super_block // G - 1) == 0
    err = ((q.dequantize() - w) ** 2).sum().item()
    assert err <= _qserve_rtn(w, codebook, G)  # the search never loses to the plain rounding
    flt = ((quantize_optimized(w, codebook, group, scale_dtype=torch.float32).dequantize() - w) ** 2).sum().item()
    assert err <= (1.1 if codebook == "min2" else 2.0) * flt  # the integer grid's cost over a float fit, bounded


def test_quantize_layer_in_blocks_equals_the_whole(monkeypatch):
    """``quantize_layer(..., "progressive")`` (the plugins' entry: vLLM on the fly, the converter) quantizes a block
    of rows at a time: the same weight as the whole matrix at once (row scales, supers and all); a scale dtype
    other than float16 is refused, naming it."""
    from aipc_kernels.lowbit import quantizers

    w = torch.randn(45, 320, generator=torch.Generator().manual_seed(3)).bfloat16()  # K = 5 groups: SB 64
    whole = progressive.quantize_progressive(w.float(), "min4", 64)
    monkeypatch.setattr(quantizers, "QUANT_ROW_BLOCK", 16)  # blocks of 16, 16 and 13 rows
    rows = progressive.quantize_layer(w, "min4", 64, "progressive", torch.float16, name="w")
    for a, b in zip((rows.qweight, rows.scales, rows.zeros, rows.supers), (whole.qweight, whole.scales, whole.zeros, whole.supers)):
        assert torch.equal(a, b)
    assert progressive.row_scales(rows) is not None and rows.super_block == 64 and rows.name == "w"
    with pytest.raises(ValueError, match=r"scale_dtype=torch.bfloat16: the progressive quantizer stores float16"):
        progressive.quantize_layer(w, "min4", 64, "progressive", torch.bfloat16)
    with pytest.raises(ValueError, match=r"method='gptq' is unknown; use one of \('rtn', 'optimized', 'progressive'\)"):
        progressive.quantize_layer(w, "min4", 64, "gptq", torch.float16)


def test_row_scales_refuses_weights_outside_the_form():
    _, q = _weight(8, 256, "min2", 64, seed=1)
    bad = q.scales.clone()
    bad[0, 0] = 86  # 3 * 86 spans more than the int8 range
    assert progressive.row_scales(packing.replace(q, scales=bad)) is None
    sup = q.supers.clone()
    sup[1, 2, 0] *= 2  # the mins' super scale differs from the scales'
    assert progressive.row_scales(packing.replace(q, supers=sup)) is None
    assert progressive.row_scales(q.single_level()) is None
    with pytest.raises(ValueError, match="leave the int8 range"):
        progressive.from_parts(q.codes(), q.scales.int() + 90, q.zeros.int(), q.supers[0, :, 0], "min2", 64)
    with pytest.raises(ValueError, match="float16 values"):
        progressive.from_parts(q.codes(), q.scales.int(), q.zeros.int(), q.supers[0, :, 0] * (1 + 2**-20), "min2", 64)
    with pytest.raises(ValueError, match="progressive form takes"):
        progressive.quantize_progressive(torch.randn(8, 256), "affine", 64)


@pytest.mark.parametrize("codebook", progressive.CODEBOOKS)
def test_layouts_round_trip(codebook):
    _, q = _weight(21, 576, codebook, 64, seed=3)
    p = packing.pack_for_triton(q)
    assert p.scales.dtype == torch.int8 and p.supers.shape == (2, 1, 21)
    back = packing.to_canonical(p)
    assert torch.equal(back.dequantize(), q.dequantize()) and torch.equal(back.supers, q.supers)
    rows = torch.tensor([0, 7, 20])
    for layout in (p, packing.pack_for_cpu(q), packing.as_canonical_packed(q)):
        assert torch.equal(packing.dequantize_rows(layout, rows), q.dequantize()[rows])
    # a two-level weight outside the form goes to triton_k32 as its float32 products, as before
    single = packing.pack_for_triton(packing.replace(q, supers=q.supers * torch.tensor([1.0, 2.0]).view(2, 1, 1)))
    assert single.supers is None and single.scales.dtype == torch.float32


def test_packed_clone_owns_every_tensor():
    """PackedLowBit.clone (the benches' weight copies): equal tensors, none shared, scales, mins and s0 included."""
    p = packing.pack_for_triton(_weight(21, 576, "min2", 64, seed=5)[1])
    c = p.clone()
    assert (c.layout, c.codebook, c.group_size, c.out_features, c.in_features) == (
        p.layout, p.codebook, p.group_size, p.out_features, p.in_features)
    assert len(c.tensors()) == len(p.tensors()) == 4
    for a, b in zip(p.tensors(), c.tensors()):
        assert torch.equal(a, b) and a.dtype == b.dtype and a.data_ptr() != b.data_ptr()


CASES = [  # (M, N, K, codebook, group, config): decode, a split GEMV, GEMM tiles, K padded past the last group
    (1, 40, 576, "min2", 64, GEMV), (5, 72, 256, "min4", 32, GEMV), (16, 33, 384, "min2", 128, None),
    (17, 48, 512, "min4", -1, GEMM), (40, 65, 576, "min2", 64, GEMM), (33, 32, 1024, "min2", 32, dict(GEMM, SPLIT_K=2)),
    (64, 50, 320, "min4", 64, None), (40, 65, 576, "min2", 64, GEMM_B), (17, 48, 512, "min4", -1, GEMM_B),
    (40, 65, 576, "min2", 64, EXPAND), (20, 33, 320, "min4", 32, EXPAND), (40, 65, 512, "min2", 64, EXPAND),
    (20, 33, 256, "min4", 32, EXPAND), (40, 65, 576, "min2", 64, GEMM_CAT),
    (40, 97, 576, "min2", 64, dict(EXPAND, ROW_CHUNKS=2)),  # row chunks of whole tiles, the last one short
    (20, 72, 320, "min4", 32, dict(EXPAND, ROW_CHUNKS=4)),  # more chunks asked than the weight has tiles
    (33, 40, 512, "min2", 32, dict(GEMM_CAT, WA=1, SPLIT_K=2)),
    (40, 65, 576, "min2", -1, GEMM_CAT),  # a group (the whole row) that neither divides the chunk nor is a multiple
    (40, 65, 576, "min2", 64, dict(GEMM_CAT, **PRE)), (33, 32, 1024, "min2", 32, dict(GEMM_CAT, SPLIT_K=2, **PRE)),
    (20, 33, 320, "min4", 32, dict(GEMM, **PRE)), (17, 48, 512, "min4", -1, dict(GEMM_B, **PRE)),
    (5, 72, 256, "min4", 32, dict(GEMV, **PRE)), (1, 40, 576, "min2", 64, dict(GEMV, **PRE)),
    (40, 65, 576, "min2", -1, dict(GEMM, **PRE)),
    (1, 40, 576, "min2", 64, STREAM), (1, 33, 512, "min4", 128, STREAM), (1, 40, 512, "min2", 32, STREAM_RB),
    (1, 24, 256, "min2", -1, STREAM), (7, 40, 576, "min2", 64, GROUP16), (16, 33, 256, "min4", -1, GROUP16),
    (40, 65, 576, "min2", 64, GROUP), (20, 33, 512, "min4", 128, GROUP),
]  # fmt: skip


@pytest.mark.parametrize("M,N,K,codebook,group,cfg", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_kernel_matches_float64(M, N, K, codebook, group, cfg, dtype):
    _, q = _weight(N, K, codebook, group, seed=M + N)
    p = packing.pack_for_triton(q).to(DEVICE)
    g = torch.Generator().manual_seed(M)
    x = torch.randn(M, K, generator=g).to(dtype)
    bias = torch.randn(N, generator=g)
    ref = _reference(x.float(), q, bias)
    out = torch.full((M, N), float("nan"), dtype=dtype, device=DEVICE)  # poisoned: every element written
    y = tlin.lowbit_linear_triton(x.to(DEVICE), p, bias.to(DEVICE), config=cfg, out=out)
    _close(y, ref, TOL if dtype == torch.float32 else 8e-3)
    y_op = ops.lowbit_linear(x.to(DEVICE), p, bias.to(DEVICE))
    if ON_GPU:  # the op: the progressive kernel, heuristic config
        _close(y_op, ref, TOL if dtype == torch.float32 else 8e-3)
    else:  # a CPU tensor in triton_k32: the op's weight-only reference, float activations
        _close(y_op, ops.reference_linear(x.double(), packing.to_canonical(p), bias).double(), 1e-5 if dtype == torch.float32 else 8e-3)


def test_extreme_levels_and_activations():
    """Every level at -128 or +127 against activations of +-127: the int32 accumulator's largest sums."""
    N, K = 16, 2048
    codes = torch.randint(0, 2, (N, K), dtype=torch.uint8) * 3
    s1 = torch.full((N, K // 64), 85)
    m = torch.full((N, K // 64), -128)
    q = progressive.from_parts(codes, s1, m, torch.full((N,), 2.0**-10), "min2", 64)
    x = torch.where(torch.rand(3, K) < 0.5, -1.0, 1.0)
    ref = _reference(x, q)
    _close(tlin.lowbit_linear_triton(x.to(DEVICE), packing.pack_for_triton(q).to(DEVICE), config=GEMV), ref)


def test_expanded_levels_are_the_weight_over_s0():
    from aipc_kernels.gpu.triton.lowbit.expand import expand_levels  # imported (interpreted or not) with the registry
    from aipc_kernels.gpu.triton.lowbit.interpret import interpreter_scope

    codes = torch.randint(0, 2, (35, 512), dtype=torch.uint8, generator=torch.Generator().manual_seed(1)) * 3
    extreme = progressive.from_parts(codes, torch.full((35, 8), 85), torch.full((35, 8), -128), torch.ones(35), "min2", 64)
    weights = [_weight(19, K, codebook, 64, seed=K)[1] for codebook, K in (("min2", 576), ("min4", 320), ("min2", 512),
                                                                           ("min4", 256))]  # fmt: skip
    for q in weights + [extreme]:  # odd and even chunk counts (programs of one or two chunks); levels -128 and 127
        with interpreter_scope():
            w8 = expand_levels(packing.pack_for_triton(q).to(DEVICE)).cpu()
        want = (q.dequantize(torch.float64) / progressive.row_scales(q).double()[:, None]).to(torch.int8)
        assert torch.equal(w8[:, : q.in_features], want)
    assert set(w8.unique().tolist()) == {-128, 127}
    p = packing.pack_for_triton(weights[0]).to(DEVICE)
    with interpreter_scope():  # a row range alone: the same rows as the whole weight's
        part = expand_levels(p, 5, 17).cpu()
        whole = expand_levels(p).cpu()
    assert torch.equal(part, whole[5:17])
    with pytest.raises(ValueError, match="range"):
        expand_levels(p, 17, 5)
    with pytest.raises(ValueError, match="out"):
        expand_levels(p, 0, 12, torch.empty(8, whole.shape[1], dtype=torch.int8, device=DEVICE))


def test_expand_prepass_is_the_two_passes():
    """``expand``'s one launch of the activation pass and the first row chunk's expansion writes the codes, scales
    and levels of the two separate passes bit for bit: odd M, K padded past the last group, a chunk shorter than N,
    with and without a given absmax."""
    from aipc_kernels.gpu.triton.lowbit import expand
    from aipc_kernels.gpu.triton.lowbit.activation import quantize_rows
    from aipc_kernels.gpu.triton.lowbit.interpret import interpreter_scope

    for codebook, K, n1 in (("min2", 576, 64), ("min4", 320, 97)):
        _, q = _weight(97, K, codebook, 64, seed=K)
        p = packing.pack_for_triton(q).to(DEVICE)
        Kp = p.qweight.shape[1] * (8 // p.bits)
        x = (torch.randn(19, K, generator=torch.Generator().manual_seed(K)) * torch.linspace(0.1, 3, K)).to(DEVICE)
        for amax in (None, x.abs().amax(-1) * 0.7):
            with interpreter_scope():
                w8 = torch.full((n1, Kp), 7, dtype=torch.int8, device=DEVICE)
                xq, sx = expand._prepass(x, Kp, amax, p, n1, w8)
                xq_want, sx_want, _ = quantize_rows(x, Kp, sums=False, act_amax=amax)
                w8_want = expand.expand_levels(p, 0, n1)
            assert torch.equal(xq, xq_want) and torch.equal(sx, sx_want)
            assert torch.equal(w8, w8_want)


def test_expand_refuses_a_bad_row_chunk_count():
    _, q = _weight(32, 256, "min2", 64, seed=3)
    x = torch.randn(40, 256).to(DEVICE)
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match="ROW_CHUNKS"):
            tlin.lowbit_linear_triton(x, packing.pack_for_triton(q).to(DEVICE), None, config=dict(EXPAND, ROW_CHUNKS=bad))
    with pytest.raises(ValueError, match="WS=2 must be 0"):
        tlin.lowbit_linear_triton(x, packing.pack_for_triton(q).to(DEVICE), None, config=dict(EXPAND, WS=2))


WS = {"KERNEL": "expand", "BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3, "WS": 1}


def test_expand_warp_specialized_gemm_is_the_triton_gemm():
    """``WS=1`` (the Gluon GEMM: TMA producer, asynchronous wgmma) gives the Triton GEMM's bits: the same int32 sums,
    rows past M and N read as zeros by TMA and dropped at the store, a bias, row chunks; refused off Hopper naming
    the fix."""
    from aipc_kernels.gpu.triton.lowbit import gluon_gemm

    _, q = _weight(97, 576, "min2", 64, seed=11)
    p = packing.pack_for_triton(q).to(DEVICE)
    x = torch.randn(70, 576).to(DEVICE)
    bias = torch.randn(97).to(DEVICE)
    assert registry.usable(dict(WS, WS=0), x.device) and registry.usable(WS, x.device) == gluon_gemm.usable(x.device)
    if not gluon_gemm.usable(x.device):
        with pytest.raises(ValueError, match="WS=1 is a Gluon kernel for CUDA GPUs of compute capability 9.x"):
            tlin.lowbit_linear_triton(x, p, config=WS)
        return
    with pytest.raises(ValueError, match="WS=1 takes BLOCK_M = 16 \\* num_warps"):
        tlin.lowbit_linear_triton(x, p, config=dict(WS, BLOCK_M=128))
    for cfg in (WS, dict(WS, BLOCK_M=128, BLOCK_N=256, num_warps=8, num_stages=2), dict(WS, ROW_CHUNKS=2, PW=1)):
        for b in (None, bias):
            want = tlin.lowbit_linear_triton(x, p, b, config=dict(cfg, WS=0, BLOCK_K=64))
            out = torch.full((70, 97), float("nan"), device=DEVICE)  # poisoned: every element written
            assert torch.equal(tlin.lowbit_linear_triton(x, p, b, config=cfg, out=out), want)
    _, q = _weight(200, 576, "min2", 64, seed=12)  # 21 x 7 tiles of 64 x 32: more than the SMs, some programs take two
    p = packing.pack_for_triton(q).to(DEVICE)
    x = torch.randn(1300, 576).to(DEVICE)
    want = tlin.lowbit_linear_triton(x, p, config=dict(WS, WS=0))
    for cfg in (dict(WS, PERSISTENT=1), dict(WS, PERSISTENT=1, num_stages=2, ROW_CHUNKS=2)):
        assert torch.equal(tlin.lowbit_linear_triton(x, p, config=cfg), want)


def test_rows_do_not_depend_on_the_batch():
    """Unsplit, a row's output is one exact int32 sum then one rounding: the same bits alone and in a batch."""
    _, q = _weight(48, 512, "min2", 64, seed=9)
    p = packing.pack_for_triton(q).to(DEVICE)
    x = torch.randn(33, 512).to(DEVICE)
    big = tlin.lowbit_linear_triton(x, p, config=GEMM)
    for i in (0, 17, 32):
        one = tlin.lowbit_linear_triton(x[i : i + 1], p, config=dict(GEMV, SPLIT_K=1))
        assert torch.equal(one[0], big[i])


def test_the_form_selects_its_kernel_and_others_refuse_it():
    _, q = _weight(40, 512, "min2", 64, seed=4)
    p = packing.pack_for_triton(q).to(DEVICE)
    x2 = torch.randn(3, 512).to(DEVICE)
    dev = torch.device(DEVICE)
    for M, want in ((1, "stream"), (2, "group"), (16, "group"), (17, "progressive"), (1023, "progressive"),
                    (1024, "expand"), (4096, "expand")):
        assert registry.heuristic_config(M, 40, 512, 2, dev, progressive=True)["KERNEL"] == want
    assert tuning.config_key(64, 40, 512, 64, 2, progressive=True) == "gemm:m64:n40:k512:g64:b2:p"
    assert registry.runs(GROUP, x2, p) and not registry.runs(dict(GEMM, KERNEL="cuda_gemm"), x2, p)
    mma = {"cuda_mma"} if ON_GPU and registry.KERNELS["cuda_mma"].available(dev) else set()  # CUDA C: compiled GPUs only
    assert {c["KERNEL"] for c in tuning.candidates(64, packing.pack_for_triton(_weight(128, 512, "min2", 64, 7)[1]))} == {
        "progressive", "expand", "group"} | mma
    assert {c["KERNEL"] for c in tuning.candidates(1, p)} == {"progressive", "stream"}
    single = packing.pack_for_triton(q.single_level()).to(DEVICE)
    assert not registry.runs(GEMM, x2, single) and not registry.runs(EXPAND, x2, single)
    assert not {"progressive", "expand"} & {c["KERNEL"] for c in tuning.candidates(64, single)}
    with pytest.raises(ValueError, match="progressive two-level form"):
        pkernel.check(x2, single, GEMM)
    _, q4 = _weight(40, 512, "min4", 64, seed=6)
    with pytest.raises(ValueError, match="KCAT=1 .* takes 2-bit codes"):
        pkernel.check(x2, packing.pack_for_triton(q4).to(DEVICE), GEMM_CAT)
    inv = registry.invariant_config(dict(GEMV, ATOMIC=1), 1, 40, 512, 2, dev)
    assert inv["KERNEL"] == "progressive" and inv["SPLIT_K"] == 1 and "ATOMIC" not in inv


MMA = {"KERNEL": "cuda_mma", "BLOCK_N": 32, "NT": 4, "SPLIT_K": 1, "D": 2, "num_warps": 4, "num_stages": 1}


@pytest.mark.skipif(not ON_GPU, reason="cuda_mma is CUDA C compiled by NVRTC: a GPU only")
@pytest.mark.parametrize("group", [32, 64, 128])
def test_cuda_mma_takes_the_form(group):
    """The CUDA C tensor-core kernel on the form (int8 scales and mins, s0 per row): one to four 16-token tiles, row
    tiles of 2 / 4 / 8 rows' pairs past a ragged N, K padded past the last group, splits, several warps, bias, x's
    dtypes; extreme levels; against the float64 reference. NT = 1 is refused naming the fix."""
    from aipc_kernels.gpu.cuda import mma as cuda_mma

    N, K = 208, 896 if group == 128 else 960  # N: 6 row blocks of 32 and one of 16 (N % 16 == 0, as NT = 8 needs)
    _, q = _weight(N, K, "min2", group, seed=group)
    p = packing.pack_for_triton(q).to(DEVICE)
    cfgs = (MMA, dict(MMA, SPLIT_K=3, D=1), dict(MMA, BLOCK_N=16, NT=2, num_warps=16, SPLIT_K=8),
            dict(MMA, BLOCK_N=64, NT=8, num_warps=1, D=4), dict(MMA, BLOCK_N=16, NT=2, num_warps=8, D=4, SPLIT_K=2))
    for M, dtype in ((2, torch.bfloat16), (16, torch.float16), (17, torch.float32), (64, torch.bfloat16)):
        g = torch.Generator().manual_seed(M + group)
        x = torch.randn(M, K, generator=g).to(dtype)
        bias = torch.randn(N, generator=g)
        ref = _reference(x.float(), q, bias)
        for cfg in cfgs:
            if cfg["NT"] * -(-M // 16) > 8 or cuda_mma.shared_bytes(cfg["num_warps"], cfg["NT"], -(-M // 16)) > cuda_mma.MAX_SHARED:
                continue  # a lane's accumulators (NT * ceil(M / 16) <= 8) and the warp sums' shared memory, as tuned
            out = torch.full((M, N), float("nan"), dtype=dtype, device=DEVICE)
            _close(tlin.lowbit_linear_triton(x.to(DEVICE), p, bias.to(DEVICE), config=cfg, out=out), ref,
                   TOL if dtype == torch.float32 else 8e-3)  # fmt: skip
    codes = torch.randint(0, 2, (16, 2048), dtype=torch.uint8, generator=torch.Generator().manual_seed(3)) * 3
    extreme = progressive.from_parts(codes, torch.full((16, 32), 85), torch.full((16, 32), -128), torch.full((16,), 2.0**-10),
                                     "min2", 64)  # fmt: skip
    x = torch.where(torch.rand(5, 2048, generator=torch.Generator().manual_seed(4)) < 0.5, -1.0, 1.0)
    pe = packing.pack_for_triton(extreme).to(DEVICE)
    _close(tlin.lowbit_linear_triton(x.to(DEVICE), pe, config=dict(MMA, BLOCK_N=16, NT=2)), _reference(x, extreme))
    with pytest.raises(ValueError, match="NT >= 2.*KERNEL='group'"):
        tlin.lowbit_linear_triton(x.to(DEVICE), pe, config=dict(MMA, BLOCK_N=8, NT=1))


def test_bad_supers_are_refused_naming_the_operand():
    _, q = _weight(40, 512, "min2", 64, seed=5)
    p = packing.pack_for_triton(q)
    x = torch.randn(2, 512)
    with pytest.raises(ValueError, match=r"supers of shape \(2, 40\).*progressive one"):
        check_operands(x, p.qweight, p.scales, p.zeros, None, p.layout, p.codebook, 64, 40, 0, supers=p.supers[:, 0])
    with pytest.raises(ValueError, match="the two-level form takes int8 scales"):
        check_operands(x, p.qweight, p.scales, p.zeros, None, p.layout, p.codebook, 64, 40, 0, supers=None)


def _native():
    from aipc_kernels.core import native

    if not native.available():
        pytest.skip("native kernels not built")
    return native


def _on_scalar(native, fn):
    """``fn()`` with the portable C kernels forced (the bits every ISA must give), the ISA in force restored."""
    isa = native.get_isa()
    native.set_isa("scalar")
    try:
        return fn()
    finally:
        native.set_isa(isa)


@pytest.mark.parametrize("codebook", progressive.CODEBOOKS)
def test_cpu_kernels_accumulate_the_form_in_int32(codebook, isa):
    """Per-token activations: every ISA's kernels (AMX tiles of the levels from 16 tokens, the VNNI / AVX2 tiles' integer
    group epilogue, 16-bit pairs where the dots fit) sum s1 * dot + m * gsum in int32 over the whole K and round once:
    each output within a few float32 roundings of the float64 reference, bit for bit the portable kernel's at every
    M, and each row the same alone as in its batch. Groups 32-128 and one a row; M across the AMX, on-the-fly and
    up-converted (512+) tiles."""
    native = _native()
    for M, group, K in ((1, 64, 576), (5, 128, 640), (20, 32, 576), (3, -1, 576), (40, 64, 576), (520, 64, 576)):
        _, q = _weight(37, K, codebook, group, seed=M)
        p = packing.pack_for_cpu(q)
        assert packing.is_cpu_progressive(p) and p.supers.shape == (1, 3, 1, 16)
        x = torch.randn(M, K)
        ref = _reference(x, q)
        out = torch.full((M, 37), float("nan"))  # poisoned: every output written
        native.lowbit_linear_into(out, x, p.qweight, p.scales, p.zeros, None, p.bits, q.group_size, 1.0, 0.0, K,
                                  supers=p.supers)  # fmt: skip
        y = ops.lowbit_linear(x, p)
        assert torch.equal(y, out)
        err = (y.double() - ref).abs()
        assert bool((err <= 2**-21 * ref.abs() + 1e-30).all()), f"M={M} G={group}: {float((err / ref.abs()).max()):.3g}"
        assert torch.equal(y, _on_scalar(native, lambda: ops.lowbit_linear(x, p)))
        for i in sorted({0, M // 2, M - 1}):
            assert torch.equal(ops.lowbit_linear(x[i : i + 1], p)[0], y[i])


@pytest.mark.parametrize("codebook", progressive.CODEBOOKS)
def test_cpu_form_with_group_activation_scales(codebook, isa):
    """Activation scales per group: the two-level min form's per-group float epilogue, both super scales s0."""
    native = _native()
    _, q = _weight(37, 576, codebook, 64, seed=11)
    p = packing.pack_for_cpu(q)
    for M in (1, 7, 33):
        x = torch.randn(M, 576)
        y = ops.lowbit_linear(x, p, act_group=64)
        _close(y, ops.reference_linear_w8(x, q, act_group=64))
        assert torch.equal(y, _on_scalar(native, lambda: ops.lowbit_linear(x, p, act_group=64)))


def test_cpu_levels_outside_int8_stay_exact(isa):
    """A caller's scales whose levels leave the int8 range (the C entry point trusts none): the AMX tiles decline,
    the integer group epilogue still gives the exact sum."""
    native = _native()
    N, K, G = 40, 512, 64
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 4, (N, K), generator=g)
    s1 = torch.randint(0, 86, (N, K // G), generator=g)
    m = (torch.rand(N, K // G, generator=g) * (256 - 3 * s1)).floor().long() - 128
    s0 = (torch.rand(N, generator=g) * 0.01).half().float()
    p = packing.pack_for_cpu(progressive.from_parts(codes, s1, m, s0, "min2", G))
    s1[5, 2], m[5, 2] = 120, 20  # levels up to 380
    p.scales.copy_(packing.pack_cpu_groups(s1.to(torch.int8)))
    p.zeros.copy_(packing.pack_cpu_groups(m.to(torch.int8)))
    for M in (1, 16, 48):
        x = torch.randn(M, K, generator=g)
        xq, sx = quantize_activations(x.double())
        w = (s0.double()[:, None] * (s1.double().repeat_interleave(G, 1) * codes + m.double().repeat_interleave(G, 1)))
        ref = (xq.double() @ w.t()) * sx.double()
        y = torch.empty(M, N)
        native.lowbit_linear_into(y, x, p.qweight, p.scales, p.zeros, None, 2, G, 1.0, 0.0, K, supers=p.supers)
        assert bool(((y.double() - ref).abs() <= 2**-21 * ref.abs() + 1e-30).all())


def test_cpu_form_refusals():
    native = _native()
    _, q = _weight(40, 512, "min2", 64, seed=8)
    p = packing.pack_for_cpu(q)
    x = torch.randn(2, 512)
    with pytest.raises(ValueError, match=r"progressive form, float32 \[1, 3, 1, 16\]"):
        check_operands(x, p.qweight, p.scales, p.zeros, None, p.layout, p.codebook, 64, 40, 0,
                       supers=p.supers.expand(1, 3, 2, 16).contiguous())  # fmt: skip
    with pytest.raises(RuntimeError, match="two-level scales"):  # the C entry point: one super-block a row
        native.lowbit_linear_into(torch.empty(2, 40), x, p.qweight, p.scales, p.zeros, None, 2, 64, 1.0, 0.0, 512,
                                  supers=p.supers.expand(1, 3, 2, 16).contiguous())  # fmt: skip
    back = packing.to_canonical(p)
    assert torch.equal(back.supers, q.supers) and torch.equal(back.dequantize(), q.dequantize())
