"""``vllm serve MODEL --quantization lowbit2``: real servers on 127.0.0.1, OpenAI endpoints, greedy
tokens against transformers references.

Which comparison is exact. The plugin runs every quantized linear through ``aipc::lowbit_linear``,
whose CPU kernel quantizes activations to int8 per token (W2A8). A transformers model whose linears
are :class:`aipc_kernels.lowbit.modules.LowBitLinear` (same weights, same op) computes the same math: with
vLLM in eager float32, its greedy tokens equal the server's exactly. Two cases are not bit-identical
and are checked by teacher forcing instead (the reference fed the server's own tokens; the server's
token must be the reference's argmax at nearly every step and otherwise a near-tie):

* the transformers model holding the *dequantized* lowbit2 weights in ``nn.Linear`` (float
  activations, W2A32): it differs from W2A8 by the int8 activation rounding;
* vLLM's compiled mode (inductor) and bf16: RMSNorm/rotary/attention round differently from
  transformers, and the int8 activation rounding turns that into a flip wherever two logits tie;
* the converter's checkpoint with per-group activation scales: transformers' own KV-cache decode
  and its full forward over the same prefix can part at such a tie (seen on a 2-core Xeon).
"""
from __future__ import annotations

import re

import pytest

from vllm_serving import VllmServer, check_teacher_forced, completion_tokens, hf_greedy, ptq2_serve_args, start_server

N_NEW = 16
COMMON = ["--max-model-len", "512", "--seed", "0", "--max-num-seqs", "8"]
F32_EAGER = ["--dtype", "float32", "--enforce-eager", *COMMON]


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    return tmp_path_factory.mktemp("vllm-logs")


@pytest.fixture(scope="module")
def llama_expected(llama_dir, prompts):
    """Greedy tokens of transformers + LowBitLinear (same op as the plugin), float32."""
    return hf_greedy(llama_dir, prompts, N_NEW, "lowbit")


# ---------------------------------------------------------------------- Llama, on the fly, compiled (vLLM's CPU default)


@pytest.fixture(scope="module")
def llama_server(llama_dir, logs, request):
    return start_server(llama_dir, ["--quantization", "lowbit2", *ptq2_serve_args(), "--dtype", "float32", *COMMON],
                        logs / "llama-compiled.log", request)  # fmt: skip


def test_llama_compiled_against_transformers(llama_server, llama_dir, prompts):
    # near-tie bound 0.08 std (0.05 with a float output projection): the int8 head rounds its input to
    # int8 per token, so inductor's other rounding of the final RMSNorm can move a head activation by a
    # whole int8 step (measured: 0.057 std at the one disagreement of 80)
    got = completion_tokens(llama_server, prompts, N_NEW)
    check_teacher_forced(llama_dir, prompts, got, "lowbit", min_agree=0.95, max_gap_in_std=0.08)
    check_teacher_forced(llama_dir, prompts, got, "dequantized", min_agree=0.85, max_gap_in_std=0.1)


def test_llama_server_compiled_and_quantized(llama_server):
    """Served with the 2-bit opt-in (random weights), and the load logs its largest reconstruction
    error against the quality table's bounds: 2-bit on random Gaussian weights is past the safe one
    (about 0.32), and the verdict follows the value."""
    log = llama_server.log.read_text(errors="replace")
    assert "quantization=lowbit2" in log and "enforce_eager=False" in log
    m = re.search(r"lowbit2: largest relative reconstruction error \|\|W - Wq\|\| / \|\|W\|\| over (\d+) quantized "
                  r"layers is ([\d.]+) \((\S+)\): (above 0.33|between 0.13)", log)  # fmt: skip
    assert m and int(m.group(1)) == 2 * 4, log[-3000:]  # 2 layers x qkv, o, gate_up, down
    err = float(m.group(2))
    assert err > 0.13 and m.group(4) == ("above 0.33" if err > 0.33 else "between 0.13")


def test_completions_text(llama_server):
    r = llama_server.post("/v1/completions", dict(model=llama_server.model, prompt="Hello, my name is",
                                                  max_tokens=8, temperature=0.0, ignore_eos=True))  # fmt: skip
    assert r["usage"]["completion_tokens"] == 8
    assert isinstance(r["choices"][0]["text"], str) and r["choices"][0]["text"]


def test_chat_completions(llama_server):
    r = llama_server.post("/v1/chat/completions", dict(
        model=llama_server.model, messages=[{"role": "user", "content": "Tell me about the small model."}],
        max_tokens=8, temperature=0.0, ignore_eos=True))  # fmt: skip
    msg = r["choices"][0]["message"]
    assert msg["role"] == "assistant" and isinstance(msg["content"], str) and msg["content"]
    assert r["usage"]["completion_tokens"] == 8


def test_streaming_equals_non_streaming(llama_server, prompts):
    body = dict(model=llama_server.model, prompt=prompts[0], max_tokens=N_NEW, temperature=0.0, ignore_eos=True,
                return_token_ids=True)  # fmt: skip
    chunks = llama_server.stream("/v1/completions", body)
    assert len(chunks) > 1
    streamed = [t for c in chunks for ch in c["choices"] for t in (ch.get("token_ids") or [])]
    assert streamed == completion_tokens(llama_server, prompts[:1], N_NEW)[0]
    chat = llama_server.stream("/v1/chat/completions", dict(
        model=llama_server.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=6, temperature=0.0,
        ignore_eos=True))  # fmt: skip
    text = "".join(ch["delta"].get("content") or "" for c in chat for ch in c["choices"])
    assert text


def test_beam_search(llama_server, prompts):
    r = llama_server.post("/v1/completions", dict(model=llama_server.model, prompt=prompts[1], max_tokens=8,
                                                  n=3, use_beam_search=True, temperature=0.0, ignore_eos=True))  # fmt: skip
    texts = [c["text"] for c in r["choices"]]
    assert len(texts) == 3 and len(set(texts)) == 3, texts


# ---------------------------------------------------------------------- eager float32: exact equality


@pytest.fixture(scope="module")
def qwen2_server(qwen2_dir, logs, request):
    return start_server(qwen2_dir, ["--quantization", "lowbit2", *ptq2_serve_args(), *F32_EAGER], logs / "qwen2-eager.log",
                        request)  # fmt: skip


def test_qwen2_eager_greedy_equals_transformers_same_op(qwen2_server, qwen2_dir, prompts):
    got = completion_tokens(qwen2_server, prompts, N_NEW)
    assert got == hf_greedy(qwen2_dir, prompts, N_NEW, "lowbit")
    check_teacher_forced(qwen2_dir, prompts, got, "dequantized", min_agree=0.85, max_gap_in_std=0.1)
    r = qwen2_server.post("/v1/chat/completions", dict(
        model=qwen2_server.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=6, temperature=0.0,
        ignore_eos=True))  # fmt: skip
    assert r["choices"][0]["message"]["content"]


@pytest.fixture(scope="module")
def prequantized_tokens(llama_prequantized, logs, prompts, request):
    """Greedy tokens of the converter's checkpoint served without ``--quantization`` (TP=1)."""
    server = start_server(llama_prequantized, F32_EAGER, logs / "llama-prequantized.log", request)
    try:
        log = server.log.read_text(errors="replace")
        assert "quantization=lowbit2" in log  # picked from the checkpoint's quantization_config
        return completion_tokens(server, prompts, N_NEW)
    finally:
        server.stop()


def test_prequantized_checkpoint_loads_without_flag(prequantized_tokens, llama_dir, prompts):
    # teacher forcing, not equality with transformers' own greedy run: on a 2-core Xeon (2026-11-26)
    # transformers' KV-cache decode took another token at a near-tie than its full forward over the same
    # prefix (one step of 80), while the server agreed with that full forward at all 80 steps
    check_teacher_forced(llama_dir, prompts, prequantized_tokens, "lowbit", min_agree=0.95, max_gap_in_std=0.05,
                         act_group=64)  # fmt: skip


def test_tensor_parallel_2_equals_1(llama_prequantized, logs, prompts, prequantized_tokens, request):
    # per-group activation scales (act_group=64, see llama_prequantized) keep every int8 scale
    # within one rank's K slice. vLLM-CPU binds each TP worker to a NUMA node unless told which cores: here one core each
    server = start_server(llama_prequantized, ["--tensor-parallel-size", "2", *F32_EAGER], logs / "llama-tp2.log",
                          request, VLLM_CPU_OMP_THREADS_BIND="0|1")  # fmt: skip
    try:
        assert completion_tokens(server, prompts, N_NEW) == prequantized_tokens
    finally:
        server.stop()


# ---------------------------------------------------------------------- bf16 (the default dtype) + --hf-overrides


def test_bf16_hf_overrides_on_the_fly(llama_dir, logs, prompts, request):
    q = dict(codebook="sym", group_size=128)
    server = start_server(llama_dir, [*ptq2_serve_args(**q), "--enforce-eager", *COMMON], logs / "llama-bf16.log",
                          request)  # fmt: skip
    try:
        log = server.log.read_text(errors="replace")
        assert "quantization=lowbit2" in log and "dtype=torch.bfloat16" in log
        got = completion_tokens(server, prompts, N_NEW)
    finally:
        server.stop()
    check_teacher_forced(llama_dir, prompts, got, "lowbit", min_agree=0.8, max_gap_in_std=0.15, **q)
    check_teacher_forced(llama_dir, prompts, got, "dequantized", min_agree=0.8, max_gap_in_std=0.15, **q)


def test_greedy_is_independent_of_server_load(llama_server):
    """Batch invariance under load: 96 greedy requests sent one at a time, then by 16 concurrent
    clients (the server batches up to 8 sequences, prefill and decode mixed). Token ids and their
    log-probabilities must be bitwise the same: the low-bit kernels compute a row the same way
    whatever the batch (tests/kernels/test_batch_invariance.py)."""
    import random
    from concurrent.futures import ThreadPoolExecutor

    rng = random.Random(19)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randrange(4, 48))] for _ in range(96)]

    def complete(ids):
        r = llama_server.post("/v1/completions", dict(model=llama_server.model, prompt=ids, max_tokens=12,
                                                      temperature=0.0, ignore_eos=True, return_token_ids=True,
                                                      logprobs=1))  # fmt: skip
        choice = r["choices"][0]
        return list(choice["token_ids"]), choice["logprobs"]["token_logprobs"]

    alone = [complete(p) for p in prompts]
    with ThreadPoolExecutor(16) as pool:
        loaded = list(pool.map(complete, prompts))
    tokens = sum(a[0] != b[0] for a, b in zip(alone, loaded))
    logprobs = sum(a[1] != b[1] for a, b in zip(alone, loaded))
    assert (tokens, logprobs) == (0, 0), f"under load {tokens}/96 completions and {logprobs}/96 log-probabilities differ"


def test_string_for_a_list_is_refused_at_startup(llama_dir, logs):
    """issue 19: ``"modules_to_not_convert": "lm_head"`` became the letters of "lm_head", which match
    every layer name, and the server ran unquantized without a word. Now ``vllm serve`` exits before
    loading any weight, naming the key and the fix."""
    overrides = '{"quantization_config": {"quant_method": "lowbit2", "modules_to_not_convert": "lm_head"}}'
    server = VllmServer(llama_dir, ["--hf-overrides", overrides, "--enforce-eager", *COMMON], logs / "llama-bad-override.log")
    try:
        with pytest.raises(RuntimeError, match="vllm serve exited") as e:
            server.wait_ready()
    finally:
        server.stop()
    assert 'lowbit2 quantization_config.modules_to_not_convert=\'lm_head\' must be a list of strings, e.g. ["lm_head"]' in str(e.value)
