"""``--quantization lowbit4``: published GPTQ and AWQ checkpoints served on the W4A8 kernels, and
bf16 checkpoints quantized to ``int4`` on the fly.

The checkpoints are the tiny Llama written in AutoGPTQ's / AutoAWQ's layouts with vLLM's own
quantize and pack helpers (:mod:`tests.helpers.gptq_checkpoint`). The reference is transformers
in float32 holding, in every linear, the weight vLLM's own GPTQ / AWQ code unpacks from those tensors,
with each linear's input rounded to int8 per token (``float_a8``) and the output projection as the plugin
serves it on this CPU (``lm_head: auto``: int8 per output channel, or int6 with AVX2 / AVX-VNNI kernels). The
served weights are compared bit for bit with vLLM's reading; the tokens by teacher forcing (a disagreement must be a near-tie): vLLM eager float32 computes
the same values up to the float32 summation order (integer dot products against float matrix
products), which the int8 rounding of an activation can still turn into a flip at a near-tie; tensor
parallelism (partial sums of row-parallel layers added across ranks) and the compiled server differ a
little more. Each test starts one engine (20-60 s on the shared two cores).
"""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from aipc_kernels.lowbit.output_projection import auto_head_format
from tests.helpers.gptq_checkpoint import vllm_dequantized_linears, write_int4_checkpoint
from tests.helpers.references import hf_model
from vllm_serving import (check_teacher_forced, completion_tokens, greedy_script, hf_greedy, run_vllm_script,
                           script_tokens, start_server)  # fmt: skip

N_NEW = 32


def default_head_layer() -> list:
    """``LAYERS``' output projection under the default ``lm_head: auto`` on this CPU (the engine runs here, under
    the same ``AIPC_ISA``): int6 in groups of 32 with AVX2 / AVX-VNNI kernels, else int8 per row (K=256)."""
    head = auto_head_format()
    return ["QuantizedLMHeadMethod", head, 32 if head == "int6" else 256]


CHECKPOINTS = {
    "gptq-sym-g128": dict(method="gptq", group_size=128, sym=True),
    "gptq-asym-g64-actorder": dict(method="gptq", group_size=64, sym=False, desc_act=True),
    "gptq-v2-asym-g32": dict(method="gptq", group_size=32, sym=False, checkpoint_format="gptq_v2"),
    "awq-g32": dict(method="awq", group_size=32, sym=False),
}

#: appended to a greedy script: what serves each linear (``LAYERS=``, one dict per rank) and, for a
#: checkpoint, whether each served linear dequantizes bit for bit to its slice of the weight vLLM's own
#: GPTQ / AWQ code reads from the checkpoint (``SERVED=``); module-level functions: apply_model pickles
#: them for the workers of TP>1
_PRINT_LAYERS = """    import functools
    from tests.helpers import gptq_checkpoint as gc
    print("LAYERS=" + json.dumps(llm.apply_model(gc.served_linears)))
"""
_PRINT_SERVED = """    print("SERVED=" + json.dumps(llm.apply_model(functools.partial(gc.served_equals_checkpoint, {model!r}))))
"""


@pytest.fixture(scope="module")
def ckpts(llama_dir, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("int4-checkpoints")
    return {name: write_int4_checkpoint(llama_dir, root / name, **kw) for name, kw in CHECKPOINTS.items()}


def reference(llama_dir: Path, ckpt: Path):
    """transformers float32 with the checkpoint's linears as vLLM's own code dequantizes them, int8
    inputs per token and the int8 output projection."""
    return hf_model(llama_dir, "float_a8", weights=vllm_dequantized_linears(ckpt))


def _printed(res: subprocess.CompletedProcess, key: str) -> list:
    """The per-rank list a script printed on its ``KEY=`` line."""
    return json.loads([ln for ln in res.stdout.splitlines() if ln.startswith(key + "=")][-1][len(key) + 1 :])


def _run(model: Path, prompts, timeout: float = 300, served: bool = False, **kw) -> subprocess.CompletedProcess:
    """An in-process engine's greedy tokens and ``LAYERS=`` (and ``SERVED=`` for a checkpoint)."""
    code = greedy_script(model, prompts, N_NEW, **kw) + _PRINT_LAYERS
    return run_vllm_script(code + (_PRINT_SERVED.format(model=str(model)) if served else ""), timeout=timeout)


# ---------------------------------------------------------------------- which method serves what (no weights loaded)


_CONFIG_SCRIPT = """
import json
from vllm.engine.arg_utils import EngineArgs
if __name__ == "__main__":
    out = []
    for model, quantization, overrides in {cases!r}:
        try:
            q = EngineArgs(model=model, quantization=quantization, max_model_len=256, enforce_eager=True,
                           hf_overrides=overrides).create_engine_config().quant_config
            spec, options = getattr(q, "spec", None), getattr(q, "options", None)
            out.append([q.get_name(), getattr(options, "codebook", None), getattr(options, "group_size", None),
                        None if spec is None else [spec.layout, spec.group_size, spec.zero_offset],
                        getattr(options, "head_setting", None)])
        except Exception as e:  # vLLM wraps the plugin's ValueError in pydantic's ValidationError
            out.append(dict(error=str(e)))
    print("RESULT=" + json.dumps(out))
"""


def test_flag_claims_gptq_and_awq_vllm_keeps_them_without(ckpts, llama_dir, tmp_path):
    """What ``vllm serve MODEL [--quantization lowbit4]`` builds before loading weights (vLLM's
    EngineArgs, in a fresh interpreter): a GPTQ / AWQ checkpoint is served by vLLM's own method without
    the flag and by lowbit4 (the checkpoint's spec) with it; a bf16 checkpoint with the flag is
    quantized on the fly (affine4, groups of 64; ``--hf-overrides`` with ``quant_method: lowbit4`` sets
    lowbit2's keys, no flag needed); a config we do not read names its key; a GPTQ config may add
    lowbit2's ``lm_head`` as a head format (a string), while GPTQ's boolean ``lm_head`` stays GPTQ's and
    is refused."""
    bad = tmp_path / "gptq-8bit"
    shutil.copytree(ckpts["gptq-sym-g128"], bad)
    config = json.loads((bad / "config.json").read_text())
    config["quantization_config"]["bits"] = 8
    (bad / "config.json").write_text(json.dumps(config))
    cases = [(str(ckpts[n]), q, {}) for n in ("gptq-sym-g128", "awq-g32") for q in (None, "lowbit4")]
    cases += [(str(ckpts[n]), "lowbit4", {}) for n in ("gptq-asym-g64-actorder", "gptq-v2-asym-g32")]
    cases += [(str(llama_dir), "lowbit4", {}), (str(bad), "lowbit4", {}),
              (str(llama_dir), None, {"quantization_config": {"quant_method": "lowbit4", "group_size": 128}})]
    gptq = json.loads((ckpts["gptq-sym-g128"] / "config.json").read_text())["quantization_config"]
    cases += [(str(ckpts["gptq-sym-g128"]), "lowbit4", {"quantization_config": dict(gptq, lm_head=v)})
              for v in ("int6", True)]  # a string: lowbit2's head format; a boolean: GPTQ's quantized head
    res = run_vllm_script(_CONFIG_SCRIPT.format(cases=cases), timeout=300)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("RESULT=")]
    assert res.returncode == 0 and lines, res.stderr[-3000:]
    got = json.loads(lines[-1][len("RESULT="):])
    assert [g[0] for g in got[:4]] == ["auto_gptq", "lowbit4", "auto_awq", "lowbit4"]
    assert got[1] == ["lowbit4", "int4", 128, ["gptq", 128, 1], "auto"]  # lm_head auto by default (int6 / int8 by the CPU)
    assert got[3] == ["lowbit4", "affine4", 32, ["awq", 32, 0], "auto"]
    assert got[4] == ["lowbit4", "affine4", 64, ["gptq", 64, 1], "auto"]
    assert got[5] == ["lowbit4", "affine4", 32, ["gptq", 32, 0], "auto"]  # gptq_v2: zero points stored as they are
    assert got[6] == ["lowbit4", "affine4", 64, None, "auto"]  # bf16: on the fly, the real-model rows' default
    assert "gptq quantization_config.bits=8 is not supported; use one of 4" in got[7]["error"]
    assert got[8] == ["lowbit4", "affine4", 128, None, "auto"]  # --hf-overrides with quant_method lowbit4: lowbit2's keys
    assert got[9] == ["lowbit4", "int4", 128, ["gptq", 128, 1], "int6"]  # the checkpoint's keys + a head format
    assert "gptq quantization_config.lm_head=True" in got[10]["error"] and "not read by aipc-plugins" in got[10]["error"]


# ---------------------------------------------------------------------- served checkpoints against the reference


@pytest.mark.parametrize("name", ["gptq-sym-g128", "awq-g32"])
def test_checkpoint_eager_float32_against_reference(ckpts, llama_dir, prompts, name):
    """``LLM(ckpt, quantization="lowbit4")``: every served linear (merged q/k/v and gate/up included)
    dequantizes bit for bit to what vLLM's own GPTQ / AWQ code reads from the checkpoint, in ``int4``
    for symmetric GPTQ and ``affine4`` with AWQ's zero points; the head is the default's (``auto``); 32 greedy
    tokens per prompt agree with the reference by teacher forcing (measured: GPTQ 160/160, AWQ 158/160, the two
    others near-ties of 0.005 and 0.03 logit std: the int8 rounding of an activation can flip on the
    last float32 bit)."""
    res = _run(ckpts[name], prompts, served=True, quantization="lowbit4")
    got = script_tokens(res)
    log = res.stdout + res.stderr
    assert "quantization=lowbit4" in log
    (layers,) = _printed(res, "LAYERS")
    codebook = "int4" if CHECKPOINTS[name]["sym"] else "affine4"
    assert layers.pop("lm_head") == default_head_layer()
    assert len(layers) == 8 and all(v == ["Int4CheckpointLinearMethod", codebook, CHECKPOINTS[name]["group_size"]]
                                    for v in layers.values()), layers  # fmt: skip
    (served,) = _printed(res, "SERVED")
    assert len(served) == 8 and all(served.values()), served
    check_teacher_forced(ckpts[name], prompts, got, "float_a8", min_agree=0.95, max_gap_in_std=0.05,
                         model=reference(llama_dir, ckpts[name]))  # fmt: skip


def test_act_order_checkpoint_tensor_parallel_2(ckpts, llama_dir, prompts):
    """TP=2 (one core per rank) on asymmetric GPTQ v1 with ``desc_act: true`` and an in-order
    ``g_idx``: qweight cut along packed K rows, qzeros along packed N columns, g_idx along K, merged
    q/k/v and gate/up shards; each rank's linears dequantize bit for bit to their slice of vLLM's
    reading. The row-parallel layers (o_proj, down_proj) hold half of each token's features and quantize
    them with the whole token's absmax, all-gathered over the ranks, as the reference and TP=1 do: teacher
    forcing with TP=1's bounds (measured 158/160, largest gap 0.043 logit std; with each rank's own K-half
    absmax it was 154/160 and 0.062)."""
    ckpt = ckpts["gptq-asym-g64-actorder"]
    res = _run(ckpt, prompts, timeout=600, served=True, quantization="lowbit4", tensor_parallel_size=2,
               env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"})  # fmt: skip
    got = script_tokens(res)
    layers = _printed(res, "LAYERS")
    assert len(layers) == 2 and all(v[:2] == ["Int4CheckpointLinearMethod", "affine4"] for rank in layers
                                    for n, v in rank.items() if n != "lm_head"), layers  # fmt: skip
    assert all(("whole_row_amax" in v) == n.endswith(("o_proj", "down_proj")) for rank in layers
               for n, v in rank.items()), layers  # fmt: skip
    served = _printed(res, "SERVED")
    assert len(served) == 2 and all(len(r) == 8 and all(r.values()) for r in served), served
    check_teacher_forced(ckpt, prompts, got, "float_a8", min_agree=0.95, max_gap_in_std=0.05,
                         model=reference(llama_dir, ckpt))  # fmt: skip


def test_serve_gptq_v2_chat(ckpts, llama_dir, prompts, tmp_path, request):
    """``vllm serve GPTQ_DIR --quantization lowbit4`` (compiled, vLLM's CPU default) answers
    /v1/chat/completions, and its greedy completions agree with the reference by teacher forcing."""
    ckpt = ckpts["gptq-v2-asym-g32"]
    server = start_server(ckpt, ["--quantization", "lowbit4", "--dtype", "float32", "--max-model-len", "512",
                                 "--seed", "0"], tmp_path / "serve.log", request)  # fmt: skip
    r = server.post("/v1/chat/completions", dict(model=server.model, max_tokens=8, temperature=0.0, ignore_eos=True,
                                                 messages=[{"role": "user", "content": "Hello"}]))  # fmt: skip
    assert r["choices"][0]["message"]["content"] and r["usage"]["completion_tokens"] == 8
    got = completion_tokens(server, prompts, 16)
    assert "quantization=lowbit4" in server.log.read_text(errors="replace")
    check_teacher_forced(ckpt, prompts, got, "float_a8", min_agree=0.9, max_gap_in_std=0.08,
                         model=reference(llama_dir, ckpt))  # fmt: skip


# ---------------------------------------------------------------------- bf16 on the fly


def test_on_the_fly_default_equals_transformers_same_op(llama_dir, prompts):
    """``LLM(BF16_DIR, quantization="lowbit4")``: every linear quantized to ``affine4`` in groups of 64
    (the default the real-model quality rows chose) while it loads, with no 2-bit opt-in needed; greedy
    tokens equal transformers with the same quantizer and op (LowBitLinear)."""
    res = _run(llama_dir, prompts, quantization="lowbit4")
    (layers,) = _printed(res, "LAYERS")
    assert layers.pop("lm_head") == default_head_layer()
    assert all(v == ["LowBit2OnlineLinearMethod", "affine4", 64] for v in layers.values()), layers
    assert script_tokens(res) == hf_greedy(llama_dir, prompts, N_NEW, "lowbit", codebook="affine4", group_size=64)


def test_hidden_576_group_falls_back_per_layer(tiny_model, prompts):
    """SmolLM2's geometry (hidden 576, not a multiple of 128) with ``group_size: 128``: the layers
    whose K is 576 use groups of 64, down_proj (K=1536) keeps 128, logged once per distinct choice;
    greedy tokens are transformers' with the same per-layer groups and op (teacher-forced)."""
    model = tiny_model("llama", hidden=576, layers=2, heads=9, kv_heads=3, intermediate=1536)
    cfg = {"quant_method": "lowbit4", "group_size": 128}
    res = _run(model, prompts, quantization="lowbit4", hf_overrides={"quantization_config": cfg})
    (layers,) = _printed(res, "LAYERS")
    layers.pop("lm_head")
    assert all(v == ["LowBit2OnlineLinearMethod", "affine4", 128 if n.endswith("down_proj") else 64]
               for n, v in layers.items()), layers  # fmt: skip
    logged = res.stdout + res.stderr
    assert logged.count("lowbit4: group_size=128 does not divide K=576") == 1, logged[-3000:]
    # teacher-forced, not token-equal: at width 576 vLLM's attention and transformers' part at near-ties
    # (seen: one in 160 tokens, at a gap of 0.050 std of the logits)
    check_teacher_forced(model, prompts, script_tokens(res), "lowbit", min_agree=0.95, max_gap_in_std=0.1,
                         codebook="affine4", group_size=128)  # fmt: skip


def test_on_the_fly_whole_row_group_equals_transformers_same_op(llama_dir, prompts):
    """``group_size: -1`` (one scale per row) on the fly: the quantizer gets -1, its own spelling of the
    whole row (the K it was once given is not a supported group and was refused)."""
    res = _run(llama_dir, prompts, quantization="lowbit4",
               hf_overrides={"quantization_config": {"quant_method": "lowbit4", "group_size": -1}})
    (layers,) = _printed(res, "LAYERS")
    layers.pop("lm_head")
    assert all(v[:2] == ["LowBit2OnlineLinearMethod", "affine4"] for v in layers.values()), layers
    assert script_tokens(res) == hf_greedy(llama_dir, prompts, N_NEW, "lowbit", codebook="affine4", group_size=-1)


def test_serve_on_the_fly_chat(llama_dir, prompts, tmp_path, request):
    """``vllm serve BF16_DIR --quantization lowbit4`` (eager float32) answers /v1/chat/completions, and
    its greedy completions equal transformers with the same affine4 g64 quantizer and op."""
    server = start_server(llama_dir, ["--quantization", "lowbit4", "--dtype", "float32", "--enforce-eager",
                                      "--max-model-len", "512", "--seed", "0"], tmp_path / "serve.log", request)  # fmt: skip
    try:
        r = server.post("/v1/chat/completions", dict(model=server.model, max_tokens=8, temperature=0.0,
                                                     ignore_eos=True, messages=[{"role": "user", "content": "Hi"}]))  # fmt: skip
        assert r["choices"][0]["message"]["content"] and r["usage"]["completion_tokens"] == 8
        got = completion_tokens(server, prompts, 16)
        assert "quantization=lowbit4" in server.log.read_text(errors="replace")
    finally:
        server.stop()
    assert got == hf_greedy(llama_dir, prompts, 16, "lowbit", codebook="affine4", group_size=64)


def test_on_the_fly_e0m4_w4a16_equals_transformers_same_op(llama_dir, prompts):
    """``quantization_config: {codebook: e0m4, activations: float}``: every linear quantized to
    Transformer-Lite's E0M4 and served on the activation-exact W4A16 kernel; greedy tokens equal
    transformers with the same quantizer and op."""
    cfg = {"quant_method": "lowbit4", "codebook": "e0m4", "activations": "float"}
    res = _run(llama_dir, prompts, quantization="lowbit4", hf_overrides={"quantization_config": cfg})
    (layers,) = _printed(res, "LAYERS")
    assert layers.pop("lm_head") == default_head_layer()
    assert all(v == ["LowBit2OnlineLinearMethod", "e0m4", 64, "a16"] for v in layers.values()), layers
    want = hf_greedy(llama_dir, prompts, N_NEW, "lowbit", codebook="e0m4", group_size=64, activations="float")
    assert script_tokens(res) == want


# ---------------------------------------------------------------------- refused at load, naming the tensor


def test_activation_order_g_idx_refused_at_load(ckpts, tmp_path, prompts):
    """A real activation-order ``g_idx`` (groups of a permuted input order) in one layer: the engine
    stops while loading, naming that tensor and how to re-quantize (vLLM's own method would drop g_idx)."""
    src = ckpts["gptq-asym-g64-actorder"]
    bad = tmp_path / "actorder"
    shutil.copytree(src, bad)
    tensors = load_file(str(bad / "model.safetensors"))
    name = "model.layers.1.mlp.down_proj.g_idx"
    perm = torch.randperm(tensors[name].numel(), generator=torch.Generator().manual_seed(0))
    tensors[name] = (perm // 64).to(torch.int32)
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    res = _run(bad, prompts[:1], quantization="lowbit4")
    assert res.returncode != 0
    assert (f"GPTQ tensor {name} is an activation-order grouping" in res.stderr
            and "quantize with desc_act false, or desc_act true with static_groups true" in res.stderr), res.stderr[-3000:]
