"""Demo part 2 (OpenVINO venv): ``OVModelForCausalLM.from_pretrained(MODEL, export_npu=True)`` then
``generate``; prints the manifest (npu_export.json) and the static-shape check, and compares the
greedy tokens with transformers eager (float32 both sides). No NPU here: OpenVINO's CPU device runs
the same static IRs.

    .venvs/openvino/bin/python -m demo_parts.npu_export [--model DIR]   (PYTHONPATH=scripts)
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from demo_parts.common import Refused, run_part, same_prefix

# Small enough to export in seconds, large enough that the demo's tokens cross prefill blocks and
# KV buckets; fp32 weights and f32 inference so the tokens can equal transformers' float32 exactly.
EXPORT_KW = dict(max_seq_len=256, prefill_block=16, kv_buckets=[32, 64, 128], weight_format="fp32")
F32 = {"INFERENCE_PRECISION_HINT": "f32"}
PROMPT = "The quiet river reads a long letter in the kitchen, and the old engineer checks"


def manifest_summary(directory: Path) -> str:
    """One line from ``npu_export.json``: what was exported, in which static pieces."""
    m = json.loads((directory / "npu_export.json").read_text())
    groups = m["layer_groups"]
    files = 2 + sum(1 + len(g["decode"]) for g in groups)
    return (f"{m['model_type']}, {m['num_layers']} layers in {len(groups)} chunk(s), max_seq_len {m['max_seq_len']}, "
            f"prefill block {m['prefill_block']}, KV buckets {m['kv_buckets']}, {files} IRs, "
            f"quantization {json.dumps(m['quantization']) if m.get('quantization') else 'none'}")  # fmt: skip


def timed_generate(model, ids, n: int) -> tuple[list[int], float, float]:
    """Greedy ``n`` tokens (no EOS stop); the first token's time and the decode rate after it."""
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    t0 = time.perf_counter()
    model.generate(ids, max_new_tokens=1, **kw)
    t1 = time.perf_counter()
    out = model.generate(ids, max_new_tokens=n, **kw)[0, ids.shape[1] :].tolist()
    t2 = time.perf_counter()
    first = t1 - t0
    return out, first, (n - 1) / max(t2 - t1 - first, 1e-9)


def main(args, model_dir: Path) -> str:
    from optimum.intel import OVModelForCausalLM
    from transformers import AutoTokenizer

    from tests.helpers.references import greedy, hf_model
    from optimum_npu import check_npu_ready

    t0 = time.perf_counter()
    try:
        model = OVModelForCausalLM.from_pretrained(model_dir, export_npu=True, device="CPU", ov_config=F32, **EXPORT_KW)
    except (ValueError, NotImplementedError) as e:
        raise Refused(f"export_npu refused this model: {e}") from None
    export_s = time.perf_counter() - t0
    print(f"OVModelForCausalLM.from_pretrained(MODEL, export_npu=True, {', '.join(f'{k}={v!r}' for k, v in EXPORT_KW.items())}) "
          f"-> {type(model).__name__} in {export_s:.1f} s", flush=True)  # fmt: skip
    print(f"manifest (npu_export.json): {manifest_summary(model.model_dir)}", flush=True)
    ready = check_npu_ready(model.model_dir)  # raises naming the node on any dynamic dimension
    print(f"static-shape check (optimum_npu.check_npu_ready): {ready.files} IRs, {ready.nodes} nodes, "
          f"{ready.states} state variables, no dynamic dimension", flush=True)  # fmt: skip

    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok(PROMPT, return_tensors="pt").input_ids
    got, first_s, rate = timed_generate(model, ids, args.new_tokens)
    print(f"generate: {tok.decode(got)!r}", flush=True)
    ref = greedy(hf_model(model_dir, "float", attn_implementation="eager"), [ids[0].tolist()], args.new_tokens)[0]
    same = same_prefix(got, ref, "export_npu vs transformers eager", strict=args.model is None)
    print(f"transformers eager float32: {same}/{len(ref)} leading greedy tokens identical", flush=True)
    return (f"export {export_s:.1f} s, 0 dynamic dims in {ready.files} IRs; {ids.shape[1]}-token prompt: first token "
            f"{first_s * 1e3:.0f} ms, decode {rate:.0f} tok/s (OpenVINO CPU); greedy tokens = transformers: "
            f"{same}/{len(ref)}")  # fmt: skip


if __name__ == "__main__":
    run_part(main, __doc__)
