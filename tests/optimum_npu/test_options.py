"""``export_npu`` keywords (issue 19): exact types, choices and ranges, checked before any work, each
error naming the keyword. Nothing is coerced: ``sym="false"`` was ``bool("false") = True``,
``group_size=64.5`` was ``int(64.5) = 64``, ``True`` passed as an int."""
from __future__ import annotations

import pytest
import torch

# tiny shapes: an export that wrongly starts stays short
SMALL = dict(max_seq_len=64, prefill_block=16, kv_buckets=[32], layers_per_chunk=2, weight_format="fp32")
INT4 = dict(SMALL, weight_format="int4")

BAD_EXPORT = [
    (dict(INT4, sym="false"), "export_npu: sym='false' must be True or False or None"),
    (dict(INT4, group_size=64.5), "export_npu: group_size=64.5 must be an integer or None, e.g. 128"),
    (dict(INT4, group_size="abc"), "group_size='abc' must be an integer or None"),
    (dict(INT4, ratio="0.5"), "ratio='0.5' must be a number in (0, 1] or None"),
    (dict(INT4, ratio=True), "ratio=True must be a number in (0, 1] or None"),
    (dict(INT4, ratio=1.5), "ratio=1.5 must be a number in (0, 1] or None"),
    (dict(INT4, all_layers="no"), "all_layers='no' must be True or False or None"),
    (dict(SMALL, max_seq_len=True), "max_seq_len=True must be an integer >= 1"),
    (dict(SMALL, prefill_block=16.0), "prefill_block=16.0 must be an integer >= 1"),
    (dict(SMALL, layers_per_chunk=0), "layers_per_chunk=0 must be an integer >= 1"),
    (dict(SMALL, kv_buckets=[32, True]), "kv_buckets=[32, True] must be a list of integers >= 1 or None, e.g. [256, 512, 1024]"),
    (dict(SMALL, kv_buckets="32,64"), "kv_buckets='32,64' must be a list of integers >= 1"),
    (dict(SMALL, kv_buckets=[0, 32]), "kv_buckets=[0, 32] must be a list of integers >= 1"),
    (dict(SMALL, weight_format=4), "weight_format=4 is not supported; use one of 'fp32', 'fp16', 'int8', 'int4'"),
    (dict(SMALL, target="npu"), "target='npu' is not supported; use one of 'NPU', 'CPU', 'GPU'"),
]  # fmt: skip
BAD_LOAD = [
    (dict(SMALL, max_compiled_buckets=True), "max_compiled_buckets=True must be an integer >= 1 or None"),
    (dict(SMALL, compile="no"), "compile='no' must be True or False"),
    (dict(SMALL, device=0), "device=0 must be a string or None, e.g. 'NPU'"),
    (dict(SMALL, ov_config="LATENCY"), "ov_config='LATENCY' must be a dict or None"),
    (dict(SMALL, local_files_only="yes"), "local_files_only='yes' must be True or False"),
    (dict(SMALL, use_cache=False), "use_cache=False is not supported; use one of None, True"),
    (dict(SMALL, export=1), "export=1 must be True or False or None"),
    (dict(SMALL, quantization_config={"bits": 4.0}), "quantization_config bits=4.0"),
]  # fmt: skip


@pytest.mark.parametrize("kw, message", BAD_EXPORT)
def test_export_npu_model_keywords(source_model, tmp_path, kw, message):
    from optimum_npu import export_npu_model

    with pytest.raises(ValueError) as e:
        export_npu_model(source_model("llama"), tmp_path / "out", **kw)
    assert message in str(e.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kw, message", BAD_EXPORT + BAD_LOAD)
def test_from_pretrained_export_npu_keywords(source_model, tmp_path, kw, message):
    """Through optimum-intel's own entry point (the import hook), before any export starts."""
    from optimum.intel import OVModelForCausalLM

    with pytest.raises(ValueError) as e:
        OVModelForCausalLM.from_pretrained(source_model("llama"), export_npu=True, export_dir=tmp_path / "out", **kw)
    assert message in str(e.value)
    assert not (tmp_path / "out").exists()


def test_loading_keywords_of_an_export(exported):
    from optimum_npu import OVNPUModelForCausalLM

    for kw, message in [(dict(max_compiled_buckets=True), "max_compiled_buckets=True must be an integer >= 1"),
                        (dict(compile="false"), "compile='false' must be True or False")]:  # fmt: skip
        with pytest.raises(ValueError, match=message.replace("(", r"\(")):
            OVNPUModelForCausalLM(exported("llama"), device="CPU", **kw)
    model = OVNPUModelForCausalLM(exported("llama"), device="CPU", max_compiled_buckets=1, compile=False)
    assert model.max_compiled_buckets == 1
    assert model.generate(torch.tensor([[1, 50, 60, 70]]), max_new_tokens=2).shape == (1, 6)
