"""Where the time of ``aipc::lowbit_linear`` goes at small M on the GPU, each part timed as
``bench/gemv_gpu.py`` times its rows (CUDA-graph replay over weight copies >= 4x L2, so the weights
stream from HBM as in a forward pass), beside the read-only floor of the same bytes:

    python bench/kernel_times_gpu.py [--m 1,16] [--shapes '8B*'] [--sweep] [--vary L2P=0,1] [--form int2] [--out bench/results/gpu] [--name N]

Rows per shape and M (``--form int2``: int2 code book, group 64, fp16 scales; ``w2a8_prog``: the progressive
two-level form, ``min2`` group 64; bf16 activations, ``bench/gemv_gpu.py``'s weights):
- ``op``: the op with the config it selects (shipped or tuned), programmatic dependent launch (PDL) as
  that config says;
- ``op_nopdl``: the same config with PDL off (the two kernels serialised);
- ``act``: the activation pass alone (M = 1: the packed pre-pass; M > 1: the row pass);
- ``kernel``: the GEMV/GEMM alone, on activation codes computed once before the graph (PDL off; for
  ``expand``, its weight expansion and int8 GEMM);
- ``expand``: ``expand``'s weight expansion alone (the int8 levels written), where the selected config is
  ``expand``'s;
- ``kernel_l2``: the same on one weight copy replayed, L2-warm: what the op's tuner times;
- ``read``: ``bench/gemv_gpu.py``'s ``read`` row (the fastest read-only kernel over the same bytes);
- ``bf16``, ``int8_mm`` (M > 16): ``bench/gemv_gpu.py``'s rows of the same names (``F.linear`` on the bf16
  weight; ``torch._int_mm`` on int8 activations and an int8 weight, none of the low-bit work), timed the
  same way in the same run: the references the op's parts add up against.
``--sweep``: ``kernel`` and ``kernel_l2`` for every config the tuner times at this M (its kernels'
spaces), the five fastest by each timing. ``--vary KEY=V1,V2``: ``op``, ``kernel`` and ``kernel_l2`` again for
the selected config with each value of the field (and every sweep config with each value).

(Before issue 20's decomposition this script timed the kernels with torch.profiler, L2-warm and without
a graph; those numbers made the M = 1 GEMV look within 1.2x of a bare read. It is not, from HBM.)
"""
from __future__ import annotations

import sys
import time

import torch

import gemv_gpu as gb  # bench/ is on sys.path when run as a script
from aipc_kernels.gpu.triton.lowbit import expand, group, progressive, stream
from aipc_kernels.gpu.triton.lowbit import linear as tlin
from aipc_kernels.gpu.triton.lowbit.activation import quantize_row_packed, quantize_rows
from aipc_kernels.gpu.triton.lowbit.tuning import candidates, select_config
from harness import BenchParser, bench_lock, gpu_info, machine_info, select, write_results
from llama_shapes import SHAPES

PARTS = ("op", "op_nopdl", "act", "expand", "kernel", "kernel_l2", "read", "bf16", "int8_mm")
DEFAULT_PARTS = PARTS[:7]
FORMS = {"int2": None, "w2a8_prog": "ours_w2a8_prog"}  # --form: gemv_gpu's progressive row of that form, or int2
NOT_LAUNCH = ("us", "by_kernel", "timed")  # a shipped config's record of its timing, not a launch field


class _FixedActivations:
    """While active, the kernels' activation passes return codes computed once (the kernel timed alone)."""

    def __init__(self, x2: torch.Tensor, Kp: int):
        self.one = quantize_row_packed(x2, Kp, False) if x2.shape[0] == 1 else None
        self.rows = quantize_rows(x2, Kp, sums=False)

    def __enter__(self):
        self.saved = (stream.quantize_row_packed, group.quantize_rows, progressive.quantize_rows, expand._prepass)
        stream.quantize_row_packed = lambda *a, **k: self.one
        group.quantize_rows = progressive.quantize_rows = lambda *a, **k: self.rows
        expand._prepass = self._expansion_only  # expand's launch of the activation pass and the first levels
        return self

    def _expansion_only(self, x2, Kp, act_amax, weight, n1, w8):
        """``expand._prepass`` without its activation half: the first row chunk's levels, the fixed codes."""
        expand.expand_levels(weight, 0, n1, w8)
        return self.rows[0], self.rows[1]

    def __exit__(self, *exc):
        stream.quantize_row_packed, group.quantize_rows, progressive.quantize_rows, expand._prepass = self.saved


def _us(calls: list) -> float:
    return gb.time_rotating(calls) * 1e6


def measure(sname: str, M: int, l2: int, parts: list[str], sweep: bool, vary: tuple[str, list[int]] | None = None,
            form: str = "int2") -> dict:
    """The ``parts`` of one shape at one M (the selected config with each ``vary`` value, the sweep's five
    fastest by each timing)."""
    N, K = SHAPES[sname]
    W = (torch.randn(N, K, device="cuda") * 0.02).to(torch.bfloat16)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    state: dict = {}
    if FORMS[form]:
        calls, _, copies = gb.row_ours_progressive(W, x, l2, state, FORMS[form])
    else:
        calls, _, copies = gb.row_ours(W, x, l2, state)
    ws = [f.__defaults__[0] for f in calls]  # row_ours' weight copies
    Kp = ws[0].qweight.shape[1] * 4
    y = torch.empty(M, N, device="cuda", dtype=x.dtype)
    cfg = select_config(x, ws[0], None, y)
    nopdl = dict(cfg, PDL=0)

    def run(c, w):
        return tlin.lowbit_linear_triton(x, w, config=c)

    e = {"shape": sname, "N": N, "K": K, "M": M, "copies": copies, "config": {k: v for k, v in cfg.items() if k not in NOT_LAUNCH}}
    if "op" in parts:
        e["op"] = _us([lambda w=w: run(cfg, w) for w in ws])
    if "op_nopdl" in parts:
        e["op_nopdl"] = _us([lambda w=w: run(nopdl, w) for w in ws])
    if "act" in parts:
        act = (lambda: quantize_row_packed(x, Kp, False)) if M == 1 else (lambda: quantize_rows(x, Kp, sums=False))
        e["act"] = _us([act for _ in ws])
    if "expand" in parts and cfg["KERNEL"] == expand.NAME:
        e["expand"] = _us([lambda w=w: expand.expand_levels(w) for w in ws])
    variants = [dict(cfg, **{vary[0]: v}) for v in vary[1]] if vary else []
    e["variants"] = [dict(config={k: v for k, v in c.items() if k not in NOT_LAUNCH}, op=_us([lambda w=w, c=c: run(c, w) for w in ws]))
                     for c in variants]
    with _FixedActivations(x, Kp):
        for r, c in zip(e["variants"], variants):
            c = dict(c, PDL=0)
            r["kernel"] = _us([lambda w=w, c=c: run(c, w) for w in ws])
            r["kernel_l2"] = _us([lambda c=c: run(c, ws[0]) for _ in ws])
        if "kernel" in parts:
            e["kernel"] = _us([lambda w=w: run(nopdl, w) for w in ws])
        if "kernel_l2" in parts:
            e["kernel_l2"] = _us([lambda: run(nopdl, ws[0]) for _ in ws])
        if sweep:
            swept = candidates(M, ws[0])
            if vary:
                swept = [dict(c, **{vary[0]: v}) for c in swept for v in vary[1]]
            rows = []
            for c in swept:
                c = dict(c, PDL=0)
                try:
                    rows.append((_us([lambda w=w, c=c: run(c, w) for w in ws]), _us([lambda c=c: run(c, ws[0]) for _ in ws]), c))
                except Exception:  # noqa: BLE001 - a config the device cannot compile (shared memory, registers)
                    continue
            e["sweep_rotating"] = [dict(us=a, us_l2=b, config=c) for a, b, c in sorted(rows, key=lambda r: r[0])[:5]]
            e["sweep_l2"] = [dict(us=a, us_l2=b, config=c) for a, b, c in sorted(rows, key=lambda r: r[1])[:5]]
            e["sweep_configs"] = len(rows)
    if "read" in parts:
        read_calls, _, _ = gb.row_read(W, x, l2, state)
        e["read"] = _us(read_calls)
        e["read_config"] = state.get("read_config")
    if "bf16" in parts:
        e["bf16"] = _us(gb.row_bf16(W, x, l2)[0])
    if "int8_mm" in parts and M > 16:
        e["int8_mm"] = _us(gb.row_int8_mm(W, x, l2)[0])
    return e


def _f(e: dict, key: str) -> str:
    return f"{e[key]:.2f}" if key in e else ""


def _ratio(e: dict, key: str) -> str:
    return f"{e[key] / e['read']:.2f}" if key in e and "read" in e else ""


def _cfg(c: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in c.items() if k not in ("XPACK", "num_stages", "PDL"))


def main() -> int:
    ap = BenchParser("kernel_times_gpu", __doc__, PARTS, DEFAULT_PARTS, group="gpu")
    ap.add_argument("--m", default="1,16")
    ap.add_argument("--shapes", default="8B*", help="comma list of shapes, names or patterns such as '8B*'")
    ap.add_argument("--sweep", action="store_true", help="time every config of the M's kernels, rotating and L2-warm")
    ap.add_argument("--form", default="int2", choices=list(FORMS), help="the weights' form (see above)")
    ap.add_argument("--vary", default="", help="KEY=V1,V2: the selected (and every swept) config with each value of an integer field")
    args = ap.parse_args()
    vary = None
    if args.vary:
        key, _, vals = args.vary.partition("=")
        try:
            vary = (key, [int(v) for v in vals.split(",")])
        except ValueError:
            ap.error(f"--vary {args.vary!r}: give KEY=V1,V2 with integer values, e.g. --vary L2P=0,1")
    Ms = [int(m) for m in args.m.split(",")]
    shapes = select(args.shapes, list(SHAPES), "--shapes")
    with bench_lock(enabled=not args.no_lock):
        torch.manual_seed(0)
        info = machine_info(**gpu_info())
        l2 = torch.cuda.get_device_properties(0).L2_cache_size
        results = []
        for sname in shapes:
            for M in Ms:
                t0 = time.time()
                e = measure(sname, M, l2, args.rows, args.sweep, vary, args.form)
                results.append(e)
                print(f"[parts] {sname} M={M}: " + " ".join(f"{p} {_f(e, p)}" for p in args.rows) + f" ({time.time() - t0:.0f} s)", flush=True)
        md = ["us per call, each part a CUDA-graph replay over weight copies >= 4x L2 (median of 5 replays); "
              "x_read = part / read. op = the selected config as the bench runs it; kernel = the GEMV/GEMM alone.", "",
              "| shape | M | config | " + " | ".join(PARTS) + " | op x_read | kernel x_read |",
              "|---|---|---|" + "---|" * (len(PARTS) + 2)]
        for e in results:
            md.append(f"| {e['shape']} | {e['M']} | {_cfg(e['config'])} | " + " | ".join(_f(e, p) for p in PARTS)
                      + f" | {_ratio(e, 'op')} | {_ratio(e, 'kernel')} |")
        if vary:
            md += ["", f"The selected config with each value of {vary[0]} (op with the config's PDL; kernel and kernel_l2 alone, PDL off).", "",
                   "| shape | M | config | op | kernel | kernel_l2 | op x_read | kernel x_read |", "|---|---|---|---|---|---|---|---|"]
            for e in results:
                for r in e["variants"]:
                    rr = dict(r, read=e.get("read"))
                    md.append(f"| {e['shape']} | {e['M']} | {_cfg(r['config'])} | {_f(r, 'op')} | {_f(r, 'kernel')} | {_f(r, 'kernel_l2')} | "
                              + (f"{_ratio(rr, 'op')} | {_ratio(rr, 'kernel')} |" if rr["read"] else " | |"))
        if args.sweep:
            md += ["", "Sweep (the kernel alone, PDL off): the five fastest configs streaming from HBM (rotating) and L2-warm (one copy).", "",
                   "| shape | M | by | us rotating | us L2-warm | config |", "|---|---|---|---|---|---|"]
            for e in results:
                for by in ("rotating", "l2"):
                    for r in e[f"sweep_{by}"]:
                        md.append(f"| {e['shape']} | {e['M']} | {by} | {r['us']:.2f} | {r['us_l2']:.2f} | {_cfg(r['config'])} |")
        write_results(args.out, args.name, f"Where the op's time goes (aipc::lowbit_linear, Triton; weights {args.form})", info, results, "\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
