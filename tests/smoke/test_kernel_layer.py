"""The kernel layer as this venv installed it: one small case per op family against its float64
reference (the whole kernel suite runs once, in the kernel venv: scripts/envs.py). A venv whose
build, torch, numpy or triton broke the layer fails here, in seconds."""
from __future__ import annotations

import pytest
import torch

from aipc_kernels.lowbit import ops, packing
from aipc_kernels.lowbit.quantizers import quantize_rtn


def _weight(codebook: str, N: int, K: int, group: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return quantize_rtn(torch.randn(N, K, generator=g), codebook, group)


@pytest.mark.parametrize("codebook", ["int2", "int4", "int8"])
def test_lowbit_linear_native(codebook):
    """The op users call, on the CPU layout (the native kernel: test_packaging checks it is built), at
    decode (M=1) and a small batch, odd N."""
    w = _weight(codebook, 37, 256, 64, seed=11)
    p = packing.pack_for_cpu(w)
    for M in (1, 5):
        x, bias = torch.randn(M, 256), torch.randn(37)
        y = ops.lowbit_linear(x, p, bias)
        ref = ops.reference_linear_w8(x, w, bias)
        torch.testing.assert_close(y.double(), ref, rtol=2e-5, atol=2e-5 * ref.abs().max().item())


def test_lowbit_linear_triton_interpreted():
    """The Triton kernels import, compile under the interpreter and run against this venv's packages."""
    pytest.importorskip("triton")
    from tests.helpers.triton_kernels import import_kernels

    (tlin,) = import_kernels("aipc_kernels.gpu.triton.lowbit")
    w = _weight("int2", 19, 128, 32, seed=3)
    p = packing.pack_for_triton(w)
    x, bias = torch.randn(3, 128), torch.randn(19)
    cfg = {"KERNEL": "group", "BLOCK_N": 16, "BLOCK_M": 16, "num_warps": 4, "num_stages": 2, "WA": 1, "SPLIT_K": 1}
    y = tlin.lowbit_linear_triton(x, p, bias, config=cfg)
    ref = ops.reference_linear_w8(x, w, bias)
    torch.testing.assert_close(y.double(), ref, rtol=2e-5, atol=2e-5 * ref.abs().max().item())
