"""Benchmark of the NPU export (optimum_npu) on this machine's CPU, side by side in one run.

    .venvs/openvino/bin/python bench/npu_export.py [--rows decode,ttft --reuse-exports] [--preset llama-150m]

Model: random weights of Llama-3.2-1B geometry (``aipc_kernels.tools.tiny_model`` preset
``llama-3.2-1b``: 16 layers, hidden 2048, GQA 32/8, vocab 128256; ``--preset`` picks another). Weights
INT8 symmetric per channel for both exports (optimum-intel's own default for >1B models is INT8).
Rows (any subset; decode, eager and ttft run on the exports in ``--work``):

1. ``export``: export peak anonymous memory (RssAnon of the exporting process, polled every 50 ms):
   ``export_npu_model`` (per-chunk) vs stock ``OVModelForCausalLM.from_pretrained(export=True)``.
2. ``decode``: decode ms/token at contexts 128/512/1024 (max_seq_len 2048): this export (KV buckets) vs
   stock optimum-intel dynamic stateful, in one process, measured alternately (the machine is shared:
   both see the same load); ``eager``: transformers eager (bf16) in its own process.
3. ``ttft``: time to first token for a 512-token prompt: prefill blocks vs the same chunks token by token.

The NPU is not available here: every figure is CPU. Each phase runs in a subprocess so that the
memory of one never inflates another; results go to bench/results/e2e/npu_export.{md,json}. The
weight-read bound divides the INT8 weight bytes by the read bandwidth probe of bench/harness.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from harness import BenchParser, bench_lock, machine_info, read_bandwidth, read_results, write_results  # bench/ on sys.path

ROWS = ("export", "decode", "eager", "ttft")
CONTEXTS = (128, 512, 1024)
MAX_SEQ_LEN = 2048
DECODE_TOKENS = 16
TTFT_PROMPT = 512
LAYERS_PER_CHUNK = 2  # decoder layers per IR: bounds the export's peak memory
ROUNDS = 3  # alternating rounds of ours / stock per context


def _rss_anon_kb(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def run_phase(phase: str, args: list[str], work: Path, preset: str) -> dict:
    """Runs ``phase`` in a child process; returns its JSON result plus its peak RssAnon (MiB)."""
    cmd = [sys.executable, __file__, "--phase", phase, "--work", str(work), "--preset", preset, *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = 0
    done = threading.Event()

    def poll():
        nonlocal peak
        while not done.is_set():
            peak = max(peak, _rss_anon_kb(proc.pid))
            time.sleep(0.05)

    t = threading.Thread(target=poll, daemon=True)
    t.start()
    out, err = proc.communicate()
    done.set()
    t.join()
    if proc.returncode != 0:
        raise RuntimeError(f"phase {phase} failed:\n{err[-4000:]}")
    result = json.loads(out.strip().splitlines()[-1])
    result["peak_rss_anon_mib"] = round(peak / 1024, 1)
    print(f"[{phase}] {json.dumps(result)}", flush=True)
    return result


# ---- phases (child processes) ---------------------------------------------------------------
PRESET = "llama-3.2-1b"  # the child processes' model geometry (--preset)


def _source(work: Path) -> Path:
    from aipc_kernels.tools.tiny_model import PRESETS, build_tiny_model

    return build_tiny_model(**PRESETS[PRESET])


def phase_build(work: Path) -> dict:
    t = time.perf_counter()
    src = _source(work)
    return dict(source=str(src), seconds=round(time.perf_counter() - t, 1))


def phase_export_ours(work: Path) -> dict:
    from optimum_npu import export_npu_model

    t = time.perf_counter()
    export_npu_model(_source(work), work / "ours", max_seq_len=MAX_SEQ_LEN, prefill_block=64,
                     layers_per_chunk=LAYERS_PER_CHUNK, weight_format="int8")
    size = sum(p.stat().st_size for p in (work / "ours").glob("npu_*.bin"))
    return dict(seconds=round(time.perf_counter() - t, 1), bin_mib=round(size / 2**20))


def phase_export_stock(work: Path) -> dict:
    from optimum.intel import OVModelForCausalLM, OVWeightQuantizationConfig

    t = time.perf_counter()
    m = OVModelForCausalLM.from_pretrained(
        _source(work), export=True, compile=False,
        quantization_config=OVWeightQuantizationConfig(bits=8, sym=True))
    m.save_pretrained(work / "stock")
    return dict(seconds=round(time.perf_counter() - t, 1))


class _Clock:
    """A generate() streamer that timestamps every emitted token (the first put is the prompt)."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass


def _decode_ms(model, ids) -> tuple[float, float]:
    """(ms to first token, median ms/token of the following DECODE_TOKENS) from generate()."""
    clock = _Clock()
    t0 = time.perf_counter()
    model.generate(ids, max_new_tokens=DECODE_TOKENS + 1, min_new_tokens=DECODE_TOKENS + 1,
                   do_sample=False, streamer=clock)
    stamps = clock.times[1:]  # the first put() is the prompt
    steps = sorted(b - a for a, b in zip(stamps, stamps[1:]))
    return (stamps[0] - t0) * 1e3, steps[len(steps) // 2] * 1e3


def _prompt(n: int):
    import torch

    g = torch.Generator().manual_seed(n)
    return torch.randint(10, 1000, (1, n), generator=g)


def phase_decode(work: Path, system: str) -> dict:
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    if system == "ours":
        from optimum_npu import OVNPUModelForCausalLM

        model = OVNPUModelForCausalLM(work / "ours", device="CPU", max_compiled_buckets=1)
    elif system == "stock":
        from optimum.intel import OVModelForCausalLM

        model = OVModelForCausalLM.from_pretrained(work / "stock", device="CPU")
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(_source(work), dtype=torch.bfloat16,
                                                     attn_implementation="eager")
    _decode_ms(model, _prompt(16))  # warm-up (compilation, first-call allocations)
    res = {}
    for ctx in CONTEXTS:
        _decode_ms(model, _prompt(ctx))  # warms this context's KV bucket
        ttft, ms = _decode_ms(model, _prompt(ctx))
        res[str(ctx)] = dict(ms_per_token=round(ms, 1), first_token_ms=round(ttft, 1))
    return res


def phase_decode_pair(work: Path) -> dict:
    """This export and stock optimum-intel in one process, measured alternately (ROUNDS rounds
    per context, median over all steps of a system): on a shared machine both see the same load,
    so their ratio is fair even when the absolute figures move."""
    import torch
    from optimum.intel import OVModelForCausalLM

    from optimum_npu import OVNPUModelForCausalLM

    torch.set_num_threads(os.cpu_count() or 1)
    models = dict(ours=OVNPUModelForCausalLM(work / "ours", device="CPU", max_compiled_buckets=1),
                  stock=OVModelForCausalLM.from_pretrained(work / "stock", device="CPU"))
    for model in models.values():
        _decode_ms(model, _prompt(16))  # warm-up (compilation, first-call allocations)
    res: dict = {name: {} for name in models}
    for ctx in CONTEXTS:
        steps: dict[str, list[float]] = {name: [] for name in models}
        ttft: dict[str, list[float]] = {name: [] for name in models}
        for name, model in models.items():
            _decode_ms(model, _prompt(ctx))  # warms this context's KV bucket
        for _ in range(ROUNDS):
            for name, model in models.items():
                first, per_step = _decode_steps(model, _prompt(ctx))
                ttft[name].append(first)
                steps[name].extend(per_step)
        for name in models:
            ms = sorted(steps[name])[len(steps[name]) // 2]
            res[name][str(ctx)] = dict(ms_per_token=round(ms, 1),
                                       first_token_ms=round(min(ttft[name]), 1))
    return res


def _decode_steps(model, ids) -> tuple[float, list[float]]:
    """(ms to first token, ms of each of the following DECODE_TOKENS steps) from generate()."""
    clock = _Clock()
    t0 = time.perf_counter()
    model.generate(ids, max_new_tokens=DECODE_TOKENS + 1, min_new_tokens=DECODE_TOKENS + 1,
                   do_sample=False, streamer=clock)
    stamps = clock.times[1:]
    return (stamps[0] - t0) * 1e3, [(b - a) * 1e3 for a, b in zip(stamps, stamps[1:])]


def phase_ttft(work: Path) -> dict:
    import torch

    from optimum_npu import OVNPUModelForCausalLM

    model = OVNPUModelForCausalLM(work / "ours", device="CPU")
    ids = _prompt(TTFT_PROMPT)
    model(ids[:, :80])  # warm-up: compiles and touches prefill + the first bucket
    t = time.perf_counter()
    blocked = model(ids).logits
    t_block = time.perf_counter() - t
    t = time.perf_counter()
    out = model(ids[:, :1])
    for i in range(1, TTFT_PROMPT):
        out = model(ids[:, i:i + 1], past_key_values=out.past_key_values)
    t_token = time.perf_counter() - t
    same = bool(torch.argmax(blocked[0, -1]) == torch.argmax(out.logits[0, -1]))
    return dict(prefill_blocks_s=round(t_block, 2), token_by_token_s=round(t_token, 2),
                speedup=round(t_token / t_block, 1), same_next_token=same)


def report(res: dict, preset: str) -> tuple[str, str]:
    """(the notes after the machine sentence, the body) of the results file: a section per row run."""
    m = res["machine"]
    notes = f"OpenVINO {m['openvino']}; load average {res['loadavg_end']} at end. {m['note']}."
    rows, lines = res["rows"], []
    if "decode" in rows or "eager" in rows:
        d = {k: rows.get(k) for k in ("decode", "eager")}
        lines += [
            f"## Decode ms/token (median of {ROUNDS} x {DECODE_TOKENS} steps; this export and stock "
            "measured alternately in one process; max_seq_len 2048)",
            "",
            "| context | this export (KV bucket) | stock optimum-intel dynamic | transformers eager bf16 "
            "| ours / stock | ours / eager | weight-read bound |",
            "|---|---|---|---|---|---|---|",
        ]
        for ctx in CONTEXTS:
            o, s = ((d["decode"][k][str(ctx)]["ms_per_token"] for k in ("ours", "stock")) if d["decode"] else ("", ""))
            h = d["eager"][str(ctx)]["ms_per_token"] if d["eager"] else ""
            bucket = next(b for b in res["kv_buckets"] if b > ctx)
            lines.append(f"| {ctx} | {o} ({bucket}) | {s} | {h} | {f'{o / s:.2f}x' if o != '' else ''} | "
                         f"{f'{o / h:.2f}x' if o != '' and h != '' else ''} | {res['bound_ms']} ms |")
        lines += ["", f"Weight-read bound: {res['weight_mib']} MiB of INT8 weights per token / "
                  f"{res['bandwidth_gbs']} GB/s measured read bandwidth.", ""]
    if "ttft" in rows:
        t = rows["ttft"]
        lines += [
            f"## Time to first token, {TTFT_PROMPT}-token prompt (this export)",
            "",
            f"prefill blocks of 64: {t['prefill_blocks_s']} s; token by token: "
            f"{t['token_by_token_s']} s; **{t['speedup']}x** (same next token: {t['same_next_token']}).",
            "",
        ]
    if "export" in rows:
        e_o, e_s = rows["export"]["ours"], rows["export"]["stock"]
        lines += [
            f"## Export peak anonymous memory (RssAnon), `{preset}` geometry, INT8"
            + (" (figures of the previous run, --reuse-exports)" if res.get("reused_exports") else ""),
            "",
            "| exporter | peak RssAnon MiB | seconds |",
            "|---|---|---|",
            f"| export_npu_model ({LAYERS_PER_CHUNK} layers per chunk) | {e_o['peak_rss_anon_mib']} | {e_o['seconds']} |",
            f"| stock from_pretrained(export=True) | {e_s['peak_rss_anon_mib']} | {e_s['seconds']} |",
            f"| ratio | {e_o['peak_rss_anon_mib'] / e_s['peak_rss_anon_mib']:.0%} | |",
            "",
        ]
    lines += [
        "## Anchor: NITRO on an Intel NPU (not measured here)",
        "",
        "NITRO (Fei & Abdelfattah, arXiv 2412.11053) reports its chunked static Llama models on a",
        "Core Ultra (Meteor Lake) NPU; its NPU figures (per-token latency growing with the maximum",
        "sequence length, Figure 6) are not quoted here because the paper text could not be checked",
        "from this machine: read them there. Intel NPU: not measured on this machine (no NPU device).",
    ]
    return notes, "\n".join(lines)


def main() -> None:
    global PRESET
    from aipc_kernels.tools.tiny_model import PRESETS

    p = BenchParser("npu_export", __doc__.split("\n\n")[0], ROWS, group="e2e")
    p.add_argument("--phase", help=argparse.SUPPRESS)
    p.add_argument("--system", help=argparse.SUPPRESS)
    p.add_argument("--preset", default=PRESET, choices=sorted(PRESETS), help="model geometry (default: %(default)s)")
    p.add_argument("--reuse-exports", action="store_true",
                   help="no export row: keep the export figures of the last results file (decode/TTFT on its exports)")
    p.add_argument("--work", default=str(Path(os.environ.get(
        "AIPC_CACHE_DIR", Path.home() / ".cache" / "aipc-plugins")) / "bench-npu-export"))
    a = p.parse_args()
    PRESET = a.preset
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    if a.phase:
        fn = {"build": phase_build, "export-ours": phase_export_ours,
              "export-stock": phase_export_stock, "decode-pair": phase_decode_pair,
              "ttft": phase_ttft}.get(a.phase)
        result = fn(work) if fn else phase_decode(work, a.system)
        print(json.dumps(result))
        return
    if a.reuse_exports and "export" in a.rows:
        p.error("--reuse-exports keeps the last export figures: leave 'export' out of --rows")
    if "export" not in a.rows and not (work / "ours" / "npu_export.json").exists():
        p.error(f"--rows {','.join(a.rows)} runs on the exports in {work}, and there are none: add 'export'")
    import openvino

    with bench_lock(enabled=not a.no_lock):
        res = dict(machine=machine_info(openvino=openvino.__version__,
                                        note="shared machine: 2 cores used by several engineers at once; NPU not "
                                             "available here (all figures CPU)"), rows={})
        rows = res["rows"]
        run_phase("build", [], work, a.preset)
        if a.reuse_exports:  # decode/TTFT again on the exports (and export figures) of the last run
            last = read_results(a.out, a.name)
            rows["export"] = last["rows"]["export"] if isinstance(last["rows"], dict) else last["export"]
            res["reused_exports"] = True
        elif "export" in a.rows:
            rows["export"] = dict(ours=run_phase("export-ours", [], work, a.preset),
                                  stock=run_phase("export-stock", [], work, a.preset))
        if "decode" in a.rows:
            rows["decode"] = run_phase("decode-pair", [], work, a.preset)
        if "eager" in a.rows:
            rows["eager"] = run_phase("decode", ["--system", "eager"], work, a.preset)
        if "ttft" in a.rows:
            rows["ttft"] = run_phase("ttft", [], work, a.preset)
        res["bandwidth_gbs"] = round(read_bandwidth(), 1)
        res["loadavg_end"] = os.getloadavg()
    manifest = json.loads((work / "ours" / "npu_export.json").read_text())
    res["kv_buckets"] = manifest["kv_buckets"]
    weights = sum(p.stat().st_size for p in (work / "ours").glob("npu_layers_*.bin")) + \
        (work / "ours" / "npu_head.bin").stat().st_size
    res["weight_mib"] = round(weights / 2**20)
    res["bound_ms"] = round(weights / (res["bandwidth_gbs"] * 1e9) * 1e3, 1)
    notes, body = report(res, a.preset)
    machine = res.pop("machine")
    write_results(a.out, a.name, f"NPU export (optimum_npu) on CPU: `{a.preset}` geometry, random weights, INT8 sym "
                  "weights", machine, res.pop("rows"), body, notes, extra=res)


if __name__ == "__main__":
    main()
