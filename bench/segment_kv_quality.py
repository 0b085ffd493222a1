"""Quality of ``ipex_segment_kv.optimize(model, weights=...)`` on a real trained model, through the user path.

    python bench/segment_kv_quality.py [--windows 4] [--context 512] [--out bench/results/quality]

SmolLM2-135M-Instruct (Q4_1 GGUF from the package registry, read and dequantized to float32 by transformers'
own GGUF reader, :func:`aipc_kernels.core.registry_models.load_transformers`; Apache-2.0) is optimized as a user
would: ``optimize(model)`` (the ``fused`` row: float weights) and ``optimize(model, weights=...)`` for
``int8``, ``int4`` and ``lowbit2`` (the last with ``allow_2bit_ptq=True``), and ``int4`` with
``act_quant="per_group"`` (row ``int4_per_group``), each on a fresh copy. Every row
runs the fused decoder layers and the quantized lm_head exactly as generate does (int8 activations
inside the kernel, scaled as the row says), teacher-forced over the fixed offline texts of ``bench/quality_real.py``
(``english``: the language reference's topics; ``code``: held-out standard-library files), ``--windows``
non-overlapping windows of ``--context`` tokens each.

Per row: perplexity of each text, its ratio to the float model's (english), the mean KL(float || row) per
token, teacher-forced top-1 agreement with the float model (the share of positions whose arg-max token is
the float model's), the linears' bytes. The float reference is the model before ``optimize`` (stock
transformers, sdpa). Takes the bench lock.
"""
from __future__ import annotations

import copy
import math
import time

import torch

from harness import BenchParser, bench_lock, machine_info, write_results  # bench/ on sys.path
from quality_real import eval_windows, file_bos, text_ppl

TITLE = "ipex_segment_kv weight quantization: quality on a real trained model (SmolLM2-135M-Instruct)"
MODEL = "smollm2-135m-instruct"
ROWS = ["fused", "int8", "int4", "int4_per_group", "lowbit2"]


def evaluate(model, xs: torch.Tensor, ys: torch.Tensor, ref_logp: list[torch.Tensor] | None):
    """Per-window mean nll, the log-probabilities (kept for the reference), mean KL(ref || model) and
    top-1 agreement with the reference."""
    nll, logps, kl, agree, n = [], [], 0.0, 0, 0
    with torch.inference_mode():
        for i in range(xs.shape[0]):
            logp = torch.log_softmax(model(input_ids=xs[i : i + 1]).logits.float()[0], -1)
            y = ys[i]
            keep = y >= 0
            nll.append(-logp[keep].gather(-1, y[keep, None]).mean())
            if ref_logp is None:
                logps.append(logp)
            else:
                ref = ref_logp[i]
                kl += (ref.exp() * (ref - logp)).sum(-1)[keep].sum().item()
                agree += (ref.argmax(-1) == logp.argmax(-1))[keep].sum().item()
                n += int(keep.sum())
    return torch.stack(nll), logps, (kl / n if n else 0.0), (agree / n if n else 1.0)


def main() -> None:
    parser = BenchParser("segment_kv_quality", __doc__, ROWS, what="rows", group="quality")
    parser.add_argument("--windows", type=int, default=4, help="windows per text")
    parser.add_argument("--context", type=int, default=512, help="tokens per window")
    args = parser.parse_args()

    import ipex_segment_kv
    from aipc_kernels.core.registry_models import fetch, load_transformers

    with bench_lock(enabled=not args.no_lock):
        info = machine_info()
        model, tok = load_transformers(MODEL)
        xs, ys, spans, facts = eval_windows(tok, file_bos(fetch(MODEL)), args.context, args.windows)
        nll, ref_logp, _, _ = evaluate(model, xs, ys, None)
        ref_ppl = text_ppl(nll, spans)
        linear_bytes = sum(m.weight.numel() * m.weight.element_size() for m in model.modules()
                           if type(m) is torch.nn.Linear)  # fmt: skip
        rows = [dict(row="float", ppl=ref_ppl, kl=0.0, top1=1.0, linear_bytes=linear_bytes, quantize_s=0.0)]
        for name in args.rows:
            m = copy.deepcopy(model)
            t0 = time.perf_counter()
            scheme, _, act = name.partition("_per_")
            if name == "fused":
                ipex_segment_kv.optimize(m)
            else:
                ipex_segment_kv.optimize(m, weights=scheme, allow_2bit_ptq=scheme == "lowbit2",
                                         act_quant="per_group" if act else "per_token")  # fmt: skip
            quantize_s = time.perf_counter() - t0
            report = getattr(m, "_aipc_segment_kv_weights", None)
            fused = m._aipc_segment_kv_fusion["fused"]
            nll, _, kl, top1 = evaluate(m, xs, ys, ref_logp)
            rows.append(dict(row=name, ppl=text_ppl(nll, spans), kl=kl, top1=top1, fused_layers=fused,
                             linear_bytes=report["bytes_after"] if report else linear_bytes, quantize_s=quantize_s))  # fmt: skip
            print(rows[-1], flush=True)
            del m
    body = markdown(rows, ref_ppl)
    notes = (f"{MODEL} as transformers reads its GGUF (float32, {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M "
             f"parameters, tied embeddings: the int8 lm_head is a copy, the input embedding stays float); texts "
             f"{', '.join(f'{label} ({n} windows of {args.context})' for label, n in spans)}; "
             f"{torch.get_num_threads()} threads.")  # fmt: skip
    write_results(args.out, args.name, TITLE, info, rows, body, notes, extra=dict(texts=facts))


def markdown(rows: list[dict], ref_ppl: dict) -> str:
    lines = ["| row | weights (linears; lm_head) | ppl english | ppl code | x float (english) | KL (nats/token) | "
             "top-1 agreement with float | linears MiB | optimize s |",
             "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    what = {"float": "float32 (stock transformers)", "fused": "float32 (fused layers)",
            "int8": "int8 per channel; int8", "int4": "affine4 g128 where 128 divides K (down_proj), else g64 (K=576); int8",
            "int4_per_group": "as int4, activations per token and weight group", "lowbit2": "affine 2-bit g64; int8"}  # fmt: skip
    for r in rows:
        p = r["ppl"]
        lines.append(f"| {r['row']} | {what.get(r['row'], '')} | {_ppl(p['english'])} | {_ppl(p['code'])} | "
                     f"{p['english'] / ref_ppl['english']:,.2f} | {r['kl']:.4f} | {r['top1']:.1%} | "
                     f"{r['linear_bytes'] / 2**20:.1f} | {r['quantize_s']:.1f} |")  # fmt: skip
    lines += ["", "Activations are int8 inside the kernel, one scale per token in every quantized row (as generate runs "
              "them) but the *_per_group ones (optimize(..., act_quant=\"per_group\"): one scale per token and weight "
              "group, the lm_head's per token). "
              "lowbit2 is 2-bit post-training quantization of a trained model: noise, as "
              "bench/results/quality/quality.md found for vllm_lowbit (optimize refuses it without allow_2bit_ptq=True).", ""]
    return "\n".join(lines)


def _ppl(v: float) -> str:
    return f"{v:,.2f}" if v < 1000 else f"{v:,.0f}"


if __name__ == "__main__":
    main()
