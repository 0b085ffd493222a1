"""The fused decoder stack of ipex_segment_kv: segment attention (shared prompt K/V, fused
index-select SDPA) and its contract, the dense linear with norm / SiLU prologues and the residual
epilogue, the fused decoder layer, its weight-only-quantized projections, and RoPE."""
