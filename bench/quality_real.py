"""The real-model half of ``bench/quality.py``: trained models from the package registry
(:mod:`aipc_kernels.core.registry_models`, read by transformers' own GGUF reader), two fixed offline texts,
and the tables and summary lines of the real-model rows.

* Model: the GGUF file as transformers dequantizes it, in float32 (the "float" reference row). A
  tied output projection is given its own copy, so that head rows change the head and not the input
  embedding (the plugins keep the embedding float).
* Texts (nothing downloaded; fixed for a given Python): ``english``, the language reference's topics
  (``pydoc_data.topics``, sorted by topic); ``code``, the standard library's ``.py`` files held out by
  the trained proxy's rule (path hash), sorted by path. Each is tokenized by the model's tokenizer,
  and its first ``windows x context`` tokens are cut into non-overlapping windows.
* ``rel_err``: the largest per-layer ``||W - Wq||_F / ||W||_F`` of a row's linears: the quantity the
  plugins log at load, and from which :data:`aipc_kernels.lowbit.quality_gate.UNUSABLE_REL_ERROR` is read.
"""
from __future__ import annotations

import hashlib
import math
import sysconfig
from pathlib import Path
from typing import Optional

import torch

from aipc_kernels.core.registry_models import MODELS, fetch, load_transformers
from harness import markdown_table

#: a row is "unusable" when its perplexity (both texts) is more than this many times the float model's
UNUSABLE_PPL_RATIO = 2.0
#: ... and "noise" when it is more than this many times
DOOMED_PPL_RATIO = 100.0
TEXTS = ("english", "code")


def load(name: str):
    """``(model float32 eval, tokenizer, BOS id or None)`` with an untied output projection; the BOS id
    when the file says a text starts with it (``tokenizer.ggml.add_bos_token``, as llama.cpp reads it). A
    transformers that would convert the file's tokenizer wrongly is refused first."""
    from aipc_kernels.checkpoints.gguf import GGUFCheckpoint

    GGUFCheckpoint.open(fetch(name)).check_tokenizer_conversion()
    model, tok = load_transformers(name)
    head, emb = model.get_output_embeddings(), model.get_input_embeddings()
    if head.weight is emb.weight:
        head.weight = torch.nn.Parameter(emb.weight.detach().clone(), requires_grad=False)
    return model, tok, file_bos(fetch(name))


def llamacpp_act_groups(name: str, model) -> dict[str, int]:
    """Linear name -> the int8 activation group llama.cpp's CPU dot products give its layer in registry model
    ``name``'s GGUF file: per 32 (Q8_0 / Q8_1), a layer's larger group, a K-quant's super-block of 256 (Q8_K).
    This is what vLLM serves with ``gguf_cpu``'s ``act_super_block`` (``vllm_lowbit.options.gguf_layer_act_group``);
    the file's tensors are found under the model's names by the plugin's own map (transformers'
    ``get_gguf_hf_weights_map``)."""
    from gguf.constants import QK_K  # the K-quants' super-block: 256

    from aipc_kernels.checkpoints.gguf import K_QUANTS, LOWBIT_TYPES, GGUFCheckpoint
    from aipc_kernels.lowbit.modules import linear_names
    from vllm_lowbit.gguf_source import GGUFTensors
    from vllm_lowbit.options import GGUF_ACT_GROUP, gguf_layer_act_group

    ck = GGUFCheckpoint.open(fetch(name))
    names = GGUFTensors(ck, model.config)
    out = {}
    for n in linear_names(model):
        qtype = ck.tensor_type(names.gguf_name(f"{n}.weight"))
        out[n] = gguf_layer_act_group(GGUF_ACT_GROUP, LOWBIT_TYPES[qtype][1], QK_K if qtype in K_QUANTS else None,
                                      model.get_submodule(n).in_features)  # fmt: skip
    return out


def file_bos(path) -> Optional[int]:
    """The BOS id when the GGUF file says a text starts with it (``tokenizer.ggml.add_bos_token``, as
    llama.cpp reads it), else None."""
    import gguf

    fields = gguf.GGUFReader(str(path)).fields
    add_bos = fields.get("tokenizer.ggml.add_bos_token")
    return int(fields["tokenizer.ggml.bos_token_id"].contents()) if add_bos is not None and add_bos.contents() else None


def english_text() -> str:
    import pydoc_data.topics as topics

    return "\n\n".join(topics.topics[k] for k in sorted(topics.topics))


def code_text(heldout_pct: int = 5) -> str:
    root = Path(sysconfig.get_paths()["stdlib"])
    rels = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.py")
                  if p.is_file() and not {"site-packages", "dist-packages"} & set(p.relative_to(root).parts))
    held = [r for r in rels if int(hashlib.sha256(r.encode()).hexdigest()[:8], 16) % 100 < heldout_pct]
    return "\n\n".join((root / r).read_text(errors="replace") for r in held)


def eval_windows(tok, bos: Optional[int], context: int, windows: int
                 ) -> tuple[torch.Tensor, torch.Tensor, list[tuple[str, int]], dict]:  # fmt: skip
    """Inputs and targets ``[n, context]`` of both texts (english first) and ``[(text, windows)]``. With
    ``bos`` (a model whose texts start with it, Gemma) every window starts with it too (such models are
    not meant to run without it); its position is not scored."""
    xs, ys, spans, facts = [], [], [], {}
    span = context if bos is None else context - 1
    for label, text in (("english", english_text()), ("code", code_text())):
        ids = torch.tensor(tok(text, add_special_tokens=False)["input_ids"], dtype=torch.int64)
        n = min(windows, (ids.numel() - 1) // span)
        x, y = ids[: n * span].view(n, span), ids[1 : n * span + 1].view(n, span)
        if bos is not None:  # [BOS, t0 .. t_{c-2}] predicts [ignored, t1 .. t_{c-1}]: score from t0's successor
            x = torch.cat([torch.full((n, 1), bos), x], 1)
            y = torch.cat([torch.full((n, 1), -100), y], 1)
        xs.append(x)
        ys.append(y)
        spans.append((label, n))
        facts[label] = dict(chars=len(text), tokens=ids.numel(), sha256=hashlib.sha256(text.encode()).hexdigest()[:16],
                            eval_tokens=n * span, bos_per_window=bos is not None)  # fmt: skip
    return torch.cat(xs), torch.cat(ys), spans, facts


def text_ppl(win_nll: torch.Tensor, spans: list[tuple[str, int]]) -> dict[str, float]:
    """Perplexity of each text from the per-window mean nll (windows in ``spans`` order)."""
    out, i = {}, 0
    for label, n in spans:
        out[label] = math.exp(win_nll[i : i + n].mean().item())
        i += n
    return out


# ------------------------------------------------------------------------------------------ report


def _ratio(r: dict, ref: dict) -> float:
    return r["ppl"] / ref["ppl"]


def usable(r: dict, ref: dict) -> bool:
    return _ratio(r, ref) <= UNUSABLE_PPL_RATIO


def _ppl(v: float) -> str:
    return f"{v:,.2f}" if v < 1000 else f"{v:,.0f}"


def _line(r: dict, ref: dict) -> dict:
    from quality import kl_str

    return {"ppl english": _ppl(r["ppl_english"]), "ppl code": _ppl(r["ppl_code"]), "x float": f"{_ratio(r, ref):,.2f}",
            "KL": kl_str(r["kl"]), "top1": f"{r['top1']:.1%}",
            "rel_err": "" if r.get("rel_err") is None else f"{r['rel_err']:.3f}"}  # fmt: skip


def error_bounds(rows: list[dict]) -> Optional[tuple[float, float, float]]:
    """Over every model's weights rows: (``safe``: the largest rel_err up to which every row is usable,
    ``doomed``: the smallest rel_err from which every row's perplexity is over ``DOOMED_PPL_RATIO``x the
    float model's, the best perplexity ratio among those rows)."""
    w = sorted((r for r in rows if r["section"] == "weights" and r.get("rel_err") is not None),
               key=lambda r: r["rel_err"])  # fmt: skip
    if not w:
        return None
    safe = 0.0
    for r in w:
        if not usable(r, r["_ref"]):
            break
        safe = r["rel_err"]
    doomed_rows: list[dict] = []
    for r in reversed(w):
        if _ratio(r, r["_ref"]) <= DOOMED_PPL_RATIO:
            break
        doomed_rows.append(r)
    if not doomed_rows:
        return safe, float("inf"), float("inf")
    return safe, doomed_rows[-1]["rel_err"], min(_ratio(r, r["_ref"]) for r in doomed_rows)


def tables(model: str, rows: list[dict]) -> str:
    ref = next(r for r in rows if r["section"] == "reference")
    parts = [f"Float: ppl english {_ppl(ref['ppl_english'])}, code {_ppl(ref['ppl_code'])}."]
    w = [r for r in rows if r["section"] == "weights"]
    if w:
        body = [dict(codebook=r["codebook"], bits=r["bits"], group=r["group_label"], quantizer=r["quantizer"],
                     bpw=f"{r['bpw']:.2f}", **_line(r, ref)) for r in w]  # fmt: skip
        parts.append(f"### {model}: weights (float activations, float output projection)\n\n" + markdown_table(body, list(body[0])))
    a = [r for r in rows if r["section"] == "activations"]
    if a:
        body = [dict(weights=r["weights"], act=r["act"], **_line(r, ref)) for r in a]
        parts.append(f"### {model}: activations (float output projection)\n\n" + markdown_table(body, list(body[0])))
    h = [r for r in rows if r["section"] == "head"]
    if h:
        body = [dict(weights=r["weights"], act=r["act"], head=r["head"], **_line(r, ref)) for r in h]
        parts.append(f"### {model}: output projection\n\n" + markdown_table(body, list(body[0])))
    pg = [r for r in rows if r["section"] == "progressive"]
    if pg:
        body = [dict(weights=r["weights"], bpw=f"{r['bpw']:.2f}", **_line(r, ref)) for r in pg]
        parts.append(f"### {model}: the progressive two-level form against float16 group scales (A8 per token, float "
                     f"output projection)\n\n" + markdown_table(body, list(body[0])))
    g = [r for r in rows if r["section"] == "gguf"]
    if g:
        body = [dict(linears=published(r), act=r["act"], head=r["head"], **_line(r, ref)) for r in g]
        parts.append(f"### {model}: the GGUF as published against re-quantized (A8 per token / per group: 32 (as "
                     f"served) and llama.cpp's groups (A8 Q8_K) for the file's own, 64 for the re-quantized; float / "
                     f"int8 output projection)\n\nA8 Q8_K: each linear's activations per 32 (Q8_0), a K-quant's per "
                     f"super-block of 256 (Q8_K), as llama.cpp's CPU dot products; vllm_lowbit's act_super_block.\n\n"
                     + markdown_table(body, list(body[0])))
    return "\n\n".join(parts)


def published(r: dict) -> str:
    """A row's linears: ``as published`` for the file's own values, else the re-quantized format."""
    return "as published (GGUF)" if r["weights"] == "bf16" else r["weights"] + " (re-quantized)"


def conclusions(model: str, rows: list[dict]) -> list[str]:
    """One model's summary lines: the plugins' defaults and the best rows at 2 and 4 bits."""
    ref = next(r for r in rows if r["section"] == "reference")

    def find(section: str, weights: str, act: str = "A16", head: str = "bf16") -> Optional[dict]:
        return next((r for r in rows if r["section"] == section and r["weights"] == weights and r["act"] == act
                     and r["head"] == head), None)  # fmt: skip

    def d(r: Optional[dict]) -> str:
        if r is None:
            return "not run"
        return (f"ppl {_ppl(r['ppl_english'])} / {_ppl(r['ppl_code'])} (x{_ratio(r, ref):,.2f}, KL {r['kl']:.3g}, "
                f"top-1 {r['top1']:.1%})")  # fmt: skip

    out = [f"{model}: float (GGUF dequantized) ppl english {_ppl(ref['ppl_english'])}, code {_ppl(ref['ppl_code'])}."]
    w = [r for r in rows if r["section"] == "weights"]
    two = [r for r in w if r["bits"] <= 2]
    four = [r for r in w if r["bits"] == 4]
    if two:
        best = min(two, key=lambda r: r["ppl"])
        out.append(f"2-bit post-training quantization: lowbit2's default (affine g64 optimized) {d(find('weights', 'affine g64 optimized'))}; "
                   f"best 2-bit or 1-bit row ({best['weights']}) {d(best)}; {sum(usable(r, ref) for r in two)} of {len(two)} "
                   f"such rows usable (ppl at most {UNUSABLE_PPL_RATIO:g}x the float model's).")  # fmt: skip
    if four:
        ranked = sorted((r for r in four if r["group"] != 32), key=lambda r: r["ppl"])
        out.append(f"4-bit: affine4 g64 optimized (lowbit4's default) {d(find('weights', 'affine4 g64 optimized'))}; "
                   f"int4 g128 optimized (its default before) {d(find('weights', 'int4 g128 optimized'))}; int4 g64 "
                   f"optimized {d(find('weights', 'int4 g64 optimized'))}; e0m4 g64 optimized "
                   f"{d(find('weights', 'e0m4 g64 optimized'))}; best at groups of 64 or more: {ranked[0]['weights']}. "
                   f"Group 32: affine4 {d(find('weights', 'affine4 g32 optimized'))}, int4 {d(find('weights', 'int4 g32 optimized'))}"
                   + (" (affine4 g32 is the grid of the file's own Q4_1 blocks: it reproduces them, so that row measures "
                      "the file, not a re-quantization)" if "smollm2" in model else "") + ".")  # fmt: skip
    for weights in ("affine g64 optimized", "affine4 g64 optimized", "int4 g128 optimized"):
        tok, grp = find("activations", weights, "A8 token"), find("activations", weights, "A8 g64")
        if tok:
            out.append(f"{weights}: A16 {d(find('activations', weights))}, A8 per token {d(tok)}"
                       + (f", A8 per 64-group {d(grp)}" if grp else "") + ".")
    prog = {w: find("progressive", w, "A8 token") for w in ("min2 g64 progressive", "affine g64 optimized",
                                                             "min4 g128 progressive", "affine4 g128 optimized")}
    if any(prog.values()):
        out.append("Progressive two-level form (A8 per token, float output projection): " + "; ".join(
            f"{w} {d(r)}" for w, r in prog.items()) + ".")  # fmt: skip
    g = [r for r in rows if r["section"] == "gguf"]
    if g:
        out.append(f"GGUF as published and served (A8 per 32-group into the linears, the file's output projection on "
                   f"float activations): {d(find('gguf', 'bf16', 'A8 g32'))}; with llama.cpp's groups (a K-quant's A8 per "
                   f"super-block of 256, Q8_K) {d(find('gguf', 'bf16', 'A8 Q8_K'))}; A8 per token "
                   f"{d(find('gguf', 'bf16', 'A8 token'))}; with an int8 output projection (A8 per 32) "
                   f"{d(find('gguf', 'bf16', 'A8 g32', 'int8'))}. Re-quantized from it (A8 per 64-group, float output "
                   f"projection): " + "; ".join(f"{w} {d(find('gguf', w, 'A8 g64'))}" for w in
                                              ("affine4 g64 optimized", "int4 g64 optimized", "e0m4 g64 optimized",
                                               "affine g64 optimized")) + ".")  # fmt: skip
    i8 = next((r for r in rows if r["section"] == "head" and r["weights"] == "bf16" and r["head"] == "int8"), None)
    if i8:
        out.append(f"Output projection int8 per output channel with float linears: {d(i8)}.")
    i6 = next((r for r in rows if r["section"] == "head" and r["weights"] == "bf16" and r["head"] == "int6"), None)
    if i6:
        out.append(f"Output projection int6 in groups of 32 (6.5 bits a weight) with float linears: {d(i6)}.")
    return out


__all__ = ["MODELS", "TEXTS", "UNUSABLE_PPL_RATIO", "conclusions", "eval_windows", "load", "tables", "text_ppl",
           "error_bounds", "usable"]
