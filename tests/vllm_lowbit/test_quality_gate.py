"""2-bit post-training quantization is refused unless asked for (server and converter alike), and a
group that does not divide K falls back per layer in the converter as on the server. The tiny models
have random weights, on no low-bit grid: exactly what the refusal is for. Checkpoints whose weights
lie on a grid (ParetoQ, BitNet) need no option: test_paretoq.py and test_bitnet.py serve and convert
them without one."""
from __future__ import annotations

import json
import re
import subprocess
import sys

from vllm_serving import greedy_script, run_vllm_script

#: what the refusal must say: the layer, the measured cost, the alternatives and the opt-in
REFUSAL = (
    "does not lie on a 1/1.58/2-bit grid",
    "SmolLM2-135M-Instruct's perplexity goes from 15.22 to 336,864",
    "--quantization lowbit4",
    "BitNet b1.58, Falcon3-1.58bit, ParetoQ",
    '"allow_2bit_ptq": true',
)


def test_server_refuses_2bit_ptq_of_random_weights(llama_dir):
    """``LLM(BF16_DIR, quantization="lowbit2")`` stops at load with the message (the opt-in is served in
    test_serve.py, whose servers pass it)."""
    res = run_vllm_script(greedy_script(llama_dir, [[1, 45, 541]], 1, quantization="lowbit2"), timeout=300)
    assert res.returncode != 0, "2-bit post-training quantization of random weights was served without the opt-in"
    assert re.search(r"lowbit2: layer 'model\.layers\.\d\.\w+\.\w+_proj' does not lie", res.stderr), res.stderr[-3000:]
    for needle in REFUSAL:
        assert needle in res.stderr, f"{needle!r} not in:\n{res.stderr[-3000:]}"


def _convert(model, out, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vllm_lowbit.quantize", str(model), str(out), "--threads", "1",
                           "--no-progress", *args], capture_output=True, text=True, timeout=600)  # fmt: skip


def test_converter_refuses_2bit_ptq_and_writes_nothing(llama_dir, tmp_path):
    for args in ([], ["--codebook", "int2"], ["--no-detect-grid"]):
        res = _convert(llama_dir, tmp_path / "out", *args)
        assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-3000:]
        assert "python -m vllm_lowbit.quantize: layer 'model.layers." in res.stderr
        for needle in REFUSAL[:4] + ("--allow-2bit-ptq",):
            assert needle in res.stderr, f"{needle!r} not in:\n{res.stderr[-3000:]}"
        assert list(tmp_path.iterdir()) == [], "a refused conversion left files behind"


def test_converter_4bit_group_fallback_and_error_line(tiny_model, tmp_path):
    """``--codebook affine4 --group-size 128`` on hidden 576: the K=576 linears are written with groups
    of 64 and say so in ``layer_formats`` (which the server reads), down_proj (K=1536) keeps 128; no
    opt-in needed at 4 bits; the largest reconstruction error is printed with the quality table's bounds."""
    model = tiny_model("llama", hidden=576, layers=2, heads=9, kv_heads=3, intermediate=1536)
    out = tmp_path / "out"
    res = _convert(model, out, "--codebook", "affine4", "--group-size", "128")
    assert res.returncode == 0, res.stderr[-3000:]
    qcfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qcfg["group_size"] == 128 and qcfg["codebook"] == "affine4"
    fmts = qcfg["layer_formats"]
    names = {f"model.layers.{i}.{m}" for i in range(2) for m in ("self_attn.q_proj", "self_attn.k_proj",
                                                                  "self_attn.v_proj", "self_attn.o_proj",
                                                                  "mlp.gate_proj", "mlp.up_proj")}  # fmt: skip
    assert set(fmts) == names, sorted(fmts)
    assert all(f == {"codebook": "affine4", "group_size": 64, "scale_dtype": "float16"} for f in fmts.values())
    assert "group_size=128 does not divide the in_features of 12 linears" in res.stdout, res.stdout
    assert "largest relative reconstruction error ||W - Wq|| / ||W|| over 14 quantized layers is" in res.stdout


def test_converted_fallback_checkpoint_serves_its_groups(tiny_model, tmp_path):
    """The converted hidden-576 checkpoint loads without flags: each layer with the group its
    ``layer_formats`` entry gives, tokens equal to transformers with the same quantizer, groups and op."""
    from tests.helpers.references import hf_greedy

    model = tiny_model("llama", hidden=576, layers=2, heads=9, kv_heads=3, intermediate=1536)
    out = tmp_path / "out"
    assert _convert(model, out, "--codebook", "affine4", "--group-size", "128").returncode == 0
    prompts = [[1, 45, 541, 84], [1, 298, 272, 452, 282]]
    res = run_vllm_script(greedy_script(out, prompts, 8))
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("TOKENS=")]
    assert res.returncode == 0 and lines, res.stderr[-3000:]
    assert json.loads(lines[-1][len("TOKENS="):]) == hf_greedy(model, prompts, 8, "lowbit", codebook="affine4",
                                                               group_size=128)  # fmt: skip

