"""The projection matrices the benchmarks time: Llama-3.2-1B and Llama-3-8B, (N = out, K = in), the
output projections (vocabulary x hidden) that decode reads once per token, and the merged projections of
bench/segment_kv.py's ``llama-150m`` model."""

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

#: output projections: Llama-3.2-1B (tied) and BitNet b1.58 2B-4T (tied), vocabulary 128256
HEAD_SHAPES = {
    "1B lm_head 128256x2048": (128256, 2048),
    "2B-4T lm_head 128256x2560": (128256, 2560),
}

#: bench/segment_kv.py's ``llama-150m`` (hidden 768, 12 heads of 64, 4 KV heads or 12, MLP 2048) as its fused
#: layers call the op: q/k/v and gate/up merged
SEGMENT_KV_SHAPES = {
    "150m qkv 1280x768": (1280, 768),
    "150m qkv MHA 2304x768": (2304, 768),
    "150m o 768x768": (768, 768),
    "150m gate/up 4096x768": (4096, 768),
    "150m down 768x2048": (768, 2048),
}
