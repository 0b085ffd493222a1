"""Constants and helpers shared by the optimum_npu tests (imported as ``npu_testing``)."""
from __future__ import annotations

from pathlib import Path

# Shapes used by the tests: a ~20-token prompt takes two 16-token prefill blocks; 64 new tokens
# then decode through the 32-, 64- and 128-slot KV buckets.
EXPORT_KW = dict(max_seq_len=128, prefill_block=16, kv_buckets=[32, 64], layers_per_chunk=1,
                 weight_format="fp32")
F32 = {"INFERENCE_PRECISION_HINT": "f32"}
ARCHS = ("llama", "qwen2", "qwen3", "mistral", "phi3", "phi3_longrope", "gemma")
PROMPT = "The quiet river reads a long letter in the kitchen, and the old engineer checks"


def build_qwen3(out: Path) -> Path:
    """A tiny random Qwen3 (transformers has it; the shared tiny_model builder does not), built
    like the builder's models: its tokenizer, N(0, 1/fan_in) matrices, unit norms."""
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    from aipc_kernels.tools.tiny_model import _TOKEN_IDS, build_tokenizer

    if (out / "model.safetensors").is_file():
        return out
    build_tokenizer(out)
    config = Qwen3Config(vocab_size=1024, hidden_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                         intermediate_size=256, max_position_embeddings=2048,
                         tie_word_embeddings=False, **_TOKEN_IDS)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                std = (2.0 if name == "lm_head.weight" else 1.0) / p.shape[1] ** 0.5
                p.normal_(0.0, std)
            else:
                p.fill_(1.0)
    model.generation_config = GenerationConfig(**_TOKEN_IDS)
    model.to(torch.bfloat16).save_pretrained(out)
    return out


def eager_greedy(src: Path, ids, new_tokens: int):
    """transformers eager, float32: greedy continuation of ``ids``. LongRoPE models: transformers'
    forward over the whole sequence at every step (what transformers >= 5.24 generate computes;
    5.5's Phi-3 generate drops the cache at original_max_position_embeddings and then continues
    from the new token alone)."""
    import torch
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32,
                                               attn_implementation="eager")
    if getattr(ref.config, "rope_parameters", {}).get("rope_type") != "longrope":
        return ref.generate(ids, max_new_tokens=new_tokens, do_sample=False)
    with torch.no_grad():
        for _ in range(new_tokens):
            nxt = ref(ids, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], dim=1)
    return ids
