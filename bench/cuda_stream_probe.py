"""The CUDA C kernels against the op's shipped config, per Llama shape, each timed as ``bench/gemv_gpu.py``
times its rows (CUDA-graph replay over weight copies >= 4x L2): ``cuda_stream`` at M = 1, ``cuda_mma`` at
1 < M <= 64 and ``cuda_gemm`` at M > 16 (``--m M``, default 1):

    python bench/cuda_stream_probe.py [SHAPES] [OUT.json] [--m M] [--ship AB_NAME]

Prints, per shape, the shipped op's time, the read-only floor and the six fastest of the kernel's space
(``err``: max |difference| to the shipped op's output / max |output|; 0 = bit-identical at M = 1; at M > 1
the two sum in another order). ``--ship``: writes each shape's fastest config into this GPU's shipped
configs of the working tree where it took <= 0.97x the shipped op (their ``timed`` field names this run
and the A/B ``AB_NAME`` that is to check them: ``bench/triton_ab.py --m M`` against the tree without them).
"""
import json
import sys
from pathlib import Path

import torch

import gemv_gpu as gb  # bench/ is on sys.path when run as a script
from aipc_kernels.gpu.cuda import gemm as cuda_gemm, mma as cuda_mma, stream as cuda_stream
from aipc_kernels.gpu.triton.lowbit import linear as tlin
from aipc_kernels.gpu.triton.lowbit.tuning import SHIPPED_CONFIGS, config_key, select_config
from harness import select
from llama_shapes import SHAPES

SHIP_RATIO = 0.97


def probe(sname: str, l2: int, M: int) -> dict:
    N, K = SHAPES[sname]
    torch.manual_seed(0)
    W = (torch.randn(N, K, device="cuda") * 0.02).to(torch.bfloat16)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    state: dict = {}
    calls, _, _ = gb.row_ours(W, x, l2, state)
    ws = [f.__defaults__[0] for f in calls]
    cfg = select_config(x, ws[0], None, torch.empty(M, N, device="cuda", dtype=x.dtype))
    ref = tlin.lowbit_linear_triton(x, ws[0], config=cfg)
    op = gb.time_rotating([lambda w=w: tlin.lowbit_linear_triton(x, w, config=cfg) for w in ws]) * 1e6
    read_calls, _, _ = gb.row_read(W, x, l2, state)
    rd = gb.time_rotating(read_calls) * 1e6
    rows = []
    for c in cuda_stream.SPACE if M == 1 else cuda_mma.space(M) + cuda_gemm.space(M):
        try:
            out = tlin.lowbit_linear_triton(x, ws[0], config=c)
            err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
            t = gb.time_rotating([lambda w=w, c=c: tlin.lowbit_linear_triton(x, w, config=c) for w in ws]) * 1e6
            rows.append((t, err, c))
        except Exception as e:  # noqa: BLE001 - a variant the device cannot compile or launch
            rows.append((float("inf"), -1.0, dict(c, error=str(e)[:120])))
    rows.sort(key=lambda r: r[0])
    print(f"{sname}: op {op:.2f} read {rd:.2f} op/read {op / rd:.2f}  shipped {cfg}")
    for t, err, c in rows[:6]:
        fields = " ".join(f"{k}={v}" for k, v in c.items() if k not in ("KERNEL", "num_stages", "error"))
        print(f"   {c['KERNEL']} {t:.2f} x_read {t / rd:.2f} vs_op {t / op:.3f} err {err:.1e} {fields} {c.get('error', '')}")
    return dict(shape=sname, M=M, N=N, K=K, op=op, read=rd, shipped={k: v for k, v in cfg.items() if k not in ("by_kernel", "timed")},
                cuda_us=rows[0][0], cuda=rows[0][2], top=[dict(us=t, config=c) for t, _, c in rows[:5]])


def ship(device: str, results: list[dict], run: str, ab_name: str) -> None:
    allc = json.loads(SHIPPED_CONFIGS.read_text())
    h = allc[device]
    for e in results:
        ratio = e["cuda_us"] / e["op"]
        print(e["shape"], f"cuda {e['cuda_us']:.2f} op {e['op']:.2f} ratio {ratio:.3f}", "SHIP" if ratio <= SHIP_RATIO else "keep")
        if ratio <= SHIP_RATIO:
            h[config_key(e["M"], e["N"], e["K"], 64, 2)] = dict(
                e["cuda"], us=round(e["cuda_us"], 2), timed=f"op from HBM (bench/cuda_stream_probe.py, {run}.log); A/B: {ab_name}")
    SHIPPED_CONFIGS.write_text(json.dumps(allc, indent=1, sort_keys=True) + "\n")


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    ab_name = sys.argv[sys.argv.index("--ship") + 1] if "--ship" in sys.argv else None
    M = int(sys.argv[sys.argv.index("--m") + 1]) if "--m" in sys.argv else 1
    for value in (ab_name, str(M) if "--m" in sys.argv else None):
        if value in args:
            args.remove(value)
    shapes = select(args[0] if args else "*", list(SHAPES), "shapes")
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    device = torch.cuda.get_device_name(0)
    print(device)
    results = [probe(s, l2, M) for s in shapes]
    if len(args) > 1:
        Path(args[1]).write_text(json.dumps(dict(device=device, rows=results), indent=1))
    if ab_name:
        ship(device, results, Path(args[1]).stem if len(args) > 1 else "cuda_stream_probe", ab_name)


if __name__ == "__main__":
    main()
