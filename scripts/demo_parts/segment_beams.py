"""Demo part 3 (transformers venv): beam search (``num_beams=4``) with
``attn_implementation="segment_kv"`` against stock transformers (sdpa) on the same float32 model:
the same beams, and the KV memory of each.

    .venvs/transformers/bin/python -m demo_parts.segment_beams [--model DIR]   (PYTHONPATH=scripts)
"""
from __future__ import annotations

import time
import warnings
from pathlib import Path

from demo_parts.common import Refused, run_part

NUM_BEAMS = 4
# Two prompts of different lengths (a left-padded batch); a long prompt is where sharing it pays.
PROMPTS = ["The old engineer reads a long letter in the kitchen, and the quiet river answers. " * 12,
           "Why is the sky blue? Maybe the weather knows. " * 14]  # fmt: skip


def beam_search(model, enc, n: int):
    """``generate`` with NUM_BEAMS beams, every beam returned, ``n`` new tokens; (output, seconds)."""
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as seen:  # one line per kind instead of one per step
        warnings.simplefilter("always")
        out = model.generate(**enc, num_beams=NUM_BEAMS, num_return_sequences=NUM_BEAMS, max_new_tokens=n,
                             min_new_tokens=n, do_sample=False, return_dict_in_generate=True)  # fmt: skip
    seconds = time.perf_counter() - t0
    kinds: dict[tuple, int] = {}
    for w in seen:
        key = (w.category.__name__, str(w.message).split(". ")[0][:160])  # first sentence: steps differ after it
        kinds[key] = kinds.get(key, 0) + 1
    for (category, text), count in kinds.items():
        print(f"  ({model.config._attn_implementation}: {category} x{count}: {text})", flush=True)
    return out, seconds


def main(args, model_dir: Path) -> str:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    stock = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    try:
        seg = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="segment_kv").eval()
        b, seg_s = beam_search(seg, enc, args.new_tokens)
    except (ValueError, NotImplementedError) as e:
        if "segment_kv" not in str(e):
            raise
        raise Refused(str(e)) from None
    a, stock_s = beam_search(stock, enc, args.new_tokens)
    cache = b.past_key_values
    if type(cache).__name__ != "SegmentKVCache":
        raise RuntimeError(f"generate ran with {type(cache).__name__}, not the segment KV cache")
    stock_bytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in a.past_key_values.layers)
    same = sum(torch.equal(x, y) for x, y in zip(a.sequences, b.sequences))
    rows = a.sequences.shape[0]
    print(f"{len(PROMPTS)} prompts of {enc['attention_mask'].sum(1).tolist()} tokens, num_beams={NUM_BEAMS}, "
          f"{args.new_tokens} new tokens: segment_kv {seg_s:.2f} s, stock {stock_s:.2f} s", flush=True)  # fmt: skip
    print(f"best beam of prompt 1: {tok.decode(b.sequences[0, enc['input_ids'].shape[1]:])!r}", flush=True)
    if same != rows and args.model is None:  # the tests assert equality on the tiny models
        raise RuntimeError(f"only {same}/{rows} beam sequences equal stock transformers'")
    return (f"KV cache peak {cache.peak_kv_bytes / 2**20:.2f} MiB vs stock's final {stock_bytes / 2**20:.2f} MiB "
            f"({cache.peak_kv_bytes / stock_bytes:.2f}x); {same}/{rows} beam sequences identical to stock")


if __name__ == "__main__":
    run_part(main, __doc__)
