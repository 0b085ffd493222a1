"""A/B of two versions of the Triton ``lowbit_linear`` kernels, interleaved in one process on one GPU:
per shape and token count, the same packed weights, the same activations, one CUDA graph per version.

    rm -rf /tmp/base && mkdir /tmp/base && git archive REV shared/aipc_kernels/triton | tar -x -C /tmp/base
    python bench/triton_ab.py --base /tmp/base/shared/aipc_kernels/triton/lowbit_linear.py --base-name REV --name NAME

``--base``: a module file or package directory that exports ``lowbit_linear_triton`` (``triton/lowbit_linear.py``
before the split, ``triton/lowbit/`` after); it is loaded as a submodule of the working tree's
``aipc_kernels.gpu.triton``, so its relative imports (formats, packing, ops) resolve to the working tree's modules
(the packed layout must be the same) and its shipped configs are the JSON beside it. Each version's calls over
weight copies >= 4x the L2 are captured once (as ``bench/gemv_gpu.py`` times its rows); rounds alternate the
order (base first, then new first, ...), each round's time is the median of 5 replays, and the median round is
reported with the spread of the rounds. ``same_bits``: the two versions' outputs are bit-identical;
``repeat_bits``: the working tree's output is bit-identical to itself called again (not so where the
config adds split-K partials with float atomics, in no fixed order); ``same_bits_det``: the two versions
bit-identical under ``torch.use_deterministic_algorithms`` (split-K then takes the ordered ticket path).
``new_over_base`` > 1: the working tree is slower. Rows: the shapes of ``bench/llama_shapes.py``.
"""
from __future__ import annotations

import importlib.util
import statistics
import sys
from pathlib import Path

import torch

from aipc_kernels.lowbit.packing import PackedLowBit, pack_for_triton
from aipc_kernels.lowbit.quantizers import quantize_rtn
from aipc_kernels.gpu.triton import lowbit as new
from gemv_gpu import GROUP, capture, n_copies, replay_seconds  # bench/ is on sys.path when run as a script
from harness import BenchParser, bench_lock, gpu_info, machine_info, markdown_table, write_results
from llama_shapes import SHAPES


def load_base(path: str):
    """The baseline version, as the module ``aipc_kernels.gpu.triton._ab_base``."""
    p = Path(path)
    name = "aipc_kernels.gpu.triton._ab_base"
    if p.is_dir():
        spec = importlib.util.spec_from_file_location(name, p / "__init__.py", submodule_search_locations=[str(p)])
    else:
        spec = importlib.util.spec_from_file_location(name, p)
    if spec is None or not p.exists():
        raise ValueError(f"--base {path}: not a module file or package directory")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    if not hasattr(mod, "lowbit_linear_triton"):
        raise ValueError(f"--base {path}: exports no lowbit_linear_triton")
    return mod


def main() -> None:
    ap = BenchParser("triton_ab", __doc__, list(SHAPES), what="shapes", group="gpu")
    ap.add_argument("--base", required=True, help="the baseline's triton linear module file or package directory")
    ap.add_argument("--base-name", default="base", help="what the baseline is (a revision)")
    ap.add_argument("--m", default="1,16,1024")
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()
    base = load_base(args.base)
    torch.manual_seed(0)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    rows = []
    with bench_lock(enabled=not args.no_lock):
        info = machine_info(**gpu_info())
        for label in args.rows:
            N, K = SHAPES[label]
            W = (torch.randn(N, K, device="cuda") * 0.02).to(torch.bfloat16)
            p = pack_for_triton(quantize_rtn(W.float(), "int2", GROUP))  # gemv_gpu's ours_w2a8 row
            ws = [p] + [PackedLowBit(p.layout, p.qweight.clone(), p.scales.clone(), None, p.codebook, p.group_size, N, K)
                        for _ in range(n_copies(p.nbytes(), l2) - 1)]  # fmt: skip
            for M in (int(m) for m in args.m.split(",")):
                x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
                same = torch.equal(base.lowbit_linear_triton(x, p), new.lowbit_linear_triton(x, p))
                repeat = torch.equal(new.lowbit_linear_triton(x, p), new.lowbit_linear_triton(x, p))
                torch.use_deterministic_algorithms(True, warn_only=True)
                try:
                    same_det = torch.equal(base.lowbit_linear_triton(x, p), new.lowbit_linear_triton(x, p))
                finally:
                    torch.use_deterministic_algorithms(False)
                graphs = {v: capture([lambda w=w, f=m.lowbit_linear_triton: f(x, w) for w in ws]) for v, m in (("base", base), ("new", new))}
                t: dict[str, list[float]] = {"base": [], "new": []}
                for r in range(args.rounds):
                    for v in ("base", "new") if r % 2 == 0 else ("new", "base"):
                        t[v].append(replay_seconds(graphs[v], len(ws)) * 1e6)
                del graphs
                torch.cuda.empty_cache()
                b, n = statistics.median(t["base"]), statistics.median(t["new"])
                cfg = new.cached_configs(new.device_name(x.device)).get(new.config_key(M, N, K, GROUP, 2))
                kernel = "heuristic" if cfg is None else cfg["KERNEL"] + (" atomic split-K" if cfg.get("ATOMIC") else "")
                rows.append(dict(shape=label, M=M, base_us=b, new_us=n, new_over_base=n / b,
                                 base_spread=(max(t["base"]) - min(t["base"])) / b, new_spread=(max(t["new"]) - min(t["new"])) / n,
                                 same_bits="yes" if same else "NO", repeat_bits="yes" if repeat else "NO",
                                 same_bits_det="yes" if same_det else "NO", copies=len(ws), rounds_base=t["base"], rounds_new=t["new"],
                                 kernel=kernel, config=cfg or "heuristic"))  # fmt: skip
                print({k: v for k, v in rows[-1].items() if not k.startswith("rounds")}, flush=True)
            del W, p, ws
            torch.cuda.empty_cache()
    notes = (f"int2 code book, group {GROUP}, fp16 scales, bf16 activations (bench/gemv_gpu.py's ours_w2a8 weights), "
             f"lowbit_linear_triton of each version called directly; CUDA-graph replay over weight copies >= 4x L2; "
             f"{args.rounds} rounds alternating which version goes first, each the median of 5 replays; the median "
             f"round is shown, spread = (max - min) / median of the rounds. base = {args.base_name}, new = the working "
             f"tree. new_over_base > 1: the working tree is slower.")
    cols = ["shape", "M", "base_us", "new_us", "new_over_base", "base_spread", "new_spread", "same_bits", "repeat_bits", "same_bits_det", "kernel"]
    write_results(args.out, args.name, f"Triton lowbit_linear A/B: working tree vs {args.base_name}", info, rows,
                  markdown_table(rows, cols, ".3f"), notes)


if __name__ == "__main__":
    main()
