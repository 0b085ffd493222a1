"""The exported directory's manifest (``npu_export.json``): what was exported and where it lies.

Standard library only: the hook reads it to recognise an exported directory (and one whose export
was interrupted) without importing torch or OpenVINO.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from aipc_kernels.core.atomic_output import IncompleteOutputError, check_complete

MANIFEST_NAME = "npu_export.json"
FORMAT_VERSION = 1
COMPILE_CACHE_DIR = "npu_compile_cache"  # OpenVINO CACHE_DIR inside the exported directory
#: files every export writes (an existing one this package did not write stops an export early)
ALWAYS_WRITTEN = (MANIFEST_NAME, "config.json", "generation_config.json")
#: side files that exports written before the ``aipc_output.json`` record existed also wrote
_LEGACY_SIDE_FILES = ALWAYS_WRITTEN + (
    COMPILE_CACHE_DIR, "openvino_tokenizer.xml", "openvino_tokenizer.bin", "openvino_detokenizer.xml",
    "openvino_detokenizer.bin", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "chat_template.jinja", "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model")

# Names by convention on every Parameter / Result of the chunk IRs.
TOKEN, X, X_OUT, POSITION, LOGITS = "token", "x", "x_out", "position", "logits"
# Layer input of LongRoPE exports only: the length of the sequence a call belongs to.
SEQUENCE_LENGTH = "sequence_length"


def cache_name(kind: str, layer: int) -> str:
    """The input name (and OpenVINO state variable id) of layer ``layer``'s K (``kind="k"``) or V."""
    return f"cache_{kind}_{layer}"


def cache_out_name(kind: str, layer: int) -> str:
    """The output name paired with :func:`cache_name` before the IR is made stateful."""
    return f"cache_{kind}_{layer}_out"


@dataclass
class ChunkFile:
    """One IR file: ``xml`` (relative to the directory) and the ``weights`` file it reads."""

    xml: str
    weights: str


@dataclass
class LayerGroup:
    """Decoder layers ``[first, last)`` of one chunk: a prefill IR (``prefill_block`` tokens per
    call, KV capacity ``max_seq_len`` rounded up to the block) and one decode IR per KV bucket."""

    first: int
    last: int
    prefill: ChunkFile
    decode: dict[str, ChunkFile]  # str(bucket capacity) -> IR


@dataclass
class NPUExportManifest:
    """Contents of ``npu_export.json``."""

    format_version: int
    model_type: str
    max_seq_len: int
    prefill_block: int
    kv_buckets: list[int]
    prefill_capacity: int
    hidden_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    embedding: ChunkFile
    head: ChunkFile
    layer_groups: list[LayerGroup]
    quantization: dict[str, Any] | None
    names: dict[str, str] = field(default_factory=lambda: dict(
        token=TOKEN, x=X, x_out=X_OUT, position=POSITION, logits=LOGITS,
        cache_k="cache_k_<layer>", cache_v="cache_v_<layer>"))
    tokenizer: dict[str, str] = field(default_factory=dict)
    exporter: dict[str, str] = field(default_factory=dict)
    # LongRoPE: {"original_max_position_embeddings": N, "input": SEQUENCE_LENGTH}; the layer IRs
    # take that input and use the long factors when it exceeds N (None: no such input)
    longrope: dict[str, Any] | None = None

    def write(self, directory: str | os.PathLike) -> Path:
        path = Path(directory) / MANIFEST_NAME
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")
        return path

    @classmethod
    def read(cls, directory: str | os.PathLike) -> "NPUExportManifest":
        path = Path(directory) / MANIFEST_NAME
        data = json.loads(path.read_text())
        if data.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"{path} has format_version={data.get('format_version')}, this "
                             f"optimum_npu reads {FORMAT_VERSION}; re-export the model")
        data["embedding"] = ChunkFile(**data["embedding"])
        data["head"] = ChunkFile(**data["head"])
        data["layer_groups"] = [
            LayerGroup(g["first"], g["last"], ChunkFile(**g["prefill"]),
                       {k: ChunkFile(**v) for k, v in g["decode"].items()})
            for g in data["layer_groups"]]
        return cls(**data)

    def all_files(self) -> list[ChunkFile]:
        files = [self.embedding, self.head]
        for g in self.layer_groups:
            files.append(g.prefill)
            files.extend(g.decode.values())
        return files


def legacy_export_files(directory: Path) -> set[str]:
    """Files an export written before the record existed holds: its manifest's IRs and the side
    files every export writes (nothing when ``directory`` holds no manifest)."""
    try:
        manifest = NPUExportManifest.read(directory)
    except (OSError, ValueError, KeyError, TypeError):
        return set()
    return {n for f in manifest.all_files() for n in (f.xml, f.weights)} | set(_LEGACY_SIDE_FILES)


def check_export_complete(path: Any) -> None:
    """Raises :class:`IncompleteOutputError` ("incomplete export: ... delete DIR and export
    again") when ``path`` is an export directory whose writing did not finish: its record says
    so, it holds chunk IRs but no manifest (written last), or a file the manifest lists is missing."""
    try:
        path = Path(path)
        if not path.is_dir():
            return
    except (TypeError, OSError):
        return
    check_complete(path, "export", "export again")
    if not (path / MANIFEST_NAME).is_file():
        chunks = sorted(p.name for p in path.glob("npu_*.xml"))
        if chunks:
            raise IncompleteOutputError(
                f"incomplete export: {path} holds {chunks[0]} but no {MANIFEST_NAME}, which the "
                f"exporter writes last: the export was interrupted; delete {path} and export again")
        return
    try:
        listed = {n for f in NPUExportManifest.read(path).all_files() for n in (f.xml, f.weights)}
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise IncompleteOutputError(
            f"incomplete export: {path / MANIFEST_NAME} cannot be read ({type(e).__name__}: {e}); "
            f"delete {path} and export again") from None
    missing = sorted(n for n in listed if not (path / n).is_file())
    if missing:
        raise IncompleteOutputError(
            f"incomplete export: {path} lacks {', '.join(missing[:3])}, listed in {MANIFEST_NAME}: "
            f"the export was interrupted or files were removed; delete {path} and export again")


def is_npu_export(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a directory written by this exporter."""
    try:
        return (Path(path) / MANIFEST_NAME).is_file()
    except (TypeError, OSError):
        return False
