"""Quantizer quality: the optimised fit beats RTN clearly at 2 bits; activations match the kernels."""
import pytest
import torch

from aipc_kernels.lowbit.formats import CODEBOOKS
from aipc_kernels.lowbit.quantizers import quantize_activations, quantize_optimized, quantize_rtn, quantize_weight


def _rel_err(w, q):
    return ((q.dequantize() - w).norm() / w.norm()).item()


def _matrices():
    g = torch.Generator().manual_seed(1)
    gauss = torch.randn(256, 512, generator=g)
    heavy = torch.distributions.StudentT(3.0).sample((256, 512))
    return {"gaussian": gauss, "student-t(3)": heavy}


@pytest.mark.parametrize("codebook", sorted(CODEBOOKS))
@pytest.mark.parametrize("kind", ["gaussian", "student-t(3)"])
def test_optimized_beats_rtn(codebook, kind):
    w = _matrices()[kind]
    rtn, opt = _rel_err(w, quantize_rtn(w, codebook, 64)), _rel_err(w, quantize_optimized(w, codebook, 64))
    assert opt <= rtn
    if CODEBOOKS[codebook].bits == 2:
        assert opt < 0.9 * rtn, (rtn, opt)  # "clearly": at least 10% lower error at 2 bits


def test_group_size_and_scale_dtype_are_honoured():
    w = torch.randn(32, 256)
    q = quantize_weight(w, "affine", 128, method="optimized", scale_dtype=torch.bfloat16)
    assert q.scales.shape == (32, 2) and q.scales.dtype == torch.bfloat16 and q.zeros.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="method='gptq' is unknown"):
        quantize_weight(w, method="gptq")


def test_constant_and_zero_groups_are_exact():
    w = torch.zeros(4, 64)
    w[1] = 0.25
    for cb in ("affine", "sym", "int2"):
        assert torch.isfinite(quantize_optimized(w, cb, 32).dequantize()).all()
    assert torch.allclose(quantize_optimized(w, "affine", 32).dequantize(), w, atol=1e-3)


def test_activation_quantization_per_token_and_group():
    x = torch.randn(3, 5, 128)
    xq, s = quantize_activations(x)
    assert xq.dtype == torch.int8 and s.shape == (3, 5, 1)
    assert xq.abs().amax(-1).eq(127).all()
    assert torch.allclose(xq.float() * s, x, atol=(s.max() / 2 + 1e-6).item())
    xq, s = quantize_activations(x, 32)
    assert s.shape == (3, 5, 4)
    with pytest.raises(ValueError, match="group_size=48 does not divide K=128"):
        quantize_activations(x, 48)
