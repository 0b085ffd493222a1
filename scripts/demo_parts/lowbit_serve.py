"""Demo part 1 (vLLM venv): ``vllm serve MODEL --quantization lowbit2`` on 127.0.0.1 answers an
OpenAI chat request (the ``openai`` client, streamed); then the same greedy tokens are computed by
transformers with the same lowbit2 weights and op, and the quantized linears are weighed.

    .venvs/vllm/bin/python -m demo_parts.lowbit_serve [--model DIR]   (PYTHONPATH=scripts)
"""
from __future__ import annotations

import re
import tempfile
from pathlib import Path

from demo_parts.common import CHAT, Refused, run_part, same_prefix

# The server's flags besides the literal ``--quantization lowbit2``: float32 activations like the
# transformers reference (the linears are W2A8 either way), no graph compilation (start in seconds),
# a context that the 1 GiB KV space of VLLM_CPU_KVCACHE_SPACE holds, fixed seed.
SERVE_ARGS = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "1024", "--seed", "0"]
CODEBOOK, GROUP_SIZE = "affine", 64  # the plugin's defaults, which `--quantization lowbit2` uses
# The embedded tiny model has random weights, on no low-bit grid: 2-bit post-training quantization of it
# is refused unless asked for (aipc_kernels.lowbit.quality_gate), so the demo asks, and says so. A --model DIR
# of a real trained model is not given the opt-in: the plugin's refusal is the demo's answer for it.
OPT_IN_ARGS = ["--hf-overrides", '{"quantization_config": {"quant_method": "lowbit2", "allow_2bit_ptq": true}}']
REFERENCE_MAX_BYTES = 200e6  # checkpoints above this skip the transformers reference (minutes on 2 cores)
QUANTIZE_S_PER_BYTE = 1.25e-6  # on-the-fly quantization (optimised fit): ~10 s per 4 M bf16 weights, one core
# An exception line, bare or after vLLM's log prefix ("(Worker pid=1) ERROR ... [file.py:9] ValueError: ...").
_ERROR_LINE = re.compile(r"(?:^|\] )(?:\w+\.)*(\w+(?:Error|Exception)): (.+)$")


def startup_error(log: Path) -> str | None:
    """The first ``SomeError: message`` line of a server log: the root cause of a failed start
    (later ones, such as vLLM's "Engine core initialization failed", wrap it)."""
    for line in log.read_text(errors="replace").splitlines():
        m = _ERROR_LINE.search(line)
        if m:
            return f"{m.group(1)}: {m.group(2).strip()}"
    return None


def wait_or_refuse(server, log: Path, timeout: float) -> None:
    """Waits for ``server``; a server that exited with an error before it was ready is a :class:`Refused`
    naming the root cause (its log kept in a temporary folder)."""
    try:
        server.wait_ready(timeout)
    except RuntimeError:
        err = startup_error(log)
        if err is None or server.proc.poll() is None:
            raise
        kept = Path(tempfile.mkdtemp(prefix="aipc-demo-vllm-log-")) / log.name
        kept.write_bytes(log.read_bytes())
        raise Refused(f"vllm serve exited before it was ready: {err} (log: {kept})") from None


def chat(server, n: int, messages: list[dict] = CHAT, ignore_eos: bool = True) -> dict:
    """One streamed OpenAI chat completion of ``messages`` (greedy, ``n`` tokens, fewer where the model ends
    its answer and ``ignore_eos`` is off): its text, token ids and prompt ids."""
    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key="EMPTY", timeout=120)
    stream = client.chat.completions.create(
        model=server.model, messages=messages, max_tokens=n, temperature=0.0, stream=True,
        extra_body={"ignore_eos": ignore_eos, "return_token_ids": True},
    )  # fmt: skip
    text, ids, prompt_ids = "", [], None
    for chunk in stream:
        prompt_ids = getattr(chunk, "prompt_token_ids", None) or prompt_ids
        for choice in chunk.choices:
            text += choice.delta.content or ""
            ids += getattr(choice, "token_ids", None) or []
    if (ignore_eos and len(ids) != n) or not ids or prompt_ids is None:
        raise RuntimeError(f"the server streamed {len(ids)} token ids of {n} (prompt ids: {prompt_ids is not None})")
    return dict(text=text, ids=ids, prompt_ids=list(prompt_ids))


def metric_sum(metrics: str, name: str) -> float:
    """The sum over label sets of a Prometheus sample ``name`` in a ``/metrics`` text."""
    total, found = 0.0, False
    for line in metrics.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total, found = total + float(line.rsplit(" ", 1)[1]), True
    if not found:
        raise RuntimeError(f"the server's /metrics has no {name}")
    return total


def server_timings(server) -> tuple[float, float]:
    """The server's own measurement of the requests so far (here: one): seconds to the first token
    and seconds of the decode phase (vLLM's ``/metrics``)."""
    import urllib.request

    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as r:
        metrics = r.read().decode()
    return (metric_sum(metrics, "vllm:time_to_first_token_seconds_sum"),
            metric_sum(metrics, "vllm:request_decode_time_seconds_sum"))  # fmt: skip


def lowbit_reference(model_dir: Path, prompt_ids: list[int], n: int) -> tuple[list[int], int, int]:
    """transformers with lowbit2 linears (same quantizer and op as the plugin): its greedy tokens,
    the packed bytes of its quantized linears (the CPU layout that vLLM holds too) and their bf16 bytes."""
    from aipc_kernels.lowbit.modules import LowBitLinear
    from tests.helpers.references import greedy, hf_model

    model = hf_model(model_dir, "lowbit", CODEBOOK, GROUP_SIZE)
    lin = [m for m in model.modules() if isinstance(m, LowBitLinear)]
    packed = sum(t.nbytes for m in lin for t in (m.qweight, m.scales, m.zeros) if t is not None)
    bf16 = sum(2 * m.in_features * m.out_features for m in lin)
    return greedy(model, [prompt_ids], n)[0], packed, bf16


def main(args, model_dir: Path) -> str:
    from aipc_kernels.core import native
    from tests.helpers.vllm_server import START_TIMEOUT_S, VllmServer

    embedded = args.model is None
    size = sum(p.stat().st_size for p in Path(model_dir).glob("*.safetensors"))
    start_timeout = START_TIMEOUT_S + QUANTIZE_S_PER_BYTE * size
    with tempfile.TemporaryDirectory(prefix="aipc-demo-vllm-") as tmp:
        log = Path(tmp) / "vllm-serve.log"
        opt_in = OPT_IN_ARGS if embedded else []
        with VllmServer(model_dir, ["--quantization", "lowbit2", *opt_in, *SERVE_ARGS], log) as server:
            print("$ " + " ".join(server.cmd), flush=True)
            if embedded:
                print("(the embedded model's weights are random: 2-bit post-training quantization is served with the "
                      "opt-in allow_2bit_ptq, which a real trained model should not get: bench/results/quality/quality.md)",
                      flush=True)  # fmt: skip
            wait_or_refuse(server, log, start_timeout)
            print(f"server ready on {server.url} in {server.start_s:.1f} s (native kernel ISA: {native.get_isa()})", flush=True)
            got = chat(server, args.new_tokens)
            ttft, decode_s = server_timings(server)
        print(f"chat answer ({len(got['ids'])} tokens): {got['text']!r}", flush=True)
    n = len(got["ids"])
    figure = (f"OpenAI chat request, {n} tokens: first after {ttft * 1e3:.0f} ms, decode {(n - 1) / decode_s:.0f} tok/s "
              f"(server's /metrics)")  # fmt: skip
    if embedded:
        figure = f"random weights, 2-bit served with the opt-in allow_2bit_ptq; {figure}"
    if size > REFERENCE_MAX_BYTES:
        print(f"transformers reference skipped: {size / 1e6:.0f} MB of safetensors (> {REFERENCE_MAX_BYTES / 1e6:.0f} MB)")
        return figure
    ref, packed, bf16 = lowbit_reference(model_dir, got["prompt_ids"], args.new_tokens)
    same = same_prefix(got["ids"], ref, "vLLM lowbit2 vs transformers with the same op", strict=embedded)
    print(f"transformers, same lowbit2 weights and op: {same}/{len(ref)} leading greedy tokens identical", flush=True)
    return (f"{figure}; linears {packed / 1e6:.2f} MB vs {bf16 / 1e6:.2f} MB bf16 ({packed / bf16:.3f}x); "
            f"greedy tokens = transformers with the same lowbit2 op: {same}/{len(ref)}")


if __name__ == "__main__":
    run_part(main, __doc__)
