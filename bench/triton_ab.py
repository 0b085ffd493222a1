"""A/B of two versions of the Triton ``lowbit_linear`` kernels, interleaved in one process on one GPU:
per shape and token count, the same packed weights, the same activations, one CUDA graph per version.

    rm -rf /tmp/base && mkdir /tmp/base && git archive REV shared/aipc_kernels/gpu/triton | tar -x -C /tmp/base
    python bench/triton_ab.py --base /tmp/base/shared/aipc_kernels/gpu/triton/lowbit/progressive.py --kernel progressive \
        --form w2a8_prog --m 64,256 --base-name REV --name NAME

``--kernel K`` (one kernel module of ``registry.KERNELS``): ``--base`` is that module's file at the base
revision, loaded beside the working tree's as ``lowbit._ab_base_K``; its imports of the other modules resolve to
the working tree's, so the two versions differ in that module's code only, and each runs through its own
``launch()`` with the same config (``--config``, else the working tree's selected config where it is that
kernel's, else the kernel's heuristic). Without ``--kernel``, ``--base`` is a module file that exports
``lowbit_linear_triton`` (the single-file ``triton/lowbit_linear.py`` of revisions before the package split,
whose relative imports resolve to the working tree's modules) and both versions run the whole op.
``--config-extra``: fields merged into every cell's config (e.g. a field only the working tree's version reads).
``--base-kernel K2`` (instead of ``--base``): an A/B of two kernels of the working tree, ``--kernel``'s module
(``--config``: one JSON config or a list, a row each) against ``K2``'s with its selected config (the shipped or
cached one where it is K2's, else K2's heuristic); ``--base-kernel shipped``: against the selected config,
whatever its kernel.
``--form``: the weights (int2 g64, or the progressive form's ``w2a8_prog`` / ``w4a8_prog``, as bench/gemv_gpu.py
makes them). Each version's calls over weight copies >= 4x the L2 are captured once (as ``bench/gemv_gpu.py``
times its rows); rounds alternate the order (base first, then new first, ...), each round's time is the median
of 5 replays, and the median round is reported with the spread of the rounds. ``same_bits``: the two
versions' outputs are bit-identical; ``repeat_bits``: the working tree's output is bit-identical to itself
called again (not so where the config adds split-K partials with float atomics, in no fixed order);
``same_bits_det``: the two versions bit-identical under ``torch.use_deterministic_algorithms`` (split-K then
takes the ordered ticket path). ``new_over_base`` > 1: the working tree is slower. Rows: the shapes of
``bench/llama_shapes.py``.
"""
from __future__ import annotations

import importlib.util
import json
import statistics
import sys
from pathlib import Path

import torch

from aipc_kernels.lowbit.packing import PackedLowBit, pack_for_triton
from aipc_kernels.lowbit.quantizers import quantize_rtn
from aipc_kernels.gpu.triton import lowbit as new
from gemv_gpu import GROUP, PROGRESSIVE_FORMATS, capture, n_copies, progressive_weight, replay_seconds  # bench/ is on sys.path when run as a script
from harness import BenchParser, bench_lock, gpu_info, machine_info, markdown_table, write_results
from llama_shapes import SHAPES


def _exec_module(name: str, spec, path: str, what: str):
    """The module of ``spec`` under ``name`` (a ValueError naming ``path`` where there is none)."""
    if spec is None:
        raise ValueError(f"--base {path}: not {what}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def load_base(path: str):
    """The baseline version, as the module ``aipc_kernels.gpu.triton._ab_base``."""
    p = Path(path)
    name = "aipc_kernels.gpu.triton._ab_base"
    if p.is_dir():
        spec = importlib.util.spec_from_file_location(name, p / "__init__.py", submodule_search_locations=[str(p)])
    else:
        spec = importlib.util.spec_from_file_location(name, p) if p.exists() else None
    mod = _exec_module(name, spec, path, "a module file or package directory")
    if not hasattr(mod, "lowbit_linear_triton"):
        raise ValueError(f"--base {path}: exports no lowbit_linear_triton")
    return mod


def load_kernel(path: str, kernel: str):
    """The baseline version of one kernel module (``registry.KERNELS[kernel]``'s file at another revision), as
    the module ``aipc_kernels.gpu.triton.lowbit._ab_base_<kernel>``: its imports of the other modules resolve
    to the working tree's, so only this module's code differs."""
    name = f"aipc_kernels.gpu.triton.lowbit._ab_base_{kernel}"
    spec = importlib.util.spec_from_file_location(name, path) if Path(path).is_file() else None
    mod = _exec_module(name, spec, path, "a module file (with --kernel, the kernel module's file at the base revision)")
    if not hasattr(mod, "launch"):
        raise ValueError(f"--base {path}: has no launch(); not a kernel module")
    return mod


def ab_weight(form: str, N: int, K: int) -> PackedLowBit:
    """The packed weight of ``--form``: bench/gemv_gpu.py's ``ours_w2a8`` weights (int2 g64) or its progressive
    rows' (``w2a8_prog``: min2 g64, ``w4a8_prog``: min4 g128)."""
    W = (torch.randn(N, K, device="cuda") * 0.02).to(torch.bfloat16)
    if form == "int2":
        return pack_for_triton(quantize_rtn(W.float(), "int2", GROUP))
    return pack_for_triton(progressive_weight(W, *PROGRESSIVE_FORMATS["ours_" + form]))


def base_config(base_kernel: str, selected: dict | None, M: int, N: int, K: int, p: PackedLowBit) -> dict:
    """The baseline's config of ``--base-kernel``: the selected (shipped or cached) config where it is that kernel's
    (``shipped``: whatever its kernel), else that kernel's heuristic (``shipped``: the untuned choice)."""
    from aipc_kernels.gpu.triton.lowbit import registry

    if selected is not None and base_kernel in ("shipped", selected["KERNEL"]):
        return selected
    if base_kernel == "shipped":
        return registry.heuristic_config(M, N, K, p.bits, p.qweight.device, progressive=p.supers is not None)
    return registry.kernel_of({"KERNEL": base_kernel}).heuristic(M, N, K, p.bits, p.qweight.device)


def main() -> None:
    ap = BenchParser("triton_ab", __doc__, list(SHAPES), what="shapes", group="gpu")
    ap.add_argument("--base", default=None, help="the baseline's triton linear module file or package directory "
                    "(with --kernel: that kernel module's file)")  # fmt: skip
    ap.add_argument("--base-kernel", default=None, help="with --kernel, instead of --base: the working tree's kernel to "
                    "compare with (its selected config), or 'shipped' (the selected config, whatever its kernel)")  # fmt: skip
    ap.add_argument("--base-name", default="base", help="what the baseline is (a revision)")
    ap.add_argument("--m", default="1,16,1024")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--form", default="int2", choices=("int2", "w2a8_prog", "w4a8_prog"),
                    help="the weights: int2 g64, or the progressive form (min2 g64 / min4 g128)")  # fmt: skip
    ap.add_argument("--kernel", default=None, help="A/B one kernel module (a registry.KERNELS name) through its launch()")
    ap.add_argument("--config", default=None, help="with --kernel: a JSON config for every cell (default: the "
                    "working tree's selected config where it is that kernel's, else the kernel's heuristic)")  # fmt: skip
    ap.add_argument("--config-extra", default=None, help="with --kernel: JSON fields merged into each cell's config "
                    "(both versions get them; a field the base does not know, it ignores)")  # fmt: skip
    args = ap.parse_args()
    if (args.config or args.config_extra or args.base_kernel) and not args.kernel:
        ap.error("--config, --config-extra and --base-kernel take --kernel")
    if (args.base is None) == (args.base_kernel is None):
        ap.error("give one of --base (a file of another revision) and --base-kernel (a kernel of the working tree)")
    extra = json.loads(args.config_extra) if args.config_extra else {}
    forced = json.loads(args.config) if args.config else None
    if args.kernel:
        from aipc_kernels.gpu.triton.lowbit import registry

        new_kernel = registry.kernel_of({"KERNEL": args.kernel})
        base = load_kernel(args.base, args.kernel) if args.base else None
    else:
        base = load_base(args.base)
    torch.manual_seed(0)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    rows = []
    with bench_lock(enabled=not args.no_lock):
        info = machine_info(**gpu_info())
        for label in args.rows:
            N, K = SHAPES[label]
            p = ab_weight(args.form, N, K)
            ws = [p] + [p.clone() for _ in range(n_copies(p.nbytes(), l2) - 1)]
            for M, forced_one in ((int(m), f) for m in args.m.split(",") for f in (forced if isinstance(forced, list) else [forced])):
                x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
                cfg = new.cached_configs(new.device_name(x.device)).get(
                    new.config_key(M, N, K, p.group_size, p.bits, p.supers is not None))
                base_cfg = None
                if args.kernel:
                    if args.base_kernel:
                        base_cfg = base_config(args.base_kernel, cfg, M, N, K, p)
                    if forced_one is None and (cfg is None or cfg["KERNEL"] != args.kernel):
                        cfg = new_kernel.heuristic(M, N, K, p.bits, x.device)
                    cfg = dict(forced_one or cfg, **extra)
                    ys = {v: torch.empty(M, N, device="cuda", dtype=x.dtype) for v in ("base", "new")}
                    if base_cfg is None:
                        base_fn = lambda x, w, c=cfg: base.launch(x, w, None, ys["base"], c) or ys["base"]  # noqa: E731
                    else:
                        base_fn = lambda x, w, c=base_cfg: registry.launch(x, w, None, ys["base"], c) or ys["base"]  # noqa: E731
                    fns = {"base": base_fn,
                           "new": lambda x, w, c=cfg: new_kernel.launch(x, w, None, ys["new"], c) or ys["new"]}  # fmt: skip
                    kernel = cfg["KERNEL"]
                else:
                    fns = {"base": base.lowbit_linear_triton, "new": new.lowbit_linear_triton}
                    kernel = "heuristic" if cfg is None else cfg["KERNEL"] + (" atomic split-K" if cfg.get("ATOMIC") else "")
                same = torch.equal(fns["base"](x, p).clone(), fns["new"](x, p).clone())
                repeat = torch.equal(fns["new"](x, p).clone(), fns["new"](x, p).clone())
                torch.use_deterministic_algorithms(True, warn_only=True)
                try:
                    same_det = torch.equal(fns["base"](x, p).clone(), fns["new"](x, p).clone())
                finally:
                    torch.use_deterministic_algorithms(False)
                graphs = {v: capture([lambda w=w, f=fns[v]: f(x, w) for w in ws]) for v in ("base", "new")}
                t: dict[str, list[float]] = {"base": [], "new": []}
                for r in range(args.rounds):
                    for v in ("base", "new") if r % 2 == 0 else ("new", "base"):
                        t[v].append(replay_seconds(graphs[v], len(ws)) * 1e6)
                del graphs
                torch.cuda.empty_cache()
                b, n = statistics.median(t["base"]), statistics.median(t["new"])
                rows.append(dict(shape=label, M=M, base_us=b, new_us=n, new_over_base=n / b,
                                 base_spread=(max(t["base"]) - min(t["base"])) / b, new_spread=(max(t["new"]) - min(t["new"])) / n,
                                 same_bits="yes" if same else "NO", repeat_bits="yes" if repeat else "NO",
                                 same_bits_det="yes" if same_det else "NO", copies=len(ws), rounds_base=t["base"], rounds_new=t["new"],
                                 kernel=kernel, config=cfg or "heuristic", base_config=base_cfg or "as new"))  # fmt: skip
                print({k: v for k, v in rows[-1].items() if not k.startswith("rounds")}, flush=True)
            del p, ws
            torch.cuda.empty_cache()
    what = {"int2": f"int2 code book, group {GROUP}, fp16 scales (bench/gemv_gpu.py's ours_w2a8 weights)",
            "w2a8_prog": "the progressive form, min2 group 64 (bench/gemv_gpu.py's ours_w2a8_prog weights)",
            "w4a8_prog": "the progressive form, min4 group 128 (bench/gemv_gpu.py's ours_w4a8_prog weights)"}[args.form]  # fmt: skip
    how = (f"the {args.kernel} kernel module's launch() of each version with the same config (the column config)"
           if args.kernel else "lowbit_linear_triton of each version called directly")
    if args.base_kernel:
        how = (f"base = the working tree's {args.base_kernel} kernel with its selected config (column base_config), "
               f"new = its {args.kernel} kernel with the column config, each through its launch()")
        args.base_name = args.base_name if args.base_name != "base" else f"{args.base_kernel} (working tree)"
    notes = (f"{what}, bf16 activations, {how}; CUDA-graph replay over weight copies >= 4x L2; "
             f"{args.rounds} rounds alternating which version goes first, each the median of 5 replays; the median "
             f"round is shown, spread = (max - min) / median of the rounds. base = {args.base_name}, new = the working "
             f"tree. new_over_base > 1: the working tree is slower.")
    cols = ["shape", "M", "base_us", "new_us", "new_over_base", "base_spread", "new_spread", "same_bits", "repeat_bits",
            "same_bits_det", "kernel", "config"] + (["base_config"] if args.base_kernel else [])  # fmt: skip
    write_results(args.out, args.name, f"Triton lowbit_linear A/B: working tree vs {args.base_name}", info, rows,
                  markdown_table(rows, cols, ".3f"), notes)


if __name__ == "__main__":
    main()
