"""bench/harness/llamacpp.py, the benches' llama.cpp peer: parsing ``llama-bench -o json`` (a real
output of the tool), the bytes-per-token bound, vllm_e2e's target lines (paired rounds included) and
vllm_head_ab's per-format summary, and, where llama.cpp is built
in the default cache, the whole pipeline on a tiny Llama (staging with a SentencePiece vocabulary,
llama.cpp's own converter, ``llama-quantize`` Q4_0, the GGUF's bytes against Q4_0's block size, a
``llama-bench`` decode)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

from harness import llamacpp  # noqa: E402

# `llama-bench -m model-Q4_0.gguf -t 1 -o json -p 0 -n 4 -r 2` (llama-cpp-python 0.3.36's llama.cpp, AMD EPYC)
LLAMA_BENCH_JSON = """[
  {
    "build_commit": "0c1e570",
    "build_number": 1,
    "cpu_info": "AMD EPYC",
    "gpu_info": "",
    "backends": "CPU",
    "model_filename": "/root/.cache/aipc-plugins/llamacpp/gguf/bitnet-float-8e0b60df4da7/model-Q4_0.gguf",
    "model_type": "bitnet ?B Q4_0",
    "model_size": 1291264,
    "model_n_params": 2034944,
    "n_batch": 2048,
    "n_ubatch": 512,
    "n_threads": 1,
    "cpu_mask": "0x0",
    "cpu_strict": false,
    "poll": 50,
    "type_k": "f16",
    "type_v": "f16",
    "n_gpu_layers": -1,
    "n_cpu_moe": 0,
    "split_mode": "layer",
    "main_gpu": 0,
    "no_kv_offload": false,
    "flash_attn": -1,
    "devices": "auto",
    "tensor_split": "0.00",
    "tensor_buft_overrides": "none",
    "load_mode": "auto",
    "lazy_mode": "auto",
    "embeddings": false,
    "no_op_offload": 0,
    "no_host": false,
    "repack": true,
    "fit_target": 0,
    "fit_min_ctx": 0,
    "n_prompt": 0,
    "n_gen": 4,
    "n_depth": 0,
    "test_time": "2026-11-25T17:50:02Z",
    "avg_ns": 510905,
    "stddev_ns": 49375,
    "avg_ts": 7865.954851,
    "stddev_ts": 760.032519,
    "samples_ns": [ 545812, 475999 ],
    "samples_ts": [ 7328.53, 8403.38 ]
  }
]
"""


def test_parse_llama_bench_real_output():
    rates, build = llamacpp.parse_llama_bench(LLAMA_BENCH_JSON)
    assert rates == [7328.53, 8403.38]
    assert build == "0c1e570 (1), AMD EPYC, backend CPU"
    with pytest.raises(ValueError, match="-o json"):
        llamacpp.parse_llama_bench("| model | size | ...")  # the default markdown output
    two = json.dumps(json.loads(LLAMA_BENCH_JSON) * 2)
    with pytest.raises(ValueError, match="expected one test"):
        llamacpp.parse_llama_bench(two)


def test_per_token_bytes_and_bound():
    b = dict(linear=900_000_000, scales=120, output=269_000_000, other=500_000, total=1_440_000_000)
    assert llamacpp.per_token_bytes(b) == 1_169_000_120  # norms ("other") and the embedding row left out
    assert llamacpp.bound_tok_s(29.0, 1_000_000_000) == pytest.approx(29.0)
    assert llamacpp.bound_tok_s(31.3, 765_000_000) == pytest.approx(40.915, rel=1e-4)
    with pytest.raises(ValueError, match="nbytes"):
        llamacpp.bound_tok_s(30.0, 0)


def test_vllm_e2e_targets():
    import vllm_e2e

    def row(name, med, best, first=None, first_long=None):
        return dict(variant=name, decode_tok_s=med, decode_tok_s_best=best, prefill_32_s=first, prefill_long_s=first_long)

    rows = [row("bf16", 11.35, 11.64), row("lowbit2", 39.28, 39.87, 0.25, 4.0), row("lowbit4_gptq", 36.33, 37.87),
            row("llamacpp_q4_0", 29.0, 30.0), row("llamacpp_tq2_0", 30.0, 31.0, 0.3, 3.2)]  # fmt: skip
    lines = vllm_e2e.targets(rows)
    assert lines[:3] == ["- lowbit4 (lowbit4_gptq row) >= 1.3x llama.cpp Q4_0 decode: 1.25x (best 1.26x), **not met**",
                         "- lowbit2 >= 3x vLLM bf16 decode: 3.46x (best 3.43x), **met**",
                         "- lowbit2 >= 1.2x llama.cpp TQ2_0 decode: 1.31x (best 1.29x), **met**"]  # fmt: skip
    # first token: the reference's seconds over the row's (>= 1: not slower); a row without the measure is named
    assert "0.250 s against 0.300 s, 1.20x, **met**" in lines[4]
    assert "4.000 s against 3.200 s, 0.80x, **not met**" in lines[5]
    assert lines[6].endswith("not measured (lowbit4_gptq, llamacpp_q4_0 did not run or has no prefill_32_s)")
    assert vllm_e2e.targets(rows[:2])[0].endswith("not measured (lowbit4_gptq, llamacpp_q4_0 did not run or has no decode_tok_s)")
    assert {"llamacpp_q4_0", "llamacpp_q4_k_m", "llamacpp_tq2_0"} <= set(vllm_e2e.VARIANTS)
    # --paired: a row's rounds against its peer give their own line, before the medians' one
    rows[2]["paired"] = dict(peer="llamacpp_q4_0", ratio_all=[1.1, 1.3, 1.25], ratio_median=1.25)
    paired = vllm_e2e.targets(rows)
    assert paired[0] == ("- lowbit4 (lowbit4_gptq row) >= 1.3x llama.cpp Q4_0 decode, paired rounds: 1.25x "
                         "(rounds 1.10-1.30x), **not met**")  # fmt: skip
    assert paired[1] == lines[0] and len(paired) == len(lines) + 2  # the 1.3x and the 1.2x targets
    assert [vllm_e2e.paired_peer(n) for n in ("lowbit4_gptq_int6_head", "lowbit2_small_pages", "bf16")] == [
        "llamacpp_q4_0", "llamacpp_tq2_0", None]


def test_vllm_head_ab_summary():
    """Each format's ratio is the median over rounds of its tokens/s over the first format's in the same round."""
    import vllm_head_ab

    res = dict(row="lowbit2", head_bytes={"int8": 262_924_800, "int6": 213_417_984},
               tok_s={"int8": [50.0, 40.0, 60.0], "int6": [55.0, 48.0, 60.0]})  # fmt: skip
    base, six = vllm_head_ab.summary(res, ["int8", "int6"])
    assert (base["ratio"], base["ratio_min"], base["ratio_max"]) == (1.0, 1.0, 1.0)
    assert six["ratio"] == pytest.approx(1.1) and six["ratio_min"] == 1.0 and six["ratio_max"] == pytest.approx(1.2)
    assert (six["tok_s"], six["head_mb"], six["rounds"]) == (55.0, pytest.approx(213.418, abs=1e-3), 3)


@pytest.mark.skipif(not llamacpp.llamacpp_ready(llamacpp.DEFAULT_CACHE), reason="llama.cpp not built in the default cache")
def test_pipeline_on_a_tiny_llama(tiny_model, tmp_path):
    """A tiny Llama (its fixture tokenizer is an offline byte-level BPE llama.cpp's converter refuses)
    staged, converted, quantized to Q4_0 and timed: every linear is Q4_0 (18 bytes per 32 weights)."""
    pytest.importorskip("sentencepiece")
    src = tiny_model("llama", hidden=256, intermediate=512, layers=2, heads=4, kv_heads=2)
    cache = tmp_path / "llamacpp"  # the built tools, fresh GGUFs
    cache.mkdir()
    for d in ("src", llamacpp.build_dir(llamacpp.DEFAULT_CACHE).name):
        (cache / d).symlink_to(llamacpp.DEFAULT_CACHE / d)
    gguf = llamacpp.ggufs(lambda stage: llamacpp.stage_float_model(src, stage), cache, ["Q4_0"], src.name)["Q4_0"]
    assert gguf.exists() and not (gguf.parent / "hf").exists()

    cfg = json.loads((src / "config.json").read_text())
    h, i, n_layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    kv = cfg["num_key_value_heads"] * h // cfg["num_attention_heads"]
    weights = n_layers * (2 * h * h + 2 * h * kv + 3 * h * i)
    b = llamacpp.gguf_bytes(gguf, cache)
    assert b["linear_types"] == ["Q4_0"] and b["linear"] == weights // 32 * 18
    assert b["output"] > 0 and b["total"] > b["linear"] + b["output"]
    assert llamacpp.per_token_bytes(b) == b["linear"] + b["scales"] + b["output"]

    rates, build, rss = llamacpp.llama_bench(gguf, cache, threads=1, prompt=0, gen=4, reps=2)
    assert len(rates) == 2 and min(rates) > 0 and "backend CPU" in build and rss > 0


def test_builds_per_instruction_set(tmp_path):
    """Each forced instruction set builds into a folder of its own, with GGML_NATIVE off and AVX-512 off,
    and the hint a user copies says the same; the native build is per CPU (a cache moved to another CPU
    builds again); an unknown one is refused naming the choices."""
    key = llamacpp.cpu_key()
    assert len(key) == 12 and int(key, 16) >= 0 and key == llamacpp.cpu_key()
    assert llamacpp.build_dir(tmp_path) == tmp_path / f"build-native-{key}"
    assert llamacpp.llamacpp_bin(tmp_path, "llama-bench", "avx2") == tmp_path / "build-avx2" / "bin" / "llama-bench"
    assert not llamacpp.llamacpp_ready(tmp_path, "avx_vnni")
    hint = llamacpp.build_hint(tmp_path, "avx_vnni")
    assert f"-B {tmp_path}/build-avx_vnni -DGGML_NATIVE=OFF -DGGML_AVX512=OFF -DGGML_AVX_VNNI=ON" in hint
    assert "-DGGML_AVX_VNNI=OFF" in " ".join(llamacpp.ISA_OPTIONS["avx2"])
    assert llamacpp.build_dir(tmp_path, "native_no_amx") == tmp_path / f"build-native_no_amx-{key}"
    hint = llamacpp.build_hint(tmp_path, "native_no_amx")  # the flags' spaces quoted for the shell
    assert "-DGGML_NATIVE=ON '-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16'" in hint
    with pytest.raises(ValueError, match=r"isa='avx512': use one of \['avx2', 'avx_vnni', 'native', 'native_no_amx'\]"):
        llamacpp.build_dir(tmp_path, "avx512")


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
def test_no_amx_flags_outrank_march():
    """native_no_amx puts -mno-amx-* in CMAKE_C_FLAGS, which come before ggml's -march=native on the compile
    line: GCC must leave AMX off with them first (checked on an AMX target, so on any build machine)."""
    c_flags = next(o for o in llamacpp.ISA_OPTIONS["native_no_amx"] if o.startswith("-DCMAKE_C_FLAGS="))
    flags = c_flags.split("=", 1)[1].split()

    def amx_int8(args: list[str]) -> bool:
        out = subprocess.run(["gcc", *args, "-dM", "-E", "-x", "c", "/dev/null"], capture_output=True, text=True,
                             check=True).stdout  # fmt: skip
        return "__AMX_INT8__" in out

    assert amx_int8(["-march=sapphirerapids"])
    assert not amx_int8([*flags, "-march=sapphirerapids"])
