"""Beam search on this CPU: stock transformers vs the segment KV cache (ipex_segment_kv), one run.

    python bench/segment_kv.py [--quick] [--threads 1] [--rows kv4-float32] [--out bench/results]

A random Llama of the ``llama-150m`` preset (151M parameters, 12 layers, 12 heads / 4 KV heads of 64) and
its multi-head twin (12 KV heads, 160M: the KV-heavier setting of the plain-torch prototype),
BS=1, BW=4, a 1024-token prompt, 128 new tokens (``min_new_tokens`` = ``max_new_tokens``, so both
runs generate every step), float32 and bfloat16: rows ``kv4-float32``, ``kv4-bfloat16``, ``kv12-float32``,
``kv12-bfloat16``. The same model object runs stock
(``attn_implementation="sdpa"``, DynamicCache) and then segment_kv, and the two outputs are compared.

Per run: first-token latency (generate start -> first logits, i.e. the prefill) and next-token
latency (mean of the later steps), each as wall time and as this process's CPU time (the machine is
shared: threads are pinned to cores and the load average is recorded); the KV bytes each cache holds
(measured from its tensors), next to the paper's formulas (also for its GPT-J-6B configuration); and
the physical bound of a decode step: (weights + KV bytes read) / measured read bandwidth.
Takes the bench lock so that no two benchmarks overlap.
"""
from __future__ import annotations

import json
import os
import time

import torch

from aipc_kernels.testing.tiny_model import PRESETS, build_tiny_model
from aipc_kernels.segment_attention import native_isa
from harness import BenchParser, bench_lock, machine_info, read_bandwidth, read_results, write_results  # bench/ on sys.path

TITLE = "Segment KV cache vs stock transformers beam search (CPU)"
KV_HEADS = (4, 12)  # the llama-150m preset (GQA) and its multi-head twin
DTYPES = ("float32", "bfloat16")
ROWS = [f"kv{kv}-{dt}" for kv in KV_HEADS for dt in DTYPES]
FLOOR_PROMPT = 16  # prompt of the no-KV floor run
GPTJ = dict(layers=28, hidden=4096, dtype_bytes=2, batch=32, beams=4, prompt=1024, response=1024)


class StepClock:
    """Stopping criterion that only records wall and CPU time at every step (after the step's logits)."""

    def __init__(self):
        self.wall: list[float] = []
        self.cpu: list[float] = []

    def __call__(self, input_ids, scores, **kwargs):
        self.wall.append(time.perf_counter())
        self.cpu.append(time.process_time())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def run(model, enc, impl: str, beams: int, new_tokens: int) -> dict:
    from transformers import StoppingCriteriaList

    model.set_attn_implementation(impl)
    clock = StepClock()
    w0, c0 = time.perf_counter(), time.process_time()
    out = model.generate(
        **enc, num_beams=beams, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
        stopping_criteria=StoppingCriteriaList([clock]), return_dict_in_generate=True, output_scores=True,
    )  # fmt: skip
    w1, c1 = time.perf_counter(), time.process_time()
    cache = out.past_key_values
    if hasattr(cache, "peak_kv_bytes"):
        held, peak = cache.kv_bytes(), cache.peak_kv_bytes
    else:  # DynamicCache: grows monotonically, so what it holds at the end is its peak
        held = peak = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    steps = len(clock.wall)
    return dict(
        impl=impl,
        first_token_wall_s=clock.wall[0] - w0,
        first_token_cpu_s=clock.cpu[0] - c0,
        next_token_wall_ms=(clock.wall[-1] - clock.wall[0]) / (steps - 1) * 1e3,
        next_token_cpu_ms=(clock.cpu[-1] - clock.cpu[0]) / (steps - 1) * 1e3,
        total_wall_s=w1 - w0,
        total_cpu_s=c1 - c0,
        steps=steps,
        kv_bytes_held=held,
        kv_bytes_peak=peak,
        sequences=out.sequences,
        scores=out.sequences_scores,
    )


def linear_share(model, enc, beams: int, new_tokens: int = 16) -> dict:
    """Shares of the self CPU time of a short beam-search ``generate`` (``enc``'s prompt, ``new_tokens``
    steps, its small prefill included) spent in torch's matrix products (``aten::mm``/``addmm``: the
    linear layers, at M = beams rows in decode) and in the lm_head alone, from torch.profiler (its own
    overhead inflates the total, so only shares are reported)."""
    from torch.profiler import ProfilerActivity, profile

    vocab = model.get_output_embeddings().weight.shape[0]
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        model.generate(**enc, num_beams=beams, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    total = mm = head = 0.0
    for e in prof.key_averages(group_by_input_shape=True):
        total += e.self_cpu_time_total
        if e.key in ("aten::mm", "aten::addmm"):
            mm += e.self_cpu_time_total
            if any(len(sh) == 2 and vocab in sh for sh in e.input_shapes if sh):
                head += e.self_cpu_time_total
    return dict(matmul_share=mm / total, lm_head_share=head / total)


def main() -> None:
    parser = BenchParser("segment_kv", __doc__, ROWS, what="models (kv<KV heads>-<dtype>)")
    parser.add_argument("--threads", type=int, default=1, help="torch / kernel threads, pinned to as many cores")
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--beams", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="prompt 128, 16 new tokens (smoke test)")
    parser.add_argument("--render", action="store_true", help="only rewrite the markdown from the results JSON")
    args = parser.parse_args()
    if args.render:
        data = read_results(args.out, args.name)
        if not data.get("machine"):
            parser.error(f"--render: {args.out}/{args.name}.json was written before the harness (no machine block)")
        write_results(args.out, args.name, TITLE, data["machine"], data["rows"], markdown(data["meta"], data["rows"]),
                      notes(data["meta"]), extra=dict(meta=data["meta"]), command=data["command"])
        return
    if args.quick:
        args.prompt, args.new = 128, 16

    from transformers import AutoModelForCausalLM

    import ipex_segment_kv.hook
    from ipex_segment_kv.cache import kv_bytes_per_token, segment_kv_bytes, standard_kv_bytes

    ipex_segment_kv.hook.install()
    cores = sorted(os.sched_getaffinity(0))[: args.threads]
    os.sched_setaffinity(0, cores)
    torch.set_num_threads(args.threads)
    preset = dict(PRESETS["llama-150m"])
    arch = preset.pop("arch")
    selected = [(int(r.split("-")[0][2:]), r.split("-")[1]) for r in args.rows]
    paths = {}
    for kv in dict.fromkeys(kv for kv, _ in selected):
        paths[kv] = build_tiny_model(arch, dtype="float32", **dict(preset, kv_heads=kv))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(6, 1024, (1, args.prompt), generator=g)  # trained tokenizer ids, no special tokens
    enc = dict(input_ids=ids, attention_mask=torch.ones_like(ids))

    results = []
    with bench_lock(enabled=not args.no_lock):
        info = machine_info(segment_isa=native_isa())  # the segment kernel's own ISA (no AMX path)
        bandwidth = read_bandwidth(args.threads)
        for kv, dtype_name in selected:
            path = paths[kv]
            dtype = getattr(torch, dtype_name)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").eval()
            params = sum(p.numel() for p in model.parameters())
            weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
            emb = model.get_input_embeddings().weight
            weight_read = weight_bytes - emb.numel() * emb.element_size()  # decode reads 4 embedding rows
            run(model, dict(input_ids=ids[:, :16], attention_mask=enc["attention_mask"][:, :16]), "segment_kv", 2, 2)
            short = {k: v[:, :FLOOR_PROMPT] for k, v in enc.items()}
            with torch.inference_mode():
                stock = run(model, enc, "sdpa", args.beams, args.new)
                ours = run(model, enc, "segment_kv", args.beams, args.new)
                # the same decode with a FLOOR_PROMPT-token prompt: everything a step does but attend over
                # the long prompt (linear layers, norms, beam search, Python), i.e. the floor that any KV
                # cache and attention kernel, however fast, still pays
                floor = run(model, short, "segment_kv", args.beams, args.new)
                floor_stock = run(model, short, "sdpa", args.beams, args.new)
                floor_split = linear_share(model, short, args.beams)
            c = kv_bytes_per_token(model.config, dtype)
            Np, Nr, B, BW = args.prompt, args.new, 1, args.beams
            # decode-step bytes: weights + the K/V each layer reads (stock: BW copies of everything)
            kv_read_ours = B * (Np + BW * Nr // 2) * c  # mean response length over the run
            kv_read_stock = B * BW * (Np + Nr // 2) * c
            row = dict(
                model=f"llama-150m{'' if kv == preset['kv_heads'] else f' kv_heads={kv}'}",
                kv_heads=kv,
                dtype=dtype_name,
                params=params,
                same_sequences=bool(torch.equal(stock["sequences"], ours["sequences"])),
                max_score_diff=float((stock["scores"] - ours["scores"]).abs().max()),
                formula_standard_bytes=standard_kv_bytes(B, BW, Np, Nr, c),
                formula_segment_bytes=segment_kv_bytes(B, BW, Np, Nr, c),
                bound_next_token_ms_ours=(weight_read + kv_read_ours) / (bandwidth * 1e9) * 1e3,
                bound_next_token_ms_stock=(weight_read + kv_read_stock) / (bandwidth * 1e9) * 1e3,
            )
            for r in (stock, ours, floor, floor_stock):
                for key in ("sequences", "scores"):
                    r.pop(key)
            row["stock"], row["ours"], row["floor"], row["floor_stock"] = stock, ours, floor, floor_stock
            row["floor_split"] = floor_split
            results.append(row)
            print(json.dumps({k: v for k, v in row.items()}, indent=1), flush=True)
            del model
        load_after = os.getloadavg()

    gptj_c = 2 * GPTJ["layers"] * GPTJ["hidden"] * GPTJ["dtype_bytes"]
    g_std = standard_kv_bytes(GPTJ["batch"], GPTJ["beams"], GPTJ["prompt"], GPTJ["response"], gptj_c)
    g_seg = segment_kv_bytes(GPTJ["batch"], GPTJ["beams"], GPTJ["prompt"], GPTJ["response"], gptj_c)
    meta = dict(
        threads=args.threads, pinned_cores=cores, loadavg_after=load_after, read_bandwidth_gbs=bandwidth,
        prompt=args.prompt, new_tokens=args.new, beams=args.beams,
        gptj=dict(GPTJ, standard_bytes=g_std, segment_bytes=g_seg, ratio=g_seg / g_std),
        shared_machine="2 logical CPUs of a lent VM, other jobs possible: see the load average",
    )  # fmt: skip
    write_results(args.out, args.name, TITLE, info, results, markdown(meta, results), notes(meta), extra=dict(meta=meta))


def notes(meta: dict) -> str:
    """What the machine sentence adds: threads, load after, the bandwidth, the model."""
    return (f"{meta['threads']} thread(s) pinned to core(s) {meta['pinned_cores']}; load average "
            f"{tuple(round(x, 2) for x in meta['loadavg_after'])} after ({meta['shared_machine']}: wall times are "
            f"noisy, CPU times less so); measured read bandwidth {meta['read_bandwidth_gbs']:.1f} GB/s "
            f"({meta['threads']} thread(s)). Random Llama `llama-150m` preset (12 layers, 12 heads of 64, 4 KV heads) "
            f"and its MHA twin (12 KV heads, the prototype's setting), BS=1, BW={meta['beams']}, prompt "
            f"{meta['prompt']}, {meta['new_tokens']} new tokens; one run each, same model object.")


def markdown(meta: dict, results: list[dict]) -> str:
    """The body of the results file: the per-model table, the floor table, the GPT-J formulas."""
    mib = 2**20
    lines = [
        "| model | dtype | | first token wall s | first token CPU s | next token wall ms | next token CPU ms | "
        "KV held MiB | KV peak MiB | formula KV MiB | step bound ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        s, o = r["stock"], r["ours"]
        lines.append(
            f"| {r['model']} | {r['dtype']} | stock | {s['first_token_wall_s']:.2f} | {s['first_token_cpu_s']:.2f} | "
            f"{s['next_token_wall_ms']:.1f} | {s['next_token_cpu_ms']:.1f} | {s['kv_bytes_held'] / mib:.1f} | "
            f"{s['kv_bytes_peak'] / mib:.1f} | {r['formula_standard_bytes'] / mib:.1f} | "
            f"{r['bound_next_token_ms_stock']:.1f} |"
        )
        lines.append(
            f"| {r['model']} | {r['dtype']} | segment_kv | {o['first_token_wall_s']:.2f} | {o['first_token_cpu_s']:.2f} | "
            f"{o['next_token_wall_ms']:.1f} | {o['next_token_cpu_ms']:.1f} | {o['kv_bytes_held'] / mib:.1f} | "
            f"{o['kv_bytes_peak'] / mib:.1f} | {r['formula_segment_bytes'] / mib:.1f} | "
            f"{r['bound_next_token_ms_ours']:.1f} |"
        )
        lines.append(
            f"| {r['model']} | {r['dtype']} | **stock / ours** | **{s['first_token_wall_s'] / o['first_token_wall_s']:.2f}x** | "
            f"**{s['first_token_cpu_s'] / o['first_token_cpu_s']:.2f}x** | "
            f"**{s['next_token_wall_ms'] / o['next_token_wall_ms']:.2f}x** | "
            f"**{s['next_token_cpu_ms'] / o['next_token_cpu_ms']:.2f}x** | "
            f"ours/stock **{o['kv_bytes_held'] / s['kv_bytes_held']:.3f}x** | "
            f"**{o['kv_bytes_peak'] / s['kv_bytes_peak']:.3f}x** | "
            f"**{r['formula_segment_bytes'] / r['formula_standard_bytes']:.3f}x** | "
            f"ours at {r['bound_next_token_ms_ours'] / o['next_token_wall_ms'] * 100:.0f}% of bound |"
        )
    lines += [
        "",
        f"Measured floor of a decode step (the same run with a {FLOOR_PROMPT}-token prompt: linear layers, norms, "
        "beam search and Python, with almost no K/V to read; with this plugin and with stock) and the cap it puts "
        "on next token = stock step / the lower floor (what a zero-cost KV cache and attention would reach). "
        "Matmul share: torch.profiler's self CPU time of `aten::mm`/`addmm` (the linear layers at M = 4 beams) "
        "in the floor step, and of the lm_head alone:",
        "",
        "| model | dtype | stock step ms | ours step ms | floor step ms, ours | floor step ms, stock | "
        "cap (stock / lower floor) | ours / cap | floor: matmul share (lm_head) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if "floor" not in r:
            continue
        s, o, f = r["stock"]["next_token_wall_ms"], r["ours"]["next_token_wall_ms"], r["floor"]["next_token_wall_ms"]
        fs = r.get("floor_stock", r["floor"])["next_token_wall_ms"]
        split = r.get("floor_split")
        share = f"{split['matmul_share'] * 100:.0f}% ({split['lm_head_share'] * 100:.0f}%)" if split else ""
        cap = s / min(f, fs)
        lines.append(f"| {r['model']} | {r['dtype']} | {s:.1f} | {o:.1f} | {f:.1f} | {fs:.1f} | {cap:.2f}x | "
                     f"{s / o / cap * 100:.0f}% | {share} |")
    lines += [""]
    for r in results:
        lines.append(
            f"- {r['model']} {r['dtype']}: same sequences as stock: {r['same_sequences']}; max |score difference| "
            f"{r['max_score_diff']:.2e}; {r['params'] / 1e6:.0f}M parameters."
        )
    g = meta["gptj"]
    lines += [
        "",
        f"Paper's GPT-J-6B configuration from the formulas (BS={g['batch']}, BW={g['beams']}, Np={g['prompt']}, "
        f"Nr={g['response']}, fp16, {g['layers']} layers x {g['hidden']}): standard "
        f"{g['standard_bytes'] / 1e9:.1f} GB, segment {g['segment_bytes'] / 1e9:.1f} GB, ratio **{g['ratio']:.3f}x**.",
        "",
        "Targets (issue 7): first token >= 3.5x, next token >= 3x, KV bytes <= 0.35x of stock. Step bound: weights "
        "(all but the input embedding) + the K/V read per step, divided by the measured read bandwidth.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
