"""Conformance of ``vllm serve X.gguf`` (vllm_lowbit's GGUF path) with the reference implementation of the
format, llama.cpp, on the same file: real trained models from the package registry.

Per model (``--model``, keys of ``aipc_kernels.core.registry_models.MODELS``):

* **Teacher-forced logits.** ``llama-perplexity -f TEXT -c CONTEXT --chunks N --kl-divergence-base F`` scores
  the second half of each window (its rule) and writes its tokens and every scored position's
  log-probabilities (``F``, 16-bit quantized per position, read here). The same token windows (BOS first
  where the file says so, as llama.cpp does) go through ``vllm.LLM(X.gguf)`` with ``prompt_logprobs=1``
  (the top-1 token and the scored token's log-probability at every position) and through transformers'
  own GGUF reader (the file dequantized to float32: the "float" row). Reported: perplexity over the
  same positions (llama.cpp's own figure and ours), and top-1 agreement with llama.cpp's logits (a
  position whose llama.cpp top two are within its 16-bit step is counted apart as a tie), also over the
  positions where llama.cpp's top two are at least ``CLEAR_MARGIN`` nats apart.
* **The reference against itself.** llama.cpp runs twice (``REFERENCES``): as users run it (its defaults:
  a float16 K/V cache, flash attention where it chooses) and with float32 attention (a float32 K/V cache,
  no flash attention). Their top-1 agreement with each other is how far the reference itself moves under
  a change of its attention's precision, the floor any other implementation's agreement is read against.
* **Chat.** The chat template's prompt for "What is the capital of France?" (the tokenizer from the
  file; a file without a chat template: "The capital of France is" as a completion), 16 greedy tokens from vLLM and from ``llama-server`` (``/completion`` with the prompt's token
  ids): equal prefix, and the top-two margin of vLLM's log-probabilities where they first differ.

Text: ``bench/quality_real.english_text()`` (Python's pydoc topics; nothing downloaded).

    .venvs/vllm/bin/python bench/gguf_conformance.py [--model smollm2-135m-instruct,gemma3-270m] [--chunks 10]
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Optional

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import BenchParser, bench_lock, machine_info, markdown_table, write_results  # noqa: E402
from harness import llamacpp as lc  # noqa: E402

CHAT = [{"role": "user", "content": "What is the capital of France?"}]
CHAT_TOKENS = 16
COMPLETION = "The capital of France is"  # for a file without a chat template
MODELS = ("smollm2-135m-instruct", "gemma3-270m")
#: llama.cpp's two runs: its defaults, and float32 attention (float32 K/V cache, flash attention off)
REFERENCES = {"default": [], "f32_attention": ["-fa", "off", "-ctk", "f32", "-ctv", "f32"]}
#: top-1 agreement is also reported over the positions where llama.cpp's top two are this many nats apart
CLEAR_MARGIN = 0.1


def read_logits_file(path: Path) -> dict:
    """``llama-perplexity --kl-divergence-base`` output: ``tokens [n_chunk, n_ctx]`` and per chunk, for the
    scored positions ``first .. n_ctx - 2`` (``first = n_ctx // 2``), the argmax token, whether its lead
    over the runner-up is within one 16-bit step (a tie), and the log-probability of the next token."""
    raw = path.read_bytes()
    if raw[:8] != b"_logits_":
        raise ValueError(f"{path}: not a llama-perplexity logits file (magic {raw[:8]!r})")
    n_ctx, n_vocab, n_chunk = np.frombuffer(raw, np.int32, 3, 8)
    tokens = np.frombuffer(raw, np.int32, n_chunk * n_ctx, 20).reshape(n_chunk, n_ctx)
    nv = 2 * ((n_vocab + 1) // 2) + 4
    first = n_ctx // 2
    per_chunk = n_ctx - 1 - first
    rec = np.frombuffer(raw, np.uint16, n_chunk * per_chunk * nv, 20 + 4 * n_chunk * n_ctx).reshape(n_chunk, per_chunk, nv)
    head = rec[..., :4].copy().view(np.float32)  # [scale, min_log_prob]
    q = rec[..., 4 : 4 + n_vocab]
    top2 = np.partition(q, -2, axis=-1)[..., -2:].astype(np.float32)
    nxt = tokens[:, first + 1 :]
    q_next = np.take_along_axis(q, nxt[..., None].astype(np.int64), -1)[..., 0]
    return dict(n_ctx=int(n_ctx), n_vocab=int(n_vocab), n_chunk=int(n_chunk), first=first, tokens=tokens,
                top1=q.argmax(-1), tie=(top2[..., 1] - top2[..., 0]) <= 1, margin=(top2[..., 1] - top2[..., 0]) * head[..., 0],
                logprob_next=head[..., 1] + q_next * head[..., 0])  # fmt: skip


def llama_perplexity(gguf: Path, text: Path, context: int, chunks: int, threads: int, logits: Path, isa: str,
                     extra: list[str]) -> None:  # fmt: skip
    """Runs ``llama-perplexity`` (with ``extra`` options, :data:`REFERENCES`) writing its tokens and
    log-probabilities to ``logits`` (its printed estimate is not read: its logger may not flush its last lines
    before the process exits)."""
    exe = lc.llamacpp_bin(lc.DEFAULT_CACHE, "llama-perplexity", isa)
    cmd = [str(exe), "-m", str(gguf), "-f", str(text), "-c", str(context), "--chunks", str(chunks), "-t", str(threads),
           "-b", str(context), "--kl-divergence-base", str(logits), *extra]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode or not logits.exists():
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")


def windows(ref: dict, bos: Optional[int]) -> list[list[int]]:
    """The token windows llama.cpp evaluated: BOS in place of each window's first token where it adds one."""
    out = []
    for row in ref["tokens"]:
        w = [int(t) for t in row]
        if bos is not None:
            w[0] = bos
        out.append(w)
    return out


def score(top1: np.ndarray, nll: np.ndarray, ref: dict) -> dict:
    """Perplexity over the scored positions and top-1 agreement with llama.cpp (ties apart; and over the
    positions where its top two are at least CLEAR_MARGIN nats apart)."""
    agree = top1 == ref["top1"]
    tie, clear = ref["tie"], ref["margin"] >= CLEAR_MARGIN
    return dict(ppl=math.exp(float(nll.mean())), top1=float(agree[~tie].mean()), ties=int(tie.sum()),
                top1_clear=float(agree[clear].mean()), clear=int(clear.sum()), positions=int(agree.size))  # fmt: skip


def scores(top1: np.ndarray, nll: np.ndarray, refs: dict[str, dict]) -> dict:
    """:func:`score` against each of llama.cpp's runs (:data:`REFERENCES`)."""
    return {k: score(top1, nll, r) for k, r in refs.items()}


def self_agreement(refs: dict[str, dict]) -> dict:
    """Top-1 agreement of llama.cpp's default run with its float32-attention run (ties of either apart; and
    over the positions where the default's top two are at least CLEAR_MARGIN nats apart)."""
    a, b = refs["default"], refs["f32_attention"]
    if not (a["tokens"] == b["tokens"]).all():
        raise RuntimeError("llama.cpp's two runs scored different token windows")
    agree, tie, clear = a["top1"] == b["top1"], a["tie"] | b["tie"], a["margin"] >= CLEAR_MARGIN
    return dict(top1=float(agree[~tie].mean()), ties=int(tie.sum()), top1_clear=float(agree[clear].mean()),
                clear=int(clear.sum()))  # fmt: skip


def vllm_scores(llm, wins: list[list[int]], refs: dict[str, dict]) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0.0)
    outs = llm.generate([TokensPrompt(prompt_token_ids=w) for w in wins], sp, use_tqdm=False)
    first = refs["default"]["first"]
    top1, nll = [], []
    for w, o in zip(wins, outs):
        t1, nl = [], []
        for p in range(first + 1, len(w)):
            lp = o.prompt_logprobs[p]
            t1.append(next(t for t, v in lp.items() if v.rank == 1))
            nl.append(-lp[w[p]].logprob)
        top1.append(t1)
        nll.append(nl)
    return scores(np.array(top1), np.array(nll), refs)


def float_scores(gguf: Path, wins: list[list[int]], refs: dict[str, dict]) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    first = refs["default"]["first"]
    top1, nll = [], []
    with torch.inference_mode():
        for w in wins:
            x = torch.tensor([w])
            logits = model(x).logits[0, first:-1].float()
            lsm = torch.log_softmax(logits, -1)
            top1.append(logits.argmax(-1).numpy())
            nll.append((-lsm.gather(-1, x[0, first + 1 :, None])[:, 0]).numpy())
    del model
    return scores(np.array(top1), np.array(nll), refs)


def llama_server_greedy(gguf: Path, prompt: list[int], n: int, threads: int, isa: str) -> list[int]:
    """``n`` greedy tokens of ``llama-server`` for the token ids ``prompt`` (``/completion``)."""
    from tests.helpers.vllm_server import free_port

    exe = lc.llamacpp_bin(lc.DEFAULT_CACHE, "llama-server", isa)
    port = free_port()
    cmd = [str(exe), "-m", str(gguf), "--port", str(port), "--host", "127.0.0.1", "-t", str(threads), "-c", "2048"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.2)
        body = json.dumps(dict(prompt=prompt, n_predict=n, temperature=0.0, top_k=1, cache_prompt=False,
                               return_tokens=True, ignore_eos=True)).encode()  # fmt: skip
        req = urllib.request.Request(url + "/completion", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            return list(json.loads(r.read())["tokens"])
    finally:
        proc.terminate()
        proc.wait(30)


def chat_check(llm, gguf: Path, threads: int, isa: str) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    tok = llm.get_tokenizer()
    if tok.chat_template:
        text = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
        prompt = list(tok(text, add_special_tokens=False)["input_ids"])  # the template writes BOS where needed
    else:  # a base model (Gemma-3-270M's file has no chat template): the question as a completion
        text = COMPLETION
        prompt = list(tok(text)["input_ids"])
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt)],
                       SamplingParams(max_tokens=CHAT_TOKENS, temperature=0.0, logprobs=2, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]  # fmt: skip
    ours = list(out.token_ids)
    theirs = llama_server_greedy(gguf, prompt, CHAT_TOKENS, threads, isa)
    same = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    margin = None
    if same < len(ours):
        lps = sorted((v.logprob for v in out.logprobs[same].values()), reverse=True)
        margin = lps[0] - lps[1] if len(lps) > 1 else None
    return dict(prompt=text, prompt_tokens=len(prompt), vllm_text=tok.decode(ours), llamacpp_text=tok.decode(theirs), same=same,
                n=CHAT_TOKENS, margin_at_first_difference=margin)  # fmt: skip


def run_model(name: str, args, tmp: Path) -> dict:
    from vllm import LLM

    from quality_real import english_text, file_bos

    from aipc_kernels.core.registry_models import MODELS as REG, fetch

    path = fetch(name)
    text = tmp / "english.txt"
    text.write_text(english_text())
    t0 = time.perf_counter()
    refs = {}
    for key, extra in REFERENCES.items():
        logits = tmp / f"{name}.{key}.logits"
        llama_perplexity(path, text, args.context, args.chunks, args.threads, logits, args.llamacpp_isa, extra)
        refs[key] = read_logits_file(logits)
        logits.unlink()  # 250 MB a run
    # llama.cpp's own log-probabilities, 16-bit stored
    ppl_ref = {k: math.exp(-float(r["logprob_next"].mean())) for k, r in refs.items()}
    t_ref = time.perf_counter() - t0
    wins = windows(refs["default"], file_bos(path))
    t0 = time.perf_counter()
    overrides = {"quantization_config": {"quant_method": "gguf_cpu", "act_super_block": True}} if args.act_super_block else None
    llm = LLM(str(path), max_model_len=max(args.context, 1024), dtype=args.dtype, seed=0, max_num_seqs=4,
              hf_overrides=overrides)
    t_load = time.perf_counter() - t0
    t0 = time.perf_counter()
    ours = vllm_scores(llm, wins, refs)
    t_ours = time.perf_counter() - t0
    chat = chat_check(llm, path, args.threads, args.llamacpp_isa)
    del llm
    flt = float_scores(path, wins, refs) if not args.no_float else None
    return dict(model=name, file=path.name, what=REG[name].model, licence=REG[name].licence, ppl_llamacpp=ppl_ref,
                llamacpp_self=self_agreement(refs), vllm=ours, float=flt, chat=chat,
                positions=ours["default"]["positions"], seconds=dict(
                    llamacpp=round(t_ref, 1), vllm_load=round(t_load, 1), vllm_score=round(t_ours, 1)))  # fmt: skip


def report(rows: list[dict], args) -> str:
    table = []
    for r in rows:
        me, ppl = r["llamacpp_self"], r["ppl_llamacpp"]
        table.append({"model": r["model"], "row": "llama.cpp, its defaults (float16 K/V cache)", "ppl": ppl["default"],
                      "vs llama.cpp": "1.000", "top-1 = llama.cpp": "", f"top-1 = llama.cpp, margin >= {CLEAR_MARGIN}": "",
                      "top-1 = llama.cpp f32 attention": f"{me['top1']:.2%}", "ties": me["ties"]})  # fmt: skip
        table.append({"model": r["model"], "row": "llama.cpp, float32 attention (-fa off -ctk f32 -ctv f32)",
                      "ppl": ppl["f32_attention"], "vs llama.cpp": f"{ppl['f32_attention'] / ppl['default']:.3f}",
                      "top-1 = llama.cpp": f"{me['top1']:.2%}", f"top-1 = llama.cpp, margin >= {CLEAR_MARGIN}": f"{me['top1_clear']:.2%}",
                      "top-1 = llama.cpp f32 attention": "", "ties": me["ties"]})  # fmt: skip
        for label, s in (("vLLM + vllm_lowbit (the GGUF's blocks)", r["vllm"]), ("float (transformers, GGUF dequantized)", r["float"])):
            if s is None:
                continue
            d, f = s["default"], s["f32_attention"]
            table.append({"model": r["model"], "row": label, "ppl": d["ppl"], "vs llama.cpp": f"{d['ppl'] / ppl['default']:.3f}",
                          "top-1 = llama.cpp": f"{d['top1']:.2%}", f"top-1 = llama.cpp, margin >= {CLEAR_MARGIN}": f"{d['top1_clear']:.2%}",
                          "top-1 = llama.cpp f32 attention": f"{f['top1']:.2%}", "ties": d["ties"]})  # fmt: skip
    lines = []
    for r in rows:
        v, c, me, ppl = r["vllm"]["default"], r["chat"], r["llamacpp_self"], r["ppl_llamacpp"]["default"]
        ok_ppl = abs(v["ppl"] / ppl - 1) <= 0.01
        lines.append(f"- {r['model']} ({r['file']}; {r['licence']}): {r['positions']} scored positions; vLLM perplexity "
                     f"{v['ppl']:.3f} vs llama.cpp {ppl:.3f} ({v['ppl'] / ppl - 1:+.2%}, "
                     f"target within 1%: {'met' if ok_ppl else 'NOT met'}); top-1 agreement {v['top1']:.2%} (target >= 98%: "
                     f"{'met' if v['top1'] >= 0.98 else 'NOT met'}; {v['top1_clear']:.2%} of the {v['clear']} positions whose "
                     f"llama.cpp top two are >= {CLEAR_MARGIN} nats apart), {r['vllm']['f32_attention']['top1']:.2%} with "
                     f"llama.cpp's float32-attention run; llama.cpp's two runs agree with each other on {me['top1']:.2%} "
                     f"({me['top1_clear']:.2%} of those positions). Chat ({c['n']} greedy tokens): {c['same']}/{c['n']} "
                     f"equal to llama-server's" + ("" if c["same"] == c["n"] else
                     f" (first difference at token {c['same']}, vLLM's top-two margin there {c['margin_at_first_difference']:.3g} nats)")
                     + f"; vLLM: {c['vllm_text']!r}; llama.cpp: {c['llamacpp_text']!r}.")  # fmt: skip
    return "\n".join(lines) + "\n\n" + markdown_table(table, list(table[0]), ".3f")


def main() -> None:
    ap = BenchParser("gguf_conformance", __doc__, MODELS, what="models", group="quality")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=10, help="windows (llama.cpp scores the second half of each)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="llama.cpp threads (default: all cores)")
    ap.add_argument("--dtype", default="float32", help="vLLM's activation dtype (default: %(default)s)")
    ap.add_argument("--no-float", action="store_true", help="skip the transformers float row")
    ap.add_argument("--act-super-block", action="store_true",
                    help="serve the K-quant layers with activations per super-block of 256 (gguf_cpu's act_super_block, "
                         "llama.cpp's Q8_K grouping) instead of the default per 32")
    ap.add_argument("--llamacpp-isa", choices=sorted(lc.ISA_OPTIONS), default="native",
                    help="the llama.cpp build to run (its own build folder, see bench/harness/llamacpp.py)")
    args = ap.parse_args()
    for tool in ("llama-perplexity", "llama-server"):
        if not lc.llamacpp_bin(lc.DEFAULT_CACHE, tool, args.llamacpp_isa).exists():
            raise SystemExit(f"{tool} is not built: {lc.build_hint(lc.DEFAULT_CACHE, args.llamacpp_isa)} llama-perplexity "
                             f"llama-server (configured with -DLLAMA_BUILD_SERVER=ON)")
    machine = machine_info()
    with bench_lock(enabled=not args.no_lock), tempfile.TemporaryDirectory() as tmp:
        rows = [run_model(m, args, Path(tmp)) for m in args.rows]
    notes = (f"Text: pydoc topics (bench/quality_real.english_text); windows of {args.context} tokens, llama.cpp's rule "
             f"(the second half of each scored), {args.chunks} windows; llama.cpp built from llama-cpp-python "
             f"{lc.LLAMA_CPP_PYTHON}'s sources ({args.llamacpp_isa} build), {args.threads} threads; llama.cpp's perplexity "
             f"is computed from the log-probabilities it writes (16-bit per value: within 1e-4 of its own sum); its two runs: "
             f"its defaults (the chat check's llama-server too) and {' '.join(REFERENCES['f32_attention'])}; "
             f"vLLM dtype {args.dtype}"
             + ("; K-quant layers' activations per super-block of 256 (act_super_block)." if args.act_super_block else ".")
             )  # fmt: skip
    write_results(args.out, args.name, "GGUF conformance: vLLM + vllm_lowbit against llama.cpp on the same file",
                  machine, rows, report(rows, args), notes=notes)  # fmt: skip


if __name__ == "__main__":
    main()
