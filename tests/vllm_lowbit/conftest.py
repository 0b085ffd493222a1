"""Fixtures of the vLLM lowbit2 tests: tiny models, converted checkpoints, prompts. Servers are
module-scoped fixtures of the test modules (a start costs 20-90 s on two cores)."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

pytest.importorskip("vllm")

from vllm_serving import TINY, registry_gguf  # noqa: E402


# ---------------------------------------------------------------------- models


@pytest.fixture(scope="session")
def llama_dir(tiny_model) -> Path:
    return tiny_model("llama", **TINY)


@pytest.fixture(scope="session")
def bitnet_dir(tiny_model, tmp_path_factory) -> Path:
    """The tiny float BitNet (tied embeddings, GQA, relu2, separate q/k/v and gate/up as the published
    2B-4T) with every RMSNorm weight, the two sub-norms included, set to random values: with all-ones
    norms a model that skipped a norm's weight, or loaded the wrong tensor-parallel slice of it, would
    compute the same tokens."""
    import torch
    from safetensors.torch import load_file, save_file

    src = tiny_model("bitnet", **TINY)
    out = tmp_path_factory.mktemp("bitnet-float") / "model"
    shutil.copytree(src, out)
    tensors = load_file(str(out / "model.safetensors"))
    assert {"model.layers.0.self_attn.attn_sub_norm.weight", "model.layers.0.mlp.ffn_sub_norm.weight"} <= set(tensors)
    assert "lm_head.weight" not in tensors  # tied, as microsoft/bitnet-b1.58-2B-4T
    g = torch.Generator().manual_seed(11)
    for name, t in tensors.items():
        if name.endswith("norm.weight"):
            tensors[name] = (0.5 + torch.rand(t.shape, generator=g)).to(t.dtype)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.fixture(scope="session")
def qwen2_dir(tiny_model, tmp_path_factory) -> Path:
    """Tiny Qwen2 with non-zero q/k/v biases (the builder writes zero biases, which would make it
    compute exactly what the Llama does) and its own seed."""
    import torch
    from safetensors.torch import load_file, save_file

    src = tiny_model("qwen2", seed=1, **TINY)
    out = tmp_path_factory.mktemp("qwen2-bias")
    shutil.copytree(src, out, dirs_exist_ok=True)
    tensors = load_file(str(out / "model.safetensors"))
    g = torch.Generator().manual_seed(7)
    for name, t in tensors.items():
        if name.endswith("_proj.bias"):
            tensors[name] = (0.5 * torch.randn(t.shape, generator=g)).to(t.dtype)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.fixture(scope="session")
def llama_prequantized(llama_dir, tmp_path_factory) -> Path:
    """The converter's output for the tiny Llama (affine, group 64, the optimised quantizer; random
    weights, so with the 2-bit opt-in), with
    per-group int8 activation scales (act_group 64): tensor-parallel slices then compute exactly
    what TP=1 computes."""
    out = tmp_path_factory.mktemp("llama-lowbit2") / "model"
    res = subprocess.run(
        [sys.executable, "-m", "vllm_lowbit.quantize", str(llama_dir), str(out), "--group-size", "64",
         "--codebook", "affine", "--act-group", "64", "--threads", "1", "--no-progress", "--allow-2bit-ptq"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def smollm2() -> Path:
    """SmolLM2-135M-Instruct Q4_1 GGUF (test_gguf.py, test_gguf_convert.py)."""
    return registry_gguf("smollm2-135m-instruct", "SmolLM2-135M-Instruct Q4_1")


@pytest.fixture(scope="module")
def gemma3() -> Path:
    """Gemma-3-270M Q4_K_M GGUF: K-quants (test_gguf.py, test_gguf_convert.py)."""
    return registry_gguf("gemma3-270m", "Gemma-3-270M Q4_K_M")


@pytest.fixture(scope="module")
def gguf_cache(tmp_path_factory) -> Path:
    """A config-folder cache of the test module's own (AIPC_GGUF_CACHE), so the test sees the first write."""
    return tmp_path_factory.mktemp("gguf-config-cache")


@pytest.fixture(scope="session")
def prompts(llama_dir) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(llama_dir)
    texts = ["Hello, my name is", "The capital of France", "def forward(self, x):", "Once upon a time there",
             "import torch\nfor i in range(10):"]  # fmt: skip
    return [tok(t)["input_ids"] for t in texts]


@pytest.fixture(autouse=True, scope="session")
def _single_thread_torch() -> Iterator[None]:
    """The references run in this process: one thread, the other core is the server's."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
