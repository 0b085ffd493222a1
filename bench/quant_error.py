"""Weight reconstruction error of the quantizers: min-max RTN vs the optimised fit, per code book and
group size, on Gaussian and heavy-tailed (Student-t) matrices, in one run.

    python bench/quant_error.py [--rows gaussian] [--shape 64x256] [--out bench/results/quality]

Error = ||dequantize(quantize(W)) - W||_F / ||W||_F (relative Frobenius norm) of a 1024 x 4096 matrix per
distribution (the rows: fixed seed); ratio = optimised / RTN (< 1: the optimised fit is better). Also the time of
each quantizer on this CPU (a one-off cost when a checkpoint is converted). Writes a markdown table and
its JSON.
"""
from __future__ import annotations

import time

import torch

from aipc_kernels.lowbit.formats import CODEBOOKS
from aipc_kernels.lowbit.quantizers import quantize_optimized, quantize_rtn
from harness import BenchParser, bench_lock, machine_info, markdown_table, write_results  # bench/ is on sys.path

GROUPS = (32, 64, 128, -1)  # -1: the whole row
MATRICES = ("gaussian", "student-t(5)", "student-t(3)")
COLS = ["matrix", "codebook", "bits", "group", "rtn", "optimized", "ratio", "rtn_s", "optimized_s"]


def matrices(n: int, k: int, names: list[str]) -> dict[str, torch.Tensor]:
    """The test matrices ``names`` of :data:`MATRICES`, fixed seeds: Gaussian, and Student-t with 5 and 3
    degrees of freedom (each drawn as in a run of all three, whichever are asked)."""
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)  # torch.distributions samples from the global generator
    drawn = {
        "gaussian": torch.randn(n, k, generator=g),
        "student-t(5)": torch.distributions.StudentT(5.0).sample((n, k)),
        "student-t(3)": torch.distributions.StudentT(3.0).sample((n, k)),
    }
    return {name: drawn[name] for name in names}


def rel_err(w: torch.Tensor, q) -> float:
    """Relative Frobenius error of a quantized weight against the original."""
    return ((q.dequantize(torch.float32) - w).norm() / w.norm()).item()


def main() -> None:
    ap = BenchParser("quant_error", __doc__, list(MATRICES), what="matrices", group="quality")
    ap.add_argument("--shape", default="1024x4096", help="N x K of each test matrix")
    args = ap.parse_args()
    n, k = (int(v) for v in args.shape.split("x"))
    with bench_lock(enabled=not args.no_lock):
        info = machine_info()
        rows = measure(matrices(n, k, args.rows))
    write_results(args.out, args.name, "Weight reconstruction error: RTN vs optimised", info, rows,
                  f"{summary(rows)}\n" + markdown_table(rows, COLS, ".4f"),
                  f"Matrices {n}x{k}, fixed seeds. Error = ||W_q - W||_F / ||W||_F; ratio = optimised / RTN; "
                  f"*_s = seconds to quantize the matrix.")


def measure(mats: dict[str, torch.Tensor]) -> list[dict]:
    """One row per matrix, code book and group size: both quantizers' errors and times."""
    rows = []
    for dist, w in mats.items():
        for cb in sorted(CODEBOOKS):
            for group in GROUPS:
                t0 = time.perf_counter()
                rtn = rel_err(w, quantize_rtn(w, cb, group))
                t1 = time.perf_counter()
                opt = rel_err(w, quantize_optimized(w, cb, group))
                t2 = time.perf_counter()
                rows.append(dict(matrix=dist, codebook=cb, bits=CODEBOOKS[cb].bits, group=group if group > 0 else "row",
                                 rtn=rtn, optimized=opt, ratio=opt / rtn, rtn_s=t1 - t0, optimized_s=t2 - t1))
                print(f"{dist} {cb} g{group}: rtn {rtn:.4f} optimized {opt:.4f} ({opt / rtn:.2f}x)", flush=True)
    return rows


def summary(rows: list[dict]) -> str:
    """The summary lines above the table: the 1-bit and 2-bit ranges and each code book at group 64."""
    two = [r for r in rows if r["bits"] == 2]
    one = [r for r in rows if r["bits"] == 1]
    return (
        (f"- 1-bit (`binary`): optimised / RTN error {min(r['ratio'] for r in one):.2f}-{max(r['ratio'] for r in one):.2f}: "
         "RTN's sign codes with the mean-|w| scale are already the least-squares fit, so the optimised fit "
         "has nothing to improve\n" if one else "")
        + f"- 2-bit code books, every matrix and group size: optimised / RTN error "
        f"{min(r['ratio'] for r in two):.2f}-{max(r['ratio'] for r in two):.2f} "
        f"({100 * (1 - max(r['ratio'] for r in two)):.0f}-{100 * (1 - min(r['ratio'] for r in two)):.0f}% lower)\n"
        + "".join(
            f"- {cb}, group 64: " + ", ".join(
                f"{r['matrix']} {r['rtn']:.4f} -> {r['optimized']:.4f}" for r in rows if r["codebook"] == cb and r["group"] == 64)
            + "\n" for cb in sorted(CODEBOOKS))
    )


if __name__ == "__main__":
    main()
