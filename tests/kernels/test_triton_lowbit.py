"""Triton W2A8 lowbit_linear against float64 references.

On a CUDA machine the kernels run compiled on the GPU; without one they run on CPU tensors under
``TRITON_INTERPRET=1`` (set here only while the kernel module is imported), on small shapes.
"""
import json

import pytest
import torch

pytest.importorskip("triton")

from aipc_kernels.lowbit import ops, packing  # noqa: E402
from aipc_kernels.lowbit.formats import CODEBOOKS, LowBitWeight, pack_codes  # noqa: E402
from aipc_kernels.lowbit.quantizers import quantize_rtn  # noqa: E402
from tests.helpers.triton_kernels import import_kernels  # noqa: E402

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
tlin, common, registry, stream, tuning, dequant, cuda_mma, cuda_gemm = import_kernels(
    "aipc_kernels.gpu.triton.lowbit", "aipc_kernels.gpu.triton.lowbit.common", "aipc_kernels.gpu.triton.lowbit.registry",
    "aipc_kernels.gpu.triton.lowbit.stream", "aipc_kernels.gpu.triton.lowbit.tuning", "aipc_kernels.gpu.triton.lowbit.dequant",
    "aipc_kernels.gpu.cuda.mma", "aipc_kernels.gpu.cuda.gemm",
)

# the min form (GGUF's Q4_1 / Q5_1 / K-quants) is tested on its own (test_triton_gguf_forms.py, below)
TRITON_CODEBOOKS = sorted(name for name, cb in CODEBOOKS.items() if not cb.mins)
# the 'group' kernel: weights as the dot's A operand (WA=1) or B; int32 per group, magic-number rescale
GROUP = {"KERNEL": "group", "BLOCK_N": 32, "BLOCK_M": 16, "num_warps": 4, "num_stages": 2, "WA": 1}
GROUP_B = dict(GROUP, BLOCK_N=16, BLOCK_M=32, WA=0)
GROUP16 = dict(GROUP, BLOCK_N=16, BLOCK_M=16, SPLIT_K=2)  # M <= 16: the group kernel split over K
GROUP16_ONE = dict(GROUP16, SPLIT_K=1)  # unsplit (the batch-invariant form)
# M == 1 weight streaming: the packed-activation pre-pass (+ PDL on sm_90) and the GEMV
STREAM = {"KERNEL": "stream", "XPACK": 1, "PDL": 1, "BLOCK_N": 8, "BLOCK_C": 2, "SPLIT_K": 1, "num_warps": 4, "num_stages": 1}
STREAM_FULLX = dict(STREAM, FULLX=1)  # activation words loaded in the weights' layout
STREAM_RB = dict(STREAM, RB=3)  # activations stationary: 3 row blocks per program, the K range in one step
# M > 16: the weight dequantized to x's dtype by a Triton pass, then the vendor GEMM
DEQUANT = {"KERNEL": "dequant", "BLOCK_N": 16, "CHUNKS": 3, "num_warps": 4}


@pytest.fixture(autouse=True)
def _no_tuning(tmp_path, monkeypatch):
    """Tests pick configs explicitly or take the heuristic; the cache goes to a temporary folder."""
    monkeypatch.setenv("AIPC_TRITON_AUTOTUNE", "0")
    monkeypatch.setenv("AIPC_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tuning, "_mem_cache", {})


def _case(N, K, codebook, group, seed, scale_dtype=torch.float16):
    g = torch.Generator().manual_seed(seed)
    w = quantize_rtn(torch.randn(N, K, generator=g), codebook, group, scale_dtype=scale_dtype)
    on = packing.pack_for_triton(w).to(DEVICE)
    return w, on


def _close(y, ref, rtol):
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y.double().cpu(), ref, rtol=rtol, atol=rtol * ref.abs().max().item())


@pytest.mark.parametrize("codebook", sorted(CODEBOOKS))
@pytest.mark.parametrize("K", [96, 160, 384, 512])
@pytest.mark.parametrize("group", [32, 64, 128, -1])
def test_layout_round_trip(codebook, K, group):
    if group > 0 and K % group:
        pytest.skip("group does not divide K")
    w = quantize_rtn(torch.randn(23, K), codebook, group)
    p = packing.pack_for_triton(w)
    if w.bits == 6:  # triton_k32 holds 6-bit codes as their 8-bit equivalent: the same values
        assert p.codebook == ("min8" if w.cb.mins else "int8")
        assert torch.equal(packing.to_canonical(p).dequantize(), w.dequantize())
        w = packing.as_eight_bit(w)
    kc = packing.triton_chunk(w.bits)
    assert p.qweight.shape == (23, -(-K // kc) * kc * w.bits // 8) and p.scales.shape == (K // w.group_size, 23)
    back = packing.to_canonical(p)
    assert torch.equal(back.qweight, w.qweight) and torch.equal(back.scales, w.scales)
    assert (back.zeros is None and w.zeros is None) or torch.equal(back.zeros, w.zeros)
    # bit-plane q of byte j in chunk c holds k = c * 32 * planes + 32 * q + j (8 bits: the one plane q = 0)
    codes = w.codes()
    planes = 8 // w.bits
    q = min(1, planes - 1)
    assert torch.equal((p.qweight[:, 1] >> (q * w.bits)) & ((1 << w.bits) - 1), codes[:, 32 * q + 1])
    assert planes * 32 == kc


@pytest.mark.parametrize("codebook", TRITON_CODEBOOKS)
@pytest.mark.parametrize(
    "M, N, K, group",
    [(1, 37, 256, 32), (3, 33, 192, -1), (16, 50, 384, 128), (17, 40, 512, 64), (5, 19, 96, 32), (40, 70, 256, -1)],
)
def test_matches_exact_integer_math(codebook, M, N, K, group):
    w, p = _case(N, K, codebook, group, seed=M * 1000 + N)
    x = torch.randn(M, K)
    bias = torch.randn(N)
    cfg = GROUP16 if M <= tlin.GEMV_MAX_M else GROUP
    y = tlin.lowbit_linear_triton(x.to(DEVICE), p, bias.to(DEVICE), config=cfg)
    assert y.shape == (M, N) and y.dtype == x.dtype and y.device.type == DEVICE
    ref = ops.reference_linear_w8(x, w, bias)
    _close(y, ref, 2e-5)
    if M == 1:  # the stream GEMV, activation words broadcast over the rows or in the weights' layout
        rows = [STREAM_RB, dict(STREAM_RB, SPLIT_K=2, RB=2)] if CODEBOOKS[codebook].bits > 1 else []  # group 32: within a chunk
        for cfg in (STREAM, STREAM_FULLX, *rows):
            _close(tlin.lowbit_linear_triton(x.to(DEVICE), p, bias.to(DEVICE), config=cfg), ref, 2e-5)
    if M <= tlin.GEMV_MAX_M:  # and the group kernel unsplit (the batch-invariant form)
        _close(tlin.lowbit_linear_triton(x.to(DEVICE), p, bias.to(DEVICE), config=GROUP16_ONE), ref, 2e-5)
    else:  # and the group GEMM with the weights as the dot's B operand
        _close(tlin.lowbit_linear_triton(x.to(DEVICE), p, bias.to(DEVICE), config=GROUP_B), ref, 2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("M", [1, 24])
def test_dtypes_against_float64_dequantized_weights(dtype, scale_dtype, M):
    N, K = 70, 512
    w, p = _case(N, K, "affine", 64, seed=7, scale_dtype=scale_dtype)
    x = torch.randn(2, M, K).to(dtype)  # leading dims are flattened
    bias = torch.randn(N).to(dtype)
    cfg = GROUP16 if 2 * M <= tlin.GEMV_MAX_M else GROUP
    y = tlin.lowbit_linear_triton(x.to(DEVICE), p, bias.to(DEVICE), config=cfg)
    assert y.shape == (2, M, N) and y.dtype == dtype
    tol = {torch.float32: 2e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}[dtype]
    _close(y, ops.reference_linear_w8(x, w, bias), tol)
    # against unquantized activations: the int8 activation error only (absmax/127 per token)
    weight_only = x.double() @ w.dequantize(torch.float64).T + bias.double()
    rel = ((y.double().cpu() - weight_only).norm() / weight_only.norm()).item()
    assert rel < 0.02, rel


@pytest.mark.parametrize(
    "M, kernel",
    [(1, "stream"), (1, "stream_fullx"), (1, "group"), (3, "group"), (16, "group"), (3, "group_atomic"), (16, "group_atomic")],
)
@pytest.mark.parametrize("block_n, split_k", [(16, 2), (32, 3), (16, 8)])
def test_split_k(M, kernel, block_n, split_k):
    N, K = 45, 1024  # 8 chunks: splits of 4, 3 (uneven), 1 chunk
    w, p = _case(N, K, "int2", 64, seed=M + split_k)
    x, bias = torch.randn(M, K), torch.randn(N)
    cfg = {"KERNEL": kernel, "BLOCK_N": block_n, "SPLIT_K": split_k, "num_warps": 4, "num_stages": 2, "BLOCK_C": 1}
    if kernel.startswith("stream"):
        cfg.update(KERNEL="stream", XPACK=1, PDL=1, FULLX=int(kernel == "stream_fullx"))
    if kernel.startswith("group"):
        cfg.update(KERNEL="group", BLOCK_M=16, WA=1, ATOMIC=int(kernel == "group_atomic"))
    for _ in range(2):  # tickets (and the atomic sums) are re-armed by the reducing program: a second call is right too
        y = tlin.lowbit_linear_triton(x.to(DEVICE), p, bias.to(DEVICE), config=cfg)
        _close(y, ops.reference_linear_w8(x, w, bias), 2e-5)
        if kernel == "group_atomic":
            assert not common._sums[common.stream_key(y.device)].any()  # the reducing programs left the buffer zeroed


@pytest.mark.parametrize("M, block_m", [(40, 16), (33, 32)])
@pytest.mark.parametrize("wa, atomic", [(1, 0), (0, 0), (1, 1)])
@pytest.mark.parametrize("codebook, group", [("int2", 64), ("affine", 128), ("int4", -1)])
def test_gemm_split_k(M, block_m, wa, atomic, codebook, group):
    """The GEMM path (M > 16) split over K, several token tiles: workspace or atomic partials, weights as
    A or B, against the float64 int8-activation reference, twice (the tickets re-armed)."""
    N, K = 45, 1024
    w, p = _case(N, K, codebook, group, seed=M + wa)
    x, bias = torch.randn(M, K), torch.randn(N)
    cfg = dict(GROUP, BLOCK_N=16, BLOCK_M=block_m, WA=wa, SPLIT_K=3, ATOMIC=atomic)
    for _ in range(2):
        _close(tlin.lowbit_linear_triton(x.to(DEVICE), p, bias.to(DEVICE), config=cfg), ops.reference_linear_w8(x, w, bias), 2e-5)


def test_untuned_gemm_splits_only_few_tiles():
    dev = torch.device(DEVICE)
    few = registry.heuristic_config(64, 128, 2048, 2, dev)  # one output tile: split (the interpreter counts 4 SMs)
    many = registry.heuristic_config(512, 14336, 4096, 2, dev)
    assert few["KERNEL"] == "group" and few["SPLIT_K"] > 1 and many["SPLIT_K"] == 1
    assert all(c.get("SPLIT_K", 1) == 1 for kern in registry.KERNELS.values() for c in kern.space(513))


@pytest.mark.skipif(not ON_GPU, reason="two CUDA streams running at once need a GPU")
@pytest.mark.parametrize("kernel", ["group_atomic", "group", "stream"])
def test_split_k_on_two_streams_at_once(kernel):
    """Split-K tickets and atomic sums are per stream: two streams launching split-K calls on the same
    output tiles (same N, so the same ticket indices) at once each get their own right results. Few output
    tiles and a long K: each call fills a few SMs, so the two streams' kernels share the GPU."""
    N, K, M = 64, 32768, 1 if kernel == "stream" else 16
    cfg = {"KERNEL": kernel, "BLOCK_N": 16, "SPLIT_K": 8, "num_warps": 4, "num_stages": 2, "BLOCK_C": 1}
    if kernel == "stream":
        cfg.update(XPACK=1, PDL=1, FULLX=0)
    else:
        cfg.update(KERNEL="group", BLOCK_M=16, WA=1, ATOMIC=int(kernel == "group_atomic"))
    cases = [_case(N, K, "int2", 64, seed=s) for s in (1, 2)]
    xs = [torch.randn(M, K, generator=torch.Generator().manual_seed(10 + s)) for s in (1, 2)]
    refs = [ops.reference_linear_w8(x, w) for x, (w, _) in zip(xs, cases)]
    xd = [x.to(DEVICE) for x in xs]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    outs: list[list[torch.Tensor]] = [[], []]
    for i in range(2):  # compiled first: a compile between the launches below would end their overlap
        tlin.lowbit_linear_triton(xd[i], cases[i][1], config=cfg)
    torch.cuda.synchronize()
    for st in streams:  # hold both queues until every call is enqueued: their kernels then run back to back, at once
        with torch.cuda.stream(st):
            torch.cuda._sleep(400_000_000)
    for _ in range(100):
        for i, st in enumerate(streams):
            with torch.cuda.stream(st):
                outs[i].append(tlin.lowbit_linear_triton(xd[i], cases[i][1], config=cfg))
    torch.cuda.synchronize()
    for i in range(2):
        for y in outs[i]:
            _close(y, refs[i], 2e-5)
    keys = []
    for st in streams:
        with torch.cuda.stream(st):
            keys.append(common.stream_key(xd[0].device))
    assert keys[0] != keys[1] and all(k in common._locks for k in keys)  # one ticket buffer per stream


@pytest.mark.parametrize("M", [1, 16])
def test_atomic_split_k_bf16_repeated_and_deterministic_mode(M):
    """Atomic split-K (partials added into one zeroed fp32 buffer, read back and zeroed by one atomic
    exchange) with bf16 activations and output, the case that first raced on the H200 (a load then a
    zeroing store); under ``torch.use_deterministic_algorithms`` the same config takes the ticket path."""
    N, K = 100, 1024
    w, p = _case(N, K, "int2", 64, seed=9)
    x = torch.randn(M, K).to(torch.bfloat16)
    ref = ops.reference_linear_w8(x, w)
    calls = 20 if ON_GPU else 2
    for bn, nw, split in ((32, 2, 8), (128, 8, 4), (64, 4, 2)):
        cfg = dict(GROUP16, BLOCK_N=bn, num_warps=nw, SPLIT_K=split, ATOMIC=1)
        for _ in range(calls):
            _close(tlin.lowbit_linear_triton(x.to(DEVICE), p, config=cfg).float(), ref, 8e-3)
    assert common.split_plan(8, 4, 4, M, N, torch.empty(1, device=DEVICE), atomic=True)[4]
    torch.use_deterministic_algorithms(True)
    try:
        assert not common.split_plan(8, 4, 4, M, N, torch.empty(1, device=DEVICE), atomic=True)[4]
        y1 = tlin.lowbit_linear_triton(x.to(DEVICE), p, config=cfg)
        y2 = tlin.lowbit_linear_triton(x.to(DEVICE), p, config=cfg)
        assert torch.equal(y1, y2)
        _close(y1.float(), ref, 8e-3)
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.mark.skipif(not ON_GPU, reason="large K: compiled on the GPU only (too slow for the interpreter)")
@pytest.mark.parametrize("codebook, group", [("int2", 64), ("affine", 128)])
def test_large_k_every_path(codebook, group):
    """The Llama-3-8B down projection (K = 14336: 224 groups of 64, split-K partials, the int32 ->
    fp32 magic-number conversion, int64 row offsets): every kernel family, shipped/heuristic configs
    included (config None), against the float64 int8-activation reference."""
    N, K = 4096, 14336
    w, p = _case(N, K, codebook, group, seed=5)
    stream = dict(STREAM, BLOCK_N=16, BLOCK_C=8)
    per_m = {
        1: [dict(stream, BLOCK_N=8, BLOCK_C=32, num_warps=8), dict(stream, SPLIT_K=4), dict(stream, FULLX=1), dict(stream, FULLX=1, BLOCK_N=16, BLOCK_C=32, num_warps=2, SPLIT_K=2),
            dict(STREAM_RB, RB=4, SPLIT_K=4, num_warps=8), dict(STREAM_RB, BLOCK_N=16, RB=2, SPLIT_K=2),
            dict(GROUP16_ONE, BLOCK_N=128, num_stages=3)],
        16: [dict(GROUP16, BLOCK_N=128, SPLIT_K=8, num_stages=3), dict(GROUP16, BLOCK_N=256, SPLIT_K=16, num_warps=8, num_stages=3),
             dict(GROUP16, BLOCK_N=64, SPLIT_K=8, num_warps=2, num_stages=3, ATOMIC=1)],
        17: [dict(GROUP, BLOCK_N=128, BLOCK_M=64), dict(GROUP_B, BLOCK_N=128, BLOCK_M=64)],
    }
    for M, cfgs in per_m.items():
        x = torch.randn(M, K, generator=torch.Generator().manual_seed(M)) * 2
        ref = ops.reference_linear_w8(x, w)
        for cfg in cfgs + [None]:
            for _ in range(2):  # split-K tickets re-armed
                _close(tlin.lowbit_linear_triton(x.to(DEVICE), p, config=cfg), ref, 2e-5)


@pytest.mark.parametrize("codebook", ["int2", "sym", "affine", "ternary"])
@pytest.mark.parametrize("group", [32, 64, 128, -1], ids=["g32", "g64", "g128", "row"])
def test_stream_activations_stationary(codebook, group):
    """``RB`` > 1 (the activation words of every plane loaded once per program and kept while it walks
    its row blocks, the next block's weights loaded during this one's math): ragged last block, blocks
    past N, K splits, against the float64 int8-activation reference; bad code books refused."""
    N, K = 45, 512
    w, p = _case(N, K, codebook, group, seed=N + group)
    x = torch.randn(1, K, generator=torch.Generator().manual_seed(group)) * 2
    bias = torch.randn(N)
    ref = ops.reference_linear_w8(x, w, bias)
    for cfg in (STREAM_RB, dict(STREAM_RB, RB=8, BLOCK_N=16), dict(STREAM_RB, SPLIT_K=3, RB=2), dict(STREAM_RB, SPLIT_K=2, RB=4, BLOCK_N=16)):
        _close(tlin.lowbit_linear_triton(x.to(DEVICE), p, bias.to(DEVICE), config=cfg), ref, 2e-5)
    if codebook == "int2":
        _, p1 = _case(N, K, "binary", 32, seed=1)
        with pytest.raises(ValueError, match="RB > 1"):
            tlin.lowbit_linear_triton(x.to(DEVICE), p1, config=STREAM_RB)


CUDA_STREAM = {"KERNEL": "cuda_stream", "BLOCK_N": 8, "SPLIT_K": 1, "RW": 8, "D": 4, "num_warps": 4, "num_stages": 1, "BPS": 1}


@pytest.mark.skipif(not ON_GPU, reason="cuda_stream is CUDA C compiled by NVRTC: a GPU only")
@pytest.mark.parametrize("codebook", ["int2", "sym", "affine", "ternary"])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_cuda_stream(codebook, group):
    """The CUDA C M == 1 kernel (its own activation pass, blocks of RW rows): every row tile and grid
    size, ragged N, K padded past the last group, bias, x's dtypes (bf16 with fp16 scales, fp16, fp32 with
    bf16 scales), an x not 16-byte aligned, a given absmax; against the float64 int8-activation reference."""
    K = 896 if group == 128 else 960  # padded to 1024: groups past the weight's last one are skipped
    N = 45
    for dtype, sdtype in ((torch.bfloat16, torch.float16), (torch.float16, torch.float16), (torch.float32, torch.bfloat16)):
        w, p = _case(N, K, codebook, group, seed=group, scale_dtype=sdtype)
        x = torch.randn(1, K, generator=torch.Generator().manual_seed(1)) * 2
        bias = torch.randn(N)
        xd, bd = x.to(DEVICE, dtype), bias.to(DEVICE, dtype)
        ref = ops.reference_linear_w8(xd.cpu().float(), w, bd.cpu().float())
        tol = 2e-5 if dtype == torch.float32 else 8e-3
        for cfg in (CUDA_STREAM, dict(CUDA_STREAM, RW=4, D=8, num_warps=8, BPS=2), dict(CUDA_STREAM, RW=16, D=2, BLOCK_N=16), dict(CUDA_STREAM, RW=1, D=1, BLOCK_N=1)):
            _close(tlin.lowbit_linear_triton(xd, p, bd, config=cfg), ref, tol)
        odd = torch.empty(1, K + 1, device=DEVICE, dtype=dtype)[:, 1:]  # 2 or 4 bytes past an aligned start
        odd.copy_(xd)
        _close(tlin.lowbit_linear_triton(odd, p, bd, config=CUDA_STREAM), ref, tol)
    amax = torch.tensor([x.abs().max().item() * 0.5])  # below the row's own: codes clamped to +-127
    ref = ops.reference_linear_w8(x, w, act_amax=amax)
    _close(tlin.lowbit_linear_triton(x.to(DEVICE), p, act_amax=amax.to(DEVICE), config=CUDA_STREAM), ref, 2e-5)


def test_cuda_stream_config_not_usable_falls_back(monkeypatch):
    """A cached (or shipped) ``cuda_stream`` config where the kernel cannot run (no compiled CUDA, or a torch
    without NVRTC's entry): the op takes the heuristic's config instead of failing (cache and tuning off:
    the autouse fixture)."""
    name = tlin.device_name(torch.device(DEVICE))
    key = tlin.config_key(1, 40, 256, 64, 2)
    tuning.save_config(name, key, CUDA_STREAM)
    monkeypatch.setattr(tlin.KERNELS["cuda_stream"], "available", lambda device: False)
    w, p = _case(40, 256, "int2", 64, seed=1)
    x = torch.randn(1, 256, device=DEVICE)
    assert tlin.select_config(x, p, None, torch.empty(1, 40, device=DEVICE)) == tlin.heuristic_config(1, 40, 256, 2, x.device)
    _close(tlin.lowbit_linear_triton(x, p), ops.reference_linear_w8(x.cpu(), w), 2e-5)


def test_cuda_stream_refusals():
    """What cuda_stream cannot run is refused with the fix (the Triton ``stream`` kernel), before any
    launch: 4-bit codes, whole-row groups, M > 1 (and, without compiled CUDA, everything)."""
    x = torch.randn(1, 256)
    for codebook, group in (("int4", 64), ("int2", -1)):
        _, p = _case(8, 256, codebook, group, seed=0)
        with pytest.raises(ValueError, match="cuda_stream.*KERNEL='stream'"):
            tlin.lowbit_linear_triton(x.to(DEVICE), p, config=CUDA_STREAM)
    _, p = _case(8, 256, "int2", 64, seed=0)
    with pytest.raises(ValueError, match="M == 1 only"):
        tlin.lowbit_linear_triton(torch.randn(2, 256).to(DEVICE), p, config=CUDA_STREAM)


CUDA_MMA = {"KERNEL": "cuda_mma", "BLOCK_N": 32, "NT": 4, "SPLIT_K": 1, "D": 2, "num_warps": 4, "num_stages": 1}


@pytest.mark.skipif(not ON_GPU, reason="cuda_mma is CUDA C compiled by NVRTC: a GPU only")
@pytest.mark.parametrize("codebook", ["int2", "sym", "affine", "ternary"])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_cuda_mma(codebook, group):
    """The CUDA C tensor-core kernel (1 < M <= 64): one to four 16-token tiles, row tiles past a ragged N,
    K padded past the last group, splits (partials and ticket), one to sixteen warps sharing a block's chunks,
    bias, x's dtypes (bf16 with fp16 scales, fp16, fp32 with bf16 scales), a given absmax; against the
    float64 int8-activation reference. Each case takes one M and one dtype in turn (every variant is an
    NVRTC compile)."""
    K = 896 if group == 128 else 960  # padded to 1024: groups past the weight's last one are skipped
    N = 200  # 6 row blocks of 32 and one of 8 rows
    case = ["int2", "sym", "affine", "ternary"].index(codebook) * 3 + [32, 64, 128].index(group)
    M = (2, 16, 17, 64)[case % 4]
    dtype, sdtype = ((torch.bfloat16, torch.float16), (torch.float16, torch.float16), (torch.float32, torch.bfloat16))[case % 3]
    cfgs = (CUDA_MMA, dict(CUDA_MMA, SPLIT_K=3, D=1), dict(CUDA_MMA, BLOCK_N=16, NT=2, num_warps=16, SPLIT_K=8),
            dict(CUDA_MMA, BLOCK_N=64, NT=8, num_warps=1, D=4), dict(CUDA_MMA, BLOCK_N=8, NT=1, num_warps=8, D=4, SPLIT_K=2))
    w, p = _case(N, K, codebook, group, seed=group + M, scale_dtype=sdtype)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(M)) * 2
    bias = torch.randn(N)
    xd, bd = x.to(DEVICE, dtype), bias.to(DEVICE, dtype)
    ref = ops.reference_linear_w8(xd.cpu().float(), w, bd.cpu().float())
    tol = 2e-5 if dtype == torch.float32 else 8e-3
    for cfg in cfgs:
        if cfg["NT"] * -(-M // 16) > 8 or cuda_mma.shared_bytes(cfg["num_warps"], cfg["NT"], -(-M // 16)) > cuda_mma.MAX_SHARED:
            continue  # a lane's accumulators (NT * ceil(M / 16) <= 8 in the tuning space), 48 KiB of shared memory
        y = torch.full((M, N), float("nan"), device=DEVICE, dtype=dtype)
        _close(tlin.lowbit_linear_triton(xd, p, bd, config=cfg, out=y), ref, tol)
    _close(tlin.lowbit_linear_triton(xd, p, config=CUDA_MMA), ops.reference_linear_w8(xd.cpu().float(), w), tol)
    if case < 2:
        amax = x.abs().amax(dim=1) * 0.5  # below the rows' own: codes clamped to +-127
        _close(tlin.lowbit_linear_triton(x.to(DEVICE), p, act_amax=amax.to(DEVICE), config=dict(CUDA_MMA, SPLIT_K=2)),
               ops.reference_linear_w8(x, w, act_amax=amax), 2e-5)  # fmt: skip


@pytest.mark.skipif(not ON_GPU, reason="cuda_mma is CUDA C compiled by NVRTC: a GPU only")
def test_cuda_mma_cuda_graph_and_repeat():
    """Split-K tickets re-armed: the same call replayed in a CUDA graph and repeated gives the same bits."""
    w, p = _case(4096, 4096, "int2", 64, seed=5, scale_dtype=torch.bfloat16)
    x = torch.randn(16, 4096, device=DEVICE, dtype=torch.bfloat16)
    ref = ops.reference_linear_w8(x.cpu().float(), w)
    for cfg in (dict(CUDA_MMA, SPLIT_K=8), dict(CUDA_MMA, NT=2, BLOCK_N=16, num_warps=16, D=1)):
        _graph_replays_and_repeats_bitwise(x, p, cfg, ref)


def _graph_replays_and_repeats_bitwise(x: torch.Tensor, p, cfg: dict, ref: torch.Tensor) -> None:
    """The op with ``cfg``, near ``ref``, then three CUDA-graph replays and three eager calls with the same bits."""
    first = tlin.lowbit_linear_triton(x, p, config=cfg)
    _close(first, ref, 8e-3)
    out = torch.empty_like(first)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tlin.lowbit_linear_triton(x, p, config=cfg, out=out)
    for _ in range(3):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, first)
        assert torch.equal(tlin.lowbit_linear_triton(x, p, config=cfg), first)


def test_cuda_mma_refusals():
    """What cuda_mma cannot run is refused with the fix (the Triton ``group`` kernel), before any launch:
    4-bit codes, whole-row groups, N % 8 != 0, M == 1 and M > 64 (and, without compiled CUDA, everything)."""
    x = torch.randn(4, 256)
    for codebook, group, n in (("int4", 64, 8), ("int2", -1, 8), ("int2", 64, 12)):
        _, p = _case(n, 256, codebook, group, seed=0)
        with pytest.raises(ValueError, match="cuda_mma.*KERNEL='group'"):
            tlin.lowbit_linear_triton(x.to(DEVICE), p, config=CUDA_MMA)
    _, p = _case(8, 256, "int2", 64, seed=0)
    for m in (1, 65):
        with pytest.raises(ValueError, match="1 < M <= 64"):
            tlin.lowbit_linear_triton(torch.randn(m, 256).to(DEVICE), p, config=CUDA_MMA)


CUDA_GEMM = {"KERNEL": "cuda_gemm", "BLOCK_M": 64, "BLOCK_N": 64, "WM": 2, "WN": 2, "num_warps": 4, "num_stages": 3}


@pytest.mark.skipif(not ON_GPU, reason="cuda_gemm is CUDA C compiled by NVRTC: a GPU only")
@pytest.mark.parametrize("codebook", ["int2", "sym", "affine", "ternary"])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_cuda_gemm(codebook, group):
    """The CUDA C tiled GEMM (M > 16): token and row tiles past a ragged M and N, K padded past the last
    group, every warp layout and ring depth (one per case), bias, x's dtypes (bf16 with fp16 scales, fp16,
    fp32 with bf16 scales), a given absmax; against the float64 int8-activation reference. Each case takes
    one M, one dtype and two tiles in turn (every variant is an NVRTC compile)."""
    K = 896 if group == 128 else 960  # padded to 1024: groups past the weight's last one repeat it, times zeros
    N = 456  # a ragged last block of rows for every BLOCK_N
    case = ["int2", "sym", "affine", "ternary"].index(codebook) * 3 + [32, 64, 128].index(group)
    M = (17, 64, 200, 300)[case % 4]
    dtype, sdtype = ((torch.bfloat16, torch.float16), (torch.float16, torch.float16), (torch.float32, torch.bfloat16))[case % 3]
    tiles = [(bm, bn, wm, wn, st) for bm, bn, wm, wn in cuda_gemm._TILES for st in (2, 3, 4)]
    cfgs = [dict(CUDA_GEMM, BLOCK_M=bm, BLOCK_N=bn, WM=wm, WN=wn, num_warps=wm * wn, num_stages=st)
            for bm, bn, wm, wn, st in (tiles[case % len(tiles)], tiles[(case + 7) % len(tiles)])]
    w, p = _case(N, K, codebook, group, seed=group + M, scale_dtype=sdtype)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(M)) * 2
    bias = torch.randn(N)
    xd, bd = x.to(DEVICE, dtype), bias.to(DEVICE, dtype)
    ref = ops.reference_linear_w8(xd.cpu().float(), w, bd.cpu().float())
    tol = 2e-5 if dtype == torch.float32 else 8e-3
    for cfg in cfgs:
        y = torch.full((M, N), float("nan"), device=DEVICE, dtype=dtype)
        _close(tlin.lowbit_linear_triton(xd, p, bd, config=cfg, out=y), ref, tol)
    _close(tlin.lowbit_linear_triton(xd, p, config=CUDA_GEMM), ops.reference_linear_w8(xd.cpu().float(), w), tol)
    if case < 2:
        amax = x.abs().amax(dim=1) * 0.5  # below the rows' own: codes clamped to +-127
        _close(tlin.lowbit_linear_triton(x.to(DEVICE), p, act_amax=amax.to(DEVICE), config=CUDA_GEMM),
               ops.reference_linear_w8(x, w, act_amax=amax), 2e-5)  # fmt: skip


@pytest.mark.skipif(not ON_GPU, reason="cuda_gemm is CUDA C compiled by NVRTC: a GPU only")
def test_cuda_gemm_cuda_graph_and_repeat():
    """A ring deeper than 48 KiB (the opt-in shared memory) replayed in a CUDA graph and repeated gives the same bits."""
    w, p = _case(4096, 4096, "int2", 64, seed=5, scale_dtype=torch.bfloat16)
    x = torch.randn(256, 4096, device=DEVICE, dtype=torch.bfloat16)
    ref = ops.reference_linear_w8(x.cpu().float(), w)
    _graph_replays_and_repeats_bitwise(x, p, dict(CUDA_GEMM, BLOCK_M=128, BLOCK_N=128, WM=2, WN=4, num_warps=8, num_stages=4), ref)


@pytest.mark.skipif(not ON_GPU, reason="the CUDA C kernels are compiled by NVRTC: a GPU only")
def test_cuda_kernels_take_a_bias_of_another_dtype():
    """The op takes a bias of any float dtype, not tied to x's: each CUDA C kernel (cuda_stream at M = 1,
    cuda_mma at 16, cuda_gemm at 64), which reads the bias in x's dtype, gets it converted first (float32 beside
    bf16 x, bf16 beside float32 x, float64 beside fp16 x), against the float64 int8-activation reference with the
    bias as given (the bias's rounding to x's dtype is within the output's tolerance)."""
    K, N = 960, 200
    w, p = _case(N, K, "int2", 64, seed=11)
    for M, cfg in ((1, CUDA_STREAM), (16, CUDA_MMA), (64, CUDA_GEMM)):
        g = torch.Generator().manual_seed(M)
        x = torch.randn(M, K, generator=g) * 2
        for dtype, bdtype in ((torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16), (torch.float16, torch.float64)):
            bias = (torch.randn(N, generator=g) * 4).to(bdtype)
            xd = x.to(DEVICE, dtype)
            ref = ops.reference_linear_w8(xd.cpu().float(), w, bias.float())
            y = torch.full((M, N), float("nan"), device=DEVICE, dtype=dtype)
            _close(tlin.lowbit_linear_triton(xd, p, bias.to(DEVICE), config=cfg, out=y), ref,
                   2e-5 if dtype == torch.float32 else 8e-3)  # fmt: skip


def test_cuda_gemm_refusals():
    """What cuda_gemm cannot run is refused with the fix (the Triton ``group`` kernel), before any launch:
    4-bit codes, whole-row groups, N % 8 != 0, M <= 16, a tile outside its list (and, without compiled CUDA,
    everything)."""
    x = torch.randn(20, 256)
    for codebook, group, n in (("int4", 64, 8), ("int2", -1, 8), ("int2", 64, 12)):
        _, p = _case(n, 256, codebook, group, seed=0)
        with pytest.raises(ValueError, match="cuda_gemm.*KERNEL='group'"):
            tlin.lowbit_linear_triton(x.to(DEVICE), p, config=CUDA_GEMM)
    _, p = _case(8, 256, "int2", 64, seed=0)
    with pytest.raises(ValueError, match="M >= 17"):
        tlin.lowbit_linear_triton(torch.randn(16, 256).to(DEVICE), p, config=CUDA_GEMM)
    if ON_GPU:
        with pytest.raises(ValueError, match="BLOCK_M, BLOCK_N, WM, WN"):
            tlin.lowbit_linear_triton(x.to(DEVICE), p, config=dict(CUDA_GEMM, WM=4, num_warps=8))


@pytest.mark.parametrize("kernel", ["group", "group_b"])
@pytest.mark.parametrize("block_n, block_m", [(16, 16), (32, 64), (64, 32)])
def test_gemm_tiles(block_n, block_m, kernel):
    M, N, K = 67, 83, 384
    w, p = _case(N, K, "sym", 32, seed=block_n + block_m)
    x = torch.randn(M, K) * 3
    cfg = {"KERNEL": "group", "BLOCK_N": block_n, "BLOCK_M": block_m, "num_warps": 4, "num_stages": 2, "WA": int(kernel == "group")}
    _close(tlin.lowbit_linear_triton(x.to(DEVICE), p, config=cfg), ops.reference_linear_w8(x, w), 2e-5)


@pytest.mark.parametrize("M", [1, 9, 33])
def test_every_output_written_and_nothing_past_it(M):
    N, K = 35, 256
    w, p = _case(N, K, "ternary", 32, seed=11)
    x = torch.randn(M, K)
    gemv = {torch.float32: GROUP16_ONE, torch.bfloat16: GROUP16, torch.float16: dict(GROUP16, ATOMIC=1)}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        buf = torch.full((M * N + 64,), float("nan"), dtype=dtype, device=DEVICE)
        if M == 1:
            cfg = STREAM if dtype == torch.float32 else STREAM_FULLX
        else:
            cfg = gemv[dtype] if M <= tlin.GEMV_MAX_M else (GROUP_B if dtype == torch.float32 else GROUP)
        tlin.lowbit_linear_triton(x.to(dtype).to(DEVICE), p, config=cfg, out=buf[: M * N])
        assert not torch.isnan(buf[: M * N]).any()
        assert torch.isnan(buf[M * N :]).all()
        tol = {torch.float32: 2e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}[dtype]
        _close(buf[: M * N].view(M, N), ops.reference_linear_w8(x.to(dtype), w), tol)


def test_zero_activations_and_zero_rows():
    _, p = _case(16, 128, "affine", 32, seed=0)
    assert tlin.lowbit_linear_triton(torch.zeros(2, 128, device=DEVICE), p, config=GROUP16).abs().max() == 0
    assert tlin.lowbit_linear_triton(torch.zeros(0, 128, device=DEVICE), p).shape == (0, 16)


def test_bad_input_is_refused():
    w, p = _case(16, 128, "affine", 32, seed=0)
    x = torch.randn(1, 128, device=DEVICE)
    with pytest.raises(ValueError, match="pack it with aipc_kernels.lowbit.packing.pack_for_triton"):
        tlin.lowbit_linear_triton(x, packing.as_canonical_packed(w))
    with pytest.raises(ValueError, match="act_group=32"):
        tlin.lowbit_linear_triton(x, p, act_group=32)
    with pytest.raises(ValueError, match="does not match x's K=64"):
        tlin.lowbit_linear_triton(torch.randn(1, 64, device=DEVICE), p)
    with pytest.raises(ValueError, match="x has dtype torch.int32"):
        tlin.lowbit_linear_triton(x.to(torch.int32), p)
    with pytest.raises(ValueError, match="M == 1 only"):
        tlin.lowbit_linear_triton(torch.randn(2, 128, device=DEVICE), p, config=STREAM)
    with pytest.raises(ValueError, match="lacks 'KERNEL'"):
        tlin.lowbit_linear_triton(x, p, config={"BLOCK_N": 16})
    with pytest.raises(ValueError, match="KERNEL='fma' is unknown"):
        tlin.lowbit_linear_triton(x, p, config=dict(STREAM, KERNEL="fma"))
    with pytest.raises(ValueError, match=r"lacks \['SPLIT_K'\]"):
        tlin.lowbit_linear_triton(x, p, config={k: v for k, v in STREAM.items() if k != "SPLIT_K"})
    with pytest.raises(ValueError, match="XPACK=0"):
        tlin.lowbit_linear_triton(x, p, config=dict(STREAM, XPACK=0))
    with pytest.raises(ValueError, match="out must be"):
        tlin.lowbit_linear_triton(x, p, config=GROUP16, out=torch.empty(3, device=DEVICE))
    _, p8 = _case(1, 65568, "int8", -1, seed=0)  # one 8-bit group past 65536 k: its int32 dot could overflow
    with pytest.raises(ValueError, match="8-bit codes take groups of at most 65536"):
        tlin.lowbit_linear_triton(torch.randn(1, 65568, device=DEVICE), p8)
    _, p4 = _case(1, 8224, "affine4", -1, seed=0)  # stored zeros: one 4-bit group past 8192 k (u exact in fp32 no longer)
    with pytest.raises(ValueError, match="4-bit codes with stored zeros take groups of at most 8192"):
        tlin.lowbit_linear_triton(torch.randn(1, 8224, device=DEVICE), p4)


def test_op_dispatch_fake_kernel_and_torch_compile():
    w, p = _case(48, 256, "int2", 64, seed=2)
    x = torch.randn(4, 256, device=DEVICE)
    args = (x, p.qweight, p.scales, p.zeros, None, p.layout, p.codebook, p.group_size, p.out_features, 0)
    torch.library.opcheck(torch.ops.aipc.lowbit_linear.default, args)
    eager = ops.lowbit_linear(x, p)
    if ON_GPU:  # the op runs the Triton kernel: int8 activations
        _close(eager, ops.reference_linear_w8(x.cpu(), w), 2e-5)
    else:  # CPU + triton_k32: the weight-only reference (the Triton path is CUDA/XPU)
        torch.testing.assert_close(eager, ops.reference_linear(x, w))
    compiled = torch.compile(lambda t: ops.lowbit_linear(t, p) * 2, fullgraph=True)(x)
    torch.testing.assert_close(compiled, eager * 2)


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
def test_cuda_graph_replay():
    w, p = _case(300, 1024, "int2", 64, seed=4)
    x = torch.randn(1, 1024, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(1, 300, device="cuda", dtype=torch.bfloat16)
    for cfg in (dict(GROUP16, BLOCK_N=64, SPLIT_K=4, num_stages=3), dict(STREAM, SPLIT_K=2),
                dict(GROUP16, BLOCK_N=64, SPLIT_K=4, num_stages=3, ATOMIC=1)):
        tlin.lowbit_linear_triton(x, p, config=cfg, out=out)  # compile and allocate before capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # the stream config: pre-pass + GEMV chained by PDL, twice
            for _ in range(2):
                tlin.lowbit_linear_triton(x, p, config=cfg, out=out)
        for _ in range(3):
            x.copy_(torch.randn_like(x))
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            _close(out, ops.reference_linear_w8(x.cpu(), w), 8e-3)


def test_config_cache_per_device(tmp_path, monkeypatch):
    monkeypatch.setenv("AIPC_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tuning, "_mem_cache", {})
    name = tlin.device_name(torch.device(DEVICE))
    key = tlin.config_key(1, 40, 256, 64, 2)
    assert key == "gemv:m1:n40:k256:g64:b2"
    assert tlin.config_key(300, 40, 256, 256, 2) == "gemm:m512:n40:k256:grow:b2"
    tuning.save_config(name, key, dict(STREAM, BLOCK_N=32, SPLIT_K=2))
    # an older version's tuning of a kernel that no longer ships: skipped, the problem re-tuned
    old_key = tlin.config_key(16, 40, 256, 64, 2)
    tuning.save_config(name, old_key, {"KERNEL": "mma", "BLOCK_N": 32, "SPLIT_K": 2, "num_warps": 4, "num_stages": 2})
    monkeypatch.setattr(tuning, "_mem_cache", {})  # a second process: starts from the file
    on_disk = json.loads(tlin.cache_file(name).read_text())
    assert on_disk[key]["BLOCK_N"] == 32 and on_disk[old_key]["KERNEL"] == "mma"
    w, p = _case(40, 256, "int2", 64, seed=1)
    x = torch.randn(1, 256, device=DEVICE)
    y = torch.empty(1, 40, device=DEVICE)
    assert tlin.select_config(x, p, None, y)["SPLIT_K"] == 2
    _close(tlin.lowbit_linear_triton(x, p), ops.reference_linear_w8(x.cpu(), w), 2e-5)
    x16 = torch.randn(16, 256, device=DEVICE)
    assert old_key not in tlin.cached_configs(name)
    assert tlin.select_config(x16, p, None, torch.empty(16, 40, device=DEVICE)) == tlin.heuristic_config(16, 40, 256, 2, x16.device)


@pytest.mark.skipif(not ON_GPU, reason="timing configurations needs a GPU")
def test_autotune_writes_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("AIPC_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("AIPC_TRITON_AUTOTUNE", "1")
    monkeypatch.setattr(tuning, "_mem_cache", {})
    monkeypatch.setattr(stream, "SPACE", [dict(STREAM, BLOCK_N=16), dict(STREAM, BLOCK_N=32, BLOCK_C=4, SPLIT_K=2)])
    monkeypatch.setattr(tlin.KERNELS["cuda_stream"], "SPACE", [])  # only the two configs above are timed
    w, p = _case(64, 512, "affine", 128, seed=3)
    x = torch.randn(1, 512, device="cuda")
    _close(tlin.lowbit_linear_triton(x, p), ops.reference_linear_w8(x.cpu(), w), 2e-5)
    cached = json.loads(tlin.cache_file(tlin.device_name(x.device)).read_text())
    assert cached[tlin.config_key(1, 64, 512, 128, 2)]["BLOCK_N"] in (16, 32)


@pytest.mark.skipif(not ON_GPU, reason="timing configurations needs a GPU")
def test_tuner_times_weights_from_hbm():
    """For the GEMM path the tuner's weight copies outsize the L2 (or reach the cap), hold tensors of their own and
    compute what the weight computes; at M <= 16 it times the weight itself."""
    w, p = _case(2048, 2048, "int2", 64, seed=6)
    dev = torch.device("cuda")
    small = tuning.weight_copies(p, dev, 16)
    assert len(small) == 1 and small[0] is p
    ws = tuning.weight_copies(p, dev, 64)
    total, l2 = sum(c.nbytes() for c in ws), torch.cuda.get_device_properties(dev).L2_cache_size
    assert total >= tuning.ROTATE_L2 * l2 or len(ws) == tuning.MAX_WEIGHT_COPIES
    assert total > l2
    assert len({c.qweight.data_ptr() for c in ws}) == len(ws) and len({c.scales.data_ptr() for c in ws}) == len(ws)
    x = torch.randn(3, 2048, device=dev)
    assert torch.equal(tlin.lowbit_linear_triton(x, ws[-1]), tlin.lowbit_linear_triton(x, p))


@pytest.mark.skipif(not ON_GPU, reason="timing configurations needs a GPU")
def test_autotune_times_cuda_mma(tmp_path, monkeypatch):
    """At M=16 the tuner times the CUDA C kernel's configs beside the Triton ones (CUDA-graph replays of
    the NVRTC launch) and caches the winner, whichever it is."""
    monkeypatch.setenv("AIPC_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("AIPC_TRITON_AUTOTUNE", "1")
    monkeypatch.setattr(tuning, "_mem_cache", {})
    group_cfg = dict(GROUP16, SPLIT_K=4)
    mma_cfgs = [CUDA_MMA, dict(CUDA_MMA, BLOCK_N=16, NT=2, num_warps=8, D=1)]
    monkeypatch.setattr(tlin.KERNELS["group"], "space", lambda M: [group_cfg])
    monkeypatch.setattr(tlin.KERNELS["cuda_mma"], "space", lambda M: mma_cfgs)
    w, p = _case(256, 1024, "int2", 64, seed=4)
    x = torch.randn(16, 1024, device="cuda")
    _close(tlin.lowbit_linear_triton(x, p), ops.reference_linear_w8(x.cpu(), w), 2e-5)
    cached = json.loads(tlin.cache_file(tlin.device_name(x.device)).read_text())[tlin.config_key(16, 256, 1024, 64, 2)]
    assert {k: v for k, v in cached.items() if k not in ("us", "by_kernel")} in [group_cfg, *mma_cfgs]
    assert set(cached["by_kernel"]) == {"group", "cuda_mma"}


def test_shipped_configs_are_valid():
    """Every shipped config names a shipped kernel, gives its path's fields and fits its M bucket
    (``stream``: M == 1 only)."""
    shipped = json.loads(tlin.SHIPPED_CONFIGS.read_text())
    assert shipped, "no shipped configs"
    for device, cfgs in shipped.items():
        for key, cfg in cfgs.items():
            M = int(key.split(":")[1][1:])
            kernel = registry.kernel_of(cfg)
            registry.check_kernel_config(cfg, M)
            assert kernel is not stream or M == 1, (device, key, cfg)
            assert kernel.NAME != "cuda_stream" or M == 1, (device, key, cfg)
            assert kernel.NAME != "cuda_mma" or 1 < M <= 64, (device, key, cfg)
            assert kernel.NAME != "cuda_gemm" or M > 16, (device, key, cfg)
            assert kernel is not dequant or M > tlin.GEMV_MAX_M, (device, key, cfg)


@pytest.mark.parametrize("codebook", ["affine", "int2"])
def test_small_m_activation_pass_in_slices(codebook):
    """M <= 16: the activation pass splits each row over 1024-k programs (absmax of the whole row in
    each, the scale and the 32-k sums written once); K = 2592 pads to three slices, the last partial."""
    M, N, K = 5, 24, 2592
    w, p = _case(N, K, codebook, 32, seed=3)
    x = torch.randn(M, K) * torch.linspace(0.1, 4, K)  # absmax far from the first slice
    y = tlin.lowbit_linear_triton(x.to(DEVICE), p, config=dict(GROUP16, SPLIT_K=3))
    _close(y, ops.reference_linear_w8(x, w), 2e-5)


@pytest.mark.parametrize("codebook", TRITON_CODEBOOKS)
@pytest.mark.parametrize("group", [64, -1], ids=["g64", "row"])
@pytest.mark.parametrize("flag", ["AIPC_BATCH_INVARIANT", "VLLM_BATCH_INVARIANT"])
def test_batch_invariant_mode_row_bits_independent_of_m(codebook, group, flag, monkeypatch):
    """With the batch-invariant flag a row's output bits are the same alone (M = 1, where the default
    is the stream kernel with split-K) and inside batches that take the M <= 16 and M > 16 tiles (without
    the flag 24 of these 40 cases differ in float32 under the interpreter)."""
    monkeypatch.setenv(flag, "1")
    N, K = 48, 1024
    w, p = _case(N, K, codebook, group, seed=5)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(33, K, generator=g).to(DEVICE)
    bias = torch.randn(N, generator=g).to(DEVICE)
    alone = torch.cat([tlin.lowbit_linear_triton(x[i : i + 1], p, bias) for i in range(3)])
    _close(alone, ops.reference_linear_w8(x[:3].cpu(), w, bias.cpu()), 2e-5)
    for M in (3, 16, 17, 33):
        y = tlin.lowbit_linear_triton(x[:M], p, bias)[:3]
        assert torch.equal(y.view(torch.int32), alone.view(torch.int32)), f"M={M}: rows differ in bits from M=1"


def _cancelling(N, K, G, codebook, seed):
    """A weight of ``codebook`` (``int8``, ``int4``, ``affine4``: integer zeros 7/8) whose every group
    (G; -1: the row) is +levels in its first half and the same levels negated, plus a small surplus,
    in its second: against constant activations the group's dot is small while the dot of its first
    half is large (whole rows of K = 4096 at 8 bits: ~3e7, past 2**24). Also the weight of the
    levels' sizes (for a bound on a split row's partial conversions)."""
    g = torch.Generator().manual_seed(seed)
    cb = CODEBOOKS[codebook]
    span = K if G == -1 else G
    lo, hi, top = (100, 128, 20) if cb.bits == 8 else (4, 7, 11)  # 4 bits: codes z - 6 .. z + 6 (surplus < 11)
    half = torch.randint(lo, hi, (N, K // span, span // 2), generator=g)
    second = -half
    second[:, :, 0] += torch.randint(1, top, (N, K // span), generator=g)  # the group's dot: 127 * surplus
    levels = torch.cat([half, second], dim=-1).reshape(N, K)
    scales = (torch.rand(N, K // span, generator=g) + 0.5).to(torch.float16)
    zeros = None if cb.zero is not None else torch.randint(7, 9, (N, K // span), generator=g).to(torch.float16)
    z = torch.full((N, K), cb.zero) if zeros is None else zeros.float().repeat_interleave(span, dim=1)

    def weight(lv):
        return LowBitWeight(pack_codes((lv + z).to(torch.uint8), cb.bits), scales, zeros, codebook, span, K)

    w = weight(levels)
    on = packing.pack_for_triton(w).to(DEVICE)
    return w, weight(levels.abs()), on


@pytest.mark.parametrize("codebook", ["int8", "int4", "affine4"])
@pytest.mark.parametrize("group", [64, 128, -1], ids=["g64", "g128", "row"])
def test_wide_codes_groups_over_chunks_cancel_exactly(codebook, group):
    """8- and 4-bit codes: a group wider than a chunk (8 bits: 64/128 over 2/4 chunks of 32 k; 4 bits:
    128 over 2 chunks of 64 k) and a whole row (all of them) carry one exact int32 dot (the native
    kernels' u; ``affine4``: minus z times the group's activation sum, exact for integer z) converted
    once, so a group whose halves cancel keeps the float64 reference's value to fp32 rounding (a
    per-chunk fp32 rescale of the row is 2.6% off at 8 bits here). Splits over K take whole groups, so a split
    group-64/128 weight is exact too; a split whole row is not (each split converts its own partial
    dot): checked against the size of the partial sums instead."""
    bits = CODEBOOKS[codebook].bits
    N, K = 19, 4096 if bits == 8 else 2048
    w, w_abs, p = _cancelling(N, K, group, codebook, seed=K + group)
    split_ok = group != -1
    stream = dict(STREAM, BLOCK_C=2 if bits == 8 else 1)  # raised to a whole group of chunks for 64/128 (4 bits: 128)
    per_m = {
        1: [stream, dict(stream, FULLX=1, BLOCK_C=8), dict(stream, SPLIT_K=3), GROUP16_ONE, dict(GROUP16, SPLIT_K=3)],
        5: [GROUP16_ONE, dict(GROUP16, SPLIT_K=3, ATOMIC=1)],
        17: [GROUP, GROUP_B],
    }
    for M, cfgs in per_m.items():
        x = torch.full((M, K), 3.0) * torch.linspace(1.0, 2.0, M)[:, None]  # every activation quantizes to 127
        ref = ops.reference_linear_w8(x, w)
        size = ops.reference_linear_w8(x, w_abs)  # the sum of the terms' sizes
        for cfg in cfgs:
            y = tlin.lowbit_linear_triton(x.to(DEVICE), p, config=cfg).double().cpu()
            if cfg.get("SPLIT_K", 1) == 1 or split_ok:
                torch.testing.assert_close(y, ref, rtol=1e-6, atol=0.0, msg=lambda m: f"M={M} {cfg}: {m}")
            else:
                assert (y - ref).abs().max() < 1e-6 * size.max(), (M, cfg)
        # untuned: the b8/b4 key is not cached, so the heuristic runs (which may split a whole row)
        assert tlin.config_key(M, N, K, w.group_size, bits).endswith(f":b{bits}")
        assert tlin.select_config(x.to(DEVICE), p, None, torch.empty(M, N, device=DEVICE)) == tlin.heuristic_config(M, N, K, bits, torch.device(DEVICE))
        y = tlin.lowbit_linear_triton(x.to(DEVICE), p).double().cpu()
        assert (y - ref).abs().max() < 1e-6 * size.max(), M


@pytest.mark.parametrize("M, K, cfg", [(1, 256, STREAM), (1, 256, STREAM_FULLX), (5, 2592, GROUP16), (40, 256, GROUP)],
                         ids=["stream", "stream_fullx", "group16_slices", "group"])  # fmt: skip
@pytest.mark.parametrize("codebook", ["ternary", "affine"])
def test_act_amax_every_activation_pass(M, K, cfg, codebook):
    """``act_amax``: each token quantized with a given absmax (above its own, below it: codes clamped, zero:
    zero codes) in both activation passes, equal to ``reference_linear_w8`` with it; the token's own
    absmax gives the default's bits."""
    N = 24
    w, p = _case(N, K, codebook, 32, seed=M + K)
    g = torch.Generator().manual_seed(M)
    x = torch.randn(M, K, generator=g) * torch.linspace(0.1, 4, K)  # absmax far from the first slice
    bias = torch.randn(N, generator=g)
    own = x.abs().amax(-1)
    zero_first = own * 2
    zero_first[0] = 0.0
    for amax in (own * (1 + 3 * torch.rand(M, generator=g)), own * 0.5, zero_first):
        y = tlin.lowbit_linear_triton(x.to(DEVICE), p, bias.to(DEVICE), config=cfg, act_amax=amax.to(DEVICE))
        _close(y, ops.reference_linear_w8(x, w, bias, act_amax=amax), 2e-5)
    y_own = tlin.lowbit_linear_triton(x.to(DEVICE), p, bias.to(DEVICE), config=cfg, act_amax=own.to(DEVICE))
    assert torch.equal(y_own, tlin.lowbit_linear_triton(x.to(DEVICE), p, bias.to(DEVICE), config=cfg))
    with pytest.raises(ValueError, match=r"^lowbit_linear: act_amax of shape \(3,\)"):
        tlin.lowbit_linear_triton(x.to(DEVICE), p, config=cfg, act_amax=torch.ones(3, device=DEVICE))


@pytest.mark.parametrize("codebook", ["int4", "affine4"])
@pytest.mark.parametrize("group", [32, 64, 128, -1], ids=["g32", "g64", "g128", "row"])
def test_4bit_every_kernel_and_split(codebook, group):
    """4-bit codes (a 64-k chunk of two 32-k planes: group 32 is one plane, 128 two chunks) with random
    activations on every kernel, split over K (K = 512: 8 chunks, splits of 3 uneven, in whole groups)
    and with the atomic split, against the float64 int8-activation reference."""
    N, K = 45, 512
    w, p = _case(N, K, codebook, group, seed=K + group)
    bias = torch.randn(N)
    per_m = {
        1: [STREAM, dict(STREAM_FULLX, BLOCK_C=4), dict(STREAM, SPLIT_K=3), dict(STREAM_FULLX, SPLIT_K=2, BLOCK_C=1), GROUP16_ONE, dict(GROUP16, SPLIT_K=3)],
        5: [GROUP16_ONE, dict(GROUP16, SPLIT_K=3, ATOMIC=1), dict(GROUP16, SPLIT_K=8)],
        17: [GROUP, GROUP_B],
    }
    if group in (32, 64):  # activations stationary (groups within the 64-k chunk)
        per_m[1] += [STREAM_RB, dict(STREAM_RB, SPLIT_K=3, RB=2)]
    for M, cfgs in per_m.items():
        x = torch.randn(M, K, generator=torch.Generator().manual_seed(M)) * 2
        ref = ops.reference_linear_w8(x, w, bias)
        for cfg in cfgs:
            y = tlin.lowbit_linear_triton(x.to(DEVICE), p, bias.to(DEVICE), config=cfg)
            _close(y, ref, 2e-5)


@pytest.mark.parametrize("codebook", sorted(CODEBOOKS))
@pytest.mark.parametrize("N, K, group", [(37, 160, 32), (19, 384, 128), (50, 96, -1), (33, 512, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dequant_pass_is_the_canonical_dequantization(codebook, N, K, group, dtype):
    """Every element of a poisoned output is the canonical weight's ``dequantize()`` rounded to dtype,
    bit for bit (chunks past the last one, rows past N and the padded k are not written)."""
    w, p = _case(N, K, codebook, group, seed=N + K)
    out = torch.full((N, K), float("nan"), dtype=dtype, device=DEVICE)
    with registry.interpreter_scope():
        got = dequant.dequantize(p, dtype, dict(DEQUANT, BLOCK_N=32 if N > 40 else 16), out=out)
    assert got is out
    assert torch.equal(out.cpu(), w.dequantize().to(dtype))


@pytest.mark.parametrize("codebook", ["int2", "affine", "int4", "int8", "e0m4"])
@pytest.mark.parametrize("dtype, bias_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                               (torch.float16, torch.float32), (torch.bfloat16, None)])
@pytest.mark.parametrize("M", [17, 45])
def test_dequant_path_keeps_the_int8_activation_contract(codebook, dtype, bias_dtype, M):
    """The dequantize-then-GEMM path gives the op's W*A8 result (int8 activations, per-token scales)
    within the rounding of x's dtype, with a bias of x's or another dtype; ``act_amax`` is honoured."""
    N, K = 41, 256
    w, p = _case(N, K, codebook, 64, seed=M)
    x = torch.randn(M, K) * torch.linspace(0.1, 3, K)
    bias = None if bias_dtype is None else torch.randn(N).to(bias_dtype)
    y = tlin.lowbit_linear_triton(x.to(dtype).to(DEVICE), p, None if bias is None else bias.to(DEVICE), config=DEQUANT)
    assert y.shape == (M, N) and y.dtype == dtype
    tol = {torch.float32: 2e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}[dtype]
    _close(y, ops.reference_linear_w8(x.to(dtype), w, bias), tol)
    amax = x.abs().amax(1).float() * 2  # a wider absmax than each row's own: coarser codes
    y2 = tlin.lowbit_linear_triton(x.to(dtype).to(DEVICE), p, config=DEQUANT, act_amax=amax.to(DEVICE))
    grouped = tlin.lowbit_linear_triton(x.to(dtype).to(DEVICE), p, config=GROUP, act_amax=amax.to(DEVICE))
    _close(y2, grouped.double().cpu(), tol)
    assert not torch.allclose(y2.double().cpu(), y.double().cpu() - (0 if bias is None else bias.double()), rtol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_amax", [False, True])
def test_fake_quantized_activations_are_the_codes_times_the_scale(dtype, with_amax):
    """The dequantize path's activations: every element the int8 code times its token's scale (the
    fused kernels' activation pass) rounded once to x's dtype, on odd K."""
    from aipc_kernels.gpu.triton.lowbit import activation

    M, K = 21, 1000
    x = (torch.randn(M, K) * torch.linspace(0.1, 4, K)).to(dtype).to(DEVICE)
    amax = (x.float().abs().amax(1) * 1.5).contiguous() if with_amax else None
    with registry.interpreter_scope():
        xd = activation.fake_quantize_rows(x, amax)
        xq, sx, _ = activation.quantize_rows(x, 1024, sums=False, act_amax=amax)
    assert xd.shape == (M, K) and xd.dtype == dtype
    assert torch.equal(xd.cpu(), (xq[:, :K].float() * sx[:, None]).to(dtype).cpu())


def test_dequant_path_is_tuned_for_prompts_only_and_never_batch_invariant(monkeypatch):
    assert registry.kernel_of(DEQUANT) is dequant
    assert not [c for c in (k for kern in registry.KERNELS.values() for k in kern.space(16)) if c["KERNEL"] == "dequant"]
    assert [c for c in (k for kern in registry.KERNELS.values() for k in kern.space(17)) if c["KERNEL"] == "dequant"]
    dev = torch.device(DEVICE)
    assert registry.heuristic_config(dequant.MIN_M, 4096, 4096, 2, dev)["KERNEL"] == "dequant"  # untuned prompts
    assert registry.heuristic_config(dequant.MIN_M - 1, 4096, 4096, 2, dev)["KERNEL"] == "group"
    for cfg, M in ((DEQUANT, 64), (registry.heuristic_config(4096, 256, 512, 2, dev), 4096)):
        inv = registry.invariant_config(cfg, M, 256, 512, 2, dev)
        assert inv["KERNEL"] == "group" and inv["SPLIT_K"] == 1
    with pytest.raises(ValueError, match="CHUNKS"):
        registry.check_kernel_config({"KERNEL": "dequant", "BLOCK_N": 16, "num_warps": 4}, 64)
    w, p = _case(40, 256, "int2", 64, seed=1)
    with pytest.raises(ValueError, match="out must be"):
        dequant.dequantize(p, torch.float32, out=torch.empty(40, 255, device=DEVICE))


@pytest.mark.parametrize("codebook", sorted(name for name, cb in CODEBOOKS.items() if cb.mins))
def test_min_form_runs_on_the_int8_kernels(codebook):
    """min2 / min4 / min8 (GGUF's Q4_1 / Q5_1 / K-quant blocks): the W*A8 Triton kernels add m * (group sum of
    the int8 activations) per group, as the native kernels; GGUF's own forms (groups of 16, float32
    scales) in test_triton_gguf_forms.py."""
    w, p = _case(20, 128, codebook, 32, seed=1)
    x = torch.randn(1, 128)
    _close(tlin.lowbit_linear_triton(x.to(DEVICE), p), ops.reference_linear_w8(x, w), 2e-5)
