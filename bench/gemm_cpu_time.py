"""Prefill-size (M >= 16) low-bit GEMM vs torch bf16 on this CPU, in CPU time of one thread.

    python bench/gemm_cpu_time.py [--out bench/results/gemm_cpu_time]

Compute-bound shapes need no DRAM rotation; on a shared machine, process CPU time of a single thread
is a steadier measure of work than wall time. Rows: torch bf16 ``F.linear`` (oneDNN, AMX-bf16 where
present), ours on the best ISA (AMX-INT8 where present) and ours forced onto AVX-512 VNNI, for the
affine (per-group zero) and ``int2`` (fixed zero) code books at groups 64 and 128.
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from aipc_kernels import native
from aipc_kernels.ops import lowbit_linear
from aipc_kernels.packing import pack_for_cpu
from aipc_kernels.quantizers import quantize_rtn
from llama_shapes import SHAPES as LLAMA_SHAPES  # bench/ is on sys.path when run as a script
from report import write_report

SHAPES = {k: v for k, v in LLAMA_SHAPES.items() if k in ("8B q/o 4096x4096", "8B gate/up 14336x4096", "8B down 4096x14336")}


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
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ms", default="16,128")
    ap.add_argument("--out", default="bench/results/gemm_cpu_time")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    best = native.best_isa()
    isas = [best] + (["avx512_vnni"] if native.ISAS[best] > native.ISAS["avx512_vnni"] else [])
    rows, load0 = [], os.getloadavg()
    for label, (N, K) in SHAPES.items():
        w = torch.randn(N, K) * 0.02
        wb = w.bfloat16()
        packed = {(cb, g): pack_for_cpu(quantize_rtn(w, cb, g)) for cb in ("affine", "int2") for g in (64, 128)}
        for M in [int(m) for m in args.ms.split(",")]:
            x = torch.randn(M, K).bfloat16()
            t_bf16 = cpu_time(lambda: F.linear(x, wb))
            rows.append(dict(shape=label, M=M, row="torch bf16", ms=t_bf16 * 1e3, x_bf16=1.0))
            for (cb, g), p in packed.items():
                for isa in isas:
                    native.set_isa(isa)
                    t = cpu_time(lambda: lowbit_linear(x, p))
                    rows.append(dict(shape=label, M=M, row=f"lowbit2 {cb} g{g} {isa}", ms=t * 1e3, x_bf16=t_bf16 / t))
                native.set_isa(best)
        print(f"{label}: done", flush=True)
    head = (f"# Low-bit GEMM (M >= 16) vs torch bf16, CPU time of one thread\n\nMachine: {native_cpu()}, "
            f"torch {torch.__version__}, best ISA {best}; load average {load0} before, {os.getloadavg()} after "
            f"(shared machine: CPU time, best of 5). x_bf16 = bf16 CPU time / row CPU time (>1: faster).\n"
            f"Command: `python bench/gemm_cpu_time.py`\n\n")
    lines = ["| shape | M | row | ms | x_bf16 |", "|---|---|---|---|---|"]
    lines += [f"| {r['shape']} | {r['M']} | {r['row']} | {r['ms']:.2f} | {r['x_bf16']:.2f} |" for r in rows]
    write_report(args.out, head + "\n".join(lines) + "\n", rows)


def native_cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


if __name__ == "__main__":
    main()
