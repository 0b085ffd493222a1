"""Prefill-size (M >= 16) low-bit GEMM vs torch bf16 on this CPU, in CPU time of one thread.

    python bench/gemm_cpu_time.py [--rows bf16,affine_g64] [--shapes '8B q/o*'] [--ms 16] [--out bench/results/cpu]

Compute-bound shapes need no DRAM rotation; on a shared machine, process CPU time of a single thread
is a steadier measure of work than wall time. Rows: torch bf16 ``F.linear`` (oneDNN, AMX-bf16 where
present), ours on the best ISA (AMX-INT8 where present) and ours forced onto AVX-512 VNNI, for the
affine (per-group zero) and ``int2`` (fixed zero) code books at groups 64 and 128 (row names
``bf16`` and ``<code book>_g<group>``; each of ours on every ISA).
"""
from __future__ import annotations

import os
import time

import torch
import torch.nn.functional as F

from aipc_kernels.core import native
from aipc_kernels.lowbit.ops import lowbit_linear
from aipc_kernels.lowbit.packing import pack_for_cpu
from aipc_kernels.lowbit.quantizers import quantize_rtn
from harness import BenchParser, bench_lock, machine_info, markdown_table, select, write_results
from llama_shapes import SHAPES as LLAMA_SHAPES  # bench/ is on sys.path when run as a script

SHAPES = {k: v for k, v in LLAMA_SHAPES.items() if k in ("8B q/o 4096x4096", "8B gate/up 14336x4096", "8B down 4096x14336")}
OURS = {f"{cb}_g{g}": (cb, g) for cb in ("affine", "int2") for g in (64, 128)}  # row name -> (code book, group)


def cpu_time(fn, reps: int = 5) -> float:
    """Best-of-reps process CPU seconds per call."""
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.process_time()
        fn()
        best = min(best, time.process_time() - t)
    return best


def main() -> None:
    ap = BenchParser("gemm_cpu_time", __doc__, ["bf16", *OURS], group="cpu")
    ap.add_argument("--ms", default="16,128")
    ap.add_argument("--shapes", default="*", help="comma list of shapes, names or patterns such as '8B q/o*'")
    args = ap.parse_args()
    shapes = select(args.shapes, list(SHAPES), "--shapes")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    best = native.best_isa()
    isas = [best] + (["avx512_vnni"] if native.ISAS[best] > native.ISAS["avx512_vnni"] else [])
    rows = []
    with bench_lock(enabled=not args.no_lock):
        info = machine_info()
        for label in shapes:
            N, K = SHAPES[label]
            w = torch.randn(N, K) * 0.02
            wb = w.bfloat16()
            packed = {name: pack_for_cpu(quantize_rtn(w, *OURS[name])) for name in args.rows if name in OURS}
            for M in [int(m) for m in args.ms.split(",")]:
                x = torch.randn(M, K).bfloat16()
                t_bf16 = None
                if "bf16" in args.rows:
                    t_bf16 = cpu_time(lambda: F.linear(x, wb))
                    rows.append(dict(shape=label, M=M, row="torch bf16", ms=t_bf16 * 1e3, x_bf16=1.0))
                for name, p in packed.items():
                    cb, g = OURS[name]
                    for isa in isas:
                        native.set_isa(isa)
                        t = cpu_time(lambda: lowbit_linear(x, p))
                        rows.append(dict(shape=label, M=M, row=f"lowbit2 {cb} g{g} {isa}", ms=t * 1e3,
                                         x_bf16=t_bf16 / t if t_bf16 else None))
                    native.set_isa(best)
            print(f"{label}: done", flush=True)
    notes = (f"Best ISA {best}; load average {tuple(round(v, 2) for v in os.getloadavg())} after (shared machine: CPU time of one thread, best "
             f"of 5). x_bf16 = bf16 CPU time / row CPU time (>1: faster).")
    write_results(args.out, args.name, "Low-bit GEMM (M >= 16) vs torch bf16, CPU time of one thread", info, rows,
                  markdown_table(rows, ["shape", "M", "row", "ms", "x_bf16"]), notes)


if __name__ == "__main__":
    main()
