"""Kernel by kernel GPU time of ``aipc::lowbit_linear`` at M=1 and M=16 on the Llama-3-8B shapes (torch.profiler,
50 calls, no CUDA graph), with whatever configs the tuning cache / shipped json give:

    python bench/kernel_times_gpu.py

Prints one line per shape and M: each kernel's mean device time. Where the op's time goes (activation pass
vs the GEMV/GEMM) when the bench's row is over the read-only floor."""
import sys
import torch
from torch.profiler import profile, ProfilerActivity
sys.path[:0] = ["shared", "bench"]
from aipc_kernels.ops import lowbit_linear
from aipc_kernels.packing import pack_for_triton
from aipc_kernels.quantizers import quantize_rtn
from llama_shapes import SHAPES

for sname in ("8B q/o 4096x4096", "8B gate/up 14336x4096", "8B down 4096x14336", "8B kv 1024x4096"):
    N, K = SHAPES[sname]
    p = pack_for_triton(quantize_rtn(torch.randn(N, K, device="cuda") * 0.02, "int2", 64))
    for M in (1, 16):
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        for _ in range(3):
            lowbit_linear(x, p)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(50):
                lowbit_linear(x, p)
            torch.cuda.synchronize()
        rows = [(e.key, e.device_time_total / e.count, e.count) for e in prof.key_averages() if e.device_time_total > 0]
        print(f"{sname} M={M}: " + "; ".join(f"{k[:40]} {t:.2f}us x{c}" for k, t, c in rows), flush=True)
