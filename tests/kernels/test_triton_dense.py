"""Triton ``aipc::dense_linear`` kernel against float64 references.

On a CUDA machine the kernel runs compiled on the GPU; without one it runs on CPU tensors under
``TRITON_INTERPRET=1`` (set here only while the kernel module is imported), on small shapes.
"""
import pytest
import torch

pytest.importorskip("triton")

from tests.helpers.triton_kernels import import_kernels  # noqa: E402

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
(tdense,) = import_kernels("aipc_kernels.gpu.triton.dense_linear")

# the output dtype's rounding (the interpreter truncates fp32 to bf16: a whole ulp)
OUT_EPS = {torch.float32: 0.0, torch.bfloat16: 2**-7 if not ON_GPU else 2**-8, torch.float16: 2**-11}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("M, N, K", [(1, 37, 100), (4, 64, 128), (5, 130, 263), (17, 9, 40), (32, 1, 1)])
def test_matches_float64_reference(dtype, M, N, K):
    """Odd N and K (masked columns and K tail), one and two row blocks, with and without bias, and the
    output poisoned first: every element written."""
    g = torch.Generator().manual_seed(M * 1000 + N + K)
    x, w = torch.randn(M, K, generator=g).to(dtype), torch.randn(N, K, generator=g).to(dtype)
    bias = torch.randn(N, generator=g).to(dtype) if M % 2 else None
    y = tdense.dense_linear(x.to(DEVICE), w.to(DEVICE), None if bias is None else bias.to(DEVICE))
    assert y.shape == (M, N) and y.dtype == dtype and y.device.type == DEVICE
    ref = x.double() @ w.double().T + (0 if bias is None else bias.double())
    scale = x.double().abs() @ w.double().abs().T + 1e-30
    err = (y.double().cpu() - ref).abs()
    assert torch.isfinite(y).all()
    assert (err <= 1e-5 * scale + OUT_EPS[dtype] * ref.abs()).all(), f"max err {err.max().item():.3g}"


def test_leading_dimensions_and_strided_x():
    x = torch.randn(2, 3, 128)[..., ::2]
    w, b = torch.randn(20, 64), torch.randn(20)
    y = tdense.dense_linear(x.to(DEVICE), w.to(DEVICE), b.to(DEVICE))
    assert y.shape == (2, 3, 20)
    torch.testing.assert_close(y.cpu(), torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("config", [{"BLOCK_N": 16, "SPLIT_K": 3}, {"BLOCK_N": 32, "SPLIT_K": 2}, {"BLOCK_N": 64, "SPLIT_K": 1}])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_every_block_width_and_k_split(config, dtype):
    """Each column block, and K split in uneven parts (K = 700: 6 steps of 128, the last partial) with the
    partial sums added atomically, bias added after the split."""
    M, N, K = 5, 45, 700
    g = torch.Generator().manual_seed(K + config["BLOCK_N"])
    x, w, bias = (torch.randn(*s, generator=g).to(dtype) for s in ((M, K), (N, K), (N,)))
    y = tdense.dense_linear(x.to(DEVICE), w.to(DEVICE), bias.to(DEVICE), config=config)
    ref = x.double() @ w.double().T + bias.double()
    scale = x.double().abs() @ w.double().abs().T + bias.double().abs()
    assert ((y.double().cpu() - ref).abs() <= 1e-5 * scale + OUT_EPS[dtype] * ref.abs()).all()


def test_config_fills_the_gpu():
    """Narrower column blocks before a K split; a split only where even 16 columns leave the GPU idle."""
    assert tdense.choose_config(1, 28672, 4096, 264) == {"BLOCK_N": 64, "SPLIT_K": 1}
    assert tdense.choose_config(1, 14336, 4096, 264) == {"BLOCK_N": 32, "SPLIT_K": 1}
    assert tdense.choose_config(4, 4096, 14336, 264) == {"BLOCK_N": 16, "SPLIT_K": 2}
    cfg = tdense.choose_config(4, 1024, 4096, 264)
    assert cfg["BLOCK_N"] == 16 and cfg["SPLIT_K"] == 5
