"""Low-bit GEMV/GEMM on this CPU, side by side with torch's kernels, in one run.

    python bench/gemv_cpu.py [--quick] [--rows int2,bf16] [--shapes '8B*'] [--out bench/results/cpu]

Rows per shape and M: torch fp32 / bf16 ``F.linear``, torch int8 weight-only
(``_weight_int8pack_mm``), torch int4 (``_weight_int4pack_mm_for_cpu``), and ours: lowbit2 (affine,
group 64; group 128; group 64 forced onto the AVX-512 VNNI kernels to show what AMX adds for M >= 16;
group 64 forced onto the 256-bit AVX-VNNI kernels, the widest that client CPUs such as Core Ultra have)
and 1-bit (binary, group 64), W2A8 / W1A8 with activation quantization fused in, ``w4a8`` / ``w4a8_asym`` (the ``int4`` / ``affine4``
code books, group 128: GPTQ / AWQ int4 weights, W4A8) and ``w8a8`` (the ``int8`` code book, one scale
per output channel: the output projection's format, W8A8), ``w4a8_vnni`` / ``w8a8_vnni`` (the same forced
onto the AVX-512 VNNI kernels, to show what AMX adds for M >= 16), ``int2_prog`` (``_vnni``, ``_avxvnni``: the same
forced) the progressive two-level form (``min2`` group 64, int8 levels ``s1 * c + m`` and one ``s0`` a row, random
parts: the kernels accumulate it in int32 over the whole K) beside ``int2``; ``w4a8_prog`` (``_avxvnni``) the same form
in 4-bit codes (``min4`` group 64, ``quantizer: progressive``) beside ``w4a8_asym_g64`` (``affine4`` group 64, lowbit4's
default); the activation-exact W4A16 kernels
(``aipc::lowbit_linear_a16``, ``e0m4`` code book, group 128) with Transformer-Lite's E0M4 dequantization
(``w4a16_e0m4``: two bit operations) against int-to-float dequantization on the same skeleton
(``w4a16_int``), with bf16 activations (AVX512-BF16 dot products where the CPU has them) and with float32
ones (``*_fma``: float32 FMAs; op time only, no kernel-alone timing); the small-M dense kernels
(``aipc::dense_linear``: the model's own float32 / bf16 weights streamed once for all M rows, the
segment-KV plugin's decode path) as ``dense_fp32`` / ``dense_bf16`` against torch's ``fp32`` / ``bf16``
``F.linear`` on the same weights and activations: the kernel itself at every M, called from Python like
the op (the op runs it up to ``aipc_kernels.decoder.dense_linear.cpu_max_rows`` rows, F.linear beyond). Shapes: the
Llama projections and two output projections (``llama_shapes.HEAD_SHAPES``). At M=1 also ``read``:
the probe's read loop over exactly the int2 group-64 bytes, rotated and timed like the kernel alone, i.e.
what a plain read of those bytes reaches with the same threads, fork/join and first-line latency
(``kernel_pct_read``: a kernel's GB/s as a share of it; ``kernel_pct_own_read``: the same against a
plain read of the kind's own packed codes, its rotating copies, timed in the same round). ``us`` is
the op as the plugins call it, timed from Python: for our low-bit kinds the planned op
(:mod:`aipc_kernels.lowbit.planned_ops`: operands checked once, C++ per call), for ``int2_general`` /
``w4a8_general`` the general ``aipc::lowbit_linear`` on the same weights (operands checked in Python each
call); ``kernel_us`` is our C kernel alone, timed in C over the same rotation (as the read row and the
bandwidth probe are), so the two differ by the op's dispatch and body (``op_over_kernel``).
Weights rotate over copies totalling ``--rotate-gb`` (several times the last-level cache) so every
call streams them from DRAM. All kinds of a shape are held at once and timed round-robin (``--rounds``, best of), with the
read bandwidth probe in every round (best of): the host's bandwidth moves, and this way every row and
the probe see the same conditions. Each kernel's GB/s (weight bytes incl. scales / time) is given
as a share of it. ``gmacs``: multiply-adds per second (M x N x K / time); for the float kinds (W4A16, dense)
``pct_fma``: of the float32 FMA peak of the run's vector width (the probes' ``aipc_fma_peak``), their compute
bound at M > 1, and a summary line of the W4A16 FMA kinds' time over W4A8's, measured and at that peak;
``pct_dq`` (W4A16 with int dequantization, AVX2 / AVX-VNNI runs): of its own mask-convert-FMA mix on
registers (``aipc_dequant_fma_peak``), its bound at M=1, where each weight is used once; ``pct_dot`` (our
W*A8 kinds on the run's ISA): of that ISA's int8 dot product on registers (``aipc_int8_dot_peak``), their
compute bound at M > 1.
Writes a markdown table and a roofline plot (M=1).
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from aipc_kernels.core import native
from aipc_kernels.core.huge_pages import on_huge_pages
from aipc_kernels.lowbit.formats import get_codebook
import aipc_kernels.decoder.dense_linear  # noqa: F401  (registers torch.ops.aipc.dense_linear)
import aipc_kernels.lowbit.ops  # noqa: F401  (registers torch.ops.aipc.lowbit_linear)
from aipc_kernels.lowbit.contract import operand_plan
from aipc_kernels.lowbit.packing import CPU_LAYOUT, pack_for_cpu
from aipc_kernels.lowbit.planned_ops import available as plan_ready, plan_cpu_call
from aipc_kernels.lowbit.progressive import from_parts, max_sub_scale
from aipc_kernels.lowbit.quantizers import quantize_rtn
from harness import BenchParser, bench_lock, machine_info, markdown_table, native_probes, read_bandwidth, read_results, select, write_results
from llama_shapes import HEAD_SHAPES, SHAPES  # bench/ is on sys.path when run as a script

SHAPES = SHAPES | HEAD_SHAPES

PEERS = ("fp32", "bf16", "int8", "int4")
# a plain read (the bandwidth probe's loop) of the int2 group-64 bytes of the shape, rotated and called
# like the kernels: what any decode kernel of these bytes could reach, fork/join and first lines included
READ = "read"
# the activation-exact W4A16 kernels: code book, group size, dequantization, activation dtype
A16_CONFIGS = {
    "w4a16_e0m4": ("e0m4", 128, "e0m4", torch.bfloat16),
    "w4a16_int": ("e0m4", 128, "int", torch.bfloat16),
    "w4a16_e0m4_fma": ("e0m4", 128, "e0m4", torch.float32),
    "w4a16_int_fma": ("e0m4", 128, "int", torch.float32),
}
# the small-M dense kernels on the model's own float weights (aipc::dense_linear): weight dtype = x dtype
DENSE_CONFIGS = {"dense_fp32": torch.float32, "dense_bf16": torch.bfloat16}
# kinds whose arithmetic is float (FMA, or AVX512-BF16 dot products for bf16 activations where the CPU has
# them): their multiply-adds per second are put against the float32 FMA peak of the run's vector width
FLOAT_KINDS = tuple(A16_CONFIGS) + tuple(DENSE_CONFIGS)
# the general op (torch.ops.aipc.lowbit_linear: operands checked in Python on every call) on a kind's weights,
# beside the planned op the plugins call (aipc_kernels.lowbit.planned_ops: checked once, C++ per call)
GENERAL_OP = {"int2_general": "int2", "w4a8_general": "w4a8"}
OURS = ("int2", "int2_general", "int2_g128", "int2_vnni", "int2_avxvnni", "int1", "w4a8", "w4a8_general",
        "w4a8_asym", "w4a8_g32", "w8a8", "w6a8", "w8a8_g32", "w4a8_vnni", "w8a8_vnni", "int2_prog", "int2_prog_vnni",
        "int2_prog_avxvnni", "w4a8_asym_g64", "w4a8_asym_g64_avxvnni", "w4a8_prog", "w4a8_prog_avxvnni") + tuple(A16_CONFIGS) + tuple(DENSE_CONFIGS)
# ours: code book, group size, forced ISA (None: the best this CPU has)
OUR_CONFIGS = {
    "int2": ("affine", 64, None),
    "int2_g128": ("affine", 128, None),
    "int2_vnni": ("affine", 64, "avx512_vnni"),  # the AVX-512 VNNI kernels even where AMX exists
    "int2_avxvnni": ("affine", 64, "avx_vnni"),  # 256-bit AVX-VNNI: the widest ISA of client CPUs (Core Ultra)
    "int1": ("binary", 64, None),
    "w4a8": ("int4", 128, None),  # GPTQ symmetric int4, group 128
    "w4a8_asym": ("affine4", 128, None),  # GPTQ asymmetric / AWQ int4 (stored zeros), group 128
    "w4a8_g32": ("int4", 32, None),  # GGUF Q4_0's re-layout: symmetric int4, an fp16 scale per 32
    "w8a8": ("int8", -1, None),  # int8 per output channel: the output projection's default format
    "w6a8": ("int6", 32, None),  # 6-bit codes (GGUF's Q6_K / Q5 types), 192 bytes per 16 rows x 16 k
    "w8a8_g32": ("int8", 32, None),  # the same groups in 8-bit codes: how 6-bit codes were held before
    "w4a8_vnni": ("int4", 128, "avx512_vnni"),  # W4A8 / W8A8 on the AVX-512 VNNI kernels even where AMX exists
    "w8a8_vnni": ("int8", -1, "avx512_vnni"),
    # the progressive two-level form (issue 41's: int8 levels s1 * c + m, one s0 a row; int32 over the whole K)
    "int2_prog": ("min2", 64, None),
    "int2_prog_vnni": ("min2", 64, "avx512_vnni"),
    "int2_prog_avxvnni": ("min2", 64, "avx_vnni"),
    "w4a8_asym_g64": ("affine4", 64, None),  # lowbit4's default on the fly
    "w4a8_asym_g64_avxvnni": ("affine4", 64, "avx_vnni"),
    "w4a8_prog": ("min4", 64, None),  # lowbit4 with quantizer: progressive, codebook: min4
    "w4a8_prog_avxvnni": ("min4", 64, "avx_vnni"),
}
PROG_KINDS = ("int2_prog", "int2_prog_vnni", "int2_prog_avxvnni", "w4a8_prog", "w4a8_prog_avxvnni")  # quantized by quantize_progressive
OUR_CONFIGS.update({general: OUR_CONFIGS[kind] for general, kind in GENERAL_OP.items()})
# our W*A8 kinds on the run's own ISA (its int8 dot product bounds them at M > 1), and the W4A16 kinds with
# int dequantization (on AVX2 / AVX-VNNI its mask-convert-FMA mix bounds them at M=1)
INT_KINDS = tuple(k for k, (_, _, isa) in OUR_CONFIGS.items() if isa is None)
A16_INT_KINDS = tuple(k for k, c in A16_CONFIGS.items() if c[2] == "int")
# the instruction each int8 dot peak times (bench/native_probes.int8_dot_peak)
DOT_INSTRUCTION = {"avx2": "vpmaddubsw + 16-bit adds, 256-bit", "avx_vnni": "vpdpbusd, 256-bit",
                   "avx512_vnni": "vpdpbusd, 512-bit"}


def make_weights(kind: str, w: torch.Tensor):
    """(callable(x, weights) -> y, one weight set as a tuple of tensors, its bytes)."""
    N, K = w.shape
    if kind in ("fp32", "bf16"):
        t = w.to(torch.float32 if kind == "fp32" else torch.bfloat16)
        return (lambda x, ws: F.linear(x, ws[0])), (t,), t.numel() * t.element_size()
    if kind == "int8":
        s = w.abs().amax(1) / 127
        q = torch.round(w / s[:, None]).to(torch.int8)
        sb = s.to(torch.bfloat16)
        return (lambda x, ws: torch._weight_int8pack_mm(x, ws[0], ws[1])), (q, sb), q.numel() + sb.numel() * 2
    if kind == "int4":
        G = 64
        wg = w.reshape(N, K // G, G)
        lo, hi = wg.amin(-1), wg.amax(-1)
        sc = (hi - lo) / 15
        q = torch.clamp(torch.round((wg - lo[..., None]) / sc[..., None]), 0, 15).to(torch.int32).reshape(N, K)
        packed = torch._convert_weight_to_int4pack_for_cpu(q, 2)
        sz = torch.stack([sc, lo + 8 * sc], -1).transpose(0, 1).contiguous().to(torch.bfloat16)
        fn = lambda x, ws: torch._weight_int4pack_mm_for_cpu(x, ws[0], G, ws[1])  # noqa: E731
        return fn, (packed, sz), packed.numel() + sz.numel() * 2
    if kind in DENSE_CONFIGS:  # the kernel at every M (the op runs it up to cpu_max_rows rows, then F.linear)
        t = w.to(DENSE_CONFIGS[kind])

        def dense(x, ws):
            y = torch.empty(x.shape[0], ws[0].shape[0], dtype=x.dtype)
            native.dense_linear_into(y, x, ws[0], None, check_dense=False)
            return y

        return dense, (t,), t.numel() * t.element_size()
    if kind == READ:
        nbytes = pack_for_cpu(quantize_rtn(w, "affine", 64)).nbytes()
        # timed by the probes' time_stream_read, on the pages the packed weights have
        return None, (on_huge_pages(torch.ones(nbytes, dtype=torch.uint8)),), nbytes
    if kind in A16_CONFIGS:
        codebook, group, dequant, _ = A16_CONFIGS[kind]
        p = pack_for_cpu(quantize_rtn(w, codebook, group))
        meta = (p.layout, p.codebook, p.group_size, p.out_features)
        a16 = lambda x, ws: torch.ops.aipc.lowbit_linear_a16(x, ws[0], ws[1], ws[2], None, *meta, dequant)  # noqa: E731
        planned = plan_cpu_call(p, dequant=dequant)
        if planned is not None:
            a16 = lambda x, ws: planned(x, ws[0], ws[1], ws[2])  # noqa: E731
        return a16, (p.qweight, p.scales, p.zeros), p.nbytes()
    codebook, group, isa = OUR_CONFIGS[kind]
    p = pack_for_cpu(random_progressive(w, codebook, group) if kind in PROG_KINDS else quantize_rtn(w, codebook, group))
    meta = (p.layout, p.codebook, p.group_size, p.out_features)
    one = (p.qweight, p.scales, p.zeros) + ((p.supers,) if p.supers is not None else ())
    op = lambda x, ws: torch.ops.aipc.lowbit_linear(x, *ws[:3], None, *meta, 0, None, *ws[3:])  # noqa: E731
    planned = None if kind in GENERAL_OP else plan_cpu_call(p)
    if planned is not None:  # what the plugins call
        op = lambda x, ws: planned(x, *ws[:3], None, None, *ws[3:])  # noqa: E731
    if isa is None or native.ISAS[isa] >= native.ISAS[native.best_isa()]:
        return op, one, p.nbytes()

    def forced(x, ws):
        run_isa = native.get_isa()  # the run's own ISA (AIPC_ISA), restored after the row's
        native.set_isa(isa)
        try:
            return op(x, ws)
        finally:
            native.set_isa(run_isa)

    return forced, one, p.nbytes()


def random_progressive(w: torch.Tensor, codebook: str, group: int):
    """A weight of ``w``'s shape in the progressive form with random codes, ``s1``, ``m`` (every level an int8) and
    ``s0``: the kernels' work does not depend on the values, and the optimized quantizer takes minutes on 1B
    shapes."""
    N, K = w.shape
    top, ng = get_codebook(codebook).max_code, K // group
    s1 = torch.randint(1, max_sub_scale(codebook) + 1, (N, ng))
    m = (torch.rand(N, ng) * (256 - s1 * top) - 128).floor().clamp(max=127 - s1 * top).to(torch.int64)
    s0 = (w.abs().amax(1) / 127).half().float()
    return from_parts(torch.randint(0, top + 1, (N, K)), s1, m, s0, codebook, group)


def kernel_args(kind: str, sets, x: torch.Tensor, N: int) -> list:
    """Pre-built argument vectors of the C entry point for each weight set of one of our kinds (times the
    kernel alone: no dispatcher, no Python body; the op's own cost is the difference to the op row)."""
    codebook, group, _ = OUR_CONFIGS[kind]
    return codebook_kernel_args(codebook, group, sets, x, N)


def codebook_kernel_args(codebook: str, group: int, sets, x: torch.Tensor, N: int) -> list:
    """:func:`kernel_args` for weights in ``codebook`` / ``group`` (-1: one group per row), then ``y``; a set's
    fourth tensor, where it has one, is its supers (the two-level form)."""
    cb = get_codebook(codebook)
    y = torch.empty(x.shape[0], N, dtype=x.dtype)
    G = group if group > 0 else x.shape[1]
    zero = operand_plan(CPU_LAYOUT, codebook, G, N, x.shape[1], 0).zero  # the op's: NaN with per-group zeros
    return [native.lowbit_linear_args(y, x, q, s, z, None, cb.bits, G, cb.cmul, zero, x.shape[1], None, *sup)
            for q, s, z, *sup in sets] + [y]  # y last: kept alive


def time_kernel(kind: str, sets, x: torch.Tensor, N: int, min_calls: int) -> float:
    """Seconds per call of the C kernel alone over the rotating weight sets, timed in C like the read probe
    (the probes' ``time_lowbit_linear``: no interpreter between calls; same rotation and best-round rule
    as time_rotating)."""
    *vectors, y = kernel_args(kind, sets, x, N)  # the vectors and y stay referenced while the kernel runs
    isa, run_isa = OUR_CONFIGS[kind][2], native.get_isa()  # run_isa: AIPC_ISA's, restored after
    if isa is not None and native.ISAS[isa] < native.ISAS[native.best_isa()]:
        native.set_isa(isa)
    try:
        return native_probes().time_lowbit_linear(vectors, min_calls)
    finally:
        del y, vectors
        native.set_isa(run_isa)


def check_kernel_alone(kind: str, fn, sets, x: torch.Tensor, N: int) -> None:
    """RuntimeError unless the C kernel alone, with the vectors :func:`time_kernel` times, gives the op's output
    on the first weight set (a wrong argument there would time another code path)."""
    *vectors, y = kernel_args(kind, sets[:1], x, N)
    status = native._lib().aipc_lowbit_linear_v(vectors[0].buffer_info()[0])
    want = fn(x, sets[0])
    if status != 0 or not torch.allclose(y, want, rtol=1e-4, atol=1e-4 * float(want.abs().max())):
        raise RuntimeError(f"{kind}: the kernel-alone vectors do not compute what the op does (status {status}, "
                           f"largest difference {float((y - want).abs().max()):.3g})")  # fmt: skip


def time_rotating(fn, sets, x, min_calls: int, min_s: float = 0.3) -> float:
    """Mean seconds per call over passes through the rotating weight sets (best pass)."""
    for ws in sets[:2]:
        fn(x, ws)
    passes, best = 0, float("inf")
    t_end = time.perf_counter() + min_s
    while passes < 2 or time.perf_counter() < t_end:
        n = max(min_calls, len(sets))
        t = time.perf_counter()
        for i in range(n):
            fn(x, sets[i % len(sets)])
        best = min(best, (time.perf_counter() - t) / n)
        passes += 1
    return best


def plot(rows: list[dict], out: Path, threads: int, cpu: str) -> None:
    """Roofline-style figure: attained GB/s per shape at M=1 against the measured read bandwidth."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    m1 = [r for r in rows if r["M"] == 1]
    labels = list(dict.fromkeys(r["shape"] for r in m1))
    fig, ax = plt.subplots(figsize=(10, 4.5))
    bw = {r["shape"]: r["bw"] for r in m1}
    ax.plot(labels, [bw[l] for l in labels], "k--", label="measured read bandwidth")
    for kind, marker in (("bf16", "x"), ("int8", "s"), ("int4", "^"), ("int2", "o"), ("int1", "D")):
        got = {r["shape"]: r["gbs"] for r in m1 if r["kind"] == kind}
        if len(got) < len(labels):
            continue  # a kind not run (--rows)
        ax.plot(labels, [got[l] for l in labels], marker=marker, linestyle="-", label=kind)
    kern = {r["shape"]: r["gbs"] * r["us"] / r["kernel_us"] for r in m1 if r["kind"] == "int2" and r.get("kernel_us")}
    if len(kern) == len(labels):
        ax.plot(labels, [kern[l] for l in labels], marker="o", linestyle=":", color="tab:red", label="int2, kernel alone")
    ax.set_ylabel("attained GB/s of weight bytes (M=1)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"GEMV weight streaming, {cpu}, {threads} threads")
    ax.tick_params(axis="x", rotation=30)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out.parent / f"{out.name}.png", dpi=110)


def run_isa() -> str:
    """The ISA the run's kernels take (AIPC_ISA's, else the CPU's best), ``scalar`` without the native build."""
    return native.get_isa() if native.available() else "scalar"


def fma_peak_of_run() -> tuple[int, float] | None:
    """(vector bits, float32 multiply-adds per second) of the run's ISA (AIPC_ISA's, else the CPU's best) on
    torch's threads: 256-bit FMAs for AVX2 / AVX-VNNI, 512-bit for AVX-512 and AMX; None for portable C."""
    isa = run_isa()
    bits = {"avx2": 256, "avx_vnni": 256, "avx512_vnni": 512, "amx_int8": 512}.get(isa)
    return (bits, native_probes().fma_peak(bits, torch.get_num_threads())) if bits else None


def dot_peak_of_run() -> tuple[str, float] | None:
    """(ISA, u8 x s8 multiply-adds per second) of the run's int8 dot product instruction (AIPC_ISA's, else the
    CPU's best) on register operands, torch's threads: the W*A8 kernels' compute bound at M > 1; None for
    portable C and AMX (its tiles are another instruction)."""
    isa = run_isa()
    return (isa, native_probes().int8_dot_peak(isa, torch.get_num_threads())) if isa in native_probes().DOT_ISAS else None


def dequant_peak_of_run() -> float | None:
    """Multiply-adds per second of the AVX2 W4A16 kernel's int dequantization mix (mask, convert, FMA per 8
    weights) where the run's W4A16 kernel is that one (AVX2 / AVX-VNNI), else None: its bound at M=1."""
    isa = run_isa()
    return native_probes().dequant_fma_peak(torch.get_num_threads()) if isa in ("avx2", "avx_vnni") else None


def main() -> None:
    ap = BenchParser("gemv_cpu", __doc__, PEERS + OURS + (READ,), what="kinds (rows per shape and M)", group="cpu")
    ap.add_argument("--ms", default="1,4,16,128")
    ap.add_argument("--rotate-gb", type=float, default=1.2, help="weight copies per kind (all kinds held at once)")
    ap.add_argument("--rounds", type=int, default=3, help="round-robin passes over all kinds; best of them")
    ap.add_argument("--quick", action="store_true", help="two shapes, M=1 only, small rotation")
    ap.add_argument("--replot", action="store_true", help="only redraw the plot from the results JSON")
    ap.add_argument("--shapes", default="*", help="comma list of shapes, names or patterns such as '8B*'")
    ap.add_argument("--update", action="store_true",
                    help="replace only these shapes' rows in the results JSON (a re-measure), keep the others")
    args = ap.parse_args()
    shapes = dict(list(SHAPES.items())[4:6]) if args.quick else SHAPES
    shapes = {k: shapes[k] for k in select(args.shapes, list(shapes), "--shapes")}
    kinds = args.rows
    ms = [1] if args.quick else [int(m) for m in args.ms.split(",")]
    rotate = 0.5 if args.quick else args.rotate_gb
    threads = torch.get_num_threads()
    torch.manual_seed(0)
    stem = Path(args.out) / args.name
    if args.replot:
        data = read_results(args.out, args.name)
        plot(data["rows"], stem, threads, data["machine"].get("cpu", "?"))
        return
    with bench_lock(enabled=not args.no_lock):
        info = machine_info()
        rows = measure(shapes, kinds, ms, rotate, args.rounds)
        fma = fma_peak_of_run() if any(k in FLOAT_KINDS for k in kinds) else None
        dq = dequant_peak_of_run() if any(k in A16_CONFIGS for k in kinds) else None
        dot = dot_peak_of_run() if any(k in INT_KINDS for k in kinds) else None
        load_after = os.getloadavg()
    stamp = time.strftime("%Y-%m-%d %H:%M")
    for r in rows:
        r["run"] = f"{stamp}, load {info['loadavg'][0]:.2f}"
        if fma and r["kind"] in FLOAT_KINDS:
            r["pct_fma"], r["fma_bits"] = 100 * r["gmacs"] * 1e9 / fma[1], fma[0]
        if dq and r["kind"] in A16_INT_KINDS:
            r["pct_dq"] = 100 * r["gmacs"] * 1e9 / dq
        if dot and r["kind"] in INT_KINDS:
            r["pct_dot"], r["dot_isa"] = 100 * r["gmacs"] * 1e9 / dot[1], dot[0]
    if args.update and (Path(args.out) / f"{args.name}.json").exists():
        kept = [r for r in read_results(args.out, args.name)["rows"] if r["shape"] not in shapes]
        order = list(SHAPES)
        rows = sorted(kept + rows, key=lambda r: order.index(r["shape"]) if r["shape"] in order else len(order))
    notes = (f"{threads} threads, load average {tuple(round(v, 2) for v in load_after)} after. Weights rotated over "
             f"{rotate:.1f} GB of copies per kind (DRAM-resident: the last-level cache is {info['llc_mib']} MiB), all "
             f"kinds timed round-robin, best of {args.rounds} rounds. GB/s = weight bytes (codes + scales/zeros) / time; "
             f"% BW = of the read bandwidth measured next to each shape (all threads). us = one call of the op as the "
             f"plugins call it, timed from Python: for our low-bit kinds the planned op "
             f"(`torch.ops.aipc.lowbit_linear_cpu` / `lowbit_linear_a16_cpu`, operands checked once, C++ per call"
             f"{'' if plan_ready() else ': NOT BUILT here, the general op instead'}), for *_general kinds the general "
             f"op `torch.ops.aipc.lowbit_linear` (operands checked in Python on every call), torch's own ops for "
             f"theirs; kernel_us = our C kernel "
             f"alone on pre-built argument vectors, timed in C like the bandwidth probe (`aipc_time_lowbit_linear_v`: no "
             f"interpreter between calls; the difference to us is the op's dispatcher and body, which run "
             f"with the caches full of weights); op_over_kernel = us / kernel_us. read (M=1) = the probe's read loop over exactly the shape's int2 "
             f"group-64 bytes, rotated and timed in C like the kernel alone; kernel_pct_read = a kernel's GB/s as a "
             f"share of it; kernel_pct_own_read (M=1) = the same against a plain read of the kind's own packed "
             f"codes (its rotating copies, timed in C in the same round). x_<peer> = peer time / this row's time (>1: this row is faster). "
             f"gmacs = M x N x K multiply-adds / time, GMAC/s"
             + (f"; pct_fma (float kinds: {', '.join(k for k in FLOAT_KINDS if k in kinds)}) = of the float32 FMA peak of "
                f"the run's vector width, {fma[1] / 1e9:.1f} GMAC/s ({fma[0]}-bit FMAs, {threads} threads: the probes' "
                f"`aipc_fma_peak`, 12 independent chains per thread; AVX512-BF16 dot products, two multiply-adds "
                f"a lane, can pass it)" if fma else "")
             + (f"; pct_dq ({', '.join(k for k in A16_INT_KINDS if k in kinds)}) = of the multiply-adds per second of the "
                f"AVX2 W4A16 kernel's int dequantization mix on registers (mask the code in place, convert, FMA per 8 "
                f"weights; the probes' `aipc_dequant_fma_peak`), {dq / 1e9:.1f} GMAC/s: no kernel of that mix "
                f"multiplies faster at M=1, where each weight is used once" if dq else "")
             + (f"; pct_dot (our W*A8 kinds) = of the {dot[0]} int8 dot product instruction's multiply-adds per second "
                f"on registers ({DOT_INSTRUCTION[dot[0]]}; the probes' `aipc_int8_dot_peak`), {dot[1] / 1e9:.1f} "
                f"GMAC/s: their compute bound at M > 1" if dot else "") + "."
             + (" --update: the rows of shapes not named were kept from the previous file (see Runs)." if args.update else ""))
    runs = sorted({(r.get("run", "?"), r["shape"]) for r in rows})
    body = "Runs (shape: when, load average at its start): " + "; ".join(
        f"{sh}: {run}" for run, sh in sorted(runs, key=lambda t: list(SHAPES).index(t[1]) if t[1] in SHAPES else 99)) + "\n\n"
    cols = ["shape", "M", "kind", "us", "gbs", "pct_bw", "kernel_us", "op_over_kernel", "kernel_pct_bw", "kernel_pct_read",
            "kernel_pct_own_read", "x_bf16", "x_fp32", "x_int8", "x_int4", "gmacs"] + (["pct_fma"] if fma else []) + (
        ["pct_dq"] if dq else []) + (["pct_dot"] if dot else [])
    lines = summary(rows, ms, fma, dq, dot)
    body += ("\n".join(lines) + "\n\n" if lines else "") + markdown_table(rows, cols) + "\n"
    write_results(args.out, args.name, "Low-bit GEMV/GEMM on CPU", info, rows, body, notes)
    plot(rows, stem, threads, info["cpu"])


def measure(shapes: dict, kinds: list[str], ms: list[int], rotate: float, rounds: int) -> list[dict]:
    """The result rows of ``kinds`` for every shape and M (see the module docstring)."""
    probes = native_probes()
    rows = []
    for label, (N, K) in shapes.items():
        w = torch.randn(N, K) * 0.02
        held = {}  # kind -> (fn, rotating weight sets, bytes of one set); all held at once
        for kind in kinds:
            fn, one, nbytes = make_weights(kind, w)
            copies = max(2, int(rotate * 1e9 // nbytes))
            held[kind] = (fn, [one] + [tuple(None if t is None else t.clone() for t in one) for _ in range(copies - 1)], nbytes)
        results, bw, own_read = {}, 0.0, {}  # own_read: kind -> GB/s of a plain read of its codes (M=1)
        for M in ms:
            xs = {dt: torch.randn(M, K, dtype=dt) for dt in (torch.float32, torch.bfloat16)}
            # rounds: every kind (and the bandwidth probe) once per round, best of the rounds, so slow
            # drifts of the shared host's memory bandwidth hit all rows alike
            for _ in range(rounds):
                bw = max(bw, read_bandwidth(reps=1))
                for kind, (fn, sets, nbytes) in held.items():
                    if kind == READ and M != 1:
                        continue
                    x = xs[A16_CONFIGS[kind][3] if kind in A16_CONFIGS else DENSE_CONFIGS[kind] if kind in DENSE_CONFIGS
                           else torch.float32 if kind == "fp32" else torch.bfloat16]  # fmt: skip
                    if kind == READ:  # timed in C, as the kernel alone is (kernel_pct_read compares the two)
                        s = probes.time_stream_read([ws[0] for ws in sets], calls=8)
                    else:
                        s = time_rotating(fn, sets, x, min_calls=8 if M < 128 else 3)
                    sk = None
                    if kind in OUR_CONFIGS:
                        if (kind, M) not in results:  # once per kind and M, not every round
                            check_kernel_alone(kind, fn, sets, x, N)
                        sk = time_kernel(kind, sets, x, N, min_calls=8 if M < 128 else 3)
                    old = results.get((kind, M))
                    if old:
                        s, sk = min(s, old[0]), (min(sk, old[2]) if sk else None)
                    results[(kind, M)] = (s, nbytes, sk)
                    if M == 1 and sk:  # a plain read of this kind's own packed codes, same rotation, same round
                        codes = [ws[0] for ws in sets]
                        rs = probes.time_stream_read(codes, calls=8)
                        own = codes[0].numel() * codes[0].element_size() / rs / 1e9
                        own_read[kind] = max(own_read.get(kind, 0.0), own)
        del held
        for M in ms:
            base = {k: results[(k, M)][0] for k in PEERS if (k, M) in results}
            read_gbs = results[(READ, 1)][1] / results[(READ, 1)][0] / 1e9 if M == 1 and (READ, 1) in results else None
            for kind in kinds:
                if (kind, M) not in results:
                    continue
                s, nbytes, sk = results[(kind, M)]
                gbs = nbytes / s / 1e9
                rows.append(dict(shape=label, M=M, kind=kind, us=s * 1e6, gbs=gbs, pct_bw=100 * gbs / bw, bw=bw,
                                 gmacs=M * N * K / s / 1e9 if kind != READ else None,
                                 kernel_us=sk * 1e6 if sk else None, op_over_kernel=s / sk if sk else None,
                                 kernel_pct_bw=100 * nbytes / sk / 1e9 / bw if sk else None,
                                 kernel_pct_read=100 * nbytes / sk / 1e9 / read_gbs if sk and read_gbs else None,
                                 kernel_pct_own_read=(100 * nbytes / sk / 1e9 / own_read[kind]
                                                      if sk and M == 1 and kind in own_read else None),
                                 **{f"x_{k}": base[k] / s if kind != READ and k in base else None for k in PEERS}))
        print(f"{label}: done (read bandwidth {bw:.1f} GB/s)", flush=True)
    return rows


def summary(rows: list[dict], ms: list[int], fma: tuple[int, float] | None = None, dq: float | None = None,
            dot: tuple[str, float] | None = None) -> list[str]:
    """One line per kind of ours and M over the Llama-3-8B shapes: share of the read bandwidth, speed-ups;
    with ``fma`` (:func:`fma_peak_of_run`), the W4A16 kinds' time against W4A8's, measured and at that peak,
    and with ``dq`` (:func:`dequant_peak_of_run`) at M=1 at the bound of the int dequantization mix; with
    ``dot`` (:func:`dot_peak_of_run`), our W*A8 kinds' share of the int8 dot peak at M > 1 over all shapes."""
    def span(sel: list[dict], key: str, fmt: str) -> str:
        vals = [r[key] for r in sel if r.get(key) is not None]
        return f"{min(vals):{fmt}}-{max(vals):{fmt}}" if len(vals) == len(sel) else ""

    lines = []
    groups = (("Llama-3-8B shapes", lambda s: s.startswith("8B")), ("output projections", lambda s: "lm_head" in s))
    for kind in OURS:
        for M in ms:
            for group, match in groups:
                sel = [r for r in rows if r["kind"] == kind and r["M"] == M and match(r["shape"])]
                if not sel:
                    continue
                read = span(sel, "kernel_pct_read", ".0f")
                own = span(sel, "kernel_pct_own_read", ".0f")
                peers = ", ".join(f"x_{p} {span(sel, f'x_{p}', '.2f')}" for p in {"dense_fp32": ("fp32",), "dense_bf16": ("bf16",)}.get(kind, ("bf16", "int8", "int4"))
                                  if span(sel, f"x_{p}", ".2f"))
                alone = span(sel, "kernel_pct_bw", ".0f")
                lines.append(f"- {kind} M={M}, {group}: op {span(sel, 'pct_bw', '.0f')}% of read BW"
                             + (f" (kernel alone {alone}%" if alone else "")
                             + (f"; {read}% of a plain read of the same shape's int2 bytes" if read else "")
                             + (f"; {own}% of a plain read of its own codes" if own else "")
                             + (")" if alone else "")
                             + (f", {peers}" if peers else ""))
    # Transformer-Lite's table redone: E0M4 against int-to-float dequantization, same skeleton, per shape
    for e0m4, conv, what in (("w4a16_e0m4", "w4a16_int", "bf16 activations"),
                             ("w4a16_e0m4_fma", "w4a16_int_fma", "float32 activations, FMA")):
        for M in ms:
            us = {(r["shape"], r["kind"]): r["us"] for r in rows if r["M"] == M and r["kind"] in (e0m4, conv)}
            ratios = [us[(sh, conv)] / us[(sh, e0m4)] for sh, k in us if k == e0m4 and (sh, conv) in us]
            if ratios:
                lines.append(f"- W4A16 E0M4 against int dequantization ({what}), M={M}: int time / E0M4 time "
                             f"{min(ratios):.2f}-{max(ratios):.2f} over {len(ratios)} shapes (>1: E0M4 faster)")
    # the activation-exact W4A16 kinds computing in float32 FMAs against W4A8's int8 dot products: measured,
    # and the least time over W4A8's that any float32 kernel of these multiply-adds could take (at the FMA peak)
    for kind in (k for k in A16_CONFIGS if k.endswith("_fma")) if fma else ():
        for M in ms:
            w48 = {r["shape"]: r["us"] for r in rows if r["M"] == M and r["kind"] == "w4a8"}
            sel = [r for r in rows if r["M"] == M and r["kind"] == kind and r["shape"] in w48]
            if not sel:
                continue
            ratio = [r["us"] / w48[r["shape"]] for r in sel]
            at_peak = [r["us"] * r["pct_fma"] / 100 / w48[r["shape"]] for r in sel]
            pct = [r["pct_fma"] for r in sel]
            at_dq = ([r["us"] * r["pct_dq"] / 100 / w48[r["shape"]] for r in sel]
                     if M == 1 and all("pct_dq" in r for r in sel) else None)
            lines.append(f"- {kind} M={M}: {min(pct):.0f}-{max(pct):.0f}% of the float32 FMA peak ({fma[1] / 1e9:.1f} "
                         f"GMAC/s, {fma[0]}-bit); time / W4A8's {min(ratio):.2f}-{max(ratio):.2f}x, at the FMA peak "
                         f"{min(at_peak):.2f}-{max(at_peak):.2f}x over {len(sel)} shapes"
                         + (f"; {min(r['pct_dq'] for r in sel):.0f}-{max(r['pct_dq'] for r in sel):.0f}% of the int "
                            f"dequantization mix's bound ({dq / 1e9:.1f} GMAC/s), at that bound {min(at_dq):.2f}-"
                            f"{max(at_dq):.2f}x W4A8's time" if at_dq else ""))
    for kind in (k for k in OURS if k in INT_KINDS) if dot else ():
        for M in (m for m in ms if m > 1):
            sel = [r for r in rows if r["M"] == M and r["kind"] == kind and "pct_dot" in r]
            if sel:
                lines.append(f"- {kind} M={M}: {min(r['pct_dot'] for r in sel):.0f}-{max(r['pct_dot'] for r in sel):.0f}% "
                             f"of the {dot[0]} int8 dot peak ({dot[1] / 1e9:.1f} GMAC/s) over {len(sel)} shapes")
    return lines


if __name__ == "__main__":
    main()
