"""The output projection's formats (aipc_kernels.lowbit.output_projection), and what the default ``auto`` picks."""
import pytest
import torch

from aipc_kernels.core import native
from aipc_kernels.lowbit import ops, packing
from aipc_kernels.lowbit.output_projection import (auto_head_format, int8_scale_dtype, quantize_output_projection,
                                                   resolve_head_format)


def _head(vocab: int = 300, hidden: int = 192, seed: int = 0, scale: float = 0.02) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(vocab, hidden, generator=g) * scale).to(torch.bfloat16)


def test_int8_is_round_to_nearest_per_output_channel():
    w = _head()
    q = quantize_output_projection(w, "int8")
    assert (q.codebook, q.group_size, q.scales.shape, q.scales.dtype) == ("int8", 192, (300, 1), torch.float16)
    wf = w.float()
    s = q.scales.float().squeeze(1)
    # the scale that takes the row's extremes to the extreme levels 127 and -128
    expect = torch.maximum(wf.amax(1) / 127, wf.amin(1) / -128).to(torch.float16).float()
    torch.testing.assert_close(s, expect, rtol=0, atol=0)
    # each weight is its nearest level: error at most half a step (plus the fp16 rounding of the scale)
    err = (q.dequantize() - wf).abs().amax(1)
    assert bool((err <= 0.5 * s * (1 + 2**-9) + 128 * s * 2**-11).all())


@pytest.mark.parametrize("hidden, group", [(192, 32), (96, 32), (80, None)])
def test_int6_is_round_to_nearest_in_groups_of_32(hidden, group):
    """int6: GGUF Q6_K's levels -32 .. 31 in groups of 32 (16-bit scales taking each group's extremes to the
    extreme levels), 6.5 bits a weight; a hidden size that 32 does not divide is refused naming the head."""
    w = _head(hidden=hidden)
    if group is None:
        with pytest.raises(ValueError, match="cannot quantize the output projection lm_head to int6: .*K=80"):
            quantize_output_projection(w, "int6")
        return
    q = quantize_output_projection(w, "int6")
    assert (q.codebook, q.group_size, q.scales.dtype) == ("int6", group, torch.float16)
    wg = w.float().reshape(300, -1, group)
    s = q.scales.float()
    expect = torch.maximum(wg.amax(-1) / 31, wg.amin(-1) / -32).to(torch.float16).float()
    torch.testing.assert_close(s, expect, rtol=0, atol=0)
    err = (q.dequantize().reshape(300, -1, group) - wg).abs().amax(-1)
    assert bool((err <= 0.5 * s * (1 + 2**-9) + 32 * s * 2**-11).all())
    assert q.qweight.numel() * 8 == 300 * hidden * 6  # six bits a code


def test_int8_scale_dtype_keeps_tiny_rows_and_padding():
    w = _head()
    w[7] = 0  # vLLM pads the vocabulary with zero rows
    assert int8_scale_dtype(w) == torch.float16
    w[3] *= 1e-3  # a row whose scale is below fp16's normal range
    assert int8_scale_dtype(w) == torch.bfloat16
    q = quantize_output_projection(w, "int8")
    assert q.scales.dtype == torch.bfloat16 and q.scales[7].item() == 0 and bool((q.dequantize()[7] == 0).all())


def test_lowbit_and_float_formats():
    w = _head()
    assert quantize_output_projection(w, "float") is None
    q = quantize_output_projection(w, "lowbit", codebook="affine", group_size=64)
    assert (q.codebook, q.group_size) == ("affine", 64)
    with pytest.raises(ValueError, match="head format 'lowbit' needs the linears' codebook and group_size"):
        quantize_output_projection(w, "lowbit")
    with pytest.raises(ValueError, match=r"head format 'int4' is unknown; use one of \('int8', 'int6', 'lowbit', 'float'\)"):
        quantize_output_projection(w, "int4")
    # a group that does not divide the hidden size falls back as the linears' does (96: 64 -> 32)
    assert quantize_output_projection(_head(hidden=96), "lowbit", codebook="affine", group_size=64).group_size == 32
    with pytest.raises(ValueError, match="cannot quantize the output projection lm_head to lowbit: .*K=80 must be a multiple of 32"):
        quantize_output_projection(_head(hidden=80), "lowbit", codebook="affine", group_size=64)


@pytest.mark.skipif(not native.available(), reason="native library not built")
@pytest.mark.parametrize("M", [1, 5])
def test_int8_head_logits_close_to_float(M):
    """W8A8 logits of a head against the float head: the relative error of int8 weights and int8
    activations per token (~1%), an order of magnitude below a 2-bit head's."""
    w = _head(vocab=517, hidden=256)
    x = torch.randn(M, 256)
    ref = x.double() @ w.double().T
    y8 = ops.lowbit_linear(x, packing.pack_for_cpu(quantize_output_projection(w, "int8")))
    y6 = ops.lowbit_linear(x, packing.pack_for_cpu(quantize_output_projection(w, "int6")))
    y2 = ops.lowbit_linear(x, packing.pack_for_cpu(quantize_output_projection(w, "lowbit", codebook="affine", group_size=64)))
    rel = lambda y: float((y.double() - ref).norm() / ref.norm())  # noqa: E731
    assert rel(y8) < 0.015 and rel(y8) * 10 < rel(y2), (rel(y8), rel(y2))
    assert rel(y6) < 0.03 and rel(y6) * 4 < rel(y2), (rel(y6), rel(y2))  # int6 g32: between int8 and 2 bits


#: ``lm_head: auto`` per instruction set of the kernels: int6 without AMX (measured faster there, but on a Zen 5),
#: int8 with AMX (not measured) and in portable C
AUTO_HEAD = {"scalar": "int8", "avx2": "int6", "avx_vnni": "int6", "avx512_vnni": "int6", "amx_int8": "int8"}


@pytest.mark.skipif(not native.available(), reason="native library not built")
def test_auto_head_format_follows_the_kernels_isa(isa):
    """``auto`` is int6 where the kernels run with AVX2 / AVX-VNNI (the Core Ultra class) or AVX-512 VNNI, int8 with
    AMX or portable C, int8 off the CPU; a named format is kept as it is."""
    assert auto_head_format() == resolve_head_format("auto") == AUTO_HEAD[isa]
    assert auto_head_format(on_cpu=False) == resolve_head_format("auto", on_cpu=False) == "int8"
    assert [resolve_head_format(f) for f in ("int8", "int6", "lowbit", "float")] == ["int8", "int6", "lowbit", "float"]
