"""What the code books cost in model quality: perplexity and next-token KL divergence / top-1 agreement
against the unquantized model for every weight format, the int8 activations and the output projection
formats, in one run, on real trained models or on a small proxy trained here.

    python bench/quality.py --model smollm2-135m-instruct,gemma3-270m --device cuda   # -> results/quality/quality.md
    python bench/quality.py [--device cuda|cpu] [--smoke] [--rows weights,activations,head]   # the trained proxy

Real models (``--model``, the table the README quotes): the registry's GGUF models read by
transformers, two fixed offline texts; see ``bench/quality_real.py``. The optimized quantizer takes
about 5 minutes per format for a 135M model on two CPU cores (one minute for all 72 on an H200):
run the real models on a GPU. The rest of this docstring describes the trained proxy
(``results/quality/quality_trained_proxy.md``), a second, labelled reference: a model this young is far
easier to quantize than a real one (2-bit affine g64: +3.6% there, x37,000 on SmolLM2).

Recipe (everything fixed, nothing downloaded):

* Text: the standard library's ``.py`` sources of the Python that runs this (``sysconfig.get_paths()
  ["stdlib"]``; ``site-packages`` / ``dist-packages`` left out), sorted by relative path. A file is
  held out when ``int(sha256(relative path)[:8], 16) % 100 < 5`` (5% of the files, whole files).
* Tokens: a piece tokenizer trained here: text splits into pieces (``\\w+``, runs of spaces, runs of
  punctuation, single whitespace characters); the most frequent multi-byte pieces of the training
  files (ties by the piece) get ids, everything else falls back to its UTF-8 bytes (256 byte ids, one
  end-of-file id between files). Deterministic, lossless.
* Model: a transformers ``LlamaForCausalLM`` built from a config (no tied embeddings), trained from
  seed 0 on non-overlapping windows of the training stream in a fixed-seed permutation per epoch,
  bf16 autocast, AdamW (0.9, 0.95, weight decay 0.1), linear warm-up then cosine to a tenth, gradient
  clipping 1.0, deterministic algorithms where torch has them.
* The unquantized model ("bf16") is the trained weights rounded to bf16, as a bf16 checkpoint holds
  them; every row below is computed in float32 (TF32 off) from those weights, so rows differ only in
  the quantization. Linears: every ``nn.Linear`` but the output projection
  (``aipc_kernels.lowbit.modules.linear_names`` with its DEFAULT_SKIP): q/k/v/o/gate/up/down.
* Quantization is the plugins' own code: ``quantizers.quantize_weight`` (scales float16, the plugins'
  default; the linears of one input width are quantized as one matrix, which is the same as one at a
  time since every group lies within a row), ``output_projection.quantize_output_projection`` for the
  head. The kernels are simulated with their own math: the dequantized weight
  (``LowBitWeight.dequantize``) times the activations, which for the A8 rows are rounded exactly as
  ``quantizers.quantize_activations`` rounds them (the native W·A8 kernels' rounding; ``A8 token``:
  one scale per token, ``A8 g64``: per 64-wide K-group). That product is
  ``ops.reference_linear_w8`` up to float32 rounding (the CPU kernels are tested against that
  reference to float rounding); each A8 row checks it on a layer and records the error (``ref_err``).
  An int8 output projection always reads A8 activations per token (its kernel is W8A8).
* Metrics on the first ``eval_tokens`` of the held-out stream (non-overlapping windows of the context
  length): perplexity, its change against bf16 (± one standard error, from the per-window differences
  against bf16: the rows share the windows), mean KL(bf16 || row) over the whole vocabulary in nats per
  token, and how often the argmax agrees with bf16's.

Sections (``--rows``): ``weights``: every code book x group (32, 64, 128, row) x quantizer (rtn,
optimized), float activations, bf16 head; ``activations``: A16 / A8 per token / A8 per 64-group for
2-bit and 4-bit formats; ``head``: the output projection bf16 / int8 / lowbit (2-bit and 4-bit) with
bf16 linears and with the plugins' default linears; ``gguf`` (real models): the file's own linears (as
published) and lowbit4 int4 / affine4 / e0m4 and lowbit2 affine g64 re-quantized from them, each with
A8 per token and per group (for the file's own: 32, as vLLM serves the file, and ``A8 Q8_K``, llama.cpp's groups:
32, a K-quant's super-block of 256 (Q8_K, ``act_super_block``); 64, the weight group, for the re-quantized ones),
float and int8 output projection; ``progressive``: the progressive
two-level form (``aipc_kernels.lowbit.progressive``, the GPU prefill kernels' form and ``quantizer: progressive``)
at 2 and 4 bits beside today's float16 group scales of the same bits (4 bits in groups of 128, and of 64: lowbit4's),
A8 per token. ``--weights`` keeps the rows whose weight label matches a pattern. ``--smoke``: a tiny model, a few steps, a few
files (seconds on a CPU; checks the script, measures nothing).
"""
from __future__ import annotations

import fnmatch
import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS (before CUDA starts)

import hashlib
import math
import re
import sys
import sysconfig
import time
import traceback
from collections import Counter
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from aipc_kernels.lowbit.formats import CODEBOOKS, LowBitWeight, fitting_group_size
from aipc_kernels.lowbit.modules import linear_names
from aipc_kernels.lowbit.ops import reference_linear_w8
from aipc_kernels.lowbit.progressive import quantize_progressive
from aipc_kernels.lowbit.output_projection import quantize_output_projection
from aipc_kernels.lowbit.quantizers import quantize_activations, quantize_weight
from aipc_kernels.core.registry_models import MODELS as REGISTRY_MODELS
from harness import BenchParser, bench_lock, gpu_info, machine_info, markdown_table, write_results  # bench/ on sys.path

SECTIONS = ("weights", "activations", "head", "gguf", "progressive")
GROUPS = (32, 64, 128, -1)  # -1: one group per row
QUANTIZERS = ("rtn", "optimized")
SCALE_DTYPE = torch.float16  # the plugins' default scale_dtype
PIECE = re.compile(r"\w+| +|[^\w\s]+|\s")


@dataclass(frozen=True)
class Recipe:
    hidden: int
    layers: int
    heads: int
    intermediate: int
    context: int
    vocab: int
    batch: int
    steps: int
    lr: float
    warmup: int
    eval_tokens: int
    eval_batch: int
    max_files: Optional[int] = None  # None: every file
    heldout_pct: int = 5  # a file is held out when int(sha256(relative path)[:8], 16) % 100 < heldout_pct
    seed: int = 0


# About 3 epochs of the training files: Python 3.12's standard library on Ubuntu ships without its test
# suite (10.7 MB, 4.3M tokens); a run of 11.5 epochs memorized them (train loss 0.05, held-out loss up
# from 1.71 after 4 epochs to 2.86), and noise from quantization then *lowered* the held-out perplexity.
FULL = Recipe(hidden=768, layers=8, heads=12, intermediate=2048, context=512, vocab=8192, batch=32, steps=800,
              lr=1e-3, warmup=50, eval_tokens=262144, eval_batch=16)
SMOKE = Recipe(hidden=128, layers=1, heads=2, intermediate=128, context=32, vocab=320, batch=4, steps=4,
               lr=3e-3, warmup=1, eval_tokens=256, eval_batch=8, max_files=24, heldout_pct=25)


# ------------------------------------------------------------------------------------------ corpus


def corpus(max_files: Optional[int], heldout_pct: int) -> tuple[Path, list[str], list[str], dict]:
    """(stdlib root, training texts, held-out texts, corpus facts), files sorted by relative path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    rels = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.py")
                  if p.is_file() and not {"site-packages", "dist-packages"} & set(p.relative_to(root).parts))
    if max_files is not None:
        rels = rels[:max_files]
    digest = hashlib.sha256()
    train, held, n_held = [], [], 0
    for rel in rels:
        raw = (root / rel).read_bytes()
        digest.update(rel.encode() + b"\0" + raw)
        text = raw.decode("utf-8", errors="replace")
        if int(hashlib.sha256(rel.encode()).hexdigest()[:8], 16) % 100 < heldout_pct:
            held.append(text)
            n_held += 1
        else:
            train.append(text)
    if not held or not train:
        raise SystemExit(f"corpus under {root}: {len(train)} training and {len(held)} held-out files; need both")
    facts = dict(stdlib=str(root), python=sys.version.split()[0], files=len(rels), heldout_files=n_held,
                 bytes=sum(len(t.encode()) for t in train + held), sha256=digest.hexdigest())
    return root, train, held, facts


class PieceTokenizer:
    """Byte ids 0-255, the end-of-file id 256, then the most frequent multi-byte pieces of the
    training text (count descending, then the piece); a piece without an id is spelled in bytes."""

    EOF = 256

    def __init__(self, texts: list[str], vocab: int):
        counts: Counter[str] = Counter()
        for t in texts:
            counts.update(PIECE.findall(t))
        pieces = sorted((p for p in counts if len(p.encode()) > 1), key=lambda p: (-counts[p], p))
        self.ids = {p: 257 + i for i, p in enumerate(pieces[: vocab - 257])}

    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        get = self.ids.get
        for p in PIECE.findall(text):
            i = get(p)
            if i is None:
                out.extend(p.encode())
            else:
                out.append(i)
        return out

    def stream(self, texts: list[str]) -> torch.Tensor:
        """The texts' tokens, each file followed by the end-of-file id, as one int64 tensor."""
        ids: list[int] = []
        for t in texts:
            ids.extend(self.encode(t))
            ids.append(self.EOF)
        return torch.tensor(ids, dtype=torch.int64)


def windows(stream: torch.Tensor, context: int, limit: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-overlapping ``[n, context]`` inputs and their next-token targets (at most ``limit`` windows)."""
    n = (stream.numel() - 1) // context
    if limit is not None:
        n = min(n, limit)
    return stream[: n * context].view(n, context), stream[1 : n * context + 1].view(n, context)


# ------------------------------------------------------------------------------------------ training


def build_model(r: Recipe):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=r.vocab, hidden_size=r.hidden, intermediate_size=r.intermediate,
                         num_hidden_layers=r.layers, num_attention_heads=r.heads, num_key_value_heads=r.heads,
                         max_position_embeddings=r.context, tie_word_embeddings=False, bos_token_id=None,
                         eos_token_id=PieceTokenizer.EOF, pad_token_id=None, use_cache=False)
    torch.manual_seed(r.seed)
    return LlamaForCausalLM(config)


def lr_at(step: int, r: Recipe) -> float:
    """Linear warm-up, then cosine from ``lr`` down to ``lr / 10`` at the last step."""
    if step < r.warmup:
        return r.lr * (step + 1) / r.warmup
    t = (step - r.warmup) / max(1, r.steps - r.warmup)
    return r.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def heldout_loss(model, xs: torch.Tensor, ys: torch.Tensor, device: str, batch: int) -> float:
    model.eval()
    total = 0.0
    with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16):
        for i in range(0, xs.shape[0], batch):
            logits = model(input_ids=xs[i : i + batch]).logits.float()
            total += F.cross_entropy(logits.flatten(0, 1), ys[i : i + batch].flatten(), reduction="sum").item()
    model.train()
    return total / ys.numel()


def train(model, xs: torch.Tensor, ys: torch.Tensor, hx: torch.Tensor, hy: torch.Tensor, r: Recipe, device: str,
          budget_s: float) -> dict:
    """Trains in place for ``r.steps`` steps (stopping early, and saying so, past ``budget_s``)."""
    model.train()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    other = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                            lr=r.lr, betas=(0.9, 0.95), fused=device == "cuda")
    xs, ys = xs.to(device), ys.to(device)
    gen = torch.Generator().manual_seed(r.seed)
    order = torch.empty(0, dtype=torch.int64)
    n_win = xs.shape[0]
    check_every = max(1, r.steps // 8)
    curve, losses = [], []
    t0 = time.perf_counter()
    step, stopped = 0, None
    for step in range(r.steps):
        while order.numel() < r.batch:
            order = torch.cat([order, torch.randperm(n_win, generator=gen)])
        idx, order = order[: r.batch], order[r.batch :]
        for g in opt.param_groups:
            g["lr"] = lr_at(step, r)
        idx = idx.to(device)
        x, y = xs[idx], ys[idx]
        with torch.autocast(device, dtype=torch.bfloat16):
            logits = model(input_ids=x).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        last = step == r.steps - 1
        if (step + 1) % check_every == 0 or last or step == 0:
            train_loss = torch.stack(losses[-check_every:]).mean().item()
            point = dict(step=step + 1, tokens=(step + 1) * r.batch * r.context, train_loss=round(train_loss, 4),
                         heldout_loss=round(heldout_loss(model, hx, hy, device, r.eval_batch), 4),
                         lr=lr_at(step, r), seconds=round(time.perf_counter() - t0, 1))
            curve.append(point)
            print(f"[train] {point}", flush=True)
        if time.perf_counter() - t0 > budget_s and not last:
            stopped = f"stopped at step {step + 1} of {r.steps}: past the training budget of {budget_s:.0f} s"
            print(f"[train] {stopped}", flush=True)
            break
    steps_done = step + 1
    return dict(steps=steps_done, planned_steps=r.steps, tokens=steps_done * r.batch * r.context,
                seconds=round(time.perf_counter() - t0, 1), first_loss=round(losses[0].item(), 4), curve=curve,
                stopped_early=stopped)


def train_deterministic(*args) -> dict:
    """:func:`train` with torch's deterministic algorithms; where one op has none, the run starts over
    from the same seed with them where available (``warn_only``), and the result says so."""
    model_fn, rest = args[0], args[1:]
    torch.use_deterministic_algorithms(True)
    try:
        model = model_fn()
        return dict(model=model, **train(model, *rest), deterministic="torch.use_deterministic_algorithms(True)")
    except RuntimeError as e:
        if "deterministic" not in str(e):
            raise
        print(f"[train] restarting with warn_only: {e}", flush=True)
        torch.use_deterministic_algorithms(True, warn_only=True)
        model = model_fn()
        return dict(model=model, **train(model, *rest),
                    deterministic=f"warn_only (an op has no deterministic version: {str(e).splitlines()[0][:200]})")
    finally:
        torch.use_deterministic_algorithms(False)


# ------------------------------------------------------------------------------------------ evaluation


@dataclass(frozen=True)
class WFmt:
    """A weight format: code book, group size (-1: row) and quantizer."""

    codebook: str
    group: int
    quantizer: str

    @property
    def label(self) -> str:
        return f"{self.codebook} {f'g{self.group}' if self.group > 0 else 'row'} {self.quantizer}"


@dataclass(frozen=True)
class Row:
    section: str
    weights: Optional[WFmt]  # None: the bf16 linears
    act: str  # "A16" (float), "A8 token", "A8 g64"
    head: str  # "bf16", "int8", "int6", "lowbit"
    head_fmt: Optional[WFmt] = None  # the lowbit head's format

    @property
    def key(self) -> tuple:
        return (self.weights, self.act, self.head, self.head_fmt)


#: a GGUF's own linears with llama.cpp's activation groups: per 32, a K-quant's per super-block of 256 (Q8_K;
#: vllm_lowbit's ``act_super_block``): each linear's own group (``Evaluator.layer_groups``)
Q8_K = "A8 Q8_K"


def act_group(act: str) -> Optional[int]:
    """The ``quantize_activations`` group of an activation setting (``A16``, ``A8 token``, ``A8 g<K>``): None per
    token, -1 for A16. ``A8 Q8_K`` has a group per layer: :meth:`Evaluator.layer_act`."""
    if act == "A16":
        return -1
    if act == "A8 token":
        return None
    m = re.fullmatch(r"A8 g(\d+)", act)
    if not m:
        raise ValueError(f"activation setting {act!r}: expected A16, A8 token or A8 g<K>")
    return int(m.group(1))


#: the ``gguf`` section's linears: as published (None: the file's own values), and re-quantized from them
GGUF_WEIGHTS = (None, WFmt("int4", 64, "optimized"), WFmt("affine4", 64, "optimized"), WFmt("e0m4", 64, "optimized"),
                WFmt("affine", 64, "optimized"))


#: the ``progressive`` section: the progressive two-level form (a float scale per channel, int8 levels per group)
#: beside the single-level formats of the same bits (float16 group scales, optimized quantizer)
PROGRESSIVE_WEIGHTS = (WFmt("affine", 64, "optimized"), WFmt("min2", 64, "progressive"), WFmt("int4", 128, "optimized"),
                       WFmt("affine4", 128, "optimized"), WFmt("min4", 128, "progressive"),
                       WFmt("affine4", 64, "optimized"), WFmt("min4", 64, "progressive"))  # g64: lowbit4's group


def rows_for(sections: list[str], weights: Optional[list[str]] = None) -> list[Row]:
    """The rows of ``sections`` (the reference first); ``weights``: only those whose weight label (e.g. ``min4 g64
    progressive``; ``bf16`` for the unquantized linears, a GGUF's own) matches one of these fnmatch patterns, the
    reference kept."""
    rows = _section_rows(sections)
    return rows if not weights else [r for r in rows if r.section == "reference" or any(
        fnmatch.fnmatch(r.weights.label if r.weights else "bf16", p) for p in weights)]  # fmt: skip


def _section_rows(sections: list[str]) -> list[Row]:
    rows: list[Row] = [Row("reference", None, "A16", "bf16")]
    if "weights" in sections:
        rows += [Row("weights", WFmt(cb, g, q), "A16", "bf16") for cb in CODEBOOKS for g in GROUPS for q in QUANTIZERS]
    if "activations" in sections:
        for w in (WFmt("affine", 64, "optimized"), WFmt("int2", 64, "optimized"), WFmt("ternary", 64, "optimized"),
                  WFmt("binary", 64, "optimized"), WFmt("int4", 64, "optimized"), WFmt("affine4", 64, "optimized"),
                  WFmt("int4", 128, "optimized"), WFmt("affine4", 128, "optimized"), WFmt("e0m4", 128, "optimized"),
                  WFmt("e0m4", 128, "rtn"), WFmt("int8", -1, "rtn")):
            acts = ("A16", "A8 token", "A8 g64") if w.group in (32, 64) else ("A16", "A8 token")
            rows += [Row("activations", w, a, "bf16") for a in acts]
    if "head" in sections:
        two, four = WFmt("affine", 64, "optimized"), WFmt("int4", 128, "optimized")
        rows += [Row("head", None, "A16", h, f) for h, f in (("bf16", None), ("int8", None), ("int6", None),
                                                             ("lowbit", two), ("lowbit", four))]
        for w in (four, two):  # 4-bit linears (lowbit4's), and the 2-bit default (affine g64), A8 per token
            rows += [Row("head", w, "A8 token", h, w if h == "lowbit" else None)
                     for h in ("bf16", "int8", "int6", "lowbit")]
    if "progressive" in sections:  # the GPU prefill form (issue 41) against the float group scales it replaces
        rows += [Row("progressive", w, "A8 token", "bf16") for w in PROGRESSIVE_WEIGHTS]
    if "gguf" in sections:  # a GGUF as published (the float row's weights) against re-quantizing it (issue 38)
        for w in GGUF_WEIGHTS:
            # the kernels' activation groups span whole weight groups; the file's own: per 32 as served (llama.cpp's
            # Q8_0 blocks), and with the K-quants per super-block of 256 (llama.cpp's Q8_K, act_super_block)
            acts = ("A8 token", "A8 g32", Q8_K) if w is None else ("A8 token", "A8 g64")
            rows += [Row("gguf", w, a, h) for a in acts for h in ("bf16", "int8")]
    return rows


def fake_quant_act(x: torch.Tensor, act: str) -> torch.Tensor:
    """``x`` as the W·A8 kernels see it: int8 codes times their scales (``quantize_activations``)."""
    g = act_group(act)
    if g == -1:
        return x
    xq, sx = quantize_activations(x, g)
    K = x.shape[-1]
    span = K if g is None else g
    return (xq.float().unflatten(-1, (K // span, span)) * sx.unsqueeze(-1)).flatten(-2).to(x.dtype)


class Evaluator:
    """Runs rows over the held-out windows against the bf16 reference kept from the first pass."""

    def __init__(self, model, xs: torch.Tensor, ys: torch.Tensor, batch: int, device: str,
                 spans: Optional[list[tuple[str, int]]] = None, layer_groups: Optional[dict[str, dict[str, int]]] = None):  # fmt: skip
        self.model, self.xs, self.ys, self.batch, self.device = model, xs.to(device), ys.to(device), batch, device
        self.spans = spans  # [(text, windows)]: the windows of each text, in order (real models)
        self.layer_groups = layer_groups or {}  # act setting -> linear name -> its act group (0: per token)
        self.names = linear_names(model)
        self.base = {n: model.get_submodule(n).weight.data for n in self.names}
        self.head = model.get_output_embeddings()
        self.head_base = self.head.weight.data
        by_k: dict[int, list[str]] = {}
        for n in self.names:
            by_k.setdefault(self.base[n].shape[1], []).append(n)
        self.by_k = by_k
        self.cache: dict[WFmt, tuple[dict[str, torch.Tensor], dict[int, LowBitWeight], float, float]] = {}
        self.head_cache: dict[tuple, tuple[LowBitWeight, torch.Tensor]] = {}
        self.check_name = self.names[0]  # layer 0's q_proj: the layer the A8 rows check against the reference
        self.check_x: Optional[torch.Tensor] = None
        self.ref_logp: list[torch.Tensor] = []
        self.ref_win: Optional[torch.Tensor] = None  # the reference's mean nll per token of each window
        self.ref_top: list[torch.Tensor] = []
        self.quant_seconds = 0.0

    def weights(self, fmt: WFmt):
        """Dequantized linears (by name), the quantized matrices (by K), bits per weight of ``fmt`` and the
        largest per-layer ``||W - Wq|| / ||W||``. A group that does not divide K falls back as the
        plugins' on-the-fly quantization does (``formats.fitting_group_size``: 128 -> 64 at K=576)."""
        if fmt not in self.cache:
            t0 = time.perf_counter()
            deq, lws, bits, numel, worst = {}, {}, 0, 0, 0.0
            for K, names in self.by_k.items():
                w = torch.cat([self.base[n] for n in names])
                group = fitting_group_size(fmt.group, K)
                if fmt.quantizer == "progressive":  # its own quantizer: s0 per channel, integer s1 and m per group
                    lw = quantize_progressive(w, fmt.codebook, group)
                else:
                    lw = quantize_weight(w, fmt.codebook, group, method=fmt.quantizer, scale_dtype=SCALE_DTYPE)
                lws[K] = lw
                bits += lw.nbytes() * 8
                numel += w.numel()
                for n, part in zip(names, lw.dequantize(torch.float32).split([self.base[n].shape[0] for n in names])):
                    deq[n] = part
                    base = self.base[n].double()
                    worst = max(worst, ((part.double() - base).norm() / base.norm()).item())
            if self.device == "cuda":
                torch.cuda.synchronize()
            self.quant_seconds += time.perf_counter() - t0
            self.cache[fmt] = (deq, lws, bits / numel, worst)
        return self.cache[fmt]

    def head_weight(self, head: str, fmt: Optional[WFmt]) -> tuple[LowBitWeight, torch.Tensor]:
        """The output projection in ``head`` format (``fmt``: a lowbit head's) and its dequantized weight."""
        key = (head, fmt)
        if key not in self.head_cache:
            t0 = time.perf_counter()
            lw = quantize_output_projection(self.head_base, head, codebook=fmt and fmt.codebook,
                                            group_size=fmt and fmt.group, quantizer=fmt.quantizer if fmt else "optimized",
                                            scale_dtype=SCALE_DTYPE)
            self.head_cache[key] = (lw, lw.dequantize(torch.float32))
            self.quant_seconds += time.perf_counter() - t0
        return self.head_cache[key]

    def _check_weight(self, fmt: WFmt) -> LowBitWeight:
        """The quantized weight of the checked layer (its rows of the matrix quantized with it)."""
        lws = self.weights(fmt)[1]
        K = self.base[self.check_name].shape[1]
        start = 0
        for n in self.by_k[K]:
            if n == self.check_name:
                break
            start += self.base[n].shape[0]
        lw, stop = lws[K], start + self.base[self.check_name].shape[0]
        return LowBitWeight(lw.qweight[start:stop].cpu(), lw.scales[start:stop].cpu(),
                            None if lw.zeros is None else lw.zeros[start:stop].cpu(), lw.codebook, lw.group_size, K,
                            supers=None if lw.supers is None else lw.supers[:, start:stop].cpu())  # fmt: skip

    def layer_act(self, name: str, act: str) -> str:
        """The activation setting linear ``name`` gets under row setting ``act`` (``A8 Q8_K``: its own group)."""
        if act != Q8_K:
            return act
        if act not in self.layer_groups:
            raise ValueError(f"activation setting {act!r} needs a GGUF model (--model): the groups follow the file's types")
        g = self.layer_groups[act][name]
        return f"A8 g{g}" if g else "A8 token"

    def _setup(self, row: Row) -> tuple[list, Optional[float], Optional[LowBitWeight]]:
        """Puts ``row``'s weights in the model and hooks its activation rounding; returns the hooks,
        the bits per weight of the linears and the head's quantized weight."""
        hooks, bpw = [], None
        deq = self.weights(row.weights)[0] if row.weights else self.base
        if row.weights:
            bpw = self.weights(row.weights)[2]
        for n in self.names:
            lin = self.model.get_submodule(n)
            lin.weight.data = deq[n]
            if row.act != "A16":
                hooks.append(lin.register_forward_pre_hook(
                    lambda m, a, act=self.layer_act(n, row.act): (fake_quant_act(a[0], act),)))
        head_lw = None
        if row.head == "bf16":
            self.head.weight.data = self.head_base
        else:
            head_lw, head_deq = self.head_weight(row.head, row.head_fmt)
            self.head.weight.data = head_deq
            head_act = "A8 token" if row.head in ("int8", "int6") else row.act  # the plugins' per-token scales
            if head_act != "A16":
                hooks.append(self.head.register_forward_pre_hook(lambda m, a, act=head_act: (fake_quant_act(a[0], act),)))
        return hooks, bpw, head_lw

    def run(self, row: Row) -> dict:
        t0 = time.perf_counter()
        hooks, bpw, head_lw = self._setup(row)
        reference = not self.ref_logp
        capture = None
        if reference:
            capture = self.model.get_submodule(self.check_name).register_forward_pre_hook(
                lambda m, a: setattr(self, "check_x", a[0][0, :64].detach().float().cpu()))
        nll, kl, agree, wins = 0.0, 0.0, 0, []
        try:
            with torch.no_grad():
                for b, i in enumerate(range(0, self.xs.shape[0], self.batch)):
                    logp = torch.log_softmax(self.model(input_ids=self.xs[i : i + self.batch]).logits.float(), -1)
                    y = self.ys[i : i + self.batch]
                    scored = y >= 0  # a target of -100 (a window's BOS position) is not scored
                    tok_nll = -logp.gather(-1, y.clamp_min(0).unsqueeze(-1)).squeeze(-1).double()
                    win = (tok_nll * scored).sum(-1)
                    wins.append(win.cpu())
                    nll += win.sum().item()
                    top = logp.argmax(-1)
                    if reference:
                        self.ref_logp.append(logp)
                        self.ref_top.append(top)
                        if capture is not None:
                            capture.remove()
                            capture = None
                    else:
                        ref = self.ref_logp[b]
                        kl += ((ref.exp() * (ref - logp)).sum(-1) * scored).sum().item()
                        agree += ((top == self.ref_top[b]) & scored).sum().item()
        finally:
            for h in hooks:
                h.remove()
            if capture is not None:
                capture.remove()
        per_win = (self.ys >= 0).sum(-1).cpu()
        n = int(per_win.sum())
        win_nll = torch.cat(wins) / per_win  # mean nll per token of each window
        if reference:
            self.ref_win = win_nll
        diff = win_nll - self.ref_win  # paired with the reference, window by window
        se = (diff.std() / math.sqrt(diff.numel())).item() if diff.numel() > 1 and not reference else 0.0
        out = dict(section=row.section, weights=row.weights.label if row.weights else "bf16",
                   codebook=row.weights.codebook if row.weights else None,
                   bits=CODEBOOKS[row.weights.codebook].bits if row.weights else 16,
                   group=(row.weights.group if row.weights.group > 0 else "row") if row.weights else None,
                   quantizer=row.weights.quantizer if row.weights else None, bpw=bpw, act=row.act,
                   head=row.head if row.head != "lowbit" else f"lowbit {row.head_fmt.label}",
                   head_bpw=None if head_lw is None else head_lw.nbytes() * 8 / self.head_base.numel(),
                   ppl=math.exp(nll / n), dppl_se=100 * math.exp(diff.mean().item()) * se, kl=0.0 if reference else kl / n, top1=1.0 if reference else agree / n,
                   ref_err=self._ref_err(row), seconds=round(time.perf_counter() - t0, 2),
                   rel_err=self.weights(row.weights)[3] if row.weights else None,
                   group_label=self._group_label(row.weights) if row.weights else None)
        if self.spans:
            from quality_real import text_ppl

            out.update({f"ppl_{k}": v for k, v in text_ppl(win_nll, self.spans).items()})
        return out

    def _group_label(self, fmt: WFmt) -> str:
        """``g64``, ``row``, or ``g128 (g64 at K=576)`` where the group fell back on some K."""
        if fmt.group == -1:
            return "row"
        fits = {K: fitting_group_size(fmt.group, K) for K in self.by_k}
        fell = sorted((K, g) for K, g in fits.items() if g != fmt.group)
        return f"g{fmt.group}" + (" (" + ", ".join(f"g{g} at K={K}" for K, g in fell) + ")" if fell else "")

    def _ref_err(self, row: Row) -> Optional[float]:
        """For an A8 row: relative error of the simulated linear against ``ops.reference_linear_w8``
        (float64, the native kernel's math) on the checked layer's input of the first window."""
        if not row.weights or row.act == "A16" or self.check_x is None:
            return None
        lw = self._check_weight(row.weights)
        act = self.layer_act(self.check_name, row.act)
        g = act_group(act)
        x = self.check_x
        sim = fake_quant_act(x, act).double() @ lw.dequantize(torch.float64).T
        ref = reference_linear_w8(x, lw, act_group=0 if g is None else g)
        return ((sim - ref).norm() / ref.norm()).item()


# ------------------------------------------------------------------------------------------ report


def kl_str(kl: float) -> str:
    return f"{kl:.4f}" if kl >= 1e-3 or kl == 0 else f"{kl:.1e}"


def dppl_str(r: dict) -> str:
    """The perplexity change against bf16 with one standard error of it (paired over windows)."""
    return f"{r['dppl']:+.2f}% ±{r['dppl_se']:.2f}"


def fmt_row(r: dict, cols: list[str]) -> dict:
    f = {"ppl": ".3f", "top1": ".1%", "bpw": ".2f", "head_bpw": ".2f"}
    out = {c: (format(r[c], f[c]) if c in f and isinstance(r.get(c), float) else r.get(c)) for c in cols}
    out.update(dppl=dppl_str(r), kl=kl_str(r["kl"]))
    return out


def tables(rows: list[dict]) -> str:
    ref = next(r for r in rows if r["section"] == "reference")
    parts = []
    w = [r for r in rows if r["section"] == "weights"]
    if w:
        pivot = []
        for cb in CODEBOOKS:
            for g in GROUPS:
                gl = g if g > 0 else "row"
                got = {r["quantizer"]: r for r in w if r["codebook"] == cb and r["group"] == gl}
                if not got:
                    continue
                line = dict(codebook=cb, bits=CODEBOOKS[cb].bits, group=gl,
                            bpw=format(next(iter(got.values()))["bpw"], ".2f"))
                for q in QUANTIZERS:
                    r = got.get(q)
                    line[f"ppl {q}"] = format(r["ppl"], ".3f") if r else "skipped"
                    line[f"Δppl {q}"] = dppl_str(r) if r else ""
                    line[f"KL {q}"] = kl_str(r["kl"]) if r else ""
                    line[f"top1 {q}"] = format(r["top1"], ".1%") if r else ""
                pivot.append(line)
        cols = ["codebook", "bits", "group", "bpw"] + [f"{m} {q}" for m in ("ppl", "Δppl", "KL", "top1") for q in QUANTIZERS]
        parts.append("## Weights (float activations, bf16 output projection)\n\n"
                     f"bf16: ppl {ref['ppl']:.3f}. bpw: bits per weight with the float16 scales (and zeros). "
                     "Δppl: change against bf16 ± one standard error (paired over the held-out windows).\n\n"
                     + markdown_table(pivot, cols))
    a = [r for r in rows if r["section"] == "activations"]
    if a:
        cols = ["weights", "act", "ppl", "dppl", "kl", "top1", "ref_err"]
        body = [fmt_row(r, cols) for r in [ref] + a]
        for b in body:
            b["ref_err"] = "" if b["ref_err"] is None else f"{b['ref_err']:.1e}"
        parts.append("## Activations: float (A16) against int8 per token and per 64-group (bf16 output projection)\n\n"
                     "ref_err: relative error of the simulated linear against `ops.reference_linear_w8` (float64) "
                     "on layer 0's q_proj.\n\n" + markdown_table(body, cols))
    h = [r for r in rows if r["section"] == "head"]
    if h:
        cols = ["weights", "act", "head", "head_bpw", "ppl", "dppl", "kl", "top1"]
        parts.append("## Output projection: bf16 / int8 per output channel (A8 per token) / lowbit\n\n"
                     "act: the linears' activations (a lowbit head reads the same; an int8 head always reads "
                     "A8 per token). head_bpw: bits per weight of the quantized head with its scales.\n\n"
                     + markdown_table([fmt_row(r, cols) for r in h], cols))
    pg = [r for r in rows if r["section"] == "progressive"]
    if pg:
        cols = ["weights", "bpw", "ppl", "dppl", "kl", "top1", "ref_err"]
        body = [fmt_row(r, cols) for r in pg]
        for b in body:
            b["ref_err"] = "" if b["ref_err"] is None else f"{b['ref_err']:.1e}"
        parts.append("## The progressive two-level form against float16 group scales (A8 per token, bf16 output "
                     "projection)\n\n" + markdown_table(body, cols))
    return "\n\n".join(parts)


def find(rows: list[dict], section: Optional[str] = None, **kw) -> Optional[dict]:
    for r in rows:
        if (section is None or r["section"] == section) and all(r.get(k) == v for k, v in kw.items()):
            return r
    return None


def conclusions(rows: list[dict]) -> list[str]:
    """The summary lines: what 2 and 4 bits cost, the activations and the output projection."""
    ref = find(rows, "reference")
    d = lambda r: f"ppl {r['ppl']:.3f} ({dppl_str(r)}, KL {kl_str(r['kl'])})" if r else "not in this run (row not selected)"  # noqa: E731
    w = lambda cb, g, q: find(rows, None, weights=WFmt(cb, g, q).label, act="A16", head="bf16")  # noqa: E731
    out = [f"bf16 (unquantized): held-out ppl {ref['ppl']:.3f}."]
    two = [r for r in rows if r["section"] == "weights" and r["bits"] <= 2]
    if two:
        best = min(two, key=lambda r: r["ppl"])
        out.append(f"2-bit and 1-bit weights on a model not trained for them (float activations): affine g64 rtn "
                   f"{d(w('affine', 64, 'rtn'))}, optimized {d(w('affine', 64, 'optimized'))} (the plugins' default "
                   f"format); int2 g64 rtn {d(w('int2', 64, 'rtn'))}, optimized {d(w('int2', 64, 'optimized'))}; "
                   f"ternary g64 optimized {d(w('ternary', 64, 'optimized'))}; binary g64 "
                   f"{d(w('binary', 64, 'optimized'))}; best 2-bit row {best['weights']}: {d(best)}.")
        rtn = [r for r in two if r["quantizer"] == "rtn"]
        ratios = [find(two, None, codebook=r["codebook"], group=r["group"], quantizer="optimized") for r in rtn]
        pairs = [(r, o) for r, o in zip(rtn, ratios) if o and r["codebook"] != "binary"]
        if pairs:
            wins = sum(o["ppl"] < r["ppl"] for r, o in pairs)
            out.append(f"At 2 bits the optimized quantizer beats RTN in {wins} of {len(pairs)} code book x group "
                       f"pairs (binary excluded: RTN is already its least-squares fit).")
    if any(r["section"] == "weights" and r["bits"] == 4 for r in rows):
        out.append(f"4-bit weights: int4 g128 optimized {d(w('int4', 128, 'optimized'))}, rtn {d(w('int4', 128, 'rtn'))}; "
                   f"affine4 g128 optimized {d(w('affine4', 128, 'optimized'))}, rtn {d(w('affine4', 128, 'rtn'))}; "
                   f"int8 row rtn {d(w('int8', -1, 'rtn'))}.")
        if w("e0m4", 128, "rtn"):
            out.append(f"Transformer-Lite's E0M4 (e0m4: the range onto [1, 2), step range/16, integer bias) against int4 "
                       f"dequantization grids, RTN: e0m4 g128 {d(w('e0m4', 128, 'rtn'))}, int4 g128 "
                       f"{d(w('int4', 128, 'rtn'))}, affine4 g128 {d(w('affine4', 128, 'rtn'))}; e0m4 g64 rtn "
                       f"{d(w('e0m4', 64, 'rtn'))}; e0m4 g128 optimized {d(w('e0m4', 128, 'optimized'))}.")
    a = lambda cb, g, act: find(rows, "activations", weights=WFmt(cb, g, "optimized").label, act=act)  # noqa: E731
    if a("int4", 128, "A8 token"):
        out.append(f"W4A8 against W4A16 (int4 g128 optimized): A8 per token {d(a('int4', 128, 'A8 token'))} against "
                   f"A16 {d(a('int4', 128, 'A16'))}; 2-bit affine g64: A16 {d(a('affine', 64, 'A16'))}, A8 per token "
                   f"{d(a('affine', 64, 'A8 token'))}, A8 per 64-group {d(a('affine', 64, 'A8 g64'))}."
                   + (f" e0m4 g128 optimized: W4A16 (the activation-exact kernels) {d(a('e0m4', 128, 'A16'))}, W4A8 "
                      f"{d(a('e0m4', 128, 'A8 token'))}." if a("e0m4", 128, "A16") else ""))
        ref_errs = [r["ref_err"] for r in rows if r.get("ref_err") is not None]
        if ref_errs:
            out.append(f"The simulated A8 linears match `ops.reference_linear_w8` (float64) to a relative error of at "
                       f"most {max(ref_errs):.1e}.")
    hd = lambda w_, head: next((r for r in rows if r["section"] == "head" and r["weights"] == w_  # noqa: E731
                                and r["head"].startswith(head)), None)
    if hd("bf16", "int8"):
        lin = WFmt("affine", 64, "optimized").label
        i8, i8d, b16d = hd("bf16", "int8"), hd(lin, "int8"), hd(lin, "bf16")
        lo2 = next((r for r in rows if r["section"] == "head" and r["weights"] == "bf16" and "affine" in r["head"]), None)
        out.append(f"Output projection with bf16 linears: int8 {d(i8)}; lowbit 2-bit (affine g64) {d(lo2)}. "
                   f"With the default linears (affine g64 optimized, A8 per token): bf16 head {d(b16d)}, int8 head "
                   f"{d(i8d)}, lowbit head {d(hd(lin, 'lowbit'))}.")
        if i8d and b16d:
            share = i8["kl"] / max(b16d["kl"], 1e-12)
            verdict = ("justified: alone it costs under 1% perplexity and under 5% of the KL that the default 2-bit "
                       "linears cost, for half the head's bytes" if share < 0.05 and abs(i8["dppl"]) < 1.0 else
                       "not clearly justified: its cost is not small next to the default 2-bit linears'")
            out.append(f"The int8 output projection (the default with AMX kernels; `lm_head: auto` picks "
                       f"int6 without AMX) is {verdict} (int8 head alone: KL {kl_str(i8['kl'])}, "
                       f"{share:.2%} of the default linears' {kl_str(b16d['kl'])}, ppl {dppl_str(i8)}; on top of the "
                       f"default linears: ppl {i8d['ppl'] - b16d['ppl']:+.3f}, KL {i8d['kl'] - b16d['kl']:+.1e}).")
    return out


# ------------------------------------------------------------------------------------------ main


def main() -> None:
    ap = BenchParser("quality", __doc__, list(SECTIONS), what="sections", group="quality")
    ap.add_argument("--model", default="trained", type=lambda s: s.split(","),
                    help="'trained' (the proxy trained here, the default) or a comma list of registry models "
                         "(smollm2-135m-instruct, gemma3-270m): real trained models, results named 'quality'")
    ap.add_argument("--weights", type=lambda s: s.split(","), default=None,
                    help="only the rows whose weights match one of these comma-separated patterns, e.g. "
                         "'min4 g64*,affine4 g64*', or bf16 for the unquantized linears (a GGUF's own; the reference row always runs)")
    ap.add_argument("--windows", type=int, default=4, help="real models: windows per text")
    ap.add_argument("--context", type=int, default=512, help="real models: tokens per window")
    ap.add_argument("--eval-batch", type=int, default=2, help="real models: windows per forward pass")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--smoke", action="store_true", help="tiny model, a few steps and files: checks the script")
    ap.add_argument("--steps", type=int, help="training steps (default: the recipe's)")
    ap.add_argument("--train-budget-s", type=float, default=330.0,
                    help="stop training past this many seconds (the results say so)")
    ap.add_argument("--deadline-s", type=float, default=560.0,
                    help="skip the rows left after this many seconds from the start (the results list them)")
    args = ap.parse_args()
    real = args.model != ["trained"]
    if real:
        unknown = [m for m in args.model if m not in REGISTRY_MODELS]
        if unknown:
            ap.error(f"--model {','.join(unknown)}: use 'trained' or registry models {sorted(REGISTRY_MODELS)}")
    elif args.name == "quality":
        args.name = "quality_trained_proxy"
    with bench_lock(enabled=not args.no_lock):
        run_real(args) if real else run(args)


def run(args) -> None:
    start = time.perf_counter()
    r = SMOKE if args.smoke else FULL
    if args.steps:
        r = replace(r, steps=args.steps)
    dev = args.device
    if dev == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device; use --device cpu")
    info = machine_info(**(gpu_info() if dev == "cuda" else {}))
    torch.manual_seed(r.seed)

    root, train_texts, held_texts, facts = corpus(r.max_files, r.heldout_pct)
    tok = PieceTokenizer(train_texts, r.vocab)
    train_stream, held_stream = tok.stream(train_texts), tok.stream(held_texts)
    xs, ys = windows(train_stream, r.context)
    hx, hy = windows(held_stream, r.context, r.eval_tokens // r.context)
    facts.update(train_tokens=train_stream.numel(), heldout_tokens=held_stream.numel(), eval_tokens=hy.numel(),
                 eval_windows=hy.shape[0], tokenize_seconds=round(time.perf_counter() - start, 1))
    print(f"[corpus] {facts}", flush=True)

    if dev == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    probe_x, probe_y = hx[: r.eval_batch].to(dev), hy[: r.eval_batch].to(dev)
    trained = train_deterministic(lambda: build_model(r).to(dev), xs, ys, probe_x, probe_y, r, dev,
                                  args.train_budget_s)
    model = trained.pop("model")
    n_params = sum(p.numel() for p in model.parameters())
    with torch.no_grad():  # the bf16 checkpoint, run in float32
        for p in model.parameters():
            p.data = p.data.to(torch.bfloat16).float()
    model.eval()
    recipe = dict(asdict(r), params=n_params, linear_params=sum(model.get_submodule(n).weight.numel()
                                                                for n in linear_names(model)),
                  head_params=model.get_output_embeddings().weight.numel(), corpus=facts, training=trained,
                  epochs=round(trained["tokens"] / train_stream.numel(), 2), scale_dtype="float16")

    ev = Evaluator(model, hx, hy, r.eval_batch, dev)
    t_eval = time.perf_counter()
    rows, skipped = evaluate(ev, rows_for(args.rows, args.weights), lambda: time.perf_counter() - start > args.deadline_s)
    recipe.update(eval_seconds=round(time.perf_counter() - t_eval, 1), quantize_seconds=round(ev.quant_seconds, 1),
                  total_seconds=round(time.perf_counter() - start, 1))
    report(args, info, recipe, rows, skipped)


def evaluate(ev: Evaluator, plan: list[Row], past_deadline) -> tuple[list[dict], list[str]]:
    """Every row of ``plan`` (the reference first), skipping those left once ``past_deadline()``."""
    results: dict[tuple, dict] = {}
    rows: list[dict] = []
    skipped: list[str] = []
    for row in plan:
        if row.key in results:  # the same configuration in another section
            rows.append(dict(results[row.key], section=row.section))
            continue
        if past_deadline():
            skipped.append(f"{row.section}: {row.weights.label if row.weights else 'bf16'}, {row.act}, {row.head}")
            continue
        try:
            out = ev.run(row)
        except Exception as e:  # noqa: BLE001  (one broken row must not lose the others)
            if not rows:
                raise
            traceback.print_exc()
            skipped.append(f"{row.section}: {row.weights.label if row.weights else 'bf16'}, {row.act}, {row.head}: "
                           f"failed: {e!r}"[:300])
            continue
        ref_ppl = rows[0]["ppl"] if rows else out["ppl"]
        out["dppl"] = (out["ppl"] / ref_ppl - 1) * 100
        results[row.key] = out
        rows.append(out)
        print(f"[eval] {out['section']:11s} {out['weights']:24s} {out['act']:8s} {out['head']:30s} "
              f"ppl {out['ppl']:.3f} ({out['dppl']:+.2f}%) KL {out['kl']:.4f} top1 {out['top1']:.3f} "
              f"rel_err {out['rel_err'] or 0:.3f} {out['seconds']:.1f}s", flush=True)
    return rows, skipped


def run_real(args) -> None:
    """The registry models' rows (``--model``): float32 on the CPU, every model in one results file."""
    import quality_real as qr
    from aipc_kernels.lowbit.quality_gate import SAFE_REL_ERROR, UNUSABLE_REL_ERROR

    start = time.perf_counter()
    dev = args.device
    info = machine_info(**(gpu_info() if dev == "cuda" else {}))
    if dev == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    all_rows, skipped, lines, parts, facts = [], [], [], [], {}
    for name in args.model:
        t0 = time.perf_counter()
        model, tok, bos = qr.load(name)
        xs, ys, spans, texts = qr.eval_windows(tok, bos, args.context, args.windows)
        ev = Evaluator(model.to(dev), xs, ys, args.eval_batch, dev, spans=spans,
                       layer_groups={Q8_K: qr.llamacpp_act_groups(name, model)})
        rows, miss = evaluate(ev, rows_for(args.rows, args.weights), lambda: time.perf_counter() - start > args.deadline_s)
        ref = rows[0]
        for r in rows:
            r.update(model=name, _ref=ref)
        all_rows += rows
        skipped += [f"{name} {m}" for m in miss]
        lines += qr.conclusions(name, rows)
        q8k = Counter(ev.layer_groups[Q8_K].values())
        per = ", ".join(f"{n} linears per {g}" for g, n in sorted(q8k.items()))
        parts.append(f"## {name}\n\n{qr.MODELS[name].model}; {qr.MODELS[name].architecture}; licence "
                     f"{qr.MODELS[name].licence}. Activations {Q8_K} (K-quants per super-block): {per}.\n\n" + qr.tables(name, rows))
        facts[name] = dict(texts=texts, seconds=round(time.perf_counter() - t0, 1), quantize_seconds=round(ev.quant_seconds, 1),
                           q8k_act_groups=dict(q8k))
        del model, ev
    bounds = qr.error_bounds(all_rows)
    if bounds:
        safe, doomed, best = bounds
        lines.append(f"Reconstruction error against usability (largest per-layer ||W - Wq|| / ||W|| of a weights row): "
                     f"every row up to {safe:.3f} is usable (ppl at most {qr.UNUSABLE_PPL_RATIO:g}x float); every row from "
                     f"{doomed:.3f} up is noise (ppl {best:,.0f}x float or worse); between them usability depends on the "
                     f"format. The plugins log a load's largest error against SAFE_REL_ERROR = {SAFE_REL_ERROR} and "
                     f"UNUSABLE_REL_ERROR = {UNUSABLE_REL_ERROR} (aipc_kernels.lowbit.quality_gate), read off this line.")
    if skipped:
        lines.append(f"Not measured ({len(skipped)} rows, past the deadline or failed): " + "; ".join(skipped))
    recipe = (f"Real trained models from the package registry (aipc_kernels.core.registry_models), read by transformers' "
              f"GGUF reader and run in float32 (TF32 off on a GPU): the float row is the GGUF file's dequantized weights; every "
              f"other row quantizes those weights again with the plugins' own quantizers (scales float16). Texts "
              f"(bench/quality_real.py): english = the language reference topics of Python's pydoc_data, code = the "
              f"standard library's held-out .py files; {args.windows} windows of {args.context} tokens each. "
              f"Usable: perplexity on both texts together at most {qr.UNUSABLE_PPL_RATIO:g}x the float model's. "
              f"Whole run {time.perf_counter() - start:.0f} s.")
    body = recipe + "\n\n" + "\n".join(f"- {x}" for x in lines) + "\n\n" + "\n\n".join(parts)
    for r in all_rows:
        r.pop("_ref", None)
    write_results(args.out, args.name, "Model quality of the low-bit formats on real trained models (perplexity, "
                  "KL and top-1 against the float model)", info, all_rows, body,
                  extra=dict(texts=facts, conclusions=lines, skipped=skipped))


def report(args, info: dict, recipe: dict, rows: list[dict], skipped: list[str]) -> None:
    t, c = recipe["training"], recipe["corpus"]
    curve = t["curve"]
    lines = [f"- {s}" for s in conclusions(rows)]
    if skipped:
        lines.append(f"- Not measured ({len(skipped)} rows, past the deadline or failed): " + "; ".join(skipped))
    recipe_md = (
        f"Recipe: LlamaForCausalLM trained here, {recipe['params'] / 1e6:.1f}M parameters (hidden {recipe['hidden']}, "
        f"{recipe['layers']} layers, {recipe['heads']} heads, MLP {recipe['intermediate']}, context {recipe['context']}, "
        f"vocabulary {recipe['vocab']}; linears {recipe['linear_params'] / 1e6:.1f}M, output projection "
        f"{recipe['head_params'] / 1e6:.1f}M), on the .py files of Python {c['python']}'s standard library "
        f"({c['files']} files, {c['bytes'] / 1e6:.1f} MB, sha256 {c['sha256'][:16]}; {c['heldout_files']} files held "
        f"out by path hash): {c['train_tokens'] / 1e6:.2f}M training tokens, {c['heldout_tokens'] / 1e6:.2f}M held-out. "
        f"Trained {t['steps']} steps (of {t['planned_steps']} planned) x {recipe['batch']} x {recipe['context']} = "
        f"{t['tokens'] / 1e6:.1f}M tokens ({recipe['epochs']} epochs) in {t['seconds']:.0f} s "
        f"({t['tokens'] / max(t['seconds'], 1e-9) / 1e3:.0f}k tokens/s), bf16 autocast, AdamW "
        f"lr {recipe['lr']} (warm-up {recipe['warmup']}, cosine to a tenth); determinism: {t['deterministic']}"
        + (f"; {t['stopped_early']}" if t["stopped_early"] else "") + ". "
        f"Loss (nats/token) train {t['first_loss']:.2f} at step 1 -> {curve[-1]['train_loss']:.3f} (mean of the last "
        f"{max(1, t['planned_steps'] // 8)} steps), held-out (first {recipe['eval_batch']} windows, bf16 autocast) "
        + " -> ".join(f"{p['heldout_loss']:.3f}@{p['step']}" for p in curve) + ". "
        f"Evaluation: {c['eval_tokens']} held-out tokens ({c['eval_windows']} windows of {recipe['context']}), "
        f"float32, {recipe['eval_seconds']:.0f} s for {len(rows)} rows (quantization {recipe['quantize_seconds']:.0f} s); "
        f"whole run {recipe['total_seconds']:.0f} s.")
    notes = ("Smoke run: a tiny model trained for a few steps; the numbers measure nothing." if args.smoke else "")
    body = recipe_md + "\n\n" + "\n".join(lines) + "\n\n" + tables(rows)
    write_results(args.out, args.name, "Model quality of the low-bit formats (held-out perplexity and KL against bf16)",
                  info, rows, body, notes, extra=dict(recipe=recipe, conclusions=conclusions(rows), skipped=skipped))


if __name__ == "__main__":
    main()
