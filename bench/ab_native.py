"""A/B of two builds of the native kernel library, interleaved in one run: the C kernel alone (timed in C
over rotating weights, as ``bench/gemv_cpu.py``'s ``kernel_us``), per shape, token count and ISA.

    rm -rf /tmp/base && mkdir /tmp/base && git archive REV shared/aipc_kernels/csrc | tar -x -C /tmp/base
    C=/tmp/base/shared/aipc_kernels/csrc
    cc -O3 -std=gnu11 -fopenmp -fvisibility=hidden -ffp-contract=off -fPIC -shared -I$C \\
       $(ls $C/*.c $C/generic/*.c $C/x86/*.c 2>/dev/null) -o /tmp/base.so -lm
    python bench/ab_native.py --base /tmp/base.so --base-name REV --name NAME [--rows '8B*'] [--m 1,16]
                              [--codebook affine --group 64]
    python bench/ab_native.py --base /tmp/base.so --gguf FILE.gguf --tensors 'blk.4.ffn_down.weight,blk.4.attn_q.weight+blk.4.attn_k.weight+blk.4.attn_v.weight' --m 16,512

(every unit of the library picks its ISA per function, so one cc line builds any revision's units: csrc/*.c,
and csrc/generic/*.c, csrc/x86/*.c where the revision has them; a revision before -fno-wrapv was in setup.py's
flags was installed built with Python's -fwrapv: add it to time that revision as users ran it).
Both builds take the same argument vector (``native.lowbit_linear_args``) and are timed by the same C
loop (the probes' ``time_calls`` of each build's ``aipc_lowbit_linear_v``); rounds alternate A and B
and the best round of each is kept, so both see the same host conditions. ``new_over_base`` > 1: the
working tree's build is slower. Rows: the shapes of ``bench/llama_shapes.py`` (default the Llama-3-8B ones;
``150m *``: segment_kv's model, whose prefill is M = 1024), or ``--gguf``'s ``--tensors`` (re-laid out as vLLM
serves them: ``a+b+c`` is one merged layer in the stored form the plugin gives it) through ``--kernel`` (``lowbit``: W·A8,
``a16``: W4A16, ``dense``: the small-M dense kernel on bf16 weights), weights in ``--codebook`` / ``--group``,
and the segment-KV attention kernel (``aipc_segment_sdpa``, rows ``seg *``: bench/segment_kv.py's llama-150m
attention, BS=1, 4 beams, prompt 1024, 128 response tokens; decode is one query token per beam, prefill
the 1024-token prompt), timed from Python (``time.perf_counter`` around the same ctypes call for both).
"""
from __future__ import annotations

import ctypes
import math
import sys
import time
from array import array

import torch

from aipc_kernels.core import native
from aipc_kernels.decoder import segment_attention
from aipc_kernels.lowbit.contract import operand_plan
from aipc_kernels.lowbit.packing import CPU_LAYOUT, pack_for_cpu
from aipc_kernels.lowbit.planned_ops import plan_cpu_call
from aipc_kernels.lowbit.quantizers import quantize_rtn
from gemv_cpu import codebook_kernel_args, random_progressive  # bench/ is on sys.path when run as a script
from harness import BenchParser, bench_lock, machine_info, markdown_table, native_probes, read_bandwidth, write_results
from llama_shapes import HEAD_SHAPES, SEGMENT_KV_SHAPES, SHAPES

LOWBIT_SHAPES = SHAPES | HEAD_SHAPES | SEGMENT_KV_SHAPES


#: --kernel: the entry point each row's vectors call (the same argument vector in both builds)
ENTRIES = {"lowbit": "aipc_lowbit_linear_v", "a16": "aipc_lowbit_linear_a16_v", "dense": "aipc_dense_linear_v"}


def load(path: str) -> ctypes.CDLL:
    """Another build of the native library, with the signatures this bench calls."""
    lib = ctypes.CDLL(path)
    for entry in ENTRIES.values():
        getattr(lib, entry).restype = ctypes.c_int
        getattr(lib, entry).argtypes = [ctypes.c_void_p]
    lib.aipc_set_isa.argtypes = [ctypes.c_int]
    return lib


def set_isa(lib: ctypes.CDLL, isa: str) -> None:
    """Runs ``lib``'s kernels under ``isa`` (ValueError where this CPU lacks it)."""
    if lib.aipc_set_isa(native.ISAS[isa]) != 0:
        raise ValueError(f"isa={isa} not on this CPU")


def time_with(lib: ctypes.CDLL, entry: str, vectors: list, isa: str, calls: int) -> float:
    """Seconds per call of ``lib``'s kernel ``entry`` over the argument vectors in turn (best round), timed
    by the probes' C loop (the same loop for both builds)."""
    set_isa(lib, isa)
    return native_probes().time_calls(getattr(lib, entry), vectors, calls, 0.2)


def same_output(base: ctypes.CDLL, new: ctypes.CDLL, entry: str, vector: array, y: torch.Tensor, isa: str) -> bool:
    """Whether both builds write bit-identical outputs for one argument vector under ``isa`` (``y`` poisoned
    with NaN before each call, so an output a build leaves unwritten differs)."""
    outs = []
    for lib in (base, new):
        set_isa(lib, isa)
        y.fill_(float("nan"))
        if getattr(lib, entry)(vector.buffer_info()[0]) != 0:
            raise RuntimeError(f"{entry} failed under isa={isa}")
        outs.append(y.view(torch.int16 if y.element_size() == 2 else torch.int32).clone())
    return torch.equal(*outs)


def weight_sets(kernel: str, codebook: str, group: int, N: int, K: int, rotate_gb: float,
                progressive: bool = False) -> tuple[list, str]:  # fmt: skip
    """Copies of one weight for ``kernel`` (rotated through ``rotate_gb`` so the kernels stream them from
    DRAM), and what they are: packed low-bit codes (``progressive``: the progressive form, random parts, its supers
    fourth), or the bf16 matrix of the dense kernel."""
    w = torch.randn(N, K) * 0.02
    if kernel == "dense":
        one, what, nbytes = (w.to(torch.bfloat16),), "bf16 dense", N * K * 2
    elif progressive:
        p = pack_for_cpu(random_progressive(w, codebook, group))
        one, what, nbytes = (p.qweight, p.scales, p.zeros, p.supers), f"{codebook} g{group} progressive", p.nbytes()
    else:
        p = pack_for_cpu(quantize_rtn(w, codebook, group))
        one, what, nbytes = (p.qweight, p.scales, p.zeros), f"{codebook} g{group}", p.nbytes()
    copies = max(2, int(rotate_gb * 1e9 // nbytes))
    return [one] + [tuple(None if t is None else t.clone() for t in one) for _ in range(copies - 1)], what


def gguf_weight_sets(path: str, tensors: str, rotate_gb: float) -> tuple[list, str, int, int, list]:
    """Copies of one layer of a GGUF file as the plugin serves it (``tensors``: names joined by ``+`` for a merged
    layer, stacked along N in their common stored form by :func:`~aipc_kernels.checkpoints.gguf.cat_rows`), what
    it is, N, K, and the ``lowbit_linear_args`` scalars after the operands: ``[bits, group_size, cmul, zero]``."""
    from aipc_kernels.checkpoints.gguf import GGUFCheckpoint, cat_rows

    ckpt = GGUFCheckpoint.open(path)
    names = tensors.split("+")
    ws = [ckpt.load(n) for n in names]
    if any(isinstance(w, torch.Tensor) for w in ws):
        raise ValueError(f"--tensors {tensors}: a float tensor; pass quantized tensors of {path}")
    p = pack_for_cpu(cat_rows(ws, tensors))
    bits, G, N, cmul, _, _ = plan_cpu_call(p).args
    zero = operand_plan(CPU_LAYOUT, p.codebook, G, N, p.in_features, 0).zero  # the op's: NaN with per-group zeros
    one = (p.qweight, p.scales, p.zeros, p.supers)
    copies = max(2, int(rotate_gb * 1e9 // p.nbytes()))
    types = "+".join(ckpt.tensor_type(n).name for n in names)
    return ([one] + [tuple(None if t is None else t.clone() for t in one) for _ in range(copies - 1)],
            f"{types}: {p.codebook} g{G}{' two-level' if p.supers is not None else ''}", N, p.in_features,
            [bits, G, cmul, zero])


def ab_row(base: ctypes.CDLL, new: ctypes.CDLL, entry: str, vectors: list, y: torch.Tensor, isa: str,
           rounds: int) -> dict:
    """Both builds' best time of ``entry`` over the vectors under ``isa`` (rounds alternating base and new), their
    ratio, and whether their outputs are bit-identical."""
    t = {"base": float("inf"), "new": float("inf")}
    for _ in range(rounds):
        t["base"] = min(t["base"], time_with(base, entry, vectors, isa, 8))
        t["new"] = min(t["new"], time_with(new, entry, vectors, isa, 8))
    return dict(base_us=t["base"] * 1e6, new_us=t["new"] * 1e6, new_over_base=t["new"] / t["base"],
                identical=same_output(base, new, entry, vectors[0], y, isa))


def kernel_vectors(kernel: str, codebook: str, group: int, sets: list, x: torch.Tensor, N: int) -> list:
    """The argument vectors of ``kernel`` over the weight sets, then ``y`` (kept alive by the caller)."""
    if kernel == "lowbit":
        return codebook_kernel_args(codebook, group, sets, x, N)
    y = torch.empty(x.shape[0], N, dtype=x.dtype)
    if kernel == "dense":
        return [native.dense_linear_args(y, x, w, None) for (w,) in sets] + [y]
    zero = operand_plan(CPU_LAYOUT, codebook, group, N, x.shape[1], 0).zero  # the op's: NaN with per-group zeros
    dequant = "e0m4" if codebook == "e0m4" else "int"
    return [native.lowbit_linear_a16_args(y, x, q, s, z, None, group, zero, dequant) for q, s, z in sets] + [y]


#: segment_sdpa rows: (Hq, Hkv, D, prompt Np, response Nr, query length Lq), BS=1 x 4 beams, bf16 K/V
SEGMENT = {
    "seg 150m GQA decode": (12, 4, 64, 1024, 128, 1),
    "seg 150m MHA decode": (12, 12, 64, 1024, 128, 1),
    "seg 150m GQA prefill": (12, 4, 64, 1024, 0, 1024),
}
BEAMS = 4


def segment_case(Hq: int, Hkv: int, D: int, Np: int, Nr: int, Lq: int) -> tuple:
    """The kernel's arguments for one beam-search step (query strided as transformers passes it)."""
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g).to(torch.bfloat16)

    N = BEAMS
    q = r(N, Lq, Hq, D).transpose(1, 2)
    path = torch.randint(0, N, (Nr, N), generator=g, dtype=torch.int32)
    return q, r(1, Np, Hkv, D), r(1, Np, Hkv, D), r(max(Nr, 1), N, Hkv, D), r(max(Nr, 1), N, Hkv, D), path


def segment_entry(lib: ctypes.CDLL, isa: str):
    """``lib``'s ``aipc_segment_sdpa`` as today's signature calls it. Builds before the csrc split (no
    ``aipc_segment_isa``) took the ISA level as an argument before the thread count (0 scalar, 1 AVX2,
    3 AVX-512): the wrapper passes the level of ``isa``, as their segment_attention.py did."""
    fn = segment_attention.bind_native(lib)
    if hasattr(lib, "aipc_segment_isa"):
        return fn
    fn.argtypes = fn.argtypes[:-1] + [ctypes.c_int, ctypes.c_int]
    level = 3 if isa.startswith(("avx512", "amx")) else 1 if isa.startswith("avx") else 0
    return lambda *args: fn(*args[:-1], level, args[-1])


def time_segment(fn, args: tuple, causal: bool, isa: str, lib: ctypes.CDLL, calls: int = 20) -> float:
    """Seconds per call of one build's ``aipc_segment_sdpa`` (best of ``calls``), run under ``isa``."""
    set_isa(lib, isa)
    out = torch.empty(args[0].shape[0], args[0].shape[2], args[0].shape[1], args[0].shape[3])
    best = float("inf")
    for _ in range(calls):
        t0 = time.perf_counter()
        segment_attention.native_segment_sdpa(*args, is_causal=causal, out=out, fn=fn)
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = BenchParser("ab_native", __doc__, list(LOWBIT_SHAPES) + list(SEGMENT), [s for s in SHAPES if s.startswith("8B")],
                     what="shapes", group="cpu")
    ap.add_argument("--base", required=True, help="path of the baseline build (.so)")
    ap.add_argument("--base-name", default="base", help="what the baseline is (a revision)")
    ap.add_argument("--m", default="1,2,4,8,16,128")
    ap.add_argument("--isas", default="", help="comma list (default: the best ISA, and avx_vnni where this CPU has it)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--codebook", default="affine", help="code book of the low-bit rows' weights")
    ap.add_argument("--group", type=int, default=64, help="group size of the low-bit rows' weights")
    ap.add_argument("--progressive", action="store_true",
                    help="the shape rows' weights in the progressive form (--codebook min2 or min4; random parts)")
    ap.add_argument("--kernel", default="lowbit", choices=list(ENTRIES),
                    help="the shapes' kernel: lowbit (W*A8), a16 (W4A16; a 4-bit --codebook) or dense (bf16 weights)")
    ap.add_argument("--rotate-gb", type=float, default=1.2)
    ap.add_argument("--gguf", help="a GGUF file whose --tensors are rows too (kernel lowbit)")
    ap.add_argument("--tensors", default="", help="comma list of --gguf's tensors, a+b+c: one merged layer")
    ap.add_argument("--act-group", type=int, default=32,
                    help="--gguf rows: int8 activation scales per this many inputs, widened to the weight's group as "
                         "the plugin serves GGUF (its default 32); 0: one per token")
    args = ap.parse_args()
    if bool(args.gguf) != bool(args.tensors):
        ap.error("--gguf and --tensors go together: a GGUF file and the names of its tensors to time")
    if args.gguf and not any(a.startswith("--rows") for a in sys.argv[1:]):
        args.rows = []  # only the file's tensors
    base, new = load(args.base), native.library()
    best = native.best_isa()
    isas = args.isas.split(",") if args.isas else [best] + (["avx_vnni"] if best != "avx_vnni" and "avx_vnni" in native.supported_isas() else [])
    torch.manual_seed(0)
    rows = []
    with bench_lock(enabled=not args.no_lock):
        info = machine_info()
        for label in [r for r in args.rows if r in SEGMENT]:
            case = segment_case(*SEGMENT[label])
            for isa in isas:
                seg_fns = {"base": segment_entry(base, isa), "new": segment_entry(new, isa)}
                t = {"base": float("inf"), "new": float("inf")}
                for _ in range(args.rounds):
                    for build, lib in (("base", base), ("new", new)):
                        t[build] = min(t[build], time_segment(seg_fns[build], case, SEGMENT[label][5] > 1, isa, lib))
                rows.append(dict(shape=label, M=BEAMS, isa=isa, base_us=t["base"] * 1e6, new_us=t["new"] * 1e6,
                                 new_over_base=t["new"] / t["base"]))  # fmt: skip
                print(rows[-1], flush=True)
        entry = ENTRIES[args.kernel]
        for label in [r for r in args.rows if r in LOWBIT_SHAPES]:
            N, K = LOWBIT_SHAPES[label]
            sets, what = weight_sets(args.kernel, args.codebook, args.group, N, K, args.rotate_gb, args.progressive)
            for M in (int(m) for m in args.m.split(",")):
                x = torch.randn(M, K, dtype=torch.bfloat16)
                *vectors, y = kernel_vectors(args.kernel, args.codebook, args.group, sets, x, N)
                for isa in isas:
                    rows.append(dict(shape=label, M=M, isa=isa, kernel=args.kernel, weights=what,
                                     **ab_row(base, new, entry, vectors, y, isa, args.rounds)))
                    print(rows[-1], flush=True)
                del y, vectors
        for tensors in [t for t in args.tensors.split(",") if t]:
            sets, what, N, K, scalars = gguf_weight_sets(args.gguf, tensors, args.rotate_gb)
            for M in (int(m) for m in args.m.split(",")):
                x = torch.randn(M, K, dtype=torch.bfloat16)
                y = torch.empty(M, N, dtype=torch.bfloat16)
                span = math.lcm(args.act_group, scalars[1]) if args.act_group else K
                vectors = [native.lowbit_linear_args(y, x, q, s, z, None, scalars[0], scalars[1], scalars[2], scalars[3],
                                                     span, supers=sup) for q, s, z, sup in sets]  # fmt: skip
                for isa in isas:
                    rows.append(dict(shape=f"{tensors} {N}x{K}", M=M, isa=isa, kernel="lowbit",
                                     weights=f"{what}, activations per {span}",
                                     **ab_row(base, new, ENTRIES["lowbit"], vectors, y, isa, args.rounds)))
                    print(rows[-1], flush=True)
                del y, vectors
        native.set_isa(best)
        bw = read_bandwidth()
    notes = (f"{torch.get_num_threads()} threads, read bandwidth {bw:.1f} GB/s. Shape rows: kernel {args.kernel}, bf16 activations, "
             f"the C kernel alone timed in C over weights rotated through {args.rotate_gb:.1f} GB, rounds alternating "
             f"base ({args.base_name}) and new (the working tree), best of {args.rounds}. new_over_base > 1: the working "
             f"tree is slower; identical: both builds' outputs bit for bit on the first weight set. seg rows: "
             f"aipc_segment_sdpa (M = beams), bf16, best of 20 calls per round timed "
             f"from Python around the same ctypes call for both builds.")
    write_results(args.out, args.name, f"Native kernel A/B: working tree vs {args.base_name}", info, rows,
                  markdown_table(rows, ["shape", "M", "isa", "kernel", "weights", "base_us", "new_us", "new_over_base",
                                        "identical"]), notes)


if __name__ == "__main__":
    main()
