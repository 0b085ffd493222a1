"""Reading a Hugging Face model directory: its ``config.json`` and its safetensors weights.

One rule set for every plugin that reads a checkpoint itself (the NPU exporter materialises one
chunk at a time, the ``lowbit2`` converter streams tensor by tensor), the one transformers'
``save_pretrained`` writes and ``from_pretrained`` reads:

- ``model.safetensors.index.json`` present: its ``weight_map`` says which shard holds each tensor;
  a shard it names must exist and hold the tensors mapped to it.
- else ``model.safetensors``: one file (other ``*.safetensors`` beside it, e.g. a Mistral
  ``consolidated.safetensors``, are not this checkpoint's weights).
- else every ``*.safetensors`` of the directory, as vLLM loads a directory without index; a
  tensor held by two of them is an error naming both.
- else an error saying how to get safetensors (``.bin`` checkpoints are not read).

Tensors come back in their stored dtype; reading one opens its file (safetensors memory-maps it
and reads only that tensor), so memory follows what the caller keeps.
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
CONFIG_NAME = "config.json"

# safetensors dtype names of the 16-bit float formats a checkpoint is stored in
_HALF_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16}


class CheckpointError(ValueError):
    """The directory is not a readable Hugging Face safetensors checkpoint (the message says why)."""


def read_config(directory: str | os.PathLike) -> dict[str, Any]:
    """``directory``'s ``config.json`` as a dict; a clear error when it is missing or not JSON."""
    path = Path(directory) / CONFIG_NAME
    if not path.is_file():
        raise CheckpointError(f"{directory} has no {CONFIG_NAME}; pass a Hugging Face model directory")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON ({e})") from None


def _file_keys(path: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return list(f.keys())


def _weight_map(directory: Path) -> dict[str, str]:
    """Tensor name -> file name (relative to ``directory``), by the rules in the module docstring."""
    index = directory / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index} is not a safetensors index (no weight_map: {e!r})") from None
        for file in sorted(set(weight_map.values())):
            if not (directory / file).is_file():
                raise CheckpointError(f"{index} maps tensors to {file}, which {directory} does not hold; "
                                      "download or copy the checkpoint again")
            held = set(_file_keys(directory / file))
            missing = [name for name, f in weight_map.items() if f == file and name not in held]
            if missing:
                raise CheckpointError(f"{index} maps {missing[0]!r} to {file}, which does not hold it "
                                      f"({len(missing)} such tensor(s)); the checkpoint is corrupt")
        return dict(weight_map)
    if (directory / SINGLE_NAME).is_file():
        files = [directory / SINGLE_NAME]
    else:
        files = sorted(directory.glob("*.safetensors"))
    if not files:
        hint = (" (it holds .bin weights: load them with transformers and re-save with "
                "save_pretrained(DIR, safe_serialization=True))" if any(directory.glob("*.bin")) else "")
        raise CheckpointError(f"{directory} holds no safetensors weights ({INDEX_NAME}, {SINGLE_NAME} or "
                              f"*.safetensors){hint}")
    weight_map: dict[str, str] = {}
    for path in files:
        for name in _file_keys(path):
            if name in weight_map:
                raise CheckpointError(f"tensor {name!r} is in both {weight_map[name]} and {path.name} of "
                                      f"{directory} (no {INDEX_NAME} says which one is the model's)")
            weight_map[name] = path.name
    return weight_map


class HFCheckpoint:
    """The safetensors weights of a Hugging Face model directory, read tensor by tensor."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise CheckpointError(f"{directory} is not a directory; pass a Hugging Face model directory")
        self.weight_map = _weight_map(self.directory)

    def config(self) -> dict[str, Any]:
        """The directory's ``config.json`` (:func:`read_config`)."""
        return read_config(self.directory)

    @property
    def files(self) -> list[Path]:
        """The weight files, sorted by name."""
        return [self.directory / f for f in sorted(set(self.weight_map.values()))]

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def __len__(self) -> int:
        return len(self.weight_map)

    def _file(self, name: str) -> str:
        try:
            return str(self.directory / self.weight_map[name])
        except KeyError:
            raise KeyError(f"checkpoint {self.directory} has no tensor {name!r}") from None

    def get(self, name: str) -> torch.Tensor:
        """Tensor ``name`` as stored."""
        from safetensors import safe_open

        with safe_open(self._file(name), framework="pt") as f:
            return f.get_tensor(name)

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` of tensor ``name``, read without loading the rest."""
        from safetensors import safe_open

        with safe_open(self._file(name), framework="pt") as f:
            return f.get_slice(name)[start:stop]

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor as stored, file by file (each file opened once)."""
        from safetensors import safe_open

        for path in self.files:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    if self.weight_map.get(name) == path.name:
                        yield name, f.get_tensor(name)

    def floating_dtype(self) -> torch.dtype:
        """The dtype the checkpoint's floats are stored in: that of the first floating-point
        tensor, bfloat16 or float16, else float32 (also for a checkpoint without floats)."""
        from safetensors import safe_open

        for name in self.weight_map:
            with safe_open(self._file(name), framework="pt") as f:
                kind = f.get_slice(name).get_dtype()
            if kind.startswith("F") or kind == "BF16":
                return _HALF_DTYPES.get(kind, torch.float32)
        return torch.float32
