"""The projection matrices the benchmarks time: Llama-3.2-1B and Llama-3-8B, (N = out, K = in)."""

SHAPES = {
    "1B qkv/o 2048x2048": (2048, 2048),
    "1B gate/up 8192x2048": (8192, 2048),
    "1B down 2048x8192": (2048, 8192),
    "1B kv 512x2048": (512, 2048),
    "8B q/o 4096x4096": (4096, 4096),
    "8B kv 1024x4096": (1024, 4096),
    "8B gate/up 14336x4096": (14336, 4096),
    "8B down 4096x14336": (4096, 14336),
}
