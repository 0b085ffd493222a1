"""What calling the CPU kernel through a torch op costs at decode (M=1), and the bound it puts on the op.

    python bench/op_floor.py [--rows '8B q/o*'] [--out bench/results/cpu]

Rows: the Llama-3-8B shapes by default (``--rows '1B*'``: Llama-3.2-1B's). Per shape, weights rotated over DRAM-resident copies, in one run:
  kernel - our C kernel alone, timed in C (the probes' ``time_lowbit_linear``), as in bench/gemv_cpu.py;
  op     - ``torch.ops.aipc.lowbit_linear``, the general op (operands checked in Python on every call), timed
           from Python;
  planned - the planned op the plugins call (``aipc::lowbit_linear_cpu``: operands checked once, a C++ kernel
           registered through PyTorch's stable ABI calling the C kernel), timed from Python;
  floor  - a torch op with the same schema whose CPU kernel is a Python function that does nothing but
           call the C kernel on a pre-built argument vector and return a pre-allocated output: the least
           any op registered from Python (no torch C++ headers) can cost.
  ctypes - the same C kernel on the same argument vectors, called through ctypes from the same Python loop (no
           torch op): what the interpreter's loop alone adds to the kernel;
  alias  - ``torch.ops.aten.alias`` (a torch op that does nothing but make a view) after each ctypes call, less
           the ctypes row (``alias_after_kernel_us``), against the same op in a loop of its own (``alias_hot_us``):
           what any torch dispatch costs once a kernel has streamed its weights through the caches.
The dispatch runs after a kernel streamed megabytes of weights, with the caches full of them, as in a
decode step. Bound = the weight bytes / (kernel + floor) as a share of the read bandwidth probe: the most
an op registered from Python can reach on this machine. ``planned_over_kernel``: the planned op's time over the
kernel's alone (the target: at most 1.10 at M=1 on the 1B shapes).
"""
from __future__ import annotations

import torch

from aipc_kernels.core import native
import aipc_kernels.lowbit.ops  # noqa: F401  (registers torch.ops.aipc.lowbit_linear)
from aipc_kernels.lowbit.packing import pack_for_cpu
from aipc_kernels.lowbit.planned_ops import plan_cpu_call
from aipc_kernels.lowbit.quantizers import quantize_rtn
from gemv_cpu import kernel_args, time_rotating  # bench/ is on sys.path when run as a script
from harness import BenchParser, bench_lock, machine_info, markdown_table, native_probes, read_bandwidth, write_results
from llama_shapes import SHAPES

_FLOOR_LIB = torch.library.Library("aipc_bench", "DEF")
_FLOOR_LIB.define(
    "floor_linear(Tensor x, Tensor qweight, Tensor scales, Tensor? zeros, Tensor? bias, str layout, "
    "str codebook, int group_size, int out_features, int act_group) -> Tensor"
)
_PLANS: dict[int, tuple] = {}  # qweight address -> (argument vector address, output)
_call = native._lib().aipc_lowbit_linear_v


def _floor_cpu(x, qweight, scales, zeros, bias, layout, codebook, group_size, out_features, act_group):
    address, y = _PLANS[qweight.data_ptr()]
    _call(address)
    return y


_FLOOR_LIB.impl("floor_linear", _floor_cpu, "CPU")


def main() -> None:
    ap = BenchParser("op_floor", __doc__, list(SHAPES), [s for s in SHAPES if s.startswith("8B")], what="shapes",
                     group="cpu")  # every shape; the 8B ones by default
    ap.add_argument("--rotate-gb", type=float, default=1.2)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.manual_seed(0)
    with bench_lock(enabled=not args.no_lock):
        info = machine_info()
        rows = [measure(label, args.rotate_gb, args.rounds) for label in args.rows]
    cols = ["shape", "mb", "read_gbs", "kernel_us", "planned_us", "op_us", "floor_us", "ctypes_us", "planned_overhead_us",
            "op_overhead_us", "floor_overhead_us", "ctypes_overhead_us", "alias_after_kernel_us", "alias_hot_us",
            "planned_over_kernel", "kernel_pct", "planned_pct", "op_pct", "bound_pct"]
    notes = (f"{torch.get_num_threads()} threads. int2 affine group 64, weights rotated over {args.rotate_gb:.1f} GB, "
             f"best of {args.rounds} rounds, ISA {native.get_isa()}. kernel = C kernel timed in C; planned = the planned op "
             f"the plugins call (`torch.ops.aipc.lowbit_linear_cpu`, C++ per call) timed from Python; op = the general "
             f"op `torch.ops.aipc.lowbit_linear` timed from Python; floor = a Python-registered op that only calls the C kernel (pre-built arguments, "
             f"pre-allocated output); ctypes = the C kernel through ctypes from the same Python loop; alias_after_kernel = "
             f"`torch.ops.aten.alias` after each ctypes call less the ctypes row, alias_hot = the same op alone in a loop; *_pct = weight bytes / time as a share of the read bandwidth probe "
             f"(bound_pct: the floor's, the most an op registered from Python reaches).")
    write_results(args.out, args.name, "Op dispatch at decode (M=1): what it costs, what it bounds", info, rows,
                  markdown_table(rows, cols), notes)


def measure(label: str, rotate_gb: float, rounds: int) -> dict:
    """The row of one shape: kernel, op and floor times, best of ``rounds`` round-robin rounds."""
    N, K = SHAPES[label]
    p = pack_for_cpu(quantize_rtn(torch.randn(N, K) * 0.02, "affine", 64))
    copies = max(2, int(rotate_gb * 1e9 // p.nbytes()))
    sets = [(p.qweight, p.scales, p.zeros)] + [(p.qweight.clone(), p.scales.clone(), p.zeros.clone()) for _ in range(copies - 1)]
    x = torch.randn(1, K, dtype=torch.bfloat16)
    *vectors, y = kernel_args("int2", sets, x, N)  # bench/gemv_cpu.py's int2 row: affine, group 64
    _PLANS.clear()
    _PLANS.update({q.data_ptr(): (v.buffer_info()[0], y) for (q, _, _), v in zip(sets, vectors)})
    meta = (p.layout, p.codebook, p.group_size, p.out_features)
    op, floor = torch.ops.aipc.lowbit_linear, torch.ops.aipc_bench.floor_linear
    planned = plan_cpu_call(p)
    if planned is None:
        raise RuntimeError("the planned ops are not built (csrc/ops): build the package, then run again")
    call, addresses = native._lib().aipc_lowbit_linear_v, [v.buffer_info()[0] for v in vectors]
    alias = torch.ops.aten.alias.default
    best = {k: float("inf") for k in ("kernel", "planned", "op", "floor", "ctypes", "ctypes_alias", "alias_hot")}
    bw = 0.0
    for _ in range(rounds):  # round-robin, best of: the host's bandwidth drifts
        bw = max(bw, read_bandwidth(reps=3))
        best["kernel"] = min(best["kernel"], native_probes().time_lowbit_linear(vectors, 8))
        best["planned"] = min(best["planned"], time_rotating(lambda x, ws: planned(x, ws[0], ws[1], ws[2]), sets, x, 8))
        best["op"] = min(best["op"], time_rotating(lambda x, ws: op(x, ws[0], ws[1], ws[2], None, *meta, 0), sets, x, 8))
        best["floor"] = min(best["floor"], time_rotating(lambda x, ws: floor(x, ws[0], ws[1], ws[2], None, *meta, 0), sets, x, 8))
        best["ctypes"] = min(best["ctypes"], time_rotating(lambda x, a: call(a), addresses, x, 8))
        best["ctypes_alias"] = min(best["ctypes_alias"], time_rotating(lambda x, a: (call(a), alias(x)), addresses, x, 8))
        best["alias_hot"] = min(best["alias_hot"], time_rotating(lambda x, a: alias(x), addresses, x, 8))
    nb = p.nbytes()
    pct = {k: 100 * nb / best[k] / 1e9 / bw for k in ("kernel", "planned", "op", "floor")}
    row = dict(shape=label, mb=nb / 1e6, read_gbs=bw, kernel_us=best["kernel"] * 1e6, planned_us=best["planned"] * 1e6,
               op_us=best["op"] * 1e6, floor_us=best["floor"] * 1e6,
               planned_overhead_us=(best["planned"] - best["kernel"]) * 1e6,
               ctypes_us=best["ctypes"] * 1e6,
               op_overhead_us=(best["op"] - best["kernel"]) * 1e6, floor_overhead_us=(best["floor"] - best["kernel"]) * 1e6,
               ctypes_overhead_us=(best["ctypes"] - best["kernel"]) * 1e6,
               alias_after_kernel_us=(best["ctypes_alias"] - best["ctypes"]) * 1e6, alias_hot_us=best["alias_hot"] * 1e6,
               planned_over_kernel=best["planned"] / best["kernel"], kernel_pct=pct["kernel"],
               planned_pct=pct["planned"], op_pct=pct["op"], bound_pct=pct["floor"])
    print(row, flush=True)
    _PLANS.clear()
    return row


if __name__ == "__main__":
    main()
