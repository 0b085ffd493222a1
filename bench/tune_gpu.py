"""Tunes ``aipc::lowbit_linear``'s Triton configs on this GPU for the Llama shapes, and ships them.

    python bench/tune_gpu.py [--m 1,16,64,256,1024,4096] [--shapes '1B*,8B*'] [--out DIR]
    python bench/tune_gpu.py --merge DIR/lowbit_linear_configs-<GPU>.json   # into the shipped json

Tuning: for every shape and M, the op's own tuner (``triton.lowbit.tuning.tune``: CUDA-graph timing
of every config of every registered kernel, fused or dequantize-then-GEMM) on int2 group-64 weights
(the served format), bf16 activations; each winner goes to this device's tuning cache (so a
``bench/gemv_gpu.py`` run that follows uses it) and to ``DIR/lowbit_linear_configs-<GPU>.json``
(``{device name: {key: config}}``, each config with its time and every kernel's best time,
``by_kernel``); keys already in the tuning cache are kept (an interrupted run resumes). ``--merge`` adds such a file to ``shared/aipc_kernels/triton/lowbit/lowbit_linear_configs.json``,
replacing that device's configs of the same keys.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import torch

GROUP = 64


def tune_all(Ms: list[int], shapes: dict, out: Path) -> Path:
    from aipc_kernels.lowbit.packing import pack_for_triton
    from aipc_kernels.lowbit.quantizers import quantize_rtn
    from aipc_kernels.gpu.triton.lowbit import config_key, device_name, tuning

    name = device_name(torch.device("cuda"))
    tuned: dict[str, dict] = {}
    dest = out / f"lowbit_linear_configs-{re.sub(r'[^A-Za-z0-9._-]+', '_', name)}.json"
    cache = tuning.cache_file(name)
    done = json.loads(cache.read_text()) if cache.exists() else {}  # an interrupted run resumes
    torch.manual_seed(0)
    for sname, (N, K) in shapes.items():
        W = torch.randn(N, K, device="cuda") * 0.02
        p = pack_for_triton(quantize_rtn(W, "int2", GROUP))
        for M in Ms:
            key = config_key(M, N, K, GROUP, 2)
            if key in done:
                tuned[key] = done[key]
                continue
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            y = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
            t0 = time.time()
            cfg = tuning.tune(x, p, None, y)
            tuning.save_config(name, key, cfg)
            tuned[key] = cfg
            print(f"[tune] {sname} M={M} {key}: {cfg['KERNEL']} {cfg['us']} us, by kernel {cfg['by_kernel']} "
                  f"({time.time() - t0:.0f} s)", flush=True)  # fmt: skip
            dest.write_text(json.dumps({name: tuned}, indent=1, sort_keys=True))
    return dest


def merge(path: Path) -> None:
    from aipc_kernels.gpu.triton.lowbit import SHIPPED_CONFIGS

    shipped = json.loads(SHIPPED_CONFIGS.read_text())
    for device, cfgs in json.loads(path.read_text()).items():
        shipped.setdefault(device, {}).update(cfgs)
        print(f"[tune] {device}: {len(cfgs)} configs merged, {len(shipped[device])} shipped")
    SHIPPED_CONFIGS.write_text(json.dumps(shipped, indent=1, sort_keys=True) + "\n")


def main() -> int:
    from harness import select
    from llama_shapes import SHAPES

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", default="1,16,64,256,1024,4096")
    ap.add_argument("--shapes", default="*", help="comma list of shapes, names or patterns such as '8B*'")
    ap.add_argument("--out", default=".", help="folder for lowbit_linear_configs-<GPU>.json")
    ap.add_argument("--merge", help="a tuned json to merge into the shipped configs (no GPU needed)")
    args = ap.parse_args()
    if args.merge:
        merge(Path(args.merge))
        return 0
    if not torch.cuda.is_available():
        print("tune_gpu.py needs a CUDA GPU (or --merge FILE)", file=sys.stderr)
        return 2
    shapes = {k: SHAPES[k] for k in select(args.shapes, list(SHAPES), "--shapes")}
    print(f"[tune] wrote {tune_all([int(m) for m in args.m.split(',')], shapes, Path(args.out))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
