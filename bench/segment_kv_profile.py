"""Where a decode step of ``ipex_segment_kv.optimize(model, weights=...)`` goes, component by component.

    python bench/segment_kv_profile.py [--threads 2] [--rows kv4-bfloat16] [--weights int4] [--out bench/results/e2e]

The ``bench/segment_kv.py`` configuration (random ``llama-150m`` preset and its multi-head twin, BS=1, BW=4,
``--prompt`` tokens), one model per row, optimized with ``--weights`` (``float``: the fused layers on the float
weights). Each component's functions are wrapped in a wall-clock timer inside ``generate``: the layers'
projections (the planned low-bit op, or ``aipc::fused_linear``), the lm_head, the segment SDPA, RoPE, the
low-bit path's prologues (``aipc::prologue`` for bf16, torch ops for float32), the whole model forward; the step is
``(T(2 + new) - T(2)) / new`` of plain ``generate`` calls (the timers' own cost, under a microsecond a call,
is in it). ``rest of the forward`` is the forward minus the timed components (the layers' glue, cache updates,
norms, residuals, transformers' model code); ``outside the forward`` is the step minus the forward
(transformers' beam search and logits processors). Each row also has its bytes-per-step bound (packed weights +
the K/V read at the mean response length, over the read bandwidth measured here). Takes the bench lock.
"""
from __future__ import annotations

import os
import time
from collections import Counter
from typing import Callable

import torch

from aipc_kernels.tools.tiny_model import PRESETS, build_tiny_model
from harness import BenchParser, bench_lock, machine_info, read_bandwidth, write_results  # bench/ on sys.path

TITLE = "Segment KV decode step, component by component (CPU)"
ROWS = [f"kv{kv}-{dt}" for kv in (4, 12) for dt in ("float32", "bfloat16")]
COMPONENTS = ("projections", "lm_head", "segment_sdpa", "rope", "prologues")


class Timers:
    """Wall time and call count per component, of functions wrapped with :meth:`wrap`."""

    def __init__(self):
        self.seconds: Counter = Counter()
        self.calls: Counter = Counter()
        self._undo: list[Callable[[], None]] = []

    def wrap(self, owner, attr: str, key: str) -> None:
        original = getattr(owner, attr)

        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[key] += time.perf_counter() - t
                self.calls[key] += 1

        setattr(owner, attr, timed)
        self._undo.append(lambda: setattr(owner, attr, original))

    def restore(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()

    def snapshot(self) -> tuple[Counter, Counter]:
        return Counter(self.seconds), Counter(self.calls)


def install_timers(timers: Timers, weights: str) -> None:
    """Wraps each component's entry points (where the fused layer calls them)."""
    from transformers.models.llama import modeling_llama

    from aipc_kernels.decoder import decoder_layer, fused_lowbit, segment_attention
    from aipc_kernels.lowbit import modules, planned_ops
    from ipex_segment_kv import fused_layers

    if weights == "float":
        timers.wrap(decoder_layer, "fused_linear", "projections")
        timers.wrap(fused_layers, "dense_linear", "lm_head")
    else:
        timers.wrap(planned_ops.CpuCall, "__call__", "projections")
        timers.wrap(modules.LowBitLinear, "forward", "lm_head")
        timers.wrap(fused_lowbit, "apply_prologue", "prologues")
    timers.wrap(segment_attention, "native_segment_sdpa", "segment_sdpa")
    timers.wrap(decoder_layer, "apply_rope", "rope")
    timers.wrap(modeling_llama.LlamaForCausalLM, "forward", "forward")


def profile_row(kv: int, dtype_name: str, weights: str, prompt: int, new: int, beams: int, bandwidth: float) -> dict:
    from transformers import AutoModelForCausalLM

    import ipex_segment_kv
    from ipex_segment_kv.cache import kv_bytes_per_token

    preset = dict(PRESETS["llama-150m"])
    arch = preset.pop("arch")
    path = build_tiny_model(arch, dtype="float32", **dict(preset, kv_heads=kv))
    dtype = getattr(torch, dtype_name)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    if weights == "float":
        ipex_segment_kv.optimize(model)
        read = sum(p.numel() * p.element_size() for p in model.parameters())
        emb = model.get_input_embeddings().weight
        read -= emb.numel() * emb.element_size()
        if model.get_output_embeddings().weight is emb:  # tied: the head reads the embedding
            read += emb.numel() * emb.element_size()
    else:
        ipex_segment_kv.optimize(model, weights=weights, allow_2bit_ptq=True)
        read = model._aipc_segment_kv_weights["bytes_after"]
    ids = torch.randint(6, 1024, (1, prompt), generator=torch.Generator().manual_seed(0))
    enc = dict(input_ids=ids, attention_mask=torch.ones_like(ids))

    def generate(n: int) -> float:
        t = time.perf_counter()
        model.generate(**enc, num_beams=beams, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        return time.perf_counter() - t

    timers = Timers()
    install_timers(timers, weights)
    try:
        with torch.inference_mode():
            generate(4)  # warm
            timers.seconds.clear()
            timers.calls.clear()
            t2 = generate(2)
            s2, c2 = timers.snapshot()
            tn = generate(2 + new)
            s, c = timers.snapshot()
    finally:
        timers.restore()
    step_ms = (tn - t2) / new * 1e3
    per_step = {k: ((s[k] - s2[k]) - s2[k]) / new * 1e3 for k in (*COMPONENTS, "forward")}  # the 2-step run's share
    calls = {k: ((c[k] - c2[k]) - c2[k]) / new for k in (*COMPONENTS, "forward")}
    kv_read = (prompt + beams * new // 2) * kv_bytes_per_token(model.config, dtype)  # mean response length
    row = dict(row=f"kv{kv}-{dtype_name}", weights=weights, step_ms=step_ms, bytes_read=read + kv_read,
               bound_ms=(read + kv_read) / (bandwidth * 1e9) * 1e3, ms=per_step, calls=calls)  # fmt: skip
    row["ms"]["rest of the forward"] = per_step["forward"] - sum(per_step[k] for k in COMPONENTS)
    row["ms"]["outside the forward"] = step_ms - per_step["forward"]
    return row


def markdown(rows: list[dict]) -> str:
    parts = ["rest of the forward", "outside the forward"]
    keys = (*COMPONENTS, *parts)
    lines = ["| row | weights | step ms | bound ms | " + " | ".join(f"{k} ms (share)" for k in keys) + " |",
             "|---|---|---|---|" + "---|" * len(keys)]  # fmt: skip
    for r in rows:
        cells = " | ".join(f"{r['ms'][k]:.2f} ({r['ms'][k] / r['step_ms']:.0%})" for k in keys)
        lines.append(f"| {r['row']} | {r['weights']} | {r['step_ms']:.2f} | {r['bound_ms']:.2f} | {cells} |")
    calls = "; ".join(f"{r['row']}: " + ", ".join(f"{k} {r['calls'][k]:.0f}" for k in COMPONENTS) for r in rows)
    lines += ["", f"Calls per step: {calls}.", ""]
    return "\n".join(lines)


def main() -> None:
    parser = BenchParser("segment_kv_profile", __doc__, ROWS, default_rows=["kv4-bfloat16", "kv4-float32"],
                         what="models (kv<KV heads>-<dtype>)", group="e2e")  # fmt: skip
    parser.add_argument("--threads", type=int, default=2, help="torch / kernel threads, pinned to as many cores")
    parser.add_argument("--weights", default="int4", help="int8, int4, lowbit2, or float (the fused float layers)")
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--new", type=int, default=64, help="decode steps timed")
    parser.add_argument("--beams", type=int, default=4)
    args = parser.parse_args()
    from aipc_kernels.lowbit.weight_schemes import SCHEMES

    if args.weights != "float" and args.weights not in SCHEMES:
        parser.error(f"--weights {args.weights!r}: use float or one of {sorted(SCHEMES)}")
    cores = sorted(os.sched_getaffinity(0))[: args.threads]
    os.sched_setaffinity(0, cores)
    torch.set_num_threads(args.threads)
    rows = []
    with bench_lock(enabled=not args.no_lock):
        info = machine_info()
        bandwidth = read_bandwidth(args.threads)
        for name in args.rows:
            kv, dtype_name = int(name.split("-")[0][2:]), name.split("-")[1]
            rows.append(profile_row(kv, dtype_name, args.weights, args.prompt, args.new, args.beams, bandwidth))
            print(rows[-1], flush=True)
    meta = dict(threads=args.threads, pinned_cores=cores, read_bandwidth_gbs=bandwidth, prompt=args.prompt,
                new_tokens=args.new, beams=args.beams)  # fmt: skip
    notes = (f"{args.threads} thread(s) pinned to core(s) {cores}; measured read bandwidth {bandwidth:.1f} GB/s. "
             "Random Llama `llama-150m` preset (12 layers, 12 heads of 64, 4 KV heads) or its MHA twin (12 KV heads), "
             f"BS=1, BW={args.beams}, prompt {args.prompt}, {args.new} decode steps timed; one run.")  # fmt: skip
    write_results(args.out, args.name, TITLE, info, rows, markdown(rows), notes, extra=dict(meta=meta))


if __name__ == "__main__":
    main()
