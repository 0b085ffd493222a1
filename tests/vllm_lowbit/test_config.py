"""LowBit2Config: registration through the plugin hook, parsing, and its errors."""
from __future__ import annotations

import pytest

pytest.importorskip("vllm")


@pytest.fixture(scope="module")
def config_cls():
    import vllm_lowbit

    assert vllm_lowbit.register() is True
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, get_quantization_config

    from vllm_lowbit.lowbit2 import LowBit2Config

    assert "lowbit2" in QUANTIZATION_METHODS
    assert get_quantization_config("lowbit2") is LowBit2Config
    return LowBit2Config


def test_defaults_and_round_trip(config_cls):
    c = config_cls().options
    assert (c.codebook, c.group_size, c.quantizer, c.act_group, c.prequantized) == ("affine", 64, "optimized", 0, False)
    assert c.head_setting == "auto"  # the output projection: int6 or int8 by the CPU kernels' instruction set
    from aipc_kernels.core import native
    from aipc_kernels.lowbit.output_projection import auto_head_format

    want = "int6" if native.get_isa() in ("avx2", "avx_vnni", "avx512_vnni") else "int8"  # int8 with AMX, in portable C
    assert config_cls().head_format == auto_head_format() == want  # what the head's method quantizes to here
    assert config_cls.from_config({"lm_head": "int8"}).head_format == "int8"  # a format named is kept
    d = dict(config_cls().to_dict(), codebook="sym", group_size=-1, prequantized=True, lm_head="lowbit")
    c2 = config_cls.from_config(d)
    o2 = c2.options
    assert (o2.codebook, o2.group_size, o2.prequantized, o2.head_setting) == ("sym", -1, True, "lowbit")
    assert config_cls.from_config(c2.to_dict()).options.head_setting == "lowbit"
    # the older key: true is lm_head 'lowbit', false is 'float'
    assert config_cls.from_config({"quantize_lm_head": True}).options.head_setting == "lowbit"
    assert config_cls.from_config({"quantize_lm_head": False}).options.head_setting == "float"
    assert config_cls.get_config_filenames() == []  # plain checkpoints + --quantization lowbit2: on the fly


def test_checkpoint_selects_lowbit2_without_flag(config_cls):
    assert config_cls.override_quantization_method({"quant_method": "lowbit2"}, None) == "lowbit2"
    assert config_cls.override_quantization_method({"quant_method": "gptq"}, None) is None


@pytest.mark.parametrize("cfg, message", [
    ({"codebook": "int3"}, "codebook='int3' is not supported; use one of \"affine\", \"affine4\", \"binary\""),
    ({"group_size": 96}, "group_size=96 is not supported"),
    ({"quantizer": "gptq"}, "quantizer='gptq' is not supported; use one of \"rtn\", \"optimized\""),
    ({"scale_dtype": "float32"}, "scale_dtype='float32' is not supported"),
    ({"act_group": 32}, "act_group=32 must be 0 (per token) or a multiple of group_size=64"),
    ({"group_sise": 64}, "unknown keys ['group_sise'] (did you mean 'group_size'?)"),
    ({"format_version": 99}, "format_version=99 is newer than this aipc-plugins"),
    # issue 19: values that were coerced with list(), bool(), int() instead of refused
    ({"modules_to_not_convert": "lm_head"}, 'modules_to_not_convert=\'lm_head\' must be a list of strings, e.g. ["lm_head"]'),
    ({"modules_to_not_convert": ["lm_head", 3]}, "must be a list of strings"),
    ({"quantize_lm_head": "false"}, "quantize_lm_head='false' must be true or false (a JSON boolean, without quotes)"),
    ({"lm_head": "int4"}, "lm_head='int4' is not supported; use one of \"auto\", \"int8\", \"int6\", \"lowbit\", \"float\""),
    ({"lm_head": "float", "quantize_lm_head": True}, "quantize_lm_head=True is the older spelling of lm_head; give lm_head alone"),
    ({"activations": "float"}, "activations='float' needs a 4-bit codebook (['affine4', 'e0m4', 'int4']); 'affine' has 2-bit codes: use activations int8"),
    ({"activations": "bf16"}, "activations='bf16' is not supported; use one of \"int8\", \"float\""),
    ({"activations": "float", "codebook": "int4", "act_group": 64}, "act_group=64 sets the int8 activation groups; with activations=float nothing is quantized: use 0"),
    ({"prequantized": 1}, "prequantized=1 must be true or false"),
    ({"group_size": 64.5}, "group_size=64.5 is not supported; use one of 32, 64, 128, -1"),
    ({"group_size": "abc"}, "group_size='abc' is not supported; use one of 32, 64, 128, -1"),
    ({"group_size": True}, "group_size=True is not supported"),
    ({"act_group": "64"}, "act_group='64' must be an integer >= 0, e.g. 64"),
    ({"act_group": True}, "act_group=True must be an integer >= 0"),
    ({"act_group": 48}, "act_group=48 must be 0 (per token) or a multiple of group_size=64"),
    ({"act_group": -5}, "act_group=-5 must be an integer >= 0"),
    ({"format_version": "1"}, "format_version='1' must be an integer >= 1"),
    ({"source": "gptq"}, "source='gptq' is not supported"),
    ({"quant_method": "gptq"}, "quant_method='gptq' is not supported; use one of \"lowbit2\""),
    # the two-level form: a GGUF conversion's K-quants only, scale_dtype int8 with super_block
    ({"super_block": 256}, "super_block=256 needs scale_dtype=int8 (the two-level form: a GGUF conversion's "
                           "K-quants, or the progressive form), not 'float16'; drop super_block, or convert the model again"),
    ({"super_block": 128}, "super_block=128 is not supported; use one of null, 256"),
    ({"source": "gguf", "prequantized": True, "layer_formats": {"m.o_proj": {
        "codebook": "min4", "group_size": 32, "scale_dtype": "int8"}}},
     "layer_formats['m.o_proj'].scale_dtype='int8' (the two-level form) needs super_block (inputs per super-block "
     "scale, e.g. 256)"),
    # the progressive form (issue 41): its code books with its quantizer only, float16 row scales, int8 activations
    ({"quantizer": "progressive"}, "quantizer='progressive' gives the progressive two-level form, codebook min2 or "
                                   "min4 (2- / 4-bit codes, an integer scale and min per group, a float16 scale per "
                                   "row); 'affine' is not one: give codebook 'min4', or another quantizer"),
    ({"codebook": "min4"}, "codebook='min4' is the progressive two-level form's code book: it needs "
                           "quantizer='progressive' (the quantizer 'optimized' fits float group scales"),
    ({"codebook": "min2", "quantizer": "progressive", "scale_dtype": "bfloat16"},
     "scale_dtype='bfloat16' does not apply with quantizer='progressive': its row scales hold float16 values"),
    ({"codebook": "min4", "quantizer": "progressive", "activations": "float"},
     "activations='float' runs float activations; quantizer='progressive' gives int8 levels"),
    ({"codebook": "min8", "quantizer": "progressive"}, "codebook='min8' is not supported"),
    ({"codebook": "min4", "quantizer": "progressive", "prequantized": True, "layer_formats": {"m.o_proj": {
        "codebook": "min4", "group_size": 64, "scale_dtype": "int8", "super_block": 0}}},
     "layer_formats['m.o_proj'].super_block=0 must be an integer >= 1"),
    ({"layer_formats": {"m.o_proj": {"codebook": "min4", "group_size": 64, "scale_dtype": "int8", "super_block": 2048}}},
     "layer_formats['m.o_proj'] has unknown keys ['super_block']"),  # without quantizer progressive: one level
    # a GGUF conversion's stored token embedding / output projection: lm_head 'stored' exactly then
    ({"lm_head": "stored"}, "lm_head='stored' is not supported; use one of \"auto\""),
    ({"source": "gguf", "prequantized": True, "lm_head": "stored"},
     "lm_head='stored' needs layer_formats to store the output projection ('lm_head') or the token embedding it is "
     "tied to ('model.embed_tokens'); this checkpoint stores neither: drop lm_head"),
    ({"source": "gguf", "prequantized": True, "lm_head": "int8",
      "layer_formats": {"lm_head": {"codebook": "int8", "group_size": 32, "scale_dtype": "float16"}}},
     "lm_head='int8' must be 'stored': layer_formats stores the output projection ('lm_head') as the GGUF file "
     "has it; give lm_head 'stored'"),
    # issue 22: grid detection and the converter's per-layer formats
    ({"detect_grid": "no"}, "detect_grid='no' must be true or false"),
    ({"layer_formats": ["m.q_proj"]}, "layer_formats=['m.q_proj'] must be a JSON object"),
    ({"layer_formats": {"m.q_proj": "sym"}}, "layer_formats['m.q_proj'] must be a JSON object of keys"),
    ({"layer_formats": {"m.q_proj": {"codebook": "sym", "group_size": -1}}}, "lacks ['scale_dtype']"),
    ({"layer_formats": {"m.q_proj": {"codebook": "int3", "group_size": -1, "scale_dtype": "float16"}}},
     "layer_formats['m.q_proj'].codebook='int3' is not supported"),
    ({"layer_formats": {"m.q_proj": {"codebook": "sym", "group_size": -1, "scale_dtype": "float16", "zero": 1}}},
     "layer_formats['m.q_proj'] has unknown keys ['zero']"),
])  # fmt: skip
def test_bad_config_names_the_key(config_cls, cfg, message):
    with pytest.raises(ValueError) as e:
        config_cls.from_config(dict({"quant_method": "lowbit2"}, **cfg))
    assert str(e.value).startswith("lowbit2 quantization_config")
    assert message in str(e.value)


def test_detect_grid_and_layer_formats(config_cls):
    """detect_grid defaults to true and round-trips when off; a converted checkpoint's layer_formats
    gives a layer (and the merged layer of its q/k/v or gate/up shards) its own format, or one format per
    shard where they differ (served as segments), in merge order."""
    import torch

    assert config_cls().options.detect_grid is True
    off = config_cls.from_config({"quant_method": "lowbit2", "detect_grid": False})
    assert off.options.detect_grid is False and config_cls.from_config(off.to_dict()).options.detect_grid is False
    fmt = {"codebook": "ternary", "group_size": -1, "scale_dtype": "bfloat16"}
    names = [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]
    c = config_cls.from_config({"quant_method": "lowbit2", "prequantized": True, "layer_formats": {n: fmt for n in names}})
    c.packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    layer = c.for_layer("model.layers.0.self_attn.qkv_proj").options
    assert (layer.codebook, layer.group_size, layer.scale_dtype) == ("ternary", -1, "bfloat16")
    assert layer.torch_scale_dtype is torch.bfloat16
    assert (c.options.codebook, c.options.group_size) == ("affine", 64)  # the config itself is unchanged
    assert c.for_layer("model.layers.0.self_attn.o_proj") is c
    assert config_cls.from_config(c.to_dict()).options.layer_formats == c.options.layer_formats
    c = config_cls.from_config({"quant_method": "lowbit2", "prequantized": True,
                                "layer_formats": {n: fmt for n in names[:2]}})  # fmt: skip
    c.packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    parts = c.part_configs("model.layers.0.self_attn.qkv_proj")
    assert [(p.options.codebook, p.options.group_size) for p in parts] == [("ternary", -1)] * 2 + [("affine", 64)]
    assert c.part_configs("model.layers.0.self_attn.o_proj") is None
    method = c.linear_method("model.layers.0.self_attn.qkv_proj")
    assert type(method).__name__ == "LowBit2SegmentedLinearMethod"
    assert [m.options.codebook for m in method.parts] == ["ternary", "ternary", "affine"]
    assert type(c.linear_method("model.layers.0.self_attn.o_proj")).__name__ == "LowBit2LinearMethod"
    with pytest.raises(ValueError, match=r"layer_formats gives the layers .*k_proj.*v_proj.*one merged layer "
                                         r"'model.layers.0.self_attn.qkv_proj'"):  # fmt: skip
        c.for_layer("model.layers.0.self_attn.qkv_proj")


def test_stored_embedding_and_head(config_cls, tmp_path):
    """A GGUF conversion's packed token embedding and output projection get LowBit2EmbeddingMethod with their
    own form (an untied head its own entry, a tied one the embedding's); a tied model whose embedding is stored
    refuses another lm_head, naming the key."""
    import json
    from types import SimpleNamespace

    from vllm_lowbit.lowbit2 import LowBit2EmbeddingMethod

    q8 = {"codebook": "int8", "group_size": 32, "scale_dtype": "float16"}
    q6k = {"codebook": "int6", "group_size": 16, "scale_dtype": "int8", "super_block": 256}
    base = {"quant_method": "lowbit2", "prequantized": True, "source": "gguf", "codebook": "min4", "group_size": 32,
            "act_group": 32}  # fmt: skip
    c = config_cls.from_config({**base, "lm_head": "stored", "layer_formats": {"model.embed_tokens": q8, "lm_head": q6k}})
    assert c.head_label == "stored"

    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    # what embedding_method reads of vLLM's layers is their class: instances left uninitialised
    embedding, lm_head = VocabParallelEmbedding.__new__(VocabParallelEmbedding), ParallelLMHead.__new__(ParallelLMHead)
    emb, head = c.embedding_method(embedding), c.embedding_method(lm_head)
    assert isinstance(emb, LowBit2EmbeddingMethod) and isinstance(head, LowBit2EmbeddingMethod)
    assert (emb.name, emb.options.codebook, emb.options.group_size, emb.options.act_group) == (
        "model.embed_tokens", "int8", 32, 32)
    assert (head.name, head.options.codebook, head.options.group_size, head.options.super_block,
            head.options.act_group) == ("lm_head", "int6", 16, 256, 32)  # fmt: skip
    tied = config_cls.from_config({**base, "lm_head": "stored", "layer_formats": {"model.embed_tokens": q8}})
    assert tied.embedding_method(lm_head).name == "model.embed_tokens"
    untied_float = config_cls.from_config({**base, "lm_head": "float", "layer_formats": {"model.embed_tokens": q8}})
    assert untied_float.embedding_method(lm_head) is None

    qc = {**base, "lm_head": "stored", "layer_formats": {"model.embed_tokens": q8}}
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": qc}))
    over = config_cls.from_config({**qc, "lm_head": "float"})
    with pytest.raises(ValueError, match=r"lm_head='float', but .* stores its token embedding packed \(layer_formats "
                                         r"'model.embed_tokens'\) and ties the output projection to it"):
        over.maybe_update_config(str(tmp_path), hf_config=SimpleNamespace(tie_word_embeddings=True))


def test_exact_values_are_kept(config_cls):
    c = config_cls.from_config({"quant_method": "lowbit2", "modules_to_not_convert": ["mlp.down_proj"],
                                "lm_head": "float", "group_size": 128, "act_group": 256})  # fmt: skip
    o = c.options
    assert (o.modules_to_not_convert, o.head_setting, o.group_size, o.act_group) == (["mlp.down_proj"], "float", 128, 256)
    assert c.is_skipped("model.layers.0.mlp.down_proj") and not c.is_skipped("model.layers.0.mlp.up_proj")
    assert not c.is_skipped("model.layers.0.self_attn.o_proj")  # letters of a string would have matched


def test_config_file_and_json_errors_name_the_source(config_cls, tmp_path):
    bad = tmp_path / "q.json"
    bad.write_text('{"quant_method": "lowbit2", "quantize_lm_head": "yes"}')
    with pytest.raises(ValueError, match="quantize_lm_head='yes' must be true or false"):
        config_cls.from_config_file(str(bad))
    bad.write_text("{group_size: 64}")
    with pytest.raises(ValueError, match="quantization_config_file=.* is not valid JSON"):
        config_cls.from_config_file(str(bad))
    with pytest.raises(ValueError, match="cannot read quantization_config_file=.*: No such file"):
        config_cls.from_config_file(str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="quantization_config must be a JSON object"):
        config_cls.from_config_dict_json("[64]")


# ---------------------------------------------------------------------- through vLLM's own config path

_ENGINE_CONFIG_SCRIPT = """
import json
from vllm.engine.arg_utils import EngineArgs
if __name__ == "__main__":
    out = []
    for model, overrides in {cases!r}:
        try:
            q = EngineArgs(model=model, max_model_len=256, enforce_eager=True,
                           hf_overrides=overrides).create_engine_config().quant_config
            o = None if q is None else q.options
            out.append(None if q is None else dict(
                method=q.get_name(), codebook=o.codebook, group_size=o.group_size, act_group=o.act_group,
                prequantized=o.prequantized, lm_head=o.head_setting,
                modules_to_not_convert=o.modules_to_not_convert))
        except Exception as e:  # vLLM wraps the plugin's ValueError in pydantic's ValidationError
            out.append(dict(error=str(e)))
    print("RESULT=" + json.dumps(out))
"""


def _engine_quant_configs(cases: list) -> list:
    """``EngineArgs(model, hf_overrides=...).create_engine_config().quant_config`` for each case, in
    a fresh interpreter: what ``vllm serve MODEL --hf-overrides ...`` builds before loading weights."""
    import json

    from vllm_serving import run_vllm_script

    cases = [(str(m), o) for m, o in cases]
    res = run_vllm_script(_ENGINE_CONFIG_SCRIPT.format(cases=cases), timeout=300)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("RESULT=")]
    assert res.returncode == 0 and lines, res.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT="):])


def test_hf_overrides_through_vllm_config(llama_dir, llama_prequantized, tmp_path):
    """vLLM replaces the whole quantization_config with an --hf-overrides one (and ignores
    quantization_config_file when the checkpoint has one). A converted checkpoint stays prequantized
    whatever keys the override lacks; keys its tensors fix cannot change; a bf16 checkpoint is not
    taken for a converted one; a string for a list is refused before any weight loads."""
    qfile = tmp_path / "q.json"
    qfile.write_text('{"quant_method": "lowbit2", "lm_head": "lowbit"}')
    qc = lambda **k: {"quantization_config": k}  # noqa: E731
    got = _engine_quant_configs([
        (llama_dir, qc(quant_method="lowbit2", modules_to_not_convert="lm_head")),
        (llama_dir, qc(quant_method="lowbit2", modules_to_not_convert=["lm_head"], act_group=128)),
        (llama_dir, qc(quant_method="lowbit2", prequantized=True)),
        (llama_prequantized, {}),
        (llama_prequantized, qc(quant_method="lowbit2", act_group=0)),
        (llama_prequantized, qc(act_group=0)),  # no quant_method: vLLM alone would load it unquantized
        (llama_prequantized, qc(quant_method="lowbit2", group_size=128)),
        (llama_prequantized, qc(quant_method="lowbit2", prequantized=False)),
        (llama_prequantized, {"quantization_config_file": str(qfile)}),
    ])  # fmt: skip
    converted = dict(method="lowbit2", codebook="affine", group_size=64, act_group=64, prequantized=True,
                     lm_head="auto", modules_to_not_convert=[])  # fmt: skip
    assert 'modules_to_not_convert=\'lm_head\' must be a list of strings, e.g. ["lm_head"]' in got[0]["error"]
    assert got[1] == dict(converted, act_group=128, prequantized=False, modules_to_not_convert=["lm_head"])
    assert "prequantized=True, but" in got[2]["error"] and "is not a checkpoint converted by" in got[2]["error"]
    assert got[3] == converted
    assert got[4] == dict(converted, act_group=0)
    assert got[5] == dict(converted, act_group=0)
    assert "group_size=128 conflicts with the converted checkpoint, whose tensors were written with group_size=64" in got[6]["error"]
    assert "prequantized=False conflicts with the converted checkpoint" in got[7]["error"]
    assert got[8] == dict(converted, lm_head="lowbit")


def test_lowbit4_errors_name_its_own_quantization_config(config_cls):
    """``--quantization lowbit4``'s keys are lowbit2's; its errors name lowbit4's quantization_config."""
    from vllm.model_executor.layers.quantization import get_quantization_config

    lowbit4 = get_quantization_config("lowbit4")
    with pytest.raises(ValueError) as e:
        lowbit4.from_config({"quant_method": "lowbit4", "codebook": "affine", "activations": "float"})
    assert str(e.value).startswith("lowbit4 quantization_config.activations='float' needs a 4-bit codebook"), e.value
    w4a16 = lowbit4.from_config({"quant_method": "lowbit4", "codebook": "e0m4", "activations": "float"})
    o = w4a16.options
    assert (o.codebook, o.group_size, o.activations) == ("e0m4", 64, "float")  # lowbit4's group


def test_super_block_split_by_tensor_parallel_is_refused(config_cls):
    """A stored two-level layer (here the progressive form's, its row scale over all 512 inputs) whose
    tensor-parallel slice would cut a super-block is refused before anything loads, naming the layer and the fix."""
    import torch

    from vllm_lowbit.lowbit2 import LowBit2LinearMethod

    fmt = {"codebook": "min4", "group_size": 64, "scale_dtype": "int8", "super_block": 512}
    c = config_cls.from_config({"quant_method": "lowbit2", "codebook": "min4", "quantizer": "progressive",
                                "prequantized": True, "layer_formats": {"m.down_proj": fmt}})  # fmt: skip
    method = LowBit2LinearMethod(c.for_layer("m.down_proj"))
    assert (method.options.codebook, method.options.super_block) == ("min4", 512)
    layer = torch.nn.Module()
    layer.prefix, layer.input_size = "m.down_proj", 512
    with pytest.raises(ValueError, match=r"layer 'm.down_proj' stores its super-block scales over 512 inputs, which "
                                         r"this rank's K=256 .* a multiple of 512 \(e.g. 1\)"):  # fmt: skip
        method.create_weights(layer, 256, [64], 512, 64, torch.float32, weight_loader=None)


@pytest.mark.parametrize("act_group,group,super_block,K,expected", [
    (32, 32, None, 576, 32),      # Q4_0 / Q8_0 / Q4_1: per 32, as llama.cpp's Q8_0 / Q8_1 activations
    (32, 128, None, 2048, 128),   # TQ2_0's groups of 128: the group
    (32, 32, 256, 2048, 256),     # Q4_K with act_super_block: per super-block, as llama.cpp's Q8_K
    (32, 16, 256, 1024, 256),     # Q6_K
    (0, 16, 256, 1024, 0),        # per token stays per token
    (64, 32, None, 96, 32),       # K not a multiple of the widened group: the layer's group
])  # fmt: skip
def test_gguf_layer_act_group(act_group, group, super_block, K, expected):
    from vllm_lowbit.options import gguf_layer_act_group

    assert gguf_layer_act_group(act_group, group, super_block, K) == expected


def test_gguf_cpu_act_super_block():
    """gguf_cpu's keys: the K-quant layers' activations per 32 by default, per super-block of 256 (llama.cpp's
    Q8_K) with act_super_block; bad values refused naming the key."""
    import gguf
    import numpy as np
    from aipc_kernels.checkpoints.gguf import relayout
    from vllm_lowbit.gguf import GGUFCPUConfig

    def weight(qtype, K=512, N=8):
        block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
        raw = np.random.default_rng(0).integers(0, 256, (N, K // block * nbytes), dtype=np.uint8)
        return relayout(raw, qtype, (N, K), "blk.0.ffn_down.weight")

    q4k, q6k, q8 = (weight(t) for t in (gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K,
                                        gguf.GGMLQuantizationType.Q8_0))  # fmt: skip
    default = GGUFCPUConfig.from_config({"quant_method": "gguf_cpu"})
    assert [default.layer_act_group(w) for w in (q4k, q6k, q8)] == [32, 32, 32]
    llamacpp = GGUFCPUConfig.from_config({"quant_method": "gguf_cpu", "act_super_block": True})
    assert [llamacpp.layer_act_group(w) for w in (q4k, q6k, q8)] == [256, 256, 32]
    with pytest.raises(ValueError, match=r"act_super_block='yes' must be true"):
        GGUFCPUConfig.from_config({"act_super_block": "yes"})
    with pytest.raises(ValueError, match=r"act_super_block=true needs act_group > 0"):
        GGUFCPUConfig.from_config({"act_group": 0, "act_super_block": True})
    with pytest.raises(ValueError, match=r"unknown keys \['group'\]; its keys are act_group and act_super_block"):
        GGUFCPUConfig.from_config({"group": 32})
