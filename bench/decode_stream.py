"""A decode step's weight stream on huge pages against small pages: every linear of a Llama-3.2-1B step
(16 layers of merged q/k/v, o, merged gate/up and down, then the int8 output projection, each with weights
of its own) through the planned op at M=1, the packed weights as ``pack_for_cpu`` places them (transparent
huge pages: ``aipc_kernels.core.huge_pages``) against a copy of the same tensors from torch's allocator
(small pages), interleaved round by round in one process so that the host's drifting bandwidth hits both.

    python bench/decode_stream.py [--rows '1B lowbit4*'] [--rounds 8]

Rows: the weight formats of bench/vllm_e2e.py's lowbit4 (int4 group 128, GPTQ's) and lowbit2 (affine group 64)
rows, each with the int8 per-channel output projection those rows use. Per round: the median of
``--steps`` steps on small pages, then on huge pages, and the read probe over a 1 GB buffer on each; the
ratio small / huge per round, its median and range over the rounds.
"""
from __future__ import annotations

import statistics
import time

import torch

from aipc_kernels.core import huge_pages
from aipc_kernels.lowbit.packing import pack_for_cpu
from aipc_kernels.lowbit.planned_ops import plan_cpu_call
from aipc_kernels.lowbit.quantizers import quantize_rtn
from harness import BenchParser, bench_lock, machine_info, markdown_table, native_probes, write_results
from llama_shapes import HEAD_SHAPES, SHAPES

LAYERS = 16  # Llama-3.2-1B
Q, KV = SHAPES["1B qkv/o 2048x2048"], SHAPES["1B kv 512x2048"]
STEP_SHAPES = [(Q[0] + 2 * KV[0], Q[1]), Q, (2 * SHAPES["1B gate/up 8192x2048"][0], Q[1]), SHAPES["1B down 2048x8192"]]
FORMATS = {"1B lowbit4 int4 g128 + int8 head": ("int4", 128), "1B lowbit2 affine g64 + int8 head": ("affine", 64)}


def step_weights(codebook: str, group: int) -> list:
    """(planned call, K, qweight, scales, zeros) for every linear of one decode step, packed by pack_for_cpu."""
    out = []
    for N, K in STEP_SHAPES * LAYERS + [HEAD_SHAPES["1B lm_head 128256x2048"]]:
        head = N > 100_000
        p = pack_for_cpu(quantize_rtn(torch.randn(N, K) * 0.02, "int8" if head else codebook, -1 if head else group))
        out.append((plan_cpu_call(p), K, p.qweight, p.scales, p.zeros, p.nbytes()))
    return out


def time_step(weights: list, x: torch.Tensor, steps: int) -> float:
    """Median seconds of ``steps`` decode steps over ``weights``."""
    ts = []
    for _ in range(steps):
        t = time.perf_counter()
        for call, K, q, s, z, _ in weights:
            call(x[:, :K], q, s, z)
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def read_gbs(buf: torch.Tensor) -> float:
    """Best of three reads of ``buf`` by the native probe on torch's threads, GB/s."""
    best = 0.0
    for _ in range(3):
        t = time.perf_counter()
        native_probes().stream_read(buf, None)
        best = max(best, buf.numel() / (time.perf_counter() - t) / 1e9)
    return best


def measure(label: str, rounds: int, steps: int) -> dict:
    codebook, group = FORMATS[label]
    huge = step_weights(codebook, group)
    small = [(c, K, *(None if t is None else t.clone() for t in (q, s, z)), nb) for c, K, q, s, z, nb in huge]
    nbytes = sum(w[-1] for w in huge)
    x = torch.randn(1, max(K for _, K, *_ in huge), dtype=torch.bfloat16)
    probe_small = torch.ones(10**9 // 64 * 64, dtype=torch.uint8)
    probe_huge = huge_pages.on_huge_pages(probe_small)
    time_step(huge, x, 2), time_step(small, x, 2)  # warm-up
    per_round = []
    for r in range(rounds):
        t_small, t_huge = time_step(small, x, steps), time_step(huge, x, steps)
        per_round.append(dict(small_ms=t_small * 1e3, huge_ms=t_huge * 1e3, ratio=t_small / t_huge,
                              read_small=read_gbs(probe_small), read_huge=read_gbs(probe_huge)))  # fmt: skip
        print(label, r, {k: round(v, 3) for k, v in per_round[-1].items()}, flush=True)
    med = lambda k: statistics.median(p[k] for p in per_round)  # noqa: E731
    ratios = [p["ratio"] for p in per_round]
    return dict(row=label, mb=nbytes / 1e6, calls=len(huge), small_ms=med("small_ms"), huge_ms=med("huge_ms"),
                speedup=statistics.median(ratios), speedup_min=min(ratios), speedup_max=max(ratios),
                small_gbs=nbytes / med("small_ms") / 1e6, huge_gbs=nbytes / med("huge_ms") / 1e6,
                read_small_gbs=med("read_small"), read_huge_gbs=med("read_huge"), rounds=per_round)  # fmt: skip


def main() -> None:
    ap = BenchParser("decode_stream", __doc__.split("\n\n")[0], list(FORMATS), what="rows", group="cpu")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=7, help="decode steps per round and page kind (median)")
    args = ap.parse_args()
    if not huge_pages.enabled():
        raise SystemExit(f"decode_stream: huge pages are off here (THP mode {huge_pages.thp_mode()!r}, "
                         "or AIPC_HUGE_PAGES=0): nothing to compare")  # fmt: skip
    torch.manual_seed(0)
    with bench_lock(enabled=not args.no_lock):
        info = machine_info(thp=huge_pages.thp_mode())
        rows = [measure(label, args.rounds, args.steps) for label in args.rows]
    cols = ["row", "mb", "calls", "small_ms", "huge_ms", "speedup", "speedup_min", "speedup_max", "small_gbs",
            "huge_gbs", "read_small_gbs", "read_huge_gbs"]
    notes = (f"{torch.get_num_threads()} threads, THP mode `{huge_pages.thp_mode()}`. One decode step = every "
             f"linear of Llama-3.2-1B at M=1 (bf16 x) through the planned op, each with its own weights (so the "
             f"step streams them from DRAM); median of {args.steps} steps per round and page kind, "
             f"{args.rounds} rounds alternating small then huge. speedup = small_ms / huge_ms per round (median, "
             f"min, max); *_gbs = the step's bytes / its median time; read_*_gbs = the native read probe over "
             f"1 GB on small / huge pages, median of the rounds' best-of-3.")
    write_results(args.out, args.name, "A decode step's weight stream: huge pages against small pages", info,
                  rows, markdown_table(rows, cols), notes)


if __name__ == "__main__":
    main()
