"""The converter (``python -m vllm_lowbit.quantize``), the BitNet b1.58 import, the config, and
checkpoints that must fail at load with an error naming the tensor (real vLLM engine loads)."""
from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from aipc_kernels.lowbit.formats import load_lowbit
from aipc_kernels.lowbit.quantizers import quantize_weight
from vllm_serving import TINY, greedy_script, hf_greedy, run_vllm_script, script_tokens

LINEAR = "model.layers.0.self_attn.k_proj"


def _generate_script(model: Path, n: int = 8, **llm_kw) -> str:
    """An in-process vLLM engine that loads ``model`` and prints the greedy tokens of two prompts."""
    return greedy_script(model, [[1, 45, 541, 84], [1, 298, 272, 452, 282]], n, **llm_kw)


_tokens = script_tokens


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_config(model: Path, **qcfg) -> None:
    cfg = json.loads((model / "config.json").read_text())
    cfg["quantization_config"].update(qcfg)
    (model / "config.json").write_text(json.dumps(cfg))


def _edit_tensors(model: Path, fn) -> None:
    path = model / "model.safetensors"
    tensors = load_file(str(path))
    fn(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


# ---------------------------------------------------------------------- converter


def test_converter_output_is_the_shared_quantizer(llama_dir, llama_prequantized):
    """Every quantized linear equals quantize_weight of the bf16 weight (same quantizer, bit for bit);
    lm_head and embeddings stay as they were; config.json carries quantization_config."""
    src = load_file(str(llama_dir / "model.safetensors"))
    weights, rest = load_lowbit(str(llama_prequantized / "model.safetensors"))
    assert len(weights) == 2 * 7
    for name, w in weights.items():
        ref = quantize_weight(src[f"{name}.weight"].float(), "affine", 64)
        assert torch.equal(w.qweight, ref.qweight) and torch.equal(w.scales, ref.scales) and torch.equal(w.zeros, ref.zeros)
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
        assert torch.equal(rest[name], src[name])
    qcfg = json.loads((llama_prequantized / "config.json").read_text())["quantization_config"]
    assert qcfg["quant_method"] == "lowbit2" and qcfg["prequantized"] and qcfg["group_size"] == 64
    assert (llama_prequantized / "tokenizer.json").exists()
    lowbit = sum(w.nbytes() for w in weights.values())
    assert lowbit <= 0.16 * sum(src[f"{n}.weight"].numel() * 2 for n in weights)


def test_converter_refuses_other_quantized_checkpoints(llama_dir, tmp_path):
    model = _copy(llama_dir, tmp_path / "gptq")
    cfg = json.loads((model / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128}
    (model / "config.json").write_text(json.dumps(cfg))
    res = subprocess.run([sys.executable, "-m", "vllm_lowbit.quantize", str(model), str(tmp_path / "out")],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert res.returncode == 2
    assert "quant_method='gptq' cannot be converted to lowbit2" in res.stderr
    assert "BitNet" in res.stderr


def test_converter_killed_while_writing(llama_dir, tmp_path, interrupt_while_writing):
    """SIGKILL while the converter writes: nothing at OUT_DIR, the leftover is the visible staging
    directory, which reads as incomplete and which the next run names with the command that
    removes it; SIGTERM leaves nothing behind."""
    from aipc_kernels.core.atomic_output import IncompleteOutputError, check_complete

    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "vllm_lowbit.quantize", str(llama_dir), str(out), "--threads", "1", "--no-progress",
           "--allow-2bit-ptq"]  # fmt: skip
    staging = interrupt_while_writing(cmd, out, signal.SIGKILL)
    assert sorted(p.name for p in tmp_path.iterdir()) == [staging.name]  # no OUT_DIR, no hidden file
    assert not (staging / "config.json").exists()  # never taken for a model
    with pytest.raises(IncompleteOutputError, match=f"incomplete lowbit2 checkpoint: writing {staging} was interrupted"):
        check_complete(staging, "lowbit2 checkpoint", "convert again")
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and not out.exists(), res.stderr[-3000:]
    assert f"was interrupted and left {staging}" in res.stderr and f"`rm -rf {staging}`" in res.stderr
    shutil.rmtree(staging)
    interrupt_while_writing(cmd, out, signal.SIGTERM)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args, message", [
    (["--act-group", "48"], "--act-group=48 must be 0 (per token) or a multiple of --group-size=64"),
    (["--act-group", "-5"], "--act-group=-5 must be an integer >= 0"),
    (["--act-group", "32", "--group-size", "64"], "--act-group=32 must be 0 (per token) or a multiple of --group-size=64"),
    (["--threads", "-1"], "--threads=-1 must be an integer >= 1"),
    (["--threads", "0"], "--threads=0 must be an integer >= 1"),
])  # fmt: skip
def test_converter_refuses_what_the_server_refuses(llama_dir, tmp_path, capsys, args, message):
    """The converter checks its options with the server's schema, before any work: argparse's exit
    status 2 and usage line, the option named, no output directory."""
    from vllm_lowbit.quantize import main

    with pytest.raises(SystemExit) as e:
        main([str(llama_dir), str(tmp_path / "out"), "--no-progress", *args])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("usage: python -m vllm_lowbit.quantize")
    assert not (tmp_path / "out").exists()


def test_converter_bad_threads_exit_2_without_traceback(llama_dir, tmp_path):
    res = subprocess.run([sys.executable, "-m", "vllm_lowbit.quantize", str(llama_dir), str(tmp_path / "out"),
                          "--threads", "-1"], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "error: --threads=-1 must be an integer >= 1" in res.stderr


@pytest.mark.parametrize("kw, message", [
    (dict(modules_to_not_convert="lm_head"), "convert_checkpoint: modules_to_not_convert='lm_head' must be a list of strings"),
    (dict(act_group=48), "convert_checkpoint: act_group=48 must be 0 (per token) or a multiple of group_size=64"),
    (dict(group_size=64.0), "convert_checkpoint: group_size=64.0 is not supported"),
    (dict(scale_dtype="float32"), "convert_checkpoint: scale_dtype='float32' is not supported"),
])  # fmt: skip
def test_convert_checkpoint_keywords_are_checked(llama_dir, tmp_path, kw, message):
    from vllm_lowbit.checkpoint import convert_checkpoint

    with pytest.raises(ValueError) as e:
        convert_checkpoint(llama_dir, tmp_path / "out", progress=False, **kw)
    assert message in str(e.value)
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------- BitNet b1.58 import


@pytest.fixture(scope="module")
def bitnet_dir(llama_dir, tmp_path_factory) -> Path:
    """The tiny Llama with BitNet b1.58 linears in transformers' packed ``bitlinear`` format (absmean
    ternarization, uint8 [N/4, K] + per-tensor ``weight_scale``), written with transformers' packer."""
    from transformers.integrations.bitnet import pack_weights

    out = _copy(llama_dir, tmp_path_factory.mktemp("bitnet") / "model")
    tensors = load_file(str(out / "model.safetensors"))
    for name in [n for n in tensors if n.endswith("_proj.weight")]:
        w = tensors.pop(name).float()
        s = 1.0 / w.abs().mean().clamp(min=1e-5)
        q = (w * s).round().clamp(-1, 1)
        tensors[name] = pack_weights(q.clone())
        tensors[name.replace(".weight", ".weight_scale")] = s.reshape(1).to(torch.bfloat16)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "bitnet", "linear_class": "bitlinear", "quantization_mode": "offline"}
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.fixture(scope="module")
def bitnet_lowbit2(bitnet_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bitnet-lowbit2") / "model"
    res = subprocess.run([sys.executable, "-m", "vllm_lowbit.quantize", str(bitnet_dir), str(out), "--codebook",
                          "ternary", "--group-size", "-1", "--no-progress"], capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    return out


def test_bitnet_import_is_lossless(bitnet_dir, bitnet_lowbit2):
    """Codes equal transformers' own unpacking; values equal ``unpack / weight_scale`` up to the one
    rounding of ``1 / weight_scale`` to the fp16 scale."""
    from transformers.integrations.bitnet import unpack_weights

    unpack = getattr(unpack_weights, "_torchdynamo_orig_callable", unpack_weights)  # skip its torch.compile
    src = load_file(str(bitnet_dir / "model.safetensors"))
    weights, _ = load_lowbit(str(bitnet_lowbit2 / "model.safetensors"))
    assert len(weights) == 14 and all(w.codebook == "ternary" for w in weights.values())
    for name, w in weights.items():
        ternary = unpack(src[f"{name}.weight"], dtype=torch.float32)
        assert torch.equal(w.values(), ternary)
        ref = ternary / src[f"{name}.weight_scale"].float()
        torch.testing.assert_close(w.dequantize(), ref, rtol=1e-3, atol=0)
    qcfg = json.loads((bitnet_lowbit2 / "config.json").read_text())["quantization_config"]
    assert qcfg["codebook"] == "ternary" and qcfg["source"] == "bitnet"


def _lowbit_reference_tokens(float_dir: Path, weights: dict) -> list[list[int]]:
    """The greedy tokens of :func:`_generate_script`'s prompts from transformers (float32) with LowBitLinear on
    ``weights`` (the op vLLM's layers call) in place of the float model's linears."""
    from transformers import AutoModelForCausalLM

    from aipc_kernels.lowbit.modules import LowBitLinear

    model = AutoModelForCausalLM.from_pretrained(float_dir, dtype=torch.float32).eval()
    for name, w in weights.items():
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, LowBitLinear(w))
    with torch.inference_mode():
        return [model.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False, pad_token_id=0,
                               eos_token_id=None)[0, len(p):].tolist()
                for p in ([1, 45, 541, 84], [1, 298, 272, 452, 282])]  # fmt: skip


def test_bitnet_import_served_by_vllm(bitnet_lowbit2, llama_dir):
    """vLLM loads the imported ternary checkpoint without flags; its greedy tokens equal transformers
    with LowBitLinear on the imported weights (the same op), both float32."""
    got = _tokens(run_vllm_script(_generate_script(bitnet_lowbit2)))
    weights, _ = load_lowbit(str(bitnet_lowbit2 / "model.safetensors"))
    assert got == _lowbit_reference_tokens(llama_dir, weights)


# ---------------------------------------------------------------------- the progressive form (issue 41)


@pytest.fixture(scope="module")
def llama_progressive(llama_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("llama-progressive") / "model"
    res = subprocess.run([sys.executable, "-m", "vllm_lowbit.quantize", str(llama_dir), str(out), "--quantizer",
                          "progressive", "--codebook", "min4", "--group-size", "64", "--threads", "1", "--no-progress"],
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    return out


def test_progressive_checkpoint_and_on_the_fly(llama_dir, llama_progressive):
    """``--quantizer progressive --codebook min4``: every linear is ``quantize_progressive`` of the float weight
    bit for bit, stored as the two-level form with its super block in ``layer_formats`` (one row scale a row, so
    the CPU layout takes the integer path); vLLM serves the checkpoint without flags, and lowbit4 on the fly with
    ``quantizer: progressive`` in ``--hf-overrides`` gives the same tokens, equal to transformers with LowBitLinear
    on the checkpoint's weights (float32)."""
    from aipc_kernels.lowbit.packing import is_cpu_progressive, pack_for_cpu
    from aipc_kernels.lowbit.progressive import quantize_progressive, row_scales

    src = load_file(str(llama_dir / "model.safetensors"))
    weights, _ = load_lowbit(str(llama_progressive / "model.safetensors"))
    qcfg = json.loads((llama_progressive / "config.json").read_text())["quantization_config"]
    assert (qcfg["quantizer"], qcfg["codebook"]) == ("progressive", "min4") and len(weights) == 2 * 7
    for name, w in weights.items():
        ref = quantize_progressive(src[f"{name}.weight"].float(), "min4", 64)
        assert all(torch.equal(a, b) for a, b in zip((w.qweight, w.scales, w.zeros, w.supers),
                                                     (ref.qweight, ref.scales, ref.zeros, ref.supers)))  # fmt: skip
        assert qcfg["layer_formats"][name] == {"codebook": "min4", "group_size": 64, "scale_dtype": "int8",
                                               "super_block": w.super_block}  # fmt: skip
        assert row_scales(w) is not None and is_cpu_progressive(pack_for_cpu(w))
    stored = _tokens(run_vllm_script(_generate_script(llama_progressive)))
    override = {"quantization_config": {"quant_method": "lowbit4", "quantizer": "progressive", "codebook": "min4"}}
    on_the_fly = _tokens(run_vllm_script(_generate_script(llama_dir, quantization="lowbit4", hf_overrides=override)))
    assert stored == on_the_fly == _lowbit_reference_tokens(llama_dir, weights)


def test_progressive_checkpoint_keeps_its_quantizer(llama_progressive):
    """The quantizer fixes a converted checkpoint's layer formats: an override naming another is refused at load."""
    _expect_load_error(llama_progressive, r"quantization_config.quantizer='optimized' conflicts with the converted "
                                          r"checkpoint, whose tensors were written with quantizer='progressive'",
                       hf_overrides={"quantization_config": {"quant_method": "lowbit2", "quantizer": "optimized"}})  # fmt: skip


# ---------------------------------------------------------------------- checkpoints that must fail at load


def _expect_load_error(model: Path, *needles: str, **llm_kw) -> None:
    res = run_vllm_script(_generate_script(model, n=1, **llm_kw), timeout=300)
    assert res.returncode != 0, "the engine loaded a corrupt checkpoint"
    for needle in needles:
        assert re.search(needle, res.stderr), f"{needle!r} not in the error:\n{res.stderr[-3000:]}"


def test_wrong_shape_names_the_tensor(llama_prequantized, tmp_path):
    model = _copy(llama_prequantized, tmp_path / "m")
    _edit_tensors(model, lambda t: t.update({f"{LINEAR}.qweight": t[f"{LINEAR}.qweight"][:, :-1].contiguous()}))
    _expect_load_error(model, re.escape(f"lowbit2 checkpoint tensor {LINEAR}.qweight has shape (128, 63), expected (128, 64)"))


def test_missing_scales_names_the_tensor(llama_prequantized, tmp_path):
    model = _copy(llama_prequantized, tmp_path / "m")
    _edit_tensors(model, lambda t: t.pop("model.layers.1.mlp.up_proj.scales"))
    _expect_load_error(model, re.escape("lowbit2 checkpoint is missing tensor model.layers.1.mlp.up_proj.scales"))


def test_wrong_scale_dtype_names_the_tensor(llama_prequantized, tmp_path):
    model = _copy(llama_prequantized, tmp_path / "m")
    _edit_tensors(model, lambda t: t.update({f"{LINEAR}.zeros": t[f"{LINEAR}.zeros"].float()}))
    _expect_load_error(model, re.escape(f"lowbit2 checkpoint tensor {LINEAR}.zeros has dtype torch.float32, expected torch.float16"))


def test_mismatched_group_size_names_the_tensor(llama_prequantized, tmp_path):
    model = _copy(llama_prequantized, tmp_path / "m")
    _edit_config(model, group_size=128, act_group=0)  # the tensors hold group-64 scales
    # whichever layer loads first: its scales have 2x the groups that group_size=128 allows
    _expect_load_error(model, r"lowbit2 checkpoint tensor model\.layers\.\d\.\w+\.\w+_proj\.scales has shape "
                              r"\((\d+), (\d+)\), expected \(\1, \d+\) \(codebook=affine, group_size=128")


def test_unknown_codebook_fails(llama_prequantized, tmp_path):
    model = _copy(llama_prequantized, tmp_path / "m")
    _edit_config(model, codebook="int3")
    _expect_load_error(model, re.escape("lowbit2 quantization_config.codebook='int3' is not supported; use one of"))


def test_converted_checkpoint_with_partial_hf_overrides(llama_prequantized, llama_dir):
    """``hf_overrides`` replacing the converted checkpoint's quantization_config with one that lacks
    ``prequantized``/``codebook``/... (issue 19: vLLM then failed with "no module or parameter named
    ...qweight"): the checkpoint's own config.json keeps it prequantized; the override's act_group
    (128, the checkpoint says 64) applies. Greedy tokens equal transformers with the same op."""
    overrides = {"quantization_config": {"quant_method": "lowbit2", "act_group": 128}}
    got = _tokens(run_vllm_script(_generate_script(llama_prequantized, hf_overrides=overrides)))
    ref = hf_greedy(llama_dir, [[1, 45, 541, 84], [1, 298, 272, 452, 282]], 8, "lowbit", act_group=128)
    assert got == ref


def test_k_not_a_multiple_of_32_names_the_layer_and_method(tiny_model):
    """No supported group divides K=496 (a multiple of 16 only): refused before any weight loads, the
    method (lowbit4 here), the layer and the fix named."""
    model = tiny_model("llama", **dict(TINY, intermediate=496))
    _expect_load_error(model, re.escape("lowbit4 cannot quantize layer 'model.layers.0.mlp.down_proj'"),
                       re.escape("in_features K=496 must be a multiple of 32"),
                       re.escape("quantization_config.modules_to_not_convert"), quantization="lowbit4")  # fmt: skip
