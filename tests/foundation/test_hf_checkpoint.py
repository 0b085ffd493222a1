"""aipc_kernels.core.hf_checkpoint: which safetensors files a Hugging Face directory's weights are in
(index, single file, any *.safetensors), tensors read as stored, and errors that name the file or
tensor at fault."""
from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import save_file

from aipc_kernels.core.hf_checkpoint import CheckpointError, HFCheckpoint, read_config

A = torch.arange(12, dtype=torch.float32).reshape(4, 3).to(torch.bfloat16)
B = torch.arange(5, dtype=torch.int64)


def _sharded(tmp_path, weight_map=None):
    save_file({"a": A}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"b": B}, str(tmp_path / "model-00002-of-00002.safetensors"))
    weight_map = weight_map or {"a": "model-00001-of-00002.safetensors",
                                "b": "model-00002-of-00002.safetensors"}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return tmp_path


def test_single_file_tensors_rows_and_dtype(tmp_path):
    save_file({"b": B, "a": A}, str(tmp_path / "model.safetensors"))
    save_file({"a": A.float()}, str(tmp_path / "consolidated.safetensors"))  # not the model's weights
    ckpt = HFCheckpoint(tmp_path)
    assert [p.name for p in ckpt.files] == ["model.safetensors"] and len(ckpt) == 2 and "a" in ckpt
    assert torch.equal(ckpt.get("a"), A) and ckpt.get("a").dtype == torch.bfloat16
    assert torch.equal(ckpt.rows("a", 1, 3), A[1:3])
    assert {n: t.dtype for n, t in ckpt.tensors()} == {"a": torch.bfloat16, "b": torch.int64}
    assert ckpt.floating_dtype() == torch.bfloat16
    with pytest.raises(KeyError, match=re.escape(f"checkpoint {tmp_path} has no tensor 'c'")):
        ckpt.get("c")


def test_index_names_the_shards(tmp_path):
    ckpt = HFCheckpoint(_sharded(tmp_path))
    assert [p.name for p in ckpt.files] == ["model-00001-of-00002.safetensors",
                                            "model-00002-of-00002.safetensors"]
    assert dict(ckpt.tensors()).keys() == {"a", "b"} and torch.equal(ckpt.get("b"), B)


def test_index_errors_name_the_shard_and_tensor(tmp_path):
    with pytest.raises(CheckpointError, match="maps tensors to model-00009.safetensors, which .* does not hold"):
        HFCheckpoint(_sharded(tmp_path, {"a": "model-00009.safetensors"}))
    with pytest.raises(CheckpointError, match="maps 'c' to model-00001-of-00002.safetensors, which does not hold it"):
        HFCheckpoint(_sharded(tmp_path, {"a": "model-00001-of-00002.safetensors",
                                         "c": "model-00001-of-00002.safetensors"}))


def test_without_index_every_file_once(tmp_path):
    save_file({"a": A}, str(tmp_path / "part-1.safetensors"))
    save_file({"b": B}, str(tmp_path / "part-2.safetensors"))
    assert HFCheckpoint(tmp_path).weight_map == {"a": "part-1.safetensors", "b": "part-2.safetensors"}
    save_file({"a": A}, str(tmp_path / "part-3.safetensors"))
    with pytest.raises(CheckpointError, match="tensor 'a' is in both part-1.safetensors and part-3.safetensors"):
        HFCheckpoint(tmp_path)


def test_no_weights_and_no_config(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(CheckpointError, match="holds no safetensors weights .*save_pretrained"):
        HFCheckpoint(tmp_path)
    with pytest.raises(CheckpointError, match="has no config.json; pass a Hugging Face model directory"):
        read_config(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    assert read_config(tmp_path) == {"model_type": "llama"}
