"""vLLM-CPU end to end: decode tokens/s and weight memory of bf16, vLLM's own int4 path (a GPTQ
checkpoint through its CPU WNA16 kernel), the same checkpoint through lowbit4, and lowbit2, on a random
Llama of real geometry, against llama.cpp (Q4_0, Q4_K_M, TQ2_0) on the same threads, and where a vLLM row's
decode step goes (``--split``, ``--step-profile``).

    python bench/vllm_e2e.py                                        # takes the bench lock itself
    python bench/vllm_e2e.py --preset llama-150m --new-tokens 16 --rows bf16,lowbit2    # quick look
    python bench/vllm_e2e.py --preset llama-150m --rows 'llamacpp*' --new-tokens 8 --reps 1 --out /tmp/v

The rows (``--list-rows``; ``--rows`` runs any subset): ``bf16``, ``int4``, ``lowbit4_gptq``,
``lowbit4_e0m4_a16`` (Transformer-Lite's E0M4 on the activation-exact W4A16 kernels), ``lowbit2``, ``lowbit2_omp_active`` (OpenMP threads spinning between regions, as llama.cpp's pool polls),
``lowbit4_gptq_small_pages`` / ``lowbit2_small_pages`` (the packed weights on torch's small pages,
``AIPC_HUGE_PAGES=0``, against the default's transparent huge pages), ``lowbit4_gptq_int6_head`` /
``lowbit2_int6_head`` (the output projection in 6-bit codes, ``lm_head: int6``), ``lowbit4_gptq_int8_head`` /
``lowbit2_int8_head`` (int8 per output channel, ``lm_head: int8``), ``lowbit2_bf16_head``, ``lowbit2_lm`` (vLLM, each in its own process: an in-process
engine, compiled mode, the CPU default, the same prompt), and ``llamacpp_q4_0``, ``llamacpp_q4_k_m``,
``llamacpp_tq2_0``: the same bf16 model converted by llama.cpp's own ``convert_hf_to_gguf.py``
(``--outtype bf16``) and quantized by its ``llama-quantize``, timed with its ``llama-bench``. Every row
computes on the same number of threads: each vLLM row reads the threads its in-process engine computes
on (torch's; 2 on a 2-core machine: vLLM's in-process engine does not reserve a core for itself), and
llama.cpp gets that ``-t`` (``--threads`` overrides). A row not asked for, or whose process fails, is left out
with the reason printed and recorded, and its ratio columns stay empty.

Decode tokens/s: vLLM, (T(1 + D tokens) - T(1 token)) / D from one request of batch 1 after a 32-token
prompt (prefix caching off, so both requests prefill alike); llama.cpp, ``llama-bench -p 0 -n D``;
median of ``--reps``. First token of the 32-token prompt: vLLM, T(1 token); llama.cpp, 32 / the
``-p 32 -n 0`` rate. Bound: the run's best read bandwidth on the rows' threads / the bytes a decode step reads
(vLLM: the loaded linears + output projection; llama.cpp: the GGUF's linears + scales + output
projection); and, per row, its threads reading exactly that many bytes cyclically right after the row
(a last-level cache larger than part of a step keeps some of it between steps, which a 1 GB probe
does not see). ``--paired``: each ``lowbit4_gptq*`` / ``lowbit2*`` row's worker follows every one of its
repetitions with one ``llama-bench -p 0 -n D`` run of its llama.cpp peer (Q4_0 / TQ2_0), so that the host's
drifting bandwidth hits both alike; the report gives the ratio of each such round and their median.
``--split``: after each repetition, the row's planned-op calls alone (every low-bit layer once at M=1, its own
weights, one Python loop), so that the report splits a step into those calls and the rest (vLLM's).
``--step-profile``: each vLLM row's decode step of one sequence under the torch profiler, its engine built with
inductor's C++ kernels recording themselves (``harness.step_profile``): self time per step of each op, the low-bit
op per weight, and who owns the step (the low-bit op, the compiled graph's Python and its C++ kernels, vLLM's
attention and the rest). The
report ends with the targets: lowbit4 (``lowbit4_gptq``) >= 1.3x llama.cpp Q4_0 and
lowbit2 >= 3x vLLM bf16 decode, on the rows' medians and, where paired, on the paired rounds. Results go to bench/results/e2e/vllm_e2e.{md,json} with the machine, its
load average and the command. llama.cpp is built and its GGUFs cached as bench/bitnet_e2e.py does
(``--llamacpp-cache``, ``--build-llamacpp``; ``harness.llamacpp``).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from harness import IN_PROCESS_VLLM_ENV, RESULT_PREFIX, BenchParser, bench_lock, machine_info, read_bandwidth, run_worker, write_results  # bench/ on sys.path
from harness import llamacpp
from harness.step_profile import ownership_line, step_profile, timed_generate, with_kernel_profile
from aipc_kernels.lowbit.output_projection import auto_head_format

ROOT = Path(__file__).resolve().parent.parent
VLLM_ENV = dict(IN_PROCESS_VLLM_ENV, VLLM_CPU_KVCACHE_SPACE="2")
GPTQ_GROUP = 128
LOWBIT_GROUP = 64
#: the output projection of the rows that leave ``lm_head`` at its default (``auto``: by the kernels' ISA, AIPC_ISA's)
AUTO_HEAD = f"lm_head auto: {auto_head_format()}"
VARIANTS = {
    "bf16": dict(label="bf16 (vLLM unquantized)", model="bf16", llm={}),
    "int4": dict(label=f"int4 GPTQ g{GPTQ_GROUP} (vLLM CPU WNA16 kernel)", model="gptq", llm={}),
    "lowbit4_gptq": dict(label=f"the same GPTQ checkpoint with --quantization lowbit4 (W4A8, {AUTO_HEAD})",
                         model="gptq", llm=dict(quantization="lowbit4")),
    "lowbit4_e0m4_a16": dict(label="the bf16 checkpoint with --quantization lowbit4, e0m4 g128 (RTN while it loads) "
                                   f"on the W4A16 kernels ({AUTO_HEAD})", model="bf16",
                             llm=dict(quantization="lowbit4", hf_overrides={"quantization_config": {
                                 "quant_method": "lowbit4", "codebook": "e0m4", "group_size": 128, "quantizer": "rtn",
                                 "activations": "float"}})),
    "lowbit2": dict(label=f"lowbit2 affine g{LOWBIT_GROUP} ({AUTO_HEAD}, the default)", model="lowbit2", llm={}),
    "lowbit4_affine4": dict(label=f"affine4 g{LOWBIT_GROUP} checkpoint (lowbit4's on-the-fly default, RTN; {AUTO_HEAD})",
                            model="affine4", llm={}),
    "lowbit4_progressive": dict(label=f"min4 g{LOWBIT_GROUP} checkpoint, quantizer progressive (int8 levels per group, "
                                      f"int32 over K; {AUTO_HEAD})", model="progressive4", llm={}),
    "lowbit2_general_op": dict(label=f"lowbit2 affine g{LOWBIT_GROUP} ({AUTO_HEAD}) through the general op "
                                    "(AIPC_PLANNED_OPS=0: operands checked in Python per call)", model="lowbit2", llm={},
                               env=dict(AIPC_PLANNED_OPS="0")),
    "lowbit2_omp_active": dict(label=f"lowbit2 affine g{LOWBIT_GROUP} ({AUTO_HEAD}), OMP_WAIT_POLICY=ACTIVE "
                                    "(OpenMP threads spin between parallel regions instead of sleeping)", model="lowbit2",
                               llm={}, env=dict(OMP_WAIT_POLICY="ACTIVE")),
    "lowbit4_gptq_small_pages": dict(label="lowbit4 on the GPTQ checkpoint, packed weights on small pages "
                                          "(AIPC_HUGE_PAGES=0: torch's allocator, as before 2026-11-30)",
                                    model="gptq", llm=dict(quantization="lowbit4"), env=dict(AIPC_HUGE_PAGES="0")),
    "lowbit2_small_pages": dict(label=f"lowbit2 affine g{LOWBIT_GROUP} ({AUTO_HEAD}), packed weights on small pages "
                                     "(AIPC_HUGE_PAGES=0)", model="lowbit2", llm={}, env=dict(AIPC_HUGE_PAGES="0")),
    "lowbit4_gptq_int6_head": dict(label="the same GPTQ checkpoint with --quantization lowbit4, lm_head int6 (6-bit "
                                        "codes in groups of 32: 6.5 bits a weight, as a GGUF's Q6_K head)",
                                  model="gptq", llm=dict(quantization="lowbit4"), qcfg=dict(lm_head="int6")),
    "lowbit4_gptq_int8_head": dict(label="the same GPTQ checkpoint with --quantization lowbit4, lm_head int8 (one "
                                        "scale per output channel)",
                                  model="gptq", llm=dict(quantization="lowbit4"), qcfg=dict(lm_head="int8")),
    "lowbit2_int8_head": dict(label=f"lowbit2 affine g{LOWBIT_GROUP} (lm_head int8)", model="lowbit2", llm={},
                              qcfg=dict(lm_head="int8")),
    "lowbit2_int6_head": dict(label=f"lowbit2 affine g{LOWBIT_GROUP} (lm_head int6)", model="lowbit2", llm={},
                              qcfg=dict(lm_head="int6")),
    "lowbit2_bf16_head": dict(label=f"lowbit2 affine g{LOWBIT_GROUP} (lm_head bf16)", model="lowbit2", llm={},
                              qcfg=dict(lm_head="float")),
    "lowbit2_lm": dict(label=f"lowbit2 affine g{LOWBIT_GROUP} + lm_head lowbit2", model="lowbit2", llm={},
                       qcfg=dict(lm_head="lowbit")),
    # llama.cpp: the bf16 model converted and quantized by llama.cpp's own tools
    "llamacpp_q4_0": dict(label="llama.cpp Q4_0", model="bf16", kind="llamacpp", qtype="Q4_0"),
    "llamacpp_q4_k_m": dict(label="llama.cpp Q4_K_M", model="bf16", kind="llamacpp", qtype="Q4_K_M"),
    "llamacpp_tq2_0": dict(label="llama.cpp TQ2_0", model="bf16", kind="llamacpp", qtype="TQ2_0"),
}  # fmt: skip
#: --paired: the llama.cpp row a vLLM row is held against, round by round (the row's name starts with the key)
PAIRED_PEERS = (("lowbit4_gptq", "llamacpp_q4_0"), ("lowbit2", "llamacpp_tq2_0"))
PROMPT = 32  # the prompt's tokens (vLLM rows) = llama-bench's -p for the first-token figure
# the issues' targets: (what, row, reference row, ratio to reach, measure): decode tokens/s of the row over the
# reference's, or (first-token measures) the reference's first-token seconds over the row's: >= 1 is not slower
TARGETS = (("lowbit4 (lowbit4_gptq row) >= 1.3x llama.cpp Q4_0 decode", "lowbit4_gptq", "llamacpp_q4_0", 1.3, "decode_tok_s"),
           ("lowbit2 >= 3x vLLM bf16 decode", "lowbit2", "bf16", 3.0, "decode_tok_s"),
           ("lowbit2 >= 1.2x llama.cpp TQ2_0 decode", "lowbit2", "llamacpp_tq2_0", 1.2, "decode_tok_s"),
           ("lowbit4 (lowbit4_gptq row) >= 1.2x llama.cpp Q4_0 decode", "lowbit4_gptq", "llamacpp_q4_0", 1.2, "decode_tok_s"),
           ("lowbit2 first token not slower than llama.cpp TQ2_0's, short prompt", "lowbit2", "llamacpp_tq2_0", 1.0, "prefill_32_s"),
           ("lowbit2 first token not slower than llama.cpp TQ2_0's, long prompt", "lowbit2", "llamacpp_tq2_0", 1.0, "prefill_long_s"),
           ("lowbit4 first token not slower than llama.cpp Q4_0's, short prompt", "lowbit4_gptq", "llamacpp_q4_0", 1.0, "prefill_32_s"),
           ("lowbit4 first token not slower than llama.cpp Q4_0's, long prompt", "lowbit4_gptq", "llamacpp_q4_0", 1.0, "prefill_long_s"))  # fmt: skip


NOTES = """Notes:
- Same random weights in every variant. lowbit2 checkpoint: `python -m vllm_lowbit.quantize` with the
  `rtn` quantizer (decode speed does not depend on the quantizer; the optimised one needs ~40 min at
  1B on one core). int4: a symmetric GPTQ checkpoint (RTN, group 128; AutoGPTQ's layout written with
  vLLM's own packing helpers), loaded by vLLM's GPTQ method, which picks its CPU WNA16 kernel
  (`_C::cpu_gemm_wna16`): what vLLM-CPU users pick today; nothing below 4 bits exists in vLLM-CPU.
  lowbit4_gptq: the same checkpoint served with `--quantization lowbit4` (its int4 codes and fp16 scales
  re-laid out exactly, W4A8 kernels, the output projection as `lm_head: auto` chooses). lowbit4_affine4 /
  lowbit4_progressive: the converter's affine4 g64 (RTN) and `--quantizer progressive --codebook min4` g64
  checkpoints of the same weights (the progressive form: int8 levels per group, one float16 scale a row, which
  the CPU kernels accumulate in int32 over the whole K).
- The output projection is quantized at load by default as `lm_head: auto` chooses (int6 in groups of 32
  where the kernels run without AMX, int8 per output channel with AMX; the rows' labels
  say which): at 1B the tied 128256 x 2048 output projection is 525 MB in bf16, read at every step, as much
  as all the lowbit2 linears; `lm_head: int8` / `int6` pin a format (the `_int8_head` / `_int6_head` rows), `lm_head: float` keeps it bf16, `lm_head: lowbit` makes it 2-bit like the linears
  (quality cost of a 2-bit output projection not measured here).
- llama.cpp (vendored in llama-cpp-python 0.3.36): the same bf16 model converted by its own
  `convert_hf_to_gguf.py --outtype bf16` and quantized by `llama-quantize` (Q4_0: 4.5 bits per weight;
  Q4_K_M: Q4_K with some attn_v / ffn_down in Q6_K; TQ2_0: ternary, 2.06 bits per weight, on weights that are
  not ternary, so a speed reference only), the output projection in llama-quantize's default type for each
  (listed per row), timed with `llama-bench -t THREADS`. Its converter reads a Llama vocabulary from a
  SentencePiece `tokenizer.model` or a `tokenizer.json` whose pre-tokenizer it knows; the fixture's
  offline-trained byte-level BPE is not in its table, so the bench gives it a small SentencePiece vocabulary
  padded to the model's (the tokens do not change the timing; `llama-bench` feeds random token ids).
- Intel GPUs / NPUs: not measured (no such device here)."""


# ---------------------------------------------------------------------- checkpoints


def cache_dir() -> Path:
    return Path(os.environ.get("AIPC_CACHE_DIR", Path.home() / ".cache" / "aipc-plugins")) / "vllm_e2e"


def write_gptq_int4(src: Path, out: Path, group: int = GPTQ_GROUP) -> Path:
    """The same weights as a symmetric GPTQ int4 checkpoint (RTN per group, AutoGPTQ's v1 layout written
    with vLLM's own packing helpers: :func:`tests.helpers.gptq_checkpoint.write_int4_checkpoint`),
    into a temporary folder renamed when complete."""
    import shutil

    from tests.helpers.gptq_checkpoint import write_int4_checkpoint

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    write_int4_checkpoint(src, tmp, "gptq", group, sym=True)
    tmp.rename(out)
    return out


#: the converter's checkpoints of the bf16 model a row may serve: model key -> convert_checkpoint's options (random
#: weights: speed only, so rtn where the quantizer does not change the kernels; the 2-bit opt-in; real models'
#: quality is bench/results/quality/quality.md). ``progressive`` is its own form (the kernels' integer path)
CONVERTED = {
    "lowbit2": dict(codebook="affine", quantizer="rtn", allow_2bit_ptq=True),
    "affine4": dict(codebook="affine4", quantizer="rtn"),
    "progressive4": dict(codebook="min4", quantizer="progressive"),
}


def checkpoints(preset: str, models: set[str]) -> dict[str, Path]:
    """bf16 model (random, real geometry) and those of its converted (:data:`CONVERTED`) and GPTQ int4
    checkpoints that ``models`` names, cached."""
    import shutil

    from aipc_kernels.tools.tiny_model import PRESETS, build_tiny_model

    sys.path.insert(0, str(ROOT / "plugins"))
    from vllm_lowbit.checkpoint import convert_checkpoint

    bf16 = build_tiny_model(**PRESETS[preset])
    root = cache_dir() / bf16.name
    paths = {"bf16": bf16}
    for model, kw in CONVERTED.items():
        if model not in models:
            continue
        out = root / f"lowbit2-{kw['codebook']}-g{LOWBIT_GROUP}-{kw['quantizer']}"
        if not (out / "config.json").exists():
            # rtn: the decode speed does not depend on the quantizer; the optimised one takes ~40 min at 1B on 1
            # core, the progressive one as long
            tmp = out.with_name(out.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            convert_checkpoint(bf16, tmp, group_size=LOWBIT_GROUP, **kw)
            tmp.rename(out)
        paths[model] = out
    gptq = root / f"gptq-int4-g{GPTQ_GROUP}-sym"
    if "gptq" in models:
        if not (gptq / "config.json").exists():
            write_gptq_int4(bf16, gptq)
        paths["gptq"] = gptq
    return paths


# ---------------------------------------------------------------------- one variant (own process)


def _weight_bytes(model) -> dict[str, int]:
    """Resident bytes of the model's parameters and buffers (each storage once), and of the parts."""
    import torch
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    seen, out = set(), {"linear": 0, "lm_head": 0, "embedding": 0, "total": 0, "opaque_linear": 0}
    kinds: dict[str, Optional[str]] = {}
    for name, mod in model.named_modules():
        kind = ("linear" if isinstance(mod, LinearBase) else "lm_head" if isinstance(mod, ParallelLMHead)
                else "embedding" if isinstance(mod, VocabParallelEmbedding) else None)  # fmt: skip
        if kind is None and name:  # a submodule of a layer (a merged GGUF layer's segments): its layer's kind
            kind = kinds.get(name.rpartition(".")[0])
        kinds[name] = kind
        w = getattr(mod, "weight", None)
        if kind == "linear" and isinstance(w, torch.Tensor) and w.numel() == 0:
            # vLLM-CPU moved an unquantized weight into a oneDNN/SGL handle: count its logical bytes
            n = mod.output_size_per_partition * mod.input_size_per_partition * mod.params_dtype.itemsize
            out["linear"] += n
            out["total"] += n
            out["opaque_linear"] += n
        for t in list(mod.parameters(recurse=False)) + list(mod.buffers(recurse=False)):
            key = t.untyped_storage().data_ptr()
            n = t.numel() * t.element_size()
            if key in seen:
                continue
            seen.add(key)
            out["total"] += n
            if kind:
                out[kind] += n
    return out


def paired_peer(name: str) -> Optional[str]:
    """The llama.cpp row ``--paired`` interleaves with vLLM row ``name``, or None."""
    return next((peer for prefix, peer in PAIRED_PEERS if name.startswith(prefix)), None)


def planned_calls_ms(model, steps: int = 5) -> tuple[float, int]:
    """(median ms, count) of one pass over every planned-op call of ``model``'s low-bit layers (linears and
    output projection, in module order) at M=1 on bf16 x, with the layers' own weights: a decode step's
    kernels and op calls alone, without vLLM's step around them."""
    import torch
    from vllm_lowbit.layers import installed_weight

    layers = [m for m in model.modules() if getattr(m, "lowbit_cpu_call", None) is not None]
    xs = {}
    calls = []  # each call's arguments, built before the timing
    for m in layers:
        K = installed_weight(m).in_features
        x = xs.setdefault(K, torch.randn(1, K, dtype=torch.bfloat16))
        calls.append((m.lowbit_cpu_call, (x, m.qweight, m.scales, m.zeros, None, None, m.supers)))
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        for call, args in calls:
            call(*args)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3, len(calls)


def run_variant(name: str, model: Path, new_tokens: int, reps: int, step_prof: bool, eager: bool,
                long_prompt: int = 0, peer: Optional[dict] = None, split: bool = False) -> dict:
    """One vLLM row in this process; ``peer`` (name, gguf, cache, isa): after each repetition, one
    ``llama-bench -p 0 -n new_tokens`` run of that GGUF on the same threads (a paired round); ``split``: after
    each repetition, the step's planned-op calls alone (:func:`planned_calls_ms`); ``step_prof``: then a profiled
    decode step (:func:`harness.step_profile.step_profile`)."""
    import torch
    from vllm import LLM

    spec = VARIANTS[name]
    kw = dict(spec["llm"])
    if "qcfg" in spec:  # --hf-overrides replaces the whole quantization_config: pass the checkpoint's, amended
        qcfg = json.loads((model / "config.json").read_text())["quantization_config"]
        kw["hf_overrides"] = {"quantization_config": dict(qcfg, **spec["qcfg"])}
    if step_prof:
        kw["compilation_config"] = with_kernel_profile(kw.get("compilation_config"))
    t0 = time.time()
    llm = LLM(str(model), dtype="bfloat16", max_model_len=1024, enable_prefix_caching=False, seed=0,
              enforce_eager=eager, **kw)  # fmt: skip
    load_s = time.time() - t0
    wbytes = llm.apply_model(_weight_bytes)[0]
    methods = llm.apply_model(lambda m: sorted({type(getattr(x, "quant_method", None)).__name__ for x in m.modules()
                                                if getattr(x, "quant_method", None) is not None}))[0]  # fmt: skip
    short = [1] + [(37 * i) % 1000 + 6 for i in range(PROMPT - 1)]
    long_ = [1] + [(41 * i) % 1000 + 6 for i in range(long_prompt - 1)]

    def timed(n: int, prompt: list[int] = short) -> float:
        return timed_generate(llm, [prompt], n)

    timed(4)  # warm-up (compiles the decode and prefill graphs)
    threads = torch.get_num_threads()  # what the model computes on (the in-process engine's torch/OpenMP threads)
    bw = read_bandwidth(threads)  # under the same load as this variant's decode
    rates, firsts, peer_rates, ops_ms = [], [], [], []
    for _ in range(reps):
        t1, tn = timed(1), timed(1 + new_tokens)
        firsts.append(t1)
        rates.append(new_tokens / (tn - t1))
        if split:
            ms, calls = llm.apply_model(planned_calls_ms)[0]
            ops_ms.append(ms)
        if peer:  # the peer's decode right after this repetition, under the same load
            peer_rates.append(llamacpp.llama_bench(Path(peer["gguf"]), Path(peer["cache"]), threads, 0, new_tokens, 1,
                                                   peer["isa"])[0][0])  # fmt: skip
    res = dict(variant=name, label=spec["label"], model=str(model), load_s=load_s, weight_bytes=wbytes,
               quant_methods=methods, decode_tok_s=statistics.median(rates), decode_tok_s_best=max(rates),
               decode_tok_s_all=rates,
               prefill_32_s=statistics.median(firsts), read_bw_gbs=bw, threads=threads,
               prefill_long_s=statistics.median(timed(1, long_) for _ in range(reps)) if long_prompt else None,
               loadavg_after=os.getloadavg())  # fmt: skip
    if split:
        res["split"] = dict(calls=calls, step_ms_all=[1e3 / r for r in rates], ops_ms_all=ops_ms)
    if peer:
        ratios = [a / b for a, b in zip(rates, peer_rates)]
        res["paired"] = dict(peer=peer["name"], peer_tok_s_all=peer_rates, ratio_all=ratios,
                             ratio_median=statistics.median(ratios))  # fmt: skip
    if step_prof:
        res["step_profile"] = step_profile(llm, [short], 1 + new_tokens)
    return res


# ---------------------------------------------------------------------- report


def decode_bytes(r: dict) -> int:
    """Bytes one decode step must read: all weights except the input embedding (one row per token)."""
    w = r["weight_bytes"]
    return w["linear"] + (w["lm_head"] if w["lm_head"] else w["embedding"])


def ratio(r: dict, other: Optional[dict], key: str) -> str:
    """``r[key] / other[key]`` as a table cell; empty where the other variant did not run."""
    return f"{r[key] / other[key]:.2f}" if other else ""


def row_bytes(r: dict) -> tuple[int, int, int]:
    """(linear weights, resident weights, bytes one decode step reads) of row ``r``: a vLLM row's measured
    on the loaded model, a llama.cpp row's read from its GGUF (linears + their scales; every tensor;
    :func:`harness.llamacpp.per_token_bytes`)."""
    if "weight_bytes" in r:
        w = r["weight_bytes"]
        return w["linear"], w["total"], decode_bytes(r)
    b = r["bytes"]
    return b["linear"] + b["scales"], b["total"], llamacpp.per_token_bytes(b)


def llama_threads(given: Optional[int], rows: list[dict]) -> int:
    """llama.cpp's ``-t``: ``--threads`` if given, else the most threads a vLLM row computed on (rows run
    before the llama.cpp ones), else torch's default (what vLLM's in-process engine takes)."""
    if given:
        return given
    measured = [r["threads"] for r in rows if "weight_bytes" in r]
    if measured:
        return max(measured)
    import torch

    return torch.get_num_threads()


def own_bound(r: dict, what: str) -> str:
    """Row ``r``'s bound from the read of its own bytes per token (``bound``: tok/s, ``pct``: best decode
    as a share of it), empty for a row measured without that probe."""
    bw = r.get("read_bw_gbs_own_bytes")
    if not bw:
        return ""
    bound = llamacpp.bound_tok_s(bw, row_bytes(r)[2])
    return f"{bound:.1f}" if what == "bound" else f"{100 * r['decode_tok_s_best'] / bound:.0f}%"


def fmt_s(v: Optional[float]) -> str:
    """Seconds with 3 decimals, or empty where not measured."""
    return "" if v is None else f"{v:.3f}"


def targets(rows: list[dict]) -> list[str]:
    """One line per target of ``TARGETS``: the measured ratio on the medians (decode tokens/s with the best
    repetitions' ratio in parentheses; first-token seconds with both rows' times) and met / not met, or which
    row did not run or lacks the measure."""
    by = {r["variant"]: r for r in rows}
    out = []
    for what, row, ref, need, measure in TARGETS:
        paired = by.get(row, {}).get("paired")
        if measure == "decode_tok_s" and paired and paired["peer"] == ref:
            rs = paired["ratio_all"]
            out.append(f"- {what}, paired rounds: {paired['ratio_median']:.2f}x (rounds {min(rs):.2f}-{max(rs):.2f}x), "
                       f"**{'met' if paired['ratio_median'] >= need else 'not met'}**")  # fmt: skip
        missing = [n for n in (row, ref) if n not in by or by[n].get(measure) is None]
        if missing:
            out.append(f"- {what}: not measured ({', '.join(missing)} did not run or has no {measure})")
            continue
        if measure == "decode_tok_s":
            med = by[row]["decode_tok_s"] / by[ref]["decode_tok_s"]
            best = by[row]["decode_tok_s_best"] / by[ref]["decode_tok_s_best"]
            out.append(f"- {what}: {med:.2f}x (best {best:.2f}x), **{'met' if med >= need else 'not met'}**")
        else:
            med = by[ref][measure] / by[row][measure]
            out.append(f"- {what}: {by[row][measure]:.3f} s against {by[ref][measure]:.3f} s, {med:.2f}x, "
                       f"**{'met' if med >= need else 'not met'}**")
    return out


def section(title: str, header: list[str], body: list[str]) -> list[str]:
    """A report section's lines: a blank line, ``## title``, a blank line and a table of ``header`` over ``body``."""
    return ["", f"## {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header), *body]


def report(rows: list[dict], meta: dict) -> tuple[str, str]:
    """(the notes after the machine sentence, the body) of the results file."""
    by = {r["variant"]: r for r in rows}
    base, int4 = by.get("bf16"), by.get("int4")
    bw = max(r["read_bw_gbs"] for r in rows)  # the least disturbed probe of the run
    llama_note = f", and llama.cpp runs `llama-bench -t {meta['threads']}`" if any("bytes" in r for r in rows) else ""
    vllm_threads = sorted({r["threads"] for r in rows if "weight_bytes" in r})
    notes = (f"Cores shared with other engineers' jobs (load average {meta['loadavg_after'][0]:.2f} after); vLLM-CPU "
             f"computes on **{'/'.join(map(str, vllm_threads)) or '?'} thread(s)** (the in-process engine's torch threads, "
             f"read in each row){llama_note}. {meta['software']}. "
             f"Native ISA: {meta['isa']}"
             f"{' (forced with AIPC_ISA)' if meta.get('aipc_isa_env') else ''}. Model: random Llama, `{meta['preset']}` "
             f"geometry ({meta['params_b']:.2f} B parameters, {'tied' if meta['tied'] else 'untied'} embeddings), bf16 "
             f"activations, batch 1, {PROMPT}-token prompt, {meta['new_tokens']} decoded tokens, "
             f"{'eager' if meta['eager'] else 'compiled (default)'} mode, median of {meta['reps']}.")
    lines = [
        "| variant | decode tok/s (median) | x bf16 | x int4 | decode tok/s (best) | x bf16 | x int4 | "
        f"first token, {PROMPT}-token prompt, s (median) | first token, {meta['long_prompt']}-token prompt, s (median) | "
        "linear weights MB | x bf16 | resident weights MB | bytes read / token MB | bound tok/s (read BW, same threads) | "
        "best % of bound | bound tok/s (read of its own bytes) | best % of it |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    linear_bf16 = row_bytes(base)[0] if base else None
    for r in rows:
        lin, total, db = row_bytes(r)
        bound = llamacpp.bound_tok_s(bw, db)
        med, best = r["decode_tok_s"], r["decode_tok_s_best"]
        linear_x = f"{lin / linear_bf16:.3f}" if linear_bf16 else ""
        lines.append(
            f"| {r['label']} | {med:.2f} | {ratio(r, base, 'decode_tok_s')} | {ratio(r, int4, 'decode_tok_s')} | "
            f"{best:.2f} | {ratio(r, base, 'decode_tok_s_best')} | {ratio(r, int4, 'decode_tok_s_best')} | "
            f"{r['prefill_32_s']:.3f} | {fmt_s(r.get('prefill_long_s'))} | {lin / 1e6:.0f} | {linear_x} | {total / 1e6:.0f} | "
            f"{db / 1e6:.0f} | {bound:.1f} | {100 * best / bound:.0f}% | {own_bound(r, 'bound')} | {own_bound(r, 'pct')} |"
        )
    probes = ", ".join(f"{r['variant']} {r['read_bw_gbs']:.1f}" for r in rows)
    own_probes = ", ".join(f"{r['variant']} {r['read_bw_gbs_own_bytes']:.1f}" for r in rows if r.get("read_bw_gbs_own_bytes"))
    lines += ["", f"Read bandwidth: best probe of the run on the rows' threads, {bw:.1f} GB/s (each row probes right "
              f"before its decode, under the same load: {probes}). Bytes read per token = "
              "linear weights + output projection (tied to the bf16 embedding unless quantized); KV cache and "
              "activations are negligible at this length. bf16 linear bytes are counted from the shapes: "
              "vLLM-CPU keeps them in oneDNN handles, not tensors. llama.cpp rows: the GGUF's linears with their "
              "block scales + its output projection (the type llama-quantize gives it), resident = every tensor of "
              "the GGUF (mmapped). First token: vLLM, one request of the prompt with `max_tokens=1` (prefill + "
              f"the first sampled token); llama.cpp, {PROMPT} / the `llama-bench -p {PROMPT} -n 0` rate (the long "
              f"prompt likewise: {meta['long_prompt']} tokens, `-p {meta['long_prompt']}`; no sampling, so a lower "
              "bound on llama.cpp's first token). The "
              "machine is shared: the best of the repetitions is the least disturbed one, the median shows the "
              "disturbance. Read of its own bytes: after each row, the row's threads read a buffer of exactly its "
              "bytes per token, cyclically, best of 5 passes (a 1 GB buffer overstates the cost of a smaller step "
              "where the last-level cache keeps part of it from one step to the next, and understates it for a "
              "larger one): the bound of a decode step that only streamed those bytes "
              f"({own_probes} GB/s).", ""]  # fmt: skip
    for r in rows:
        if "weight_bytes" in r:
            lines.append(f"- {r['variant']}: quant methods {', '.join(r['quant_methods'])}; load {r['load_s']:.0f} s; "
                         f"decode tok/s over reps {', '.join(f'{x:.2f}' for x in r['decode_tok_s_all'])}")  # fmt: skip
        else:
            b = r["bytes"]
            lines.append(f"- {r['variant']}: linear types {', '.join(b['linear_types'])}, output projection "
                         f"{b['output_type']}; {r['build']}; `-t {r['threads']}`; peak RSS {r['peak_rss'] / 1e6:.0f} MB; "
                         f"decode tok/s over reps {', '.join(f'{x:.2f}' for x in r['decode_tok_s_all'])}")  # fmt: skip
    llama = [r for r in rows if "bytes" in r]
    if llama or any(t[1] in by for t in TARGETS):
        lines += ["", "## Against llama.cpp, and the targets", ""]
        for r in llama:
            db = row_bytes(r)[2]
            bound, med, best = llamacpp.bound_tok_s(bw, db), r["decode_tok_s"], r["decode_tok_s_best"]
            vs = (f"{med / base['decode_tok_s']:.2f}x vLLM bf16 (best {best / base['decode_tok_s_best']:.2f}x)" if base
                  else "vLLM bf16 not run")  # fmt: skip
            own = f", {own_bound(r, 'pct')} of the read of its own bytes" if own_bound(r, "pct") else ""
            lines.append(f"- {r['label']}: decode {med:.2f} tok/s (best {best:.2f}), {vs}, {100 * best / bound:.0f}% of its "
                         f"bytes-per-token bound ({bound:.1f} tok/s = {bw:.1f} GB/s / {db / 1e6:.0f} MB){own}; first token "
                         f"{r['prefill_32_s']:.3f} s")  # fmt: skip
        lines += targets(rows)
    paired = [r for r in rows if "paired" in r]
    if paired:
        body = []
        for r in paired:
            p = r["paired"]
            body.append(f"| {r['label']} | {VARIANTS[p['peer']]['label']} | {len(p['ratio_all'])} | "
                        f"{statistics.median(r['decode_tok_s_all']):.2f} | {statistics.median(p['peer_tok_s_all']):.2f} | "
                        f"{p['ratio_median']:.2f}x | {min(p['ratio_all']):.2f}x | {max(p['ratio_all']):.2f}x |")  # fmt: skip
        lines += section("Paired rounds: each repetition of the row, then one `llama-bench` decode of its peer, in the "
                         "row's worker", ["row", "peer", "rounds", "row tok/s (median)", "peer tok/s (median)",
                                          "ratio (median of rounds)", "min", "max"], body)  # fmt: skip
    split = [r for r in rows if "split" in r]
    if split:
        body = []
        for r in split:
            p = r["split"]
            rest = statistics.median(a - b for a, b in zip(p["step_ms_all"], p["ops_ms_all"]))
            step = statistics.median(p["step_ms_all"])
            body.append(f"| {r['label']} | {p['calls']} | {step:.2f} | {statistics.median(p['ops_ms_all']):.2f} | "
                        f"{rest:.2f} | {rest / step:.0%} |")  # fmt: skip
        lines += section("Where a step goes: after each repetition, the step's planned-op calls alone (every low-bit "
                         "layer's, M=1, its own weights, in one Python loop)",
                         ["row", "calls", "step ms (median)", "op calls alone ms (median)", "the rest ms (median of "
                          "rounds)", "rest share"], body)  # fmt: skip
    for r in (r for r in rows if "step_profile" in r):
        p = r["step_profile"]
        top = sorted(p["ops"].items(), key=lambda kv: -kv[1]["self_ms"])[:16]
        lines += section(f"Where a decode step goes: {r['label']} (one sequence, in the row's process; torch profiler "
                         f"self CPU time per step over {p['tokens'] - 1} steps; step {p['step_ms']:.1f} ms unprofiled, "
                         f"{p['self_ms']:.1f} ms of op self time profiled)", ["op", "ms per step", "share", "calls per step"],
                         [f"| `{op}` | {v['self_ms']:.2f} | {v['self_ms'] / p['step_ms']:.0%} | {v['calls']:.0f} |"
                          for op, v in top])  # fmt: skip
        lines += ["", ownership_line(p, "the step")]
    if meta.get("skipped"):
        lines += ["", "Not run: " + "; ".join(f"{k}: {v}" for k, v in meta["skipped"].items())]
    lines += ["", meta.get("notes", "")]
    return notes, "\n".join(lines)


def main() -> None:
    ap = BenchParser("vllm_e2e", __doc__.split("\n\n")[0], list(VARIANTS), what="variants", group="e2e")
    ap.add_argument("--preset", default="llama-3.2-1b")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--long-prompt", type=int, default=512,
                    help="tokens of the second first-token prompt (vLLM: T(1 token); llama.cpp: llama-bench -p N -n 0); 0 skips it")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--eager", action="store_true", help="--enforce-eager instead of vLLM's compiled default")
    ap.add_argument("--threads", type=int, default=None,
                    help="llama.cpp threads (default: the number the vLLM rows computed on, read in each row; "
                         "torch's default where no vLLM row ran)")
    llamacpp.add_arguments(ap)
    ap.add_argument("--paired", action="store_true",
                    help="follow each repetition of a lowbit4_gptq* / lowbit2* row with one llama-bench decode of its "
                         "llama.cpp peer (Q4_0 / TQ2_0) in the row's worker, and report the rounds' ratios")
    ap.add_argument("--split", action="store_true",
                    help="after each repetition of a vLLM row, time its step's planned-op calls alone (the kernels "
                         "and op calls without vLLM's step around them) and report the rest")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--peer", help=argparse.SUPPRESS)  # the worker's paired peer: NAME=GGUF
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--step-profile", action="store_true",
                    help="after the repetitions, profile one-sequence decode steps of each vLLM row (torch profiler, "
                         "inductor's C++ kernels recorded): who owns the step's time")
    args = ap.parse_args()

    if args.worker:  # one variant, in this process
        peer = None
        if args.peer:
            pname, _, gguf = args.peer.partition("=")
            peer = dict(name=pname, gguf=gguf, cache=str(args.llamacpp_cache.expanduser()), isa=args.llamacpp_isa)
        res = run_variant(args.worker, Path(args.model), args.new_tokens, args.reps, args.step_profile, args.eager,
                          args.long_prompt, peer, args.split)
        print(RESULT_PREFIX + json.dumps(res), flush=True)
        return

    cache = args.llamacpp_cache.expanduser()
    with bench_lock(enabled=not args.no_lock):  # never two benchmarks at once on the shared machine
        info = machine_info()
        paths = checkpoints(args.preset, {VARIANTS[name]["model"] for name in args.rows})
        want_llama = [n for n in args.rows if VARIANTS[n].get("kind") == "llamacpp"]
        peers = {n: paired_peer(n) for n in args.rows if args.paired and paired_peer(n)}
        need_gguf = sorted(set(want_llama) | set(peers.values()))
        no_llama = llamacpp.ensure_built(cache, args.build_llamacpp, args.llamacpp_isa, llamacpp.BENCH_TOOLS) if need_gguf else None
        files: dict[str, Path] = {}
        if need_gguf and not no_llama:  # the bf16 model through llama.cpp's converter and quantizer (cached)
            try:
                files = llamacpp.ggufs(lambda stage: llamacpp.stage_float_model(paths["bf16"], stage), cache,
                                       [VARIANTS[n]["qtype"] for n in need_gguf], paths["bf16"].name,
                                       args.llamacpp_isa)  # fmt: skip
            except (subprocess.CalledProcessError, OSError) as e:
                no_llama = f"the GGUF conversion failed: {e}"
        if peers and no_llama:
            print(f"--paired: no llama.cpp peer runs ({no_llama})", flush=True)
        rows, skipped = [], {}
        for name in VARIANTS:
            if name not in args.rows or (name in want_llama and no_llama):
                skipped[name] = no_llama if name in args.rows else "not asked for (--rows)"
                print(f"[{name}] skipped: {skipped[name]}", flush=True)
                continue
            spec = VARIANTS[name]
            print(f"[{name}] {spec['label']} ...", flush=True)
            if spec.get("kind") == "llamacpp":
                try:
                    res = llamacpp.run_row(files[spec["qtype"]], cache, llama_threads(args.threads, rows), args.new_tokens, args.reps, PROMPT,
                                           args.reps, args.llamacpp_isa)  # fmt: skip
                except (RuntimeError, ValueError, KeyError) as e:
                    skipped[name] = f"failed: {str(e)[:300]}"
                    print(f"[{name}] {skipped[name]}", flush=True)
                    continue
                long_s = None
                if args.long_prompt:  # first token of the long prompt: its -p rate, as for the short one
                    rates = llamacpp.llama_bench(files[spec["qtype"]], cache, res["threads"], args.long_prompt, 0,
                                                 args.reps, args.llamacpp_isa)[0]  # fmt: skip
                    long_s = statistics.median(args.long_prompt / r for r in rates)
                rows.append(dict(variant=name, label=spec["label"], **res, prefill_32_s=res["ttft_s"],
                                 prefill_long_s=long_s, loadavg_after=os.getloadavg()))  # fmt: skip
            else:
                cmd = [sys.executable, __file__, "--worker", name, "--model", str(paths[spec["model"]]), "--new-tokens",
                       str(args.new_tokens), "--reps", str(args.reps), "--long-prompt", str(args.long_prompt)] \
                    + (["--step-profile"] if args.step_profile else []) \
                    + (["--eager"] if args.eager else []) + (["--split"] if args.split else [])  # fmt: skip
                if name in peers and VARIANTS[peers[name]]["qtype"] in files:
                    cmd += ["--peer", f"{peers[name]}={files[VARIANTS[peers[name]]['qtype']]}", "--llamacpp-cache",
                            str(cache), "--llamacpp-isa", args.llamacpp_isa]  # fmt: skip
                row, reason = run_worker(name, cmd, dict(os.environ, **VLLM_ENV, **spec.get("env", {})))
                if row is None:
                    skipped[name] = reason
                    continue
                rows.append(row)
            # the same bytes read cyclically on the row's threads, right after the row: the bound of a step
            # that only streamed them (a last-level cache larger than part of a step keeps some between steps)
            rows[-1]["read_bw_gbs_own_bytes"] = read_bandwidth(rows[-1]["threads"], gb=row_bytes(rows[-1])[2] / 1e9,
                                                               reps=5)  # fmt: skip
            print(f"[{name}] decode {rows[-1]['decode_tok_s']:.2f} tok/s", flush=True)
        if not rows:
            sys.exit("no variant ran: " + "; ".join(f"{k}: {v}" for k, v in skipped.items()))
        import torch
        import vllm

        from aipc_kernels.core import native
        from aipc_kernels.tools.tiny_model import PRESETS

        p = PRESETS[args.preset]
        h, L, i, v, kv = p["hidden"], p["layers"], p["intermediate"], p["vocab"], p["kv_heads"] * p["hidden"] // p["heads"]
        software = f"vllm-cpu {vllm.__version__}, torch {torch.__version__}"
        if files:
            software += f", llama.cpp from llama-cpp-python {llamacpp.LLAMA_CPP_PYTHON}"
        meta = dict(
            loadavg_after=os.getloadavg(),
            software=software, isa=native.get_isa() if native.available() else "none",
            preset=args.preset, tied=bool(p.get("tie_embeddings")),
            params_b=(L * (2 * h * h + 2 * h * kv + 3 * h * i) + v * h * (1 if p.get("tie_embeddings") else 2)) / 1e9,
            aipc_isa_env=os.environ.get("AIPC_ISA"), llamacpp_isa=args.llamacpp_isa if files else None, threads=llama_threads(args.threads, rows), prompt=PROMPT,
            long_prompt=args.long_prompt,
            new_tokens=args.new_tokens, reps=args.reps, eager=args.eager, skipped=skipped, paired=args.paired,
            llamacpp_cache=str(cache) if files else None, ggufs={k: str(f) for k, f in files.items()},
            notes=NOTES,
        )  # fmt: skip
        notes, body = report(rows, meta)
        write_results(args.out, args.name, "vLLM-CPU end to end: bf16 vs vLLM int4 vs lowbit4 / lowbit2 vs llama.cpp", info,
                      rows, body, notes, extra=dict(meta=meta))  # fmt: skip

if __name__ == "__main__":
    main()
