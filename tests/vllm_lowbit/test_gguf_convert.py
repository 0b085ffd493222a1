"""``python -m vllm_lowbit.quantize X.gguf OUT``: a GGUF file converted to a ``lowbit2`` checkpoint with the
reader that serves it, checked exact (``--verify``: every written weight equals ``gguf.quants.dequantize`` of
the file's blocks) and served by ``LLM(OUT)`` as ``LLM(X.gguf)`` serves the file (SmolLM2-135M-Instruct Q4_1:
the same packed linears and act_group 32; the Q8_0 token embedding / tied head written float32, exact).
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
#: largest |logprob difference| of the greedy tokens between LLM(OUT) and LLM(X.gguf) (measured 0.062): the linears are the
#: same packed weights on the same op; only the tied head differs (float32 file values against the file's
#: Q8_0 on the W8A8 kernels, int8 activations per 32)
LOGPROB_TOL = 0.1


def convert(src: Path, out: Path, cache: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vllm_lowbit.quantize", str(src), str(out), "--no-progress", *extra],
                          capture_output=True, text=True, timeout=600, env=vllm_env(AIPC_GGUF_CACHE=str(cache)))  # fmt: skip


@pytest.fixture(scope="module")
def converted(smollm2, gguf_cache, tmp_path_factory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("smollm2-lowbit2") / "model"
    res = convert(smollm2, out, gguf_cache, "--verify", "--threads", "1")
    assert res.returncode == 0, res.stderr[-3000:]
    print("\n[gguf-convert] " + res.stdout.strip().replace("\n", "\n[gguf-convert] "))
    return out, res.stdout


def test_verify_is_exact(converted):
    out, stdout = converted
    assert "Q4_1 0 (210 tensors)" in stdout and "Q8_0 0 (1 tensors)" in stdout and "overall 0" in stdout, stdout
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert (qc["quant_method"], qc["prequantized"], qc["source"]) == ("lowbit2", True, "gguf")
    assert (qc["codebook"], qc["group_size"], qc["scale_dtype"], qc["act_group"], qc["lm_head"]) == (
        "min4", 32, "float16", 32, "float")
    assert "layer_formats" not in qc  # every linear is Q4_1
    assert {"tokenizer.json", "tokenizer_config.json", "model.safetensors"} <= {p.name for p in out.iterdir()}


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

def probe(m):
    qkv = m.model.layers[0].self_attn.qkv_proj
    return [type(qkv.quant_method).__name__, qkv.lowbit_codebook, qkv.lowbit_group_size, qkv.lowbit_act_group]

if __name__ == "__main__":
    ours = run({out!r}, probe)
    ref = run({gguf!r}, probe)
    print("RESULT=" + json.dumps({{"ours": ours, "ref": ref}}))
"""


def test_served_checkpoint_matches_serving_the_gguf(converted, smollm2, gguf_cache):
    """LLM(OUT) on the lowbit2 checkpoint path gives LLM(X.gguf)'s greedy tokens, logprobs within LOGPROB_TOL."""
    from transformers import AutoTokenizer

    out, _ = converted
    tok = AutoTokenizer.from_pretrained(out)
    prompts = [tok(t)["input_ids"] for t in TEXTS]
    code = _BOTH.format(cache=str(gguf_cache), prompts=prompts, n=N_NEW, out=str(out), gguf=str(smollm2))
    res = run_vllm_script(code, timeout=900)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("RESULT=")]
    assert res.returncode == 0 and lines, res.stderr[-5000:]
    r = json.loads(lines[-1][len("RESULT="):])
    (ours, our_layer), (ref, ref_layer) = r["ours"], r["ref"]
    assert our_layer == ["LowBit2LinearMethod", "min4", 32, 32], our_layer
    assert ref_layer[1:] == our_layer[1:], ref_layer
    diff = max(abs(a - b) for (_, la), (_, lb) in zip(ours, ref) for a, b in zip(la, lb))
    print(f"\n[gguf-convert] LLM(OUT) vs LLM(X.gguf): tokens {'equal' if [o[0] for o in ours] == [x[0] for x in ref] else 'DIFFER'}, "
          f"largest greedy-token logprob difference {diff:.2e}; {[tok.decode(o[0]) for o in ours]}")  # fmt: skip
    assert [o[0] for o in ours] == [x[0] for x in ref]
    assert diff <= LOGPROB_TOL


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
