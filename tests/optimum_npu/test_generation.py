"""The GenerationMixin contract: sampling, streamers, chat template, limits, wrong arguments."""
from __future__ import annotations

import pytest
import torch

from npu_testing import F32, PROMPT


@pytest.fixture(scope="module")
def model(exported):
    from optimum_npu import OVNPUModelForCausalLM

    return OVNPUModelForCausalLM(exported("llama"), device="CPU", ov_config=F32)


@pytest.fixture(scope="module")
def tokenizer(exported):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(exported("llama"))


def test_past_max_seq_len_raises_naming_the_limit(model, tokenizer):
    from optimum_npu import SequenceTooLongError

    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with pytest.raises(SequenceTooLongError, match="max_seq_len=128"):
        model.generate(ids, max_new_tokens=128 - ids.shape[1] + 1, do_sample=False)
    # token by token through forward: the step that would write slot 128 raises, never wraps
    out = model(ids)
    tok = out.logits[:, -1:].argmax(-1)
    for _ in range(128 - ids.shape[1]):
        out = model(tok, past_key_values=out.past_key_values)
        tok = out.logits[:, -1:].argmax(-1)
    with pytest.raises(SequenceTooLongError, match="max_seq_len=128"):
        model(tok, past_key_values=out.past_key_values)
    # exactly max_seq_len tokens is allowed
    got = model.generate(ids, max_new_tokens=128 - ids.shape[1], do_sample=False)
    assert got.shape[1] == 128


def test_sampling_streamer_and_chat_template(model, tokenizer):
    from transformers import TextStreamer

    chat = [{"role": "user", "content": "How does attention work?"}]
    ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt",
                                        return_dict=True)["input_ids"]

    class Collect(TextStreamer):
        def __init__(self, tok):
            super().__init__(tok, skip_prompt=True)
            self.text = ""

        def on_finalized_text(self, text, stream_end=False):
            self.text += text

    streamer = Collect(tokenizer)
    greedy = model.generate(ids, max_new_tokens=12, do_sample=False, streamer=streamer)
    assert streamer.text == tokenizer.decode(greedy[0, ids.shape[1]:], skip_special_tokens=True)
    torch.manual_seed(0)
    a = model.generate(ids, max_new_tokens=12, do_sample=True, top_k=50, temperature=1.5)
    torch.manual_seed(0)
    b = model.generate(ids, max_new_tokens=12, do_sample=True, top_k=50, temperature=1.5)
    assert a.tolist() == b.tolist() and a.shape == greedy.shape
    assert a.tolist() != greedy.tolist()  # 12 tokens at temperature 1.5 differ from greedy


def test_bad_inputs_fail_early(model, tokenizer):
    ids = tokenizer([PROMPT, PROMPT], return_tensors="pt").input_ids
    with pytest.raises(ValueError, match="one sequence"):
        model.generate(ids, max_new_tokens=2)
    with pytest.raises(ValueError, match="num_beams"):
        model.generate(ids[:1], max_new_tokens=2, num_beams=2)
    mask = torch.ones_like(ids[:1])
    mask[0, 0] = 0
    with pytest.raises(ValueError, match="padding"):
        model(ids[:1], attention_mask=mask)


def test_export_arguments_are_validated(source_model, tmp_path):
    from optimum_npu import export_npu_model
    from optimum_npu.chunks import UnsupportedArchitectureError

    src = source_model("llama")
    for kw, msg in [(dict(max_seq_len=0), "max_seq_len"),
                    (dict(prefill_block=256, max_seq_len=128), "prefill_block"),
                    (dict(kv_buckets=[64, 4096], max_seq_len=128), "kv_buckets"),
                    (dict(weight_format="int3"), "weight_format"),
                    (dict(weight_format="int4", sym=False), "INT4 asymmetric"),
                    (dict(weight_format="fp16", group_size=64), "group_size"),
                    (dict(max_seq_len=4096), "max_position_embeddings")]:
        with pytest.raises(ValueError, match=msg):
            export_npu_model(src, tmp_path / "x", **kw)
    with pytest.raises(UnsupportedArchitectureError, match="supported: llama, mistral, qwen2"):
        export_npu_model(source_model("gpt_neox") if False else _opt(source_model), tmp_path / "y")


def test_longrope_outside_phi3_is_refused_before_any_work(source_model, tmp_path):
    """transformers' Llama keeps the short-factor cache at the LongRoPE switch (Phi-3 recomputes it,
    which the export reproduces): a Llama with rope_scaling longrope is refused, naming it."""
    import json
    import shutil

    from aipc_kernels.tools.tiny_model import longrope_scaling
    from optimum_npu import export_npu_model
    from optimum_npu.chunks import UnsupportedArchitectureError

    src = shutil.copytree(source_model("llama"), tmp_path / "llama-longrope")
    config = json.loads((src / "config.json").read_text())
    config.pop("rope_parameters", None)
    config.update(original_max_position_embeddings=32, rope_scaling=longrope_scaling(32))
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedArchitectureError, match=r"rope_scaling type 'longrope'.*phi3"):
        export_npu_model(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def _opt(source_model):
    from aipc_kernels.tools.tiny_model import build_tiny_model

    return build_tiny_model("opt")


def test_int4_symmetric_export_is_npu_ready(source_model, tmp_path):
    import json

    import openvino as ov

    from optimum_npu import OVNPUModelForCausalLM, check_npu_ready, export_npu_model

    out = export_npu_model(source_model("llama"), tmp_path / "int4", max_seq_len=64,
                           prefill_block=16, kv_buckets=[32], layers_per_chunk=2,
                           weight_format="int4")
    q = json.loads((out / "npu_export.json").read_text())["quantization"]
    assert q == dict(weight_format="int4", mode="int4_sym", group_size=128, ratio=1.0,
                     all_layers=True)
    check_npu_ready(out)
    ir = ov.Core().read_model(out / "npu_layers_00_01_kv32.xml", out / "npu_layers_00_01_prefill.bin")
    types = {op.get_output_element_type(0).get_type_name() for op in ir.get_ordered_ops()
             if op.get_type_name() == "Constant"}
    assert "i4" in types and "u4" not in types and "u8" not in types  # no layer left in INT8 asym
    model = OVNPUModelForCausalLM(out, device="CPU")
    assert model.generate(torch.tensor([[1, 50, 60, 70]]), max_new_tokens=8).shape == (1, 12)
