"""``python -m vllm_lowbit.quantize X.gguf OUT``: a GGUF file converted to a ``lowbit2`` checkpoint with the
reader that serves it, checked exact (``--verify``: every written weight equals ``gguf.quants.dequantize`` of
the file's blocks) and served by ``LLM(OUT)`` as ``LLM(X.gguf)`` serves the file: SmolLM2-135M-Instruct Q4_1
(one type: the same packed linears and act_group 32; the Q8_0 token embedding stored as int8 g32, the tied head
multiplying it) and Gemma-3-270M Q4_K_M (K-quants: Q4_K and Q6_K (groups of 16) with their two levels of
scales, int8 sub-block scales and mins times float32 super-block scales, as serving the file holds them; Q6_K
and Q5_0 in 6-bit codes, Q8_0, each layer's form in ``layer_formats``). Both paths then run the same packed
tensors on the same ops: the greedy tokens and their logprobs are equal.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("gguf")

from vllm_serving import run_vllm_script, vllm_env  # noqa: E402

TEXTS = ["The capital of France is", "def fibonacci(n):"]
N_NEW = 12
#: the stored token embedding (and tied head) of both files: the file's Q8_0 blocks
EMBEDDING_FORM = {"codebook": "int8", "group_size": 32, "scale_dtype": "float16"}


def convert(src: Path, out: Path, cache: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vllm_lowbit.quantize", str(src), str(out), "--no-progress", *extra],
                          capture_output=True, text=True, timeout=600, env=vllm_env(AIPC_GGUF_CACHE=str(cache)))  # fmt: skip


def convert_verified(src: Path, cache: Path, tmp_path_factory) -> tuple[Path, str]:
    """``src`` converted with ``--verify`` (exit status 0: every written weight equals the file's values)."""
    out = tmp_path_factory.mktemp(src.stem) / "model"
    res = convert(src, out, cache, "--verify", "--threads", "1")
    assert res.returncode == 0, res.stderr[-3000:]
    print("\n[gguf-convert] " + res.stdout.strip().replace("\n", "\n[gguf-convert] "))
    return out, res.stdout


@pytest.fixture(scope="module")
def converted(smollm2, gguf_cache, tmp_path_factory) -> tuple[Path, str]:
    return convert_verified(smollm2, gguf_cache, tmp_path_factory)


@pytest.fixture(scope="module")
def converted_gemma3(gemma3, gguf_cache, tmp_path_factory) -> tuple[Path, str]:
    return convert_verified(gemma3, gguf_cache, tmp_path_factory)


def test_verify_is_exact(converted):
    out, stdout = converted
    assert "Q4_1 0 (210 tensors)" in stdout and "Q8_0 0 (1 tensors)" in stdout and "overall 0" in stdout, stdout
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert (qc["quant_method"], qc["prequantized"], qc["source"]) == ("lowbit2", True, "gguf")
    assert (qc["codebook"], qc["group_size"], qc["scale_dtype"], qc["act_group"], qc["lm_head"]) == (
        "min4", 32, "float16", 32, "stored")
    assert qc["layer_formats"] == {"model.embed_tokens": EMBEDDING_FORM}  # every linear is Q4_1
    assert "the tied output projection multiplies it" in stdout, stdout
    assert {"tokenizer.json", "tokenizer_config.json", "model.safetensors"} <= {p.name for p in out.iterdir()}
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        shapes = {n: (tuple(f.get_slice(n).get_shape()), f.get_slice(n).get_dtype()) for n in names if "embed" in n}
    assert not any(n.startswith("lm_head.") for n in names)
    # the file's 30 MB of Q8_0 (one byte a value, a float16 scale per 32), not a 113 MB float32 table
    assert shapes == {"model.embed_tokens.qweight": ((49152, 576), "U8"),
                      "model.embed_tokens.scales": ((49152, 18), "F16")}, shapes  # fmt: skip


_BOTH = """
import json, os
os.environ["AIPC_GGUF_CACHE"] = {cache!r}
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

def run(path, probe):
    llm = LLM(path, dtype="float32", enforce_eager=True, max_model_len=256, seed=0)
    out = llm.generate([TokensPrompt(prompt_token_ids=p) for p in {prompts!r}],
                       SamplingParams(max_tokens={n}, temperature=0.0, ignore_eos=True, logprobs=1))
    res = [[list(o.outputs[0].token_ids), [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]]
           for o in out]
    layer = llm.apply_model(probe)[0]
    del llm
    return res, layer

def packed(layer):
    return [type(layer.quant_method).__name__, getattr(layer, "lowbit_codebook", None),
            getattr(layer, "lowbit_group_size", None), getattr(layer, "lowbit_act_group", None),
            sorted(n for n, _ in layer.named_parameters())]

def probe(m):
    block = m.model.layers[0]
    qkv = block.self_attn.qkv_proj
    two_level = [lin.supers is not None for lin in (block.self_attn.o_proj, block.mlp.down_proj)]
    emb = m.model.embed_tokens
    parts = list(getattr(qkv, "lowbit_segments", [])) or [qkv]  # q/k/v of mixed types: segments
    return [type(qkv.quant_method).__name__, type(emb.quant_method).__name__,
            [[p.lowbit_codebook, p.lowbit_group_size, p.lowbit_act_group, getattr(p, "start", 0)] for p in parts],
            two_level, [m.lm_head is emb] + packed(emb)[1:], packed(m.lm_head)]

if __name__ == "__main__":
    ours = run({out!r}, probe)
    ref = run({gguf!r}, probe)
    print("RESULT=" + json.dumps({{"ours": ours, "ref": ref}}))
"""


def test_verify_is_exact_on_k_quants(converted_gemma3):
    """Every K-quant tensor of Gemma-3's Q4_K_M file is written exactly, each layer with its own form."""
    out, stdout = converted_gemma3
    for part in ("Q4_K 0 (27 tensors)", "Q6_K 0 (9 tensors)", "Q5_0 0 (81 tensors)", "Q8_0 0 (10 tensors)", "overall 0"):
        assert part in stdout, stdout
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert (qc["quant_method"], qc["prequantized"], qc["source"], qc["act_group"]) == ("lowbit2", True, "gguf", 32)
    assert (qc["codebook"], qc["group_size"], qc["scale_dtype"]) == ("int5", 32, "float16")  # Q5_0: the most
    assert (qc["lm_head"], qc["layer_formats"]["model.embed_tokens"]) == ("stored", EMBEDDING_FORM)
    forms = {(f["codebook"], f["group_size"], f["scale_dtype"], f.get("super_block")) for f in qc["layer_formats"].values()}
    # q / k Q5_0 (int5, the config's form) and v Q8_0 (int8) each in its own form, as served (segments); Q4_K
    # and Q6_K (6-bit codes) with their two levels of scales
    assert forms == {("int8", 32, "float16", None), ("min4", 32, "int8", 256), ("int6", 16, "int8", 256)}, forms


def served_against_gguf(out: Path, gguf: Path, cache: Path) -> list:
    """LLM(OUT) on the lowbit2 checkpoint path gives LLM(X.gguf)'s greedy tokens and logprobs, with the first
    layer's qkv in the same segments (one per run of q / k / v parts of one stored form), each on the same code
    book, group and activation group, its o and down projections in the same
    number of scale levels (``supers``: the two-level form), and the token embedding packed in the file's
    form, the tied output projection being that layer (one tensor)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    prompts = [tok(t)["input_ids"] for t in TEXTS]
    code = _BOTH.format(cache=str(cache), prompts=prompts, n=N_NEW, out=str(out), gguf=str(gguf))
    res = run_vllm_script(code, timeout=900)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("RESULT=")]
    assert res.returncode == 0 and lines, res.stderr[-5000:]
    r = json.loads(lines[-1][len("RESULT="):])
    (ours, our_layer), (ref, ref_layer) = r["ours"], r["ref"]
    ours_method = "LowBit2SegmentedLinearMethod" if len(ref_layer[2]) > 1 else "LowBit2LinearMethod"
    assert our_layer[0] == ours_method and ref_layer[0] == "GGUFLinearMethod", (our_layer, ref_layer)
    head_ours, head_ref = our_layer.pop(), ref_layer.pop()  # the output projection: its method and form
    assert head_ours[1:] == head_ref[1:], (head_ours, head_ref)
    assert ref_layer[2:] == our_layer[2:], (our_layer, ref_layer)
    diff = max(abs(a - b) for (_, la), (_, lb) in zip(ours, ref) for a, b in zip(la, lb))
    print(f"\n[gguf-convert] {gguf.name}: LLM(OUT) vs LLM(X.gguf): tokens "
          f"{'equal' if [o[0] for o in ours] == [x[0] for x in ref] else 'DIFFER'}, largest greedy-token logprob "
          f"difference {diff:.2e}; {[tok.decode(o[0]) for o in ours]}")  # fmt: skip
    assert [o[0] for o in ours] == [x[0] for x in ref]
    assert diff == 0.0
    return our_layer + [head_ours]


#: the stored Q8_0 embedding as served: tied head, int8 g32, activations per 32, packed tensors only
PACKED_EMBEDDING = [True, "int8", 32, 32, ["qweight", "scales"]]


def test_served_checkpoint_matches_serving_the_gguf(converted, smollm2, gguf_cache):
    layer = served_against_gguf(converted[0], smollm2, gguf_cache)
    assert layer[1:-1] == ["LowBit2EmbeddingMethod", [["min4", 32, 32, 0]], [False, False], PACKED_EMBEDDING], layer


def test_served_k_quant_checkpoint_matches_serving_the_gguf(converted_gemma3, gemma3, gguf_cache):
    # q/k Q5_0 (1024 + 256 rows), v Q8_0: two segments, each in the file's form; the first layer's o and down
    # (K 1024 and 2048: K-quants) two-level, as the file is served
    layer = served_against_gguf(converted_gemma3[0], gemma3, gguf_cache)
    qkv = [["int5", 32, 32, 0], ["int8", 32, 32, 1280]]
    assert layer[1:-1] == ["LowBit2EmbeddingMethod", qkv, [True, True], PACKED_EMBEDDING], layer


def test_segmented_part_of_wrong_shape_names_the_tensor(converted_gemma3, tmp_path):
    """A merged layer whose parts are stored in different forms checks each part's tensors against its own
    ``layer_formats`` entry as they load: the Q8_0 v's scales cut by one group are refused, naming the tensor and
    the form it must have."""
    import shutil

    from safetensors.torch import load_file, save_file

    out = shutil.copytree(converted_gemma3[0], tmp_path / "m")
    name = "model.layers.0.self_attn.v_proj.scales"
    path = next(f for f in sorted(out.glob("*.safetensors")) if name in load_file(str(f)))
    tensors = load_file(str(path))
    good = tuple(tensors[name].shape)
    tensors[name] = tensors[name][:, :-1].contiguous()
    save_file(tensors, str(path), metadata={"format": "pt"})
    code = "from vllm import LLM\nLLM({!r}, dtype='bfloat16', max_model_len=128, enforce_eager=True)\n".format(str(out))
    res = run_vllm_script(code, timeout=600)
    cut = (good[0], good[1] - 1)
    needle = f"lowbit2 checkpoint tensor {name} has shape {cut}, expected {good} (codebook=int8, group_size=32"
    assert res.returncode != 0 and needle in res.stderr, res.stderr[-3000:]


#: untied output projections (tests/helpers/gguf_fixtures.py): Qwen3's Q8_0 embedding and Q4_0 head, both
#: stored; Mistral's F16 embedding (float) and Q8_0 head (stored)
UNTIED = {
    "qwen3": ("LowBit2EmbeddingMethod", {"model.embed_tokens": EMBEDDING_FORM, "lm_head": {
        "codebook": "int4", "group_size": 32, "scale_dtype": "float16"}}, ["LowBit2EmbeddingMethod", "int4", 32, 32]),
    "mistral": ("UnquantizedEmbeddingMethod", {"lm_head": EMBEDDING_FORM}, ["LowBit2EmbeddingMethod", "int8", 32, 32]),
}  # fmt: skip


@pytest.mark.parametrize("arch", sorted(UNTIED))
def test_untied_output_projection_is_stored(arch, gguf_cache, tmp_path_factory):
    """An untied quantized output projection is written as the file has it (``lm_head`` in ``layer_formats``,
    ``lm_head: stored``) and served on its own packed tensors (not the embedding's), as serving the file serves
    it: equal tokens and logprobs; a float embedding stays float."""
    from tests.helpers.gguf_fixtures import build_gguf_fixture

    try:
        src = build_gguf_fixture(arch)
    except (subprocess.CalledProcessError, OSError) as e:  # no cached converter and no package registry
        pytest.skip(f"llama.cpp's converter (llama-cpp-python sdist) is not cached and cannot be fetched: {e}")
    out, stdout = convert_verified(src, gguf_cache, tmp_path_factory)
    assert "overall 0" in stdout, stdout
    emb_method, stored, head = UNTIED[arch]
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["lm_head"] == "stored"
    assert {k: v for k, v in qc["layer_formats"].items() if k in ("model.embed_tokens", "lm_head")} == stored
    layer = served_against_gguf(out, src, gguf_cache)
    assert layer[1] == emb_method and layer[-2][0] is False, layer  # untied: the head is its own layer
    assert layer[-1][:4] == head and "qweight" in layer[-1][4], layer


def test_refusals_write_nothing(smollm2, gguf_cache, tmp_path):
    """A non-empty OUT and a truncated file are refused (exit status 2, a message naming the path); no OUT."""
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine\n")
    res = convert(smollm2, full, gguf_cache)
    assert res.returncode == 2 and "not empty" in res.stderr and str(full) in res.stderr, res.stderr[-2000:]
    assert sorted(p.name for p in full.iterdir()) == ["keep.txt"]

    cut = tmp_path / "cut.gguf"
    with open(smollm2, "rb") as f:
        cut.write_bytes(f.read(os.path.getsize(smollm2) // 2))
    out = tmp_path / "never"
    res = convert(cut, out, gguf_cache)
    assert res.returncode == 2 and "truncated" in res.stderr and str(cut) in res.stderr, res.stderr[-2000:]
    assert not out.exists() and not any(p.name.startswith(".never") for p in tmp_path.iterdir())

    res = convert(smollm2, tmp_path / "x", gguf_cache, "--codebook", "int4")
    assert res.returncode == 2 and "drop --codebook" in res.stderr and not (tmp_path / "x").exists()
