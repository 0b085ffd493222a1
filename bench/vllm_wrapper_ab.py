"""vLLM-CPU decode with the compiled graph's C++ wrapper against its Python wrapper, two engines of one file in one
process, rounds interleaved.

    python bench/vllm_wrapper_ab.py [--rows q4_k_m] [--gguf X.gguf,...] [--rounds 8]

``vllm_lowbit.cpu_compile`` turns inductor's C++ wrapper on for this plugin's models on vLLM-CPU; this bench
measures what that gives a one-sequence decode. Files: bench/gguf_speed.py's (random Llama-3.2-1B geometry,
converted and quantized by llama.cpp's own tools, ``--rows``: their types) and any ``--gguf`` given (e.g. the registry's real
SmolLM2 / Gemma-3 files). Per file, one worker process holds two in-process engines of it (``VLLM_USE_LAYERNAME=0``,
set before vLLM is imported, as the C++ wrapper needs): ``python`` with ``compilation_config.inductor_compile_config
.cpp_wrapper = false``, ``cpp`` with the plugin's default (checked to be the C++ wrapper). Per round, the two in
turn (the order reversed every other round): two tokens to settle, then decode tokens/s as bench/gguf_speed.py
measures it, (T(1 + D tokens) - T(1 token)) / D after a 32-token prompt, and the greedy tokens of both compared.
ratio = cpp's tokens/s over python's in the same round; median, min and max over the rounds.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

from harness import (IN_PROCESS_VLLM_ENV, RESULT_PREFIX, BenchParser, bench_lock, llamacpp, machine_info,
                     markdown_table, run_worker, write_results)  # fmt: skip
from harness.step_profile import timed_generate
from gguf_speed import SHORT_PROMPT, TYPES, bench_ggufs, prompt_ids

ENGINES = ("python", "cpp")
PROMPT = prompt_ids(SHORT_PROMPT, 0)  # bench/gguf_speed.py's decode prompt (32 tokens)
# str layer names whatever the caller's environment says: both engines' wrappers are chosen by their configs
VLLM_ENV = dict(IN_PROCESS_VLLM_ENV, VLLM_CPU_KVCACHE_SPACE="1", VLLM_USE_LAYERNAME="0")


def run_file(gguf: Path, rounds: int, new_tokens: int) -> dict:
    """Both engines of ``gguf`` in this process, ``rounds`` interleaved rounds."""
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    cc = dict(python={"inductor_compile_config": {"cpp_wrapper": False}}, cpp={})
    llms = {e: LLM(str(gguf), dtype="bfloat16", max_model_len=512, enable_prefix_caching=False, seed=0,
                   compilation_config=cc[e]) for e in ENGINES}  # fmt: skip
    used = {e: bool(llms[e].llm_engine.vllm_config.compilation_config.inductor_compile_config.get("cpp_wrapper"))
            for e in ENGINES}  # fmt: skip
    if used != dict(python=False, cpp=True):
        raise SystemExit(f"vllm_wrapper_ab: {gguf}: the engines' cpp_wrapper is {used}, not python False / cpp True")
    greedy = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    tokens = {e: list(llms[e].generate([TokensPrompt(prompt_token_ids=PROMPT)], greedy, use_tqdm=False)[0]
                      .outputs[0].token_ids) for e in ENGINES}  # fmt: skip (also compiles the graphs)
    rates: dict[str, list[float]] = {e: [] for e in ENGINES}
    for r in range(rounds):
        for e in ENGINES if r % 2 == 0 else ENGINES[::-1]:
            timed_generate(llms[e], [PROMPT], 2)
            t1, tn = timed_generate(llms[e], [PROMPT], 1), timed_generate(llms[e], [PROMPT], 1 + new_tokens)
            rates[e].append(new_tokens / (tn - t1))
        print(f"[{gguf.name}] round {r}: " + ", ".join(f"{e} {rates[e][-1]:.2f}" for e in ENGINES), flush=True)
    return dict(model=str(gguf), threads=torch.get_num_threads(), tok_s=rates,
                same_tokens=tokens["python"] == tokens["cpp"])  # fmt: skip


def summary(res: dict) -> dict:
    """One table row: both engines' median tokens/s and the per-round ratio cpp / python."""
    ratios = [c / p for c, p in zip(res["tok_s"]["cpp"], res["tok_s"]["python"])]
    return dict(model=Path(res["model"]).name, python_tok_s=statistics.median(res["tok_s"]["python"]),
                cpp_tok_s=statistics.median(res["tok_s"]["cpp"]), ratio=statistics.median(ratios),
                ratio_min=min(ratios), ratio_max=max(ratios), rounds=len(ratios),
                same_tokens="yes" if res["same_tokens"] else "NO")  # fmt: skip


def main() -> None:
    ap = BenchParser("vllm_wrapper_ab", __doc__.split("\n\n")[0], [t.lower() for t in TYPES], ["q4_k_m"],
                     what="bench/gguf_speed.py files (llama.cpp types)", group="e2e")  # fmt: skip
    ap.add_argument("--gguf", default="", help="more GGUF files, comma-separated")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=32)
    llamacpp.add_arguments(ap)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(RESULT_PREFIX + json.dumps(run_file(Path(args.worker), args.rounds, args.new_tokens)), flush=True)
        return
    files = [Path(p).expanduser() for p in args.gguf.split(",") if p]
    for f in files:
        if not f.is_file():
            ap.error(f"--gguf {f}: no such file")
    with bench_lock(enabled=not args.no_lock):
        info = machine_info()
        types = [t.upper() for t in args.rows]
        made = bench_ggufs("llama-3.2-1b", types, args.llamacpp_cache.expanduser(), args.build_llamacpp,
                           args.llamacpp_isa)  # fmt: skip
        files = [made[t] for t in types] + files
        results = []
        for f in files:
            cmd = [sys.executable, __file__, "--worker", str(f), "--rounds", str(args.rounds), "--new-tokens",
                   str(args.new_tokens)]  # fmt: skip
            res, reason = run_worker(f.name, cmd, dict(os.environ, **VLLM_ENV))
            if res is None:
                raise SystemExit(f"vllm_wrapper_ab: {f}: {reason}")
            results.append(res)
    rows = [summary(r) for r in results]
    threads = sorted({r["threads"] for r in results})
    notes = (f"vLLM-CPU computes on {'/'.join(map(str, threads))} thread(s) (the in-process engines'). bf16 "
             f"activations, batch 1, {len(PROMPT)}-token prompt, {args.new_tokens} decoded tokens; two engines per "
             f"file in one process ({args.rounds} rounds, the order reversed every other round). tok_s: median over "
             f"the rounds; ratio: cpp's tokens/s over python's in the same round, median (min, max); same_tokens: "
             f"the two engines' greedy tokens equal.")
    per_round = "\n".join(f"- {Path(r['model']).name}: " + "; ".join(
        f"{e} " + ", ".join(f"{x:.2f}" for x in r["tok_s"][e]) for e in ENGINES) for r in results)  # fmt: skip
    body = markdown_table(rows, ["model", "python_tok_s", "cpp_tok_s", "ratio", "ratio_min", "ratio_max", "rounds",
                                 "same_tokens"], float_fmt=".3f") + "\n\nTokens/s per round:\n" + per_round  # fmt: skip
    write_results(args.out, args.name, "vLLM-CPU decode: the compiled graph's C++ wrapper against its Python wrapper",
                  info, rows, body, notes, extra=dict(per_round=results))  # fmt: skip


if __name__ == "__main__":
    main()
