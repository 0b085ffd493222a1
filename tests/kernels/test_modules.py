"""aipc_kernels.lowbit.modules.LowBitLinear: the packed weight's format survives module casts, and the forward reads
the module's buffers as they are now."""
from __future__ import annotations

import pytest
import torch

from aipc_kernels.lowbit.modules import LowBitLinear
from aipc_kernels.lowbit.quantizers import quantize_weight


@pytest.mark.parametrize("codebook, activations", [("e0m4", "float"), ("affine4", "int8"), ("int8", "int8")])
def test_module_casts_keep_the_format_dtypes(codebook, activations):
    """``model.float()`` / ``.to(bf16)`` / ``.half()`` (as transformers' loaders and users call them) leave
    scales and zeros in their stored dtype (the W4A16 kernels refuse float32 scales; a cast could round
    float32 ones): same outputs before and after; the bias follows the model; buffer order unchanged."""
    g = torch.Generator().manual_seed(0)
    w = quantize_weight(torch.randn(48, 128, generator=g), codebook, 64)
    m = LowBitLinear(w, None, activations=activations)
    x = torch.randn(3, 128, generator=g)
    y = m(x)
    dtypes = {n: t.dtype for n, t in m.named_buffers()}
    m.float()
    m.to(torch.bfloat16)
    m.half()
    m.to("cpu", torch.float32)
    assert {n: t.dtype for n, t in m.named_buffers()} == dtypes
    assert [n for n, _ in m.named_buffers()] == list(dtypes)
    torch.testing.assert_close(m(x), y, atol=0, rtol=0)
    with_bias = LowBitLinear(w, torch.randn(48, generator=g), activations=activations)
    assert with_bias.to(torch.bfloat16).bias.dtype == torch.bfloat16 and with_bias.scales.dtype == w.scales.dtype


def test_forward_reads_the_current_buffers():
    """A buffer assigned after construction (a loaded state dict, a view into merged storage) is the one used."""
    g = torch.Generator().manual_seed(1)
    a = LowBitLinear(quantize_weight(torch.randn(32, 64, generator=g), "affine4", 32))
    b = LowBitLinear(quantize_weight(torch.randn(32, 64, generator=g), "affine4", 32))
    x = torch.randn(2, 64, generator=g)
    a.load_state_dict(b.state_dict())
    torch.testing.assert_close(a(x), b(x), atol=0, rtol=0)
