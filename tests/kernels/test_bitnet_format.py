"""``aipc_kernels.checkpoints.bitnet`` against transformers' own BitNet code (``integrations/bitnet.py``:
``pack_weights``, ``unpack_weights``, ``WeightQuant``; ``should_convert_module``): fresh random
tensors, odd shapes, both float dtypes."""
from __future__ import annotations

import pytest
import torch

from aipc_kernels.checkpoints import bitnet as bf

bitnet = pytest.importorskip("transformers.integrations.bitnet")


def _orig(fn):
    """transformers decorates these with torch.compile: the function itself (same arithmetic)."""
    return getattr(fn, "_torchdynamo_orig_callable", fn)


def _ternary(n: int, k: int, seed: int) -> torch.Tensor:
    return torch.randint(-1, 2, (n, k), generator=torch.Generator().manual_seed(seed)).float()


@pytest.mark.parametrize("n, k", [(4, 32), (12, 96), (132, 160), (1028, 64)])
def test_unpack_equals_transformers(n, k):
    values = _ternary(n, k, n * k)
    packed = bitnet.pack_weights(values.clone())
    assert packed.shape == (n // 4, k) and packed.dtype == torch.uint8
    got = bf.unpack_ternary(packed, "w")
    assert got.dtype == torch.int8
    assert torch.equal(got.float(), _orig(bitnet.unpack_weights)(packed, dtype=torch.float32))
    assert torch.equal(got.float(), values)


def test_unpack_refuses_code_3_and_floats():
    packed = bitnet.pack_weights(_ternary(8, 32, 1))
    packed[1, 7] |= 0b00110000  # row 2*2 + 1 of the tensor gets the code 3
    with pytest.raises(ValueError, match=r"BitNet tensor layer\.weight holds the 2-bit code 3"):
        bf.unpack_ternary(packed, "layer.weight")
    with pytest.raises(ValueError, match=r"BitNet tensor layer\.weight must be a packed 2-D uint8 tensor .*"
                                         r"quantization_mode: online"):
        bf.unpack_ternary(torch.zeros(8, 32, dtype=torch.bfloat16), "layer.weight")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, k", [(8, 32), (36, 200), (256, 512)])
def test_absmean_ternarization_equals_weightquant(dtype, n, k):
    """BitNet's online rule: values and dequantized weight equal WeightQuant's, and a slice ternarized
    with the whole tensor's multiplier equals the whole tensor's rows (a TP shard or merged slot)."""
    w = (torch.randn(n, k, generator=torch.Generator().manual_seed(n + k)) * 0.02).to(dtype)
    ref = _orig(bitnet.WeightQuant.forward)(None, w)  # (round(W/mean|W|) clamped) * mean|W|, in w's dtype
    m = bf.absmean_multiplier(w)
    values, one = bf.ternarize(w, m)
    assert set(values.unique().tolist()) <= {-1, 0, 1}
    assert torch.equal((values.float() * one).to(dtype), ref)
    part, _ = bf.ternarize(w[n // 4 : n // 2], m)
    assert torch.equal(part, values[n // 4 : n // 2])


def test_packed_scale_follows_linear_class():
    s = torch.tensor([0.037], dtype=torch.bfloat16)
    assert bf.packed_scale(s, "autobitlinear", "x") == float(s)
    assert bf.packed_scale(s, "bitlinear", "x") == 1.0 / float(s)
    for bad, needle in ((torch.tensor([0.0]), "must be positive and finite"), (torch.tensor([float("nan")]), "positive"),
                        (torch.ones(2), "has 2 elements")):  # fmt: skip
        with pytest.raises(ValueError, match=needle):
            bf.packed_scale(bad, "bitlinear", "layer.weight_scale")


@pytest.mark.parametrize("group_size", [-1, 32, 64])
def test_ternary_weight_round_trip(group_size):
    values = _ternary(20, 128, 3).to(torch.int8)
    ones = torch.tensor([0.011] * 10 + [0.5] * 10)
    exact = ones.to(torch.bfloat16).float()  # bf16 numbers: held exactly (autobitlinear's scales)
    w = bf.ternary_weight(values, exact, "w", group_size=group_size)
    assert w.codebook == "ternary" and w.scales.dtype == torch.bfloat16
    assert torch.equal(w.dequantize().float(), values.float() * exact[:, None])
    w16 = bf.ternary_weight(values, ones, "w")  # other float32 values: fp16, one rounding
    assert w16.scales.dtype == torch.float16
    torch.testing.assert_close(w16.dequantize().float(), values.float() * ones[:, None], rtol=2.0**-11, atol=0)
    with pytest.raises(ValueError, match=r"BitNet layer bad cannot be packed: .*modules_to_not_convert"):
        bf.ternary_weight(values[:, :100], ones, "bad")


def test_not_converted_is_transformers_rule():
    """transformers' ``should_convert_module`` (5.24's rule; older versions also let a pattern match a
    longer name part, the one case below where they differ)."""
    import transformers
    from transformers.quantizers.quantizers_utils import should_convert_module

    names = ["lm_head", "model.layers.0.mlp.down_proj", "model.layers.11.self_attn.q_proj", "model.layers.1.mlp.up_proj"]
    for patterns in (["lm_head"], ["down_proj"], ["model.layers.1"], ["model.layers.*.up_proj"], ["q_proj", "lm_head"]):
        for name in names:
            if patterns == ["model.layers.1"] and name.startswith("model.layers.11"):
                assert not bf.not_converted(name, tuple(patterns))
                if tuple(int(v) for v in transformers.__version__.split(".")[:2]) < (5, 24):
                    continue
            assert bf.not_converted(name, tuple(patterns)) == (not should_convert_module(name, patterns)), (name, patterns)


def test_quantization_config_keys():
    spec, ignored = bf.parse_quantization_config(
        {"quant_method": "bitnet", "linear_class": "autobitlinear", "quantization_mode": "online", "pre_quantized": True}
    )
    assert not spec.packed and ignored == ["pre_quantized"]
    spec, _ = bf.parse_quantization_config({"quant_method": "bitnet", "modules_to_not_convert": None})
    assert spec.packed and spec.linear_class == "bitlinear" and spec.skipped == ()
