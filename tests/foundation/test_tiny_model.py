"""Tiny offline models: all architectures load and generate; builds are deterministic, cached."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from aipc_kernels.tools import tiny_model as tm

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
torch = pytest.importorskip("torch")

TEXTS = [
    "The model reads the weights quickly in the library.",
    "Hello, world!  Two spaces,\ttabs and\nnew lines; 12345 + 678 = 13023.",
    "def forward(self, x):\n    return x * 2  # comment",
    "Ünïcödé, 日本語 and emoji 🙂 survive the byte-level round trip.",
]
SMALL = dict(hidden=64, layers=1, heads=4)  # for tests that build more than once


@pytest.mark.parametrize("arch", tm.ARCHS)
def test_arch_loads_generates_and_tokenizes(tiny_model, arch):
    path = tiny_model(arch)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    config = model.config
    assert config.model_type == tm.model_type(arch)
    assert config.vocab_size == len(tok) == tm.TOKENIZER_VOCAB
    assert model.dtype == torch.bfloat16
    if arch not in ("gpt_neox", "opt"):
        assert config.num_key_value_heads < config.num_attention_heads
    for name, token in (("bos", tm.BOS), ("eos", tm.EOS), ("pad", tm.PAD)):
        token_id = tok.convert_tokens_to_ids(token)
        assert getattr(tok, f"{name}_token_id") == token_id
        assert getattr(config, f"{name}_token_id") == token_id
        assert getattr(model.generation_config, f"{name}_token_id") == token_id

    # Norm weights and biases are what the model's own init gives (Gemma's RMSNorm: zeros).
    reference = transformers.AutoModelForCausalLM.from_config(config).state_dict()
    for name, value in model.state_dict().items():
        if value.ndim == 1:
            torch.testing.assert_close(value.float(), reference[name].float(), msg=name)

    inputs = tok("Can you help me?", return_tensors="pt")
    assert inputs.input_ids[0, 0] == tok.bos_token_id
    out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    new = out[0, inputs.input_ids.shape[1]:].tolist()
    assert len(new) == 8
    assert len(set(new)) > 1, f"greedy decoding of the random {arch} model is constant: {new}"

    for text in TEXTS:
        ids = tok(text).input_ids
        assert tok.decode(ids, skip_special_tokens=True) == text
    assert len(tok(TEXTS[0]).input_ids) < len(TEXTS[0]) // 2  # BPE merges, not bytes

    messages = [{"role": "user", "content": "Hi there"}]
    assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        "<s><|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tok.apply_chat_template(messages + [{"role": "assistant", "content": "Hello."}],
                                  tokenize=True, return_dict=True)["input_ids"]
    im_start, im_end = tok.convert_tokens_to_ids([tm.IM_START, tm.IM_END])
    assert ids[0] == tok.bos_token_id and ids.count(im_start) == 2 and ids.count(im_end) == 2


def test_bitnet_is_the_published_float_layout(tmp_path):
    """bitnet: as microsoft/bitnet-b1.58-2B-4T's config and tensor names (tied embeddings by default,
    relu2, GQA, separate q/k/v and gate/up, the two sub-norms), float weights, no quantization_config."""
    path = tm.build_tiny_model("bitnet", tmp_path / "tied", **SMALL)
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["BitNetForCausalLM"] and config["model_type"] == "bitnet"
    assert config["hidden_act"] == "relu2" and config["tie_word_embeddings"] is True
    assert config["num_key_value_heads"] == 2 and "quantization_config" not in config
    from safetensors.torch import load_file

    tensors = load_file(str(path / "model.safetensors"))
    layer = "model.layers.0"
    assert tensors[f"{layer}.self_attn.attn_sub_norm.weight"].shape == (64,)
    assert tensors[f"{layer}.mlp.ffn_sub_norm.weight"].shape == (128,)
    assert {f"{layer}.self_attn.{p}_proj.weight" for p in "qkvo"} <= set(tensors)
    assert {f"{layer}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")} <= set(tensors)
    assert "lm_head.weight" not in tensors and all(t.dtype == torch.bfloat16 for t in tensors.values())
    untied = tm.build_tiny_model("bitnet", tmp_path / "untied", tie_embeddings=False, **SMALL)
    assert json.loads((untied / "config.json").read_text())["tie_word_embeddings"] is False
    assert "lm_head.weight" in load_file(str(untied / "model.safetensors"))


def _files(path):
    return {name: (path / name).read_bytes() for name in ("model.safetensors", "tokenizer.json")}


def test_builds_are_deterministic(tmp_path):
    a = _files(tm.build_tiny_model("qwen2", tmp_path / "a", **SMALL))
    b = _files(tm.build_tiny_model("qwen2", tmp_path / "b", **SMALL))
    assert a == b
    c = _files(tm.build_tiny_model("qwen2", tmp_path / "c", seed=1, **SMALL))
    assert c["tokenizer.json"] == a["tokenizer.json"]
    assert c["model.safetensors"] != a["model.safetensors"]


def test_tokenizer_training_is_deterministic_across_processes():
    # The Rust trainer hashes with per-process random state: compare with a fresh interpreter.
    code = ("import sys; from aipc_kernels.tools.tiny_model import _train_tokenizer; "
            "sys.stdout.write(_train_tokenizer(1024).to_str())")
    env = dict(os.environ, PYTHONHASHSEED="123")
    other = subprocess.run([sys.executable, "-c", code], env=env, check=True,
                           capture_output=True, text=True).stdout
    assert other == tm._train_tokenizer(1024).to_str()


def test_larger_vocab_pads_the_tokenizer_with_decodable_reserved_tokens(tmp_path):
    path = tm.build_tokenizer(tmp_path, vocab_size=1100)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    assert len(tok) == 1100
    assert tok.decode([1099]) == "<|reserved_1099|>"
    assert tok.decode(tok(TEXTS[1]).input_ids, skip_special_tokens=True) == TEXTS[1]


def test_cache_is_reused_and_incomplete_entries_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setenv("AIPC_CACHE_DIR", str(tmp_path))
    path = tm.build_tiny_model("opt", **SMALL)
    assert path.parent == tmp_path / "tiny-models" and path.name.startswith("opt-")
    manifest = json.loads((path / tm.MANIFEST).read_text())
    assert manifest["args"]["hidden"] == 64 and manifest["hash"] in path.name
    mtime = (path / "model.safetensors").stat().st_mtime_ns

    def no_rebuild(*args):
        raise AssertionError("rebuilt a cached model")

    with monkeypatch.context() as m:
        m.setattr(tm, "_write_model", no_rebuild)
        assert tm.build_tiny_model("opt", kv_heads=4, **SMALL) == path  # same resolved args
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime
    assert tm.build_tiny_model("opt", seed=1, **SMALL) != path

    (path / tm.MANIFEST).unlink()  # as if a build had died half-way
    assert tm.build_tiny_model("opt", **SMALL) == path
    assert (path / tm.MANIFEST).is_file()
    assert [p.name for p in (tmp_path / "tiny-models").iterdir() if p.name.startswith(".")] == []


def test_out_dir_is_replaced_but_foreign_dirs_are_kept(tmp_path):
    out = tmp_path / "model"
    tm.build_tiny_model("llama", out, **SMALL)
    tm.build_tiny_model("llama", out, seed=1, **SMALL)
    assert json.loads((out / tm.MANIFEST).read_text())["args"]["seed"] == 1
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="out_dir"):
        tm.build_tiny_model("llama", foreign, **SMALL)


@pytest.mark.parametrize("kwargs, match", [
    (dict(arch="bert"), r"arch='bert'.*llama, qwen2, qwen3, mistral, phi3, phi3_longrope, gemma, gpt_neox, opt, bitnet"),
    (dict(hidden=100, heads=8), r"hidden=100 is not divisible by heads=8"),
    (dict(heads=4, kv_heads=3), r"heads=4 is not divisible by kv_heads=3"),
    (dict(arch="gpt_neox", heads=4, kv_heads=2), r"gpt_neox.*no grouped-query.*kv_heads=4"),
    (dict(arch="opt", heads=4, kv_heads=1), r"opt.*no grouped-query.*kv_heads=4"),
    (dict(vocab=512), r"vocab=512"),
    (dict(dtype="int8"), r"dtype='int8'.*bfloat16"),
])
def test_bad_arguments_fail_early(kwargs, match):
    with pytest.raises(ValueError, match=match):
        tm.build_tiny_model(**kwargs)


def test_cli_prints_the_path_and_rejects_bad_arguments(tmp_path, capsys):
    out = tmp_path / "cli"
    tm.main([str(out), "--arch", "gemma", "--hidden", "64", "--layers", "1", "--heads", "2",
             "--kv-heads", "1", "--seed", "3"])
    assert capsys.readouterr().out.strip() == str(out)
    args = json.loads((out / tm.MANIFEST).read_text())["args"]
    assert (args["arch"], args["hidden"], args["kv_heads"], args["seed"]) == ("gemma", 64, 1, 3)
    with pytest.raises(SystemExit):
        tm.main([str(tmp_path / "bad"), "--preset", "llama-3.2-1b", "--heads", "7"])
    assert "hidden=2048 is not divisible by heads=7" in capsys.readouterr().err


def test_import_does_not_import_transformers():
    code = ("import sys, aipc_kernels.tools.tiny_model; "
            "assert not {'transformers', 'tokenizers'} & set(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True)
