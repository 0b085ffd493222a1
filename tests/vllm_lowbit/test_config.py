"""LowBit2Config: registration through the plugin hook, parsing, and its errors."""
from __future__ import annotations

import pytest

pytest.importorskip("vllm")


@pytest.fixture(scope="module")
def config_cls():
    import vllm_lowbit

    assert vllm_lowbit.register() is True
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, get_quantization_config

    from vllm_lowbit.config import LowBit2Config

    assert "lowbit2" in QUANTIZATION_METHODS
    assert get_quantization_config("lowbit2") is LowBit2Config
    return LowBit2Config


def test_defaults_and_round_trip(config_cls):
    c = config_cls()
    assert (c.codebook, c.group_size, c.quantizer, c.act_group, c.prequantized) == ("affine", 64, "optimized", 0, False)
    d = dict(c.to_dict(), codebook="sym", group_size=-1, prequantized=True, quantize_lm_head=True)
    c2 = config_cls.from_config(d)
    assert (c2.codebook, c2.group_size, c2.prequantized, c2.quantize_lm_head) == ("sym", -1, True, True)
    assert config_cls.get_config_filenames() == []  # plain checkpoints + --quantization lowbit2: on the fly


def test_checkpoint_selects_lowbit2_without_flag(config_cls):
    assert config_cls.override_quantization_method({"quant_method": "lowbit2"}, None) == "lowbit2"
    assert config_cls.override_quantization_method({"quant_method": "gptq"}, None) is None


@pytest.mark.parametrize("cfg, message", [
    ({"codebook": "int3"}, "codebook='int3' is unknown"),
    ({"group_size": 96}, "group_size=96 is not supported"),
    ({"quantizer": "gptq"}, "quantizer='gptq' is unknown"),
    ({"scale_dtype": "float32"}, "scale_dtype='float32' is not supported"),
    ({"act_group": 32}, "act_group=32 must be 0 (per token) or a multiple of group_size=64"),
    ({"group_sise": 64}, "unknown keys ['group_sise']"),
    ({"format_version": 99}, "format_version 99 is newer"),
])  # fmt: skip
def test_bad_config_names_the_key(config_cls, cfg, message):
    with pytest.raises(ValueError) as e:
        config_cls.from_config(dict({"quant_method": "lowbit2"}, **cfg))
    assert message in str(e.value)
