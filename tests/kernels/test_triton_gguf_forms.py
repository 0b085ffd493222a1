"""The Triton W*A8 ``lowbit_linear`` on GGUF's forms: the min form (``min2`` / ``min4`` / ``min8``), float32
scales and groups of 16 (the K-quants), against the float64 int8-activation reference
(:func:`aipc_kernels.lowbit.ops.reference_linear_w8`) with the existing W*A8 tests' tolerance.

Weights are what :func:`aipc_kernels.checkpoints.gguf.relayout` makes of GGUF blocks: ``gguf.quants.quantize``
of random data where the package quantizes the type (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1), random blocks with
moderate fp16 fields for the K-quants (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K). Every kernel the op dispatches to
(the heuristic's ``stream`` at M == 1, ``group`` at 1 < M <= 16 and M > 16, ``dequant``) and their
variants (split-K, atomic split-K, the weights as the dot's A or B operand, activations stationary),
odd N and M, an output buffer prefilled with NaN. On a CUDA machine the kernels run compiled; without
one on CPU tensors under ``TRITON_INTERPRET=1``, on small shapes.
"""
import numpy as np
import pytest
import torch

pytest.importorskip("triton")
gguf = pytest.importorskip("gguf")

from aipc_kernels.checkpoints import gguf as gf  # noqa: E402
from aipc_kernels.lowbit import ops, packing  # noqa: E402
from tests.helpers.triton_kernels import import_kernels  # noqa: E402

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
tlin, registry, tuning = import_kernels(
    "aipc_kernels.gpu.triton.lowbit", "aipc_kernels.gpu.triton.lowbit.registry", "aipc_kernels.gpu.triton.lowbit.tuning"
)
T = gguf.GGMLQuantizationType
GGUF_QUANTIZES = [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1]
K_QUANTS = [T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]
#: byte offsets of a K-quant block's fp16 fields (d, and dmin for the min form)
FP16_FIELDS = {T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}
TOL = 2e-5  # the W*A8 tests' fp32 tolerance (test_triton_lowbit._close)

GROUP = {"KERNEL": "group", "BLOCK_N": 32, "BLOCK_M": 16, "num_warps": 4, "num_stages": 2, "WA": 1}
CONFIGS = {
    # M == 1: the stream GEMV (activation words broadcast or in the weights' layout, split over K), the group kernel
    1: [{"KERNEL": "stream", "XPACK": 1, "PDL": 1, "BLOCK_N": 8, "BLOCK_C": 2, "SPLIT_K": 2, "num_warps": 4, "num_stages": 1},
        {"KERNEL": "stream", "XPACK": 1, "BLOCK_N": 16, "BLOCK_C": 4, "SPLIT_K": 1, "num_warps": 4, "num_stages": 1, "FULLX": 1},
        {"KERNEL": "stream", "XPACK": 1, "BLOCK_N": 8, "SPLIT_K": 1, "num_warps": 4, "num_stages": 1, "RB": 3},
        dict(GROUP, BLOCK_N=16, SPLIT_K=1)],
    # 1 < M <= 16: the group kernel split over K (workspace and atomic), 16 token columns
    5: [dict(GROUP, BLOCK_N=16, SPLIT_K=2), dict(GROUP, BLOCK_N=32, SPLIT_K=3, ATOMIC=1)],
    # M > 16: the group GEMM (weights as A or B), dequantize-then-GEMM
    19: [dict(GROUP, BLOCK_N=16, BLOCK_M=32, WA=0, SPLIT_K=2), {"KERNEL": "dequant", "BLOCK_N": 16, "CHUNKS": 3, "num_warps": 4}],
}


@pytest.fixture(autouse=True)
def _no_tuning(tmp_path, monkeypatch):
    """The heuristic or explicit configs; the tuning cache in a temporary folder."""
    monkeypatch.setenv("AIPC_TRITON_AUTOTUNE", "0")
    monkeypatch.setenv("AIPC_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tuning, "_mem_cache", {})


def _fp16(rng: np.random.Generator, n: int) -> np.ndarray:
    return (rng.standard_normal(n) * 0.02).astype(np.float16)


def _gguf_weight(qtype, N: int, K: int, seed: int):
    """A random tensor of ``qtype`` re-laid out (``gf.relayout``): quantized by gguf where it can, else random
    blocks with moderate fp16 d (and dmin)."""
    rng = np.random.default_rng(seed)
    if qtype in GGUF_QUANTIZES:
        raw = gguf.quants.quantize(rng.standard_normal((N, K)).astype(np.float32), qtype)
    else:
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        b = rng.integers(0, 256, (N, K // block, size), dtype=np.uint8)
        for at in FP16_FIELDS[qtype]:
            b[..., at:at + 2] = _fp16(rng, N * (K // block)).view(np.uint8).reshape(N, K // block, 2)
        raw = b.reshape(N, -1)
    w = gf.relayout(raw, qtype, (N, K), "w")
    assert w.codebook == gf.LOWBIT_TYPES[qtype][0] and w.group_size == gf.LOWBIT_TYPES[qtype][1]
    assert w.scales.dtype == (torch.int8 if qtype in K_QUANTS else torch.float16)  # K-quants: two-level
    on = packing.pack_for_triton(w).to(DEVICE)  # the Triton layout holds their float32 products
    assert on.supers is None and on.scales.dtype == (torch.float32 if qtype in K_QUANTS else torch.float16)
    return w, on


def _close(y, ref, rtol=TOL):
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y.double().cpu(), ref, rtol=rtol, atol=rtol * ref.abs().max().item())


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_1, T.Q5_1] + K_QUANTS, ids=lambda q: q.name)  # Q4_0 / Q5_0: int4 / int8 g32
@pytest.mark.parametrize("M", sorted(CONFIGS))
def test_gguf_forms_match_the_float64_reference(qtype, M):
    """Each GGUF form on every kernel dispatch reaches (the heuristic's, then each listed config), odd N
    and M, a bias, the output prefilled with NaN."""
    N, K = 37, 256
    w, p = _gguf_weight(qtype, N, K, seed=int(qtype) * 100 + M)
    g = torch.Generator().manual_seed(M)
    x, bias = torch.randn(M, K, generator=g), torch.randn(N, generator=g)
    ref = ops.reference_linear_w8(x, w, bias)
    xd, bd = x.to(DEVICE), bias.to(DEVICE)
    out = torch.full((M, N), float("nan"), device=DEVICE)
    y = tlin.lowbit_linear_triton(xd, p, bd, out=out)  # the heuristic's kernel
    assert y.data_ptr() == out.data_ptr()
    _close(y, ref)
    for cfg in CONFIGS[M]:
        out.fill_(float("nan"))
        if cfg.get("RB", 1) > 1 and w.group_size == 16:  # activations stationary: no groups of 16, refused by name
            with pytest.raises(ValueError, match="RB > 1"):
                tlin.lowbit_linear_triton(xd, p, bd, config=cfg, out=out)
            continue
        _close(tlin.lowbit_linear_triton(xd, p, bd, config=cfg, out=out), ref)


@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q5_K, T.Q2_K], ids=lambda q: q.name)
def test_gguf_forms_without_bias_whole_rows_and_bf16(qtype):
    """No bias, the batch-invariant mode (group kernel unsplit), bf16 activations (the op's x dtype)."""
    N, K = 19, 256
    w, p = _gguf_weight(qtype, N, K, seed=3)
    x = torch.randn(3, K)
    ref = ops.reference_linear_w8(x, w)
    _close(tlin.lowbit_linear_triton(x.to(DEVICE), p, config=dict(GROUP, BLOCK_N=16, SPLIT_K=1)), ref)
    y = tlin.lowbit_linear_triton(x.to(DEVICE, torch.bfloat16), p)
    ref16 = ops.reference_linear_w8(x.to(torch.bfloat16), w)
    _close(y, ref16, 8e-3)


@pytest.mark.parametrize("codebook, group", [("min8", 64), ("min4", 128), ("min4", -1), ("min2", -1)])
def test_min_form_wide_groups_and_whole_rows(codebook, group):
    """The min form in groups spanning several chunks (8 bits: 64) and one group per row (4 / 8 bits: one
    int32 dot over the row, the activation sum carried with it), fp32 scales and mins (``as_min8``'s)."""
    from aipc_kernels.lowbit.quantizers import quantize_rtn

    N, K = 21, 256
    w = quantize_rtn(torch.randn(N, K, generator=torch.Generator().manual_seed(5)), codebook, group)
    w = type(w)(w.qweight, w.scales.float(), w.zeros.float(), w.codebook, w.group_size, w.in_features)
    p = packing.pack_for_triton(w).to(DEVICE)
    for M, cfgs in ((1, CONFIGS[1][1:2]), (4, [dict(GROUP, BLOCK_N=16, SPLIT_K=2)]), (18, [dict(GROUP, WA=0, BLOCK_M=32)])):
        x = torch.randn(M, K)
        ref = ops.reference_linear_w8(x, w)
        for cfg in [None, *cfgs]:
            _close(tlin.lowbit_linear_triton(x.to(DEVICE), p, config=cfg), ref)


def test_a_cached_config_that_refuses_the_form_falls_back_to_a_kernel_that_takes_it(monkeypatch):
    """A tuned config is keyed by shape, group and bits only: one of a CUDA C kernel (2-bit, fp16/bf16
    scales, no min form) or activations-stationary stream (no groups of 16) met by a GGUF form runs the
    heuristic's Triton kernel instead of failing."""
    _, p = _gguf_weight(T.Q2_K, 24, 256, seed=9)
    w, _ = _gguf_weight(T.Q2_K, 24, 256, seed=9)
    x = torch.randn(1, 256)
    ref = ops.reference_linear_w8(x, w)
    for cfg in ({"KERNEL": "cuda_stream", "BLOCK_N": 8, "SPLIT_K": 1, "RW": 8, "D": 4, "num_warps": 4, "num_stages": 1},
                {"KERNEL": "stream", "XPACK": 1, "BLOCK_N": 8, "SPLIT_K": 1, "num_warps": 4, "num_stages": 1, "RB": 2}):
        monkeypatch.setattr(tlin.linear, "select_config", lambda *a, cfg=cfg: cfg)
        assert not registry.runs(cfg, x.to(DEVICE), p)
        _close(tlin.lowbit_linear_triton(x.to(DEVICE), p), ref)
    with pytest.raises(ValueError, match="RB > 1"):  # asked for explicitly: refused, naming the fix
        tlin.lowbit_linear_triton(x.to(DEVICE), p, config=cfg)
