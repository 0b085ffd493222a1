"""Triton W4A16 ``lowbit_linear_a16`` (E0M4 and int dequantization) against float64 references.

On a CUDA machine the kernel runs compiled on the GPU; without one it runs on CPU tensors under
``TRITON_INTERPRET=1`` (set here only while the kernel module is imported), on small shapes.
Reference: the weight dequantized in float64 times x in float64 (x is never quantized), plus bias.
"""
import json

import pytest
import torch

pytest.importorskip("triton")

from aipc_kernels.lowbit import ops, packing  # noqa: E402
from aipc_kernels.lowbit.formats import CODEBOOKS  # noqa: E402
from aipc_kernels.lowbit.quantizers import quantize_rtn  # noqa: E402
from tests.helpers.triton_kernels import import_kernels  # noqa: E402

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
a16, tuning = import_kernels("aipc_kernels.gpu.triton.lowbit.a16", "aipc_kernels.gpu.triton.lowbit.tuning")

FOUR_BIT = sorted(name for name, cb in CODEBOOKS.items() if cb.bits == 4 and not cb.mins)  # affine4, e0m4, int4
DEQUANTS = ("e0m4", "int")
# the output dtype's rounding: half an ulp, twice (the interpreter truncates fp32 to bf16: a whole ulp)
OUT_EPS = {torch.float32: 0.0, torch.bfloat16: 2**-7 if not ON_GPU else 2**-8, torch.float16: 2**-11}
GEMV = {"KERNEL": "a16", "BLOCK_N": 16, "BLOCK_M": 16, "SPLIT_K": 1, "num_warps": 4, "num_stages": 2, "WA": 1}
GEMM = dict(GEMV, BLOCK_N=32, BLOCK_M=32)


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


def _reference(x, w, bias=None):
    y = x.double().cpu() @ w.dequantize(torch.float64).T
    return y if bias is None else y + bias.double().cpu()


def _check(y, x, w, bias=None, acc_tol=8e-6):
    """``y`` against x @ W^T + bias in float64 (x as given: never quantized), element by element: fp32
    accumulation error relative to the largest sum of |x w| (the e0m4 form carries terms up to
    31 s |x| that cancel), then the output dtype's rounding. A tf32-rounded fp32 x is ~1e-4 off."""
    ref = _reference(x, w, bias)
    scale = (x.double().abs().cpu() @ w.dequantize(torch.float64).abs().T).max().item() + 1e-30
    err = (y.double().cpu() - ref.reshape(y.shape)).abs()
    assert torch.isfinite(y).all()
    bound = acc_tol * scale + OUT_EPS[y.dtype] * ref.reshape(y.shape).abs()
    assert (err <= bound).all(), f"max err {err.max().item():.3g} (at most {acc_tol} x scale {scale:.3g} + rounding)"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("group", [32, 128, -1], ids=["g32", "g128", "row"])
@pytest.mark.parametrize("dequant", DEQUANTS)
@pytest.mark.parametrize("codebook", FOUR_BIT)
def test_matches_float64_reference(codebook, dequant, group, dtype):
    """Every 4-bit code book, both dequantizations, groups of 32 / 128 / the row, x in fp32/bf16/fp16,
    odd N and M (the untuned configs: M <= 16 split over K, M = 17 the GEMM tile), with and without
    bias. K = 224 (groups of 32 and the row) pads the last 64-k chunk: its second plane must add nothing."""
    K = 256 if group == 128 else 224
    for i, (M, N) in enumerate([(1, 37), (3, 100), (17, 37)]):
        w, p = _case(N, K, codebook, group, seed=M * 100 + N)
        g = torch.Generator().manual_seed(M)
        x = torch.randn(M, K, generator=g).to(dtype)
        bias = torch.randn(N, generator=g).to(dtype) if i != 1 else None
        y = a16.lowbit_linear_a16_triton(x.to(DEVICE), p, None if bias is None else bias.to(DEVICE), dequant)
        assert y.shape == (M, N) and y.dtype == dtype and y.device.type == DEVICE
        _check(y, x, w, bias)


@pytest.mark.parametrize("dequant", DEQUANTS)
@pytest.mark.parametrize("codebook, group", [("affine4", 128), ("int4", 32), ("e0m4", -1)])
def test_every_tile_and_split(codebook, group, dequant):
    """Weights as the dot's A operand (WA=1) or B, split over K in whole groups (K = 640: 5 steps of
    128, 10 chunks; splits of 3 uneven) with the workspace or atomic partials, a second call after the
    tickets were re-armed, a leading batch dimension."""
    N, K = 45, 640
    w, p = _case(N, K, codebook, group, seed=K + group)
    bias = torch.randn(N)
    cfgs = {
        5: [dict(GEMV, WA=0), dict(GEMV, BLOCK_N=32, SPLIT_K=3), dict(GEMV, BLOCK_N=32, SPLIT_K=3, ATOMIC=1)],
        33: [dict(GEMM, WA=0, BLOCK_N=16), dict(GEMM, GROUP_M=1, SPLIT_K=2)],
    }
    for M, per_m in cfgs.items():
        x = torch.randn(1, M, K, generator=torch.Generator().manual_seed(M)).to(torch.bfloat16)
        for cfg in per_m:
            for _ in range(2 if cfg["SPLIT_K"] > 1 else 1):
                y = a16.lowbit_linear_a16_triton(x.to(DEVICE), p, bias.to(DEVICE), dequant, config=cfg)
                assert y.shape == (1, M, N)
                _check(y, x, w, bias)


@pytest.mark.parametrize("M", [1, 17, 33])
def test_every_output_written_and_nothing_past_it(M):
    """The output buffer poisoned with NaN: every element of y written, nothing past it."""
    N, K = 35, 256
    w, p = _case(N, K, "e0m4", 64, seed=11)
    x = torch.randn(M, K)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for dequant, cfg in zip(DEQUANTS, (None, dict(GEMV if M == 1 else GEMM, SPLIT_K=2, ATOMIC=1))):
            buf = torch.full((M * N + 64,), float("nan"), dtype=dtype, device=DEVICE)
            a16.lowbit_linear_a16_triton(x.to(dtype).to(DEVICE), p, None, dequant, config=cfg, out=buf[: M * N])
            assert not torch.isnan(buf[: M * N]).any()
            assert torch.isnan(buf[M * N :]).all()
            _check(buf[: M * N].view(M, N), x.to(dtype), w)


def test_fp32_activations_are_not_rounded():
    """fp32 x keeps all 24 bits (no tf32 matrix-unit rounding): within fp32 accumulation error of the
    exact result, which x rounded to tf32's 10 fraction bits misses."""
    N, K = 64, 1024
    w, p = _case(N, K, "int4", 128, seed=1)
    x = torch.randn(4, K, generator=torch.Generator().manual_seed(1))
    x_tf32 = (x.view(torch.int32) & ~0x1FFF).view(torch.float32)  # truncated to 10 fraction bits
    with pytest.raises(AssertionError, match="max err"):
        _check(_reference(x_tf32, w).float(), x, w)
    for dequant in DEQUANTS:
        _check(a16.lowbit_linear_a16_triton(x.to(DEVICE), p, None, dequant, config=dict(GEMV, SPLIT_K=2)), x, w)


def test_zero_rows_and_empty_batch():
    _, p = _case(16, 128, "affine4", 32, seed=0)
    assert a16.lowbit_linear_a16_triton(torch.zeros(2, 128, device=DEVICE), p, None, "e0m4").abs().max() == 0
    assert a16.lowbit_linear_a16_triton(torch.zeros(0, 128, device=DEVICE), p, None, "int").shape == (0, 16)


def test_bad_input_is_refused():
    w, p = _case(16, 128, "affine4", 32, seed=0)
    x = torch.randn(1, 128, device=DEVICE)
    _, p2 = _case(16, 128, "affine", 32, seed=0)
    with pytest.raises(ValueError, match=r"codebook='affine' has 2-bit codes; the W4A16 kernels take a 4-bit"):
        a16.lowbit_linear_a16_triton(x, p2, None, "e0m4")
    with pytest.raises(ValueError, match=r"dequant='fp4' is unknown; use one of \('e0m4', 'int'\)"):
        a16.lowbit_linear_a16_triton(x, p, None, "fp4")
    with pytest.raises(ValueError, match="pack it with aipc_kernels.lowbit.packing.pack_for_triton"):
        a16.lowbit_linear_a16_triton(x.cpu(), packing.as_canonical_packed(w), None, "e0m4")
    with pytest.raises(ValueError, match="does not match x.s K=64"):
        a16.lowbit_linear_a16_triton(torch.randn(1, 64, device=DEVICE), p, None, "int")
    with pytest.raises(ValueError, match="x has dtype torch.int32"):
        a16.lowbit_linear_a16_triton(x.to(torch.int32), p, None, "int")
    with pytest.raises(ValueError, match="KERNEL='group' is not the W4A16 kernel"):
        a16.lowbit_linear_a16_triton(x, p, None, "int", config=dict(GEMV, KERNEL="group"))
    with pytest.raises(ValueError, match=r"lacks \['SPLIT_K'\]"):
        a16.lowbit_linear_a16_triton(x, p, None, "int", config={k: v for k, v in GEMV.items() if k != "SPLIT_K"})
    with pytest.raises(ValueError, match="out must be"):
        a16.lowbit_linear_a16_triton(x, p, None, "int", config=GEMV, out=torch.empty(3, device=DEVICE))


def test_op_dispatch_fake_kernel_and_torch_compile():
    """``torch.ops.aipc.lowbit_linear_a16`` on a ``triton_k32`` weight: on a GPU this kernel, on the CPU
    the reference path; fake kernel and torch.compile."""
    w, p = _case(48, 256, "e0m4", 64, seed=2)
    x = torch.randn(4, 256, device=DEVICE)
    args = (x, p.qweight, p.scales, p.zeros, None, p.layout, p.codebook, p.group_size, p.out_features, "e0m4")
    torch.library.opcheck(torch.ops.aipc.lowbit_linear_a16.default, args)
    eager = ops.lowbit_linear_a16(x, p, dequant="int")
    _check(eager, x, w)
    compiled = torch.compile(lambda t: ops.lowbit_linear_a16(t, p) * 2, fullgraph=True)(x)
    torch.testing.assert_close(compiled, ops.lowbit_linear_a16(x, p) * 2)


def test_config_cache_per_device(tmp_path, monkeypatch):
    """Tuned configs live under ``<device>-a16`` with their own keys (dtype and dequant appended) and
    survive a new process; another kernel's config in that file is skipped."""
    monkeypatch.setenv("AIPC_CACHE_DIR", str(tmp_path))
    w, p = _case(40, 256, "int4", 64, seed=1)
    x = torch.randn(1, 256, device=DEVICE, dtype=torch.bfloat16)
    y = torch.empty(1, 40, device=DEVICE, dtype=torch.bfloat16)
    key = a16.config_key(x, p, "e0m4")
    assert key == "gemv:m1:n40:k256:g64:b4:bfloat16:e0m4"
    name = f"{tuning.device_name(x.device)}-a16"
    tuning.save_config(name, key, dict(GEMV, SPLIT_K=2))
    key_int = a16.config_key(x, p, "int")
    tuning.save_config(name, key_int, dict(GEMV, KERNEL="group"))
    monkeypatch.setattr(tuning, "_mem_cache", {})  # a second process: starts from the file
    assert json.loads(tuning.cache_file(name).read_text())[key]["SPLIT_K"] == 2
    assert key_int not in tuning.cached_configs(name, kernels=("a16",))
    assert a16.select_config(x, p, None, y, "e0m4") == dict(GEMV, SPLIT_K=2)
    assert a16.select_config(x, p, None, y, "int") == a16.heuristic(1, 40, 256, x.device)
    _check(a16.lowbit_linear_a16_triton(x, p, None, "e0m4"), x, w)


@pytest.mark.skipif(not ON_GPU, reason="timing configurations needs a GPU")
def test_autotune_writes_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("AIPC_TRITON_AUTOTUNE", "1")
    monkeypatch.setattr(a16, "GEMV_SPACE", [dict(GEMV, BLOCK_N=64), dict(GEMV, BLOCK_N=64, SPLIT_K=2)])
    w, p = _case(256, 512, "e0m4", 128, seed=3)
    x = torch.randn(1, 512, device="cuda", dtype=torch.bfloat16)
    _check(a16.lowbit_linear_a16_triton(x, p, None, "e0m4"), x, w)
    cached = json.loads(tuning.cache_file(f"{tuning.device_name(x.device)}-a16").read_text())
    assert cached[a16.config_key(x, p, "e0m4")]["SPLIT_K"] in (1, 2)


@pytest.mark.skipif(not ON_GPU, reason="large K: compiled on the GPU only (too slow for the interpreter)")
@pytest.mark.parametrize("dequant", DEQUANTS)
@pytest.mark.parametrize("codebook, group", [("e0m4", 128), ("int4", -1)])
def test_large_k_compiled(codebook, group, dequant):
    """The Llama-3-8B down projection (K = 14336) at M = 1, 16, 17 with bf16 x: the heuristic configs
    (split-K) and an atomic split, against the float64 reference."""
    N, K = 4096, 14336
    w, p = _case(N, K, codebook, group, seed=5)
    for M in (1, 16, 17):
        x = (torch.randn(M, K, generator=torch.Generator().manual_seed(M)) * 2).to(torch.bfloat16)
        for cfg in (None, dict(a16.heuristic(M, N, K, x.device), SPLIT_K=8, ATOMIC=1)):
            _check(a16.lowbit_linear_a16_triton(x.to(DEVICE), p, None, dequant, config=cfg), x, w, acc_tol=3e-5)
