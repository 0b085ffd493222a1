"""Where a vLLM decode step goes, in the bench's own process (no HTTP): the step's time and the torch profiler's
self CPU time per step of each op, the planned low-bit op apart for each weight and, for an engine built with
:func:`with_kernel_profile`'s compilation config, each C++ kernel of vLLM's compiled graph (norms, RoPE, SiLU and
the like, fused by inductor) apart from the graph's own Python wrapper (``## Call CompiledFxGraph ##``).

Used by bench/gguf_speed.py (``--step-profile``: S sequences against one) and bench/vllm_e2e.py
(``--step-profile``: one sequence per row)."""
from __future__ import annotations

import statistics
import time
from typing import Any

#: vLLM ``compilation_config`` under which inductor's C++ kernels record themselves in the torch profiler
#: (``cpp.enable_kernel_profile``: one profiler range per kernel call; vLLM's CPU platform adds its own
#: inductor options beside it)
KERNEL_PROFILE = {"inductor_compile_config": {"cpp.enable_kernel_profile": True}}

#: what the names of the compiled graph's C++ kernels contain (``graph_0_cpp_fused_add_mean_mul_...``)
COMPILED_KERNEL = "cpp_fused"
#: the compiled graph's own Python (buffer handling and the calls into its kernels and the custom ops)
COMPILED_GRAPH = "## Call CompiledFxGraph"
LOWBIT_OP = "aipc::lowbit_linear"


def with_kernel_profile(compilation_config: dict | None = None) -> dict:
    """``compilation_config`` (a vLLM engine argument) with :data:`KERNEL_PROFILE`'s inductor option added to its
    own ``inductor_compile_config``, whose other options are kept (a shallow merge would drop them)."""
    config = dict(compilation_config or {})
    config["inductor_compile_config"] = {**config.get("inductor_compile_config", {}),
                                         **KERNEL_PROFILE["inductor_compile_config"]}
    return config


def timed_generate(llm: Any, prompts: list[list[int]], n: int) -> float:
    """Seconds ``llm`` takes to generate ``n`` greedy tokens (EOS ignored) after each of ``prompts``, all at once."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    t = time.perf_counter()
    out = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                       SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), use_tqdm=False)  # fmt: skip
    assert all(len(o.outputs[0].token_ids) == n for o in out)
    return time.perf_counter() - t


def step_profile(llm: Any, prompts: list[list[int]], tokens: int) -> dict:
    """Where a decode step of ``len(prompts)`` sequences goes: the step's time, (T(``tokens``) - T(1)) /
    (``tokens`` - 1) with ``prompts`` at once (median of 3), and the torch profiler's self CPU time per step of
    each op over the same difference (the prompt's step and the first token taken off), the planned low-bit op
    apart for each weight (``aipc::lowbit_linear_cpu N x K``, N the packed rows)."""
    from torch.profiler import ProfilerActivity, profile

    from aipc_kernels.lowbit.packing import BLOCK_N

    def run(n: int) -> float:
        return timed_generate(llm, prompts, n)

    def self_us(n: int) -> dict[str, list[float]]:
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as p:
            run(n)
        out: dict[str, list[float]] = {}
        for e in p.key_averages(group_by_input_shape=True):
            key = e.key
            if key.startswith(LOWBIT_OP) and len(e.input_shapes) > 1 and e.input_shapes[1]:
                key = f"{key} {e.input_shapes[1][0] * BLOCK_N} x {e.input_shapes[0][-1]}"
            t = out.setdefault(key, [0.0, 0])
            t[0] += e.self_cpu_time_total
            t[1] += e.count
        return out

    run(4)
    step_s = statistics.median((run(tokens) - run(1)) / (tokens - 1) for _ in range(3))
    one, full = self_us(1), self_us(tokens)  # the prompt's step and the first token, then the decode steps too
    steps, ops = tokens - 1, {}
    for k, (us, calls) in full.items():
        us_one, calls_one = one.get(k, (0.0, 0))
        if us > us_one:
            ops[k] = dict(self_ms=(us - us_one) / steps / 1e3, calls=(calls - calls_one) / steps)
    return dict(streams=len(prompts), tokens=tokens, step_ms=step_s * 1e3, ops=ops,
                self_ms=sum(v["self_ms"] for v in ops.values()))  # fmt: skip


def op_groups(ops: dict[str, dict]) -> dict[str, dict]:
    """A step profile's ops (:func:`step_profile`'s ``ops``) summed by who owns them: ``lowbit`` (the plugin's
    low-bit op, every weight), ``compiled_kernels`` (the compiled graph's C++ kernels: what a fused decoder layer
    could take into the low-bit op's activation pass), ``compiled_graph`` (that graph's own Python), ``other``
    (vLLM's attention and KV-cache ops, sampling, torch's view and allocation ops); each ``self_ms`` and ``calls``
    per step."""
    groups = {g: dict(self_ms=0.0, calls=0.0) for g in ("lowbit", "compiled_kernels", "compiled_graph", "other")}
    for k, v in ops.items():
        g = ("lowbit" if k.startswith(LOWBIT_OP) else "compiled_kernels" if COMPILED_KERNEL in k
             else "compiled_graph" if k.startswith(COMPILED_GRAPH) else "other")  # fmt: skip
        groups[g]["self_ms"] += v["self_ms"]
        groups[g]["calls"] += v["calls"]
    return groups


def ownership_line(prof: dict, what: str) -> str:
    """One sentence on who owns the time of a step profile (:func:`step_profile`), by :func:`op_groups`."""
    g, step = op_groups(prof["ops"]), prof["step_ms"]
    low, kernels = g["lowbit"]["self_ms"], g["compiled_kernels"]
    return (f"Of {what} ({step:.1f} ms): the low-bit op {low:.1f} ms ({low / step:.0%}); vLLM's compiled graph "
            f"{g['compiled_graph']['self_ms']:.1f} ms of its own Python"
            + (f" and {kernels['self_ms']:.2f} ms in its {kernels['calls']:.0f} C++ kernel calls (norms, RoPE, SiLU: "
               "what a fused decoder layer could take into the low-bit op)" if kernels["calls"]
               else " (its C++ kernels inside it: not recorded apart)")
            + f"; the rest {g['other']['self_ms']:.1f} ms (vLLM's attention and KV-cache ops, sampling, views, "
            "allocations).")  # fmt: skip
