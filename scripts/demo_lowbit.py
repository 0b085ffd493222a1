"""lowbit2 on a tiny local Llama: quantize, generate with the native kernels, compare with the
same model on float32 dequantized weights (run through scripts/demo.py, which builds the venv)."""
from __future__ import annotations

import argparse
import copy
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from aipc_kernels import native
from aipc_kernels.modules import dequantized_linear, quantize_linears
from aipc_kernels.testing.tiny_model import build_tiny_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--arch", default="llama")
    ap.add_argument("--codebook", default="affine")
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=24)
    args = ap.parse_args()

    path = build_tiny_model(args.arch)
    print(f"model: {path}")
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ref = copy.deepcopy(model)
    t0 = time.time()
    weights = quantize_linears(model, args.codebook, args.group_size)
    quantize_linears(ref, args.codebook, args.group_size, replace=dequantized_linear)
    lowbit_bytes = sum(w.nbytes() for w in weights.values())
    bf16_bytes = sum(w.out_features * w.in_features * 2 for w in weights.values())
    print(f"quantized {len(weights)} linears ({args.codebook}, group {args.group_size}) in {time.time() - t0:.1f} s: "
          f"{lowbit_bytes / 1e6:.2f} MB vs {bf16_bytes / 1e6:.2f} MB bf16 ({lowbit_bytes / bf16_bytes:.3f}x)")
    print(f"native kernel ISA: {native.get_isa()}")

    chat = [{"role": "user", "content": "Tell me about the small model on this laptop."}]
    ids = tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    gen = dict(max_new_tokens=args.new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
    with torch.inference_mode():
        t0 = time.time()
        out = model.generate(**ids, **gen)
        dt = time.time() - t0
        out_ref = ref.generate(**ids, **gen)
    new = out[0, ids["input_ids"].shape[1]:]
    new_ref = out_ref[0, ids["input_ids"].shape[1]:]
    same = int((new == new_ref).cumprod(0).sum())
    print(f"lowbit2 (W2A8, native): {tok.decode(new)!r}")
    print(f"float32 dequantized:    {tok.decode(new_ref)!r}")
    print(f"identical leading tokens: {same}/{len(new)}; {len(new) / dt:.1f} tokens/s")
    print("vllm serve --quantization lowbit2: not built yet (issue 5)")
    print("OVModelForCausalLM(..., export_npu=True): not built yet (issue 6)")
    print("segment KV cache beam search: not built yet (issue 7)")


if __name__ == "__main__":
    main()
