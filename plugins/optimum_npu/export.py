"""Export a transformers decoder LM to chunked, stateful, static-shape OpenVINO IRs (NITRO style).

Directory written by :func:`export_npu_model`::

    config.json, generation_config.json, tokenizer files, openvino_tokenizer/detokenizer.xml
    npu_export.json                       manifest (format version, shapes, chunks, names, quantization)
    npu_embed.xml/.bin                    token [1, B] -> x [1, B, H]            (B = prefill block)
    npu_layers_<a>_<b>_prefill.xml/.bin   x [1, B, H], position [1] -> x_out; KV states, capacity P
    npu_layers_<a>_<b>_kv<C>.xml          x [1, 1, H], position [1] -> x_out; KV states, capacity C
    npu_head.xml/.bin                     x [1, 1, H] -> logits [1, 1, V]

Every variant of a layer group has identical weights, so they share the group's one ``.bin``.

This module is the pipeline: the arguments are checked, then :data:`EXPORT_STEPS` run in order
over one :class:`ExportContext`. The pieces live beside it: :mod:`.chunks` (the torch chunks and
their weights), :mod:`.compression` (NNCF settings), :mod:`.vocab` (streamed vocabulary
quantization), :mod:`.convert` (torch chunk -> IR files, tokenizers), :mod:`.ir_surgery` (states,
port names, shared ``.bin``), :mod:`.manifest` (``npu_export.json``).
"""
from __future__ import annotations

import logging
import math
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aipc_kernels.core.atomic_output import atomic_output_dir
from aipc_kernels.core.config_schema import parse
from aipc_kernels.core.hf_checkpoint import HFCheckpoint

from .compression import WeightCompression
from .convert import IRWriter, export_tokenizers
from .ir_surgery import name_ports
from .manifest import (ALWAYS_WRITTEN, FORMAT_VERSION, LOGITS, POSITION, SEQUENCE_LENGTH, TOKEN, X, X_OUT,
                       ChunkFile, LayerGroup, NPUExportManifest, cache_name, cache_out_name,
                       legacy_export_files)
from .options import NAMING, ExportOptions

logger = logging.getLogger(__name__)


def default_buckets(max_seq_len: int, prefill_block: int) -> list[int]:
    """KV capacities from 256, each about 1.25x the previous, rounded up to a multiple of
    ``max(128, prefill_block)`` (256, 384, 512, 640, 896, 1152, 1536, 1920 for block 64), below
    ``max_seq_len``, then ``max_seq_len`` itself: a decode step attends over at most ~1.25x the
    context (plus one step) at a logarithmic number of variants."""
    step = max(128, prefill_block)
    buckets = []
    c = math.ceil(max(256, prefill_block) / step) * step
    while c < max_seq_len:
        buckets.append(c)
        c = math.ceil(c * 1.25 / step) * step
    return buckets + [max_seq_len]


def validate_shape_args(max_seq_len: int, prefill_block: int, kv_buckets: list[int] | None,
                        layers_per_chunk: int) -> tuple[int, int, list[int], int]:
    """Checks the shape arguments against each other (each one's type and range:
    :class:`~optimum_npu.options.ExportOptions`); returns them normalised (buckets sorted, ending at
    max_seq_len)."""
    if prefill_block > max_seq_len:
        raise ValueError(f"prefill_block={prefill_block} is larger than max_seq_len={max_seq_len}; "
                         "choose a smaller block")
    if kv_buckets is None:
        buckets = default_buckets(max_seq_len, prefill_block)
    else:
        bad = [b for b in kv_buckets if b > max_seq_len]
        if bad:
            raise ValueError(f"kv_buckets {bad} exceed max_seq_len={max_seq_len}; "
                             "capacities past the limit are never used")
        buckets = sorted(set(kv_buckets) | {max_seq_len})
    return max_seq_len, prefill_block, buckets, layers_per_chunk


def resolve_model_dir(model_id: str | os.PathLike, revision: str | None = None,
                      token: Any = None, cache_dir: str | None = None,
                      local_files_only: bool = False) -> Path:
    """A local checkpoint directory for ``model_id`` (a path, or a Hub id downloaded once)."""
    path = Path(model_id)
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(
        str(model_id), revision=revision, token=token, cache_dir=cache_dir,
        local_files_only=local_files_only,
        allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "tokenizer*"]))


@dataclass
class ExportContext:
    """What the export steps share: the checked settings and the source checkpoint (given), the
    model's meta-device skeleton and the IR writer (built from them), and the files written so far
    (filled in by the steps; the manifest lists them)."""

    out: Path  # the staging directory every file is written into
    src: Path
    config: Any  # the model's transformers PretrainedConfig
    checkpoint: HFCheckpoint
    quant: dict[str, Any] | None  # WeightCompression.resolved(); None: fp32/fp16 storage
    weight_format: str
    target: str
    max_seq_len: int
    prefill_block: int
    buckets: list[int]
    layers_per_chunk: int
    model: Any = field(init=False)  # AutoModelForCausalLM on the meta device, traced in weight dtype
    blocks: dict[str, Any] = field(init=False)  # chunks.parts(model)
    rotary: Any = field(init=False)
    windows: list[int | None] = field(init=False)
    longrope_switch: int | None = field(init=False)  # chunks.longrope_switch(config)
    writer: IRWriter = field(init=False)
    embed: ChunkFile | None = None
    groups: list[LayerGroup] = field(default_factory=list)
    head: ChunkFile | None = None
    tokenizer: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        from . import chunks as ch

        dtype = ch.weight_dtype(self.weight_format, self.checkpoint.floating_dtype())
        self.model = ch.build_skeleton(self.config, dtype)
        self.blocks = ch.parts(self.model)
        self.rotary = ch.rotary_module(self.model, self.config)
        self.windows = ch.sliding_windows(self.config)
        self.longrope_switch = ch.longrope_switch(self.config)
        self.writer = IRWriter(self.out, self.quant, fp16=(self.weight_format == "fp16"))

    @property
    def rope_inputs(self) -> list[str]:
        """Extra layer inputs: LongRoPE chooses its factors in-graph from the sequence length."""
        return [SEQUENCE_LENGTH] if self.longrope_switch is not None else []

    @property
    def hidden(self) -> int:
        return self.config.hidden_size

    @property
    def kv_heads(self) -> int:
        return self.config.num_key_value_heads

    @property
    def head_dim(self) -> int:
        return getattr(self.config, "head_dim", None) or self.hidden // self.config.num_attention_heads

    @property
    def prefill_capacity(self) -> int:
        return math.ceil(self.max_seq_len / self.prefill_block) * self.prefill_block

    @property
    def vocab_shape(self) -> tuple[int, int]:
        return (self.config.vocab_size, self.hidden)


def _streamed_vocab(ctx: ExportContext, module) -> dict[str, Any]:
    """``module``'s vocabulary matrix quantized while read from the checkpoint (:mod:`.vocab`)."""
    from . import chunks as ch
    from . import vocab

    key = ch.checkpoint_key(ctx.model, module, "weight", ctx.checkpoint)
    return vocab.quantize_rows(lambda a, b: ctx.checkpoint.rows(key, a, b), ctx.vocab_shape, ctx.quant)


def export_embedding(ctx: ExportContext) -> None:
    """Embedding: one IR with the prefill block's width (decode uses its first row: a gather).
    Quantized formats stream the vocabulary matrix through NNCF's quantizer a block of rows at a
    time instead of materialising it."""
    import torch

    from . import chunks as ch

    embed = ctx.blocks["embed"]
    if ctx.quant is not None:
        from . import vocab

        q = _streamed_vocab(ctx, embed)
        emb = vocab.embedding_model(q, ctx.quant, ctx.vocab_shape, ctx.prefill_block,
                                    getattr(embed, "scalar_embed_scale", None), (TOKEN, X))
        name_ports(emb, [TOKEN], [X])
        ctx.embed = ctx.writer.save(emb, "npu_embed")
        del emb, q
    else:
        ch.materialize(ctx.model, embed, ctx.checkpoint)
        ctx.embed = ctx.writer.write(ch.EmbeddingChunk(embed).eval(),
                                     (torch.zeros(1, ctx.prefill_block, dtype=torch.int64),),
                                     [TOKEN], [X], "npu_embed")
        ch.release(embed)


def export_layer_group(ctx: ExportContext, first: int, last: int) -> LayerGroup:
    """Decoder layers ``[first, last)``: traced once with the token count and KV capacity read
    from the input shapes, compressed once; the prefill and every decode bucket are static,
    stateful reshapes of that one graph, sharing one ``.bin``."""
    import torch

    from . import chunks as ch

    layers = ctx.blocks["layers"][first:last]
    for layer in layers:
        ch.materialize(ctx.model, layer, ctx.checkpoint)
    chunk = ch.cast_linears(ch.LayersChunk(layers, first, ctx.rotary, ctx.windows).eval())
    rope_inputs = ctx.rope_inputs
    in_names, out_names, states = [X, POSITION, *rope_inputs], [X_OUT], {}
    for i in range(first, last):
        for kind in ("k", "v"):
            in_names.append(cache_name(kind, i))
            out_names.append(cache_out_name(kind, i))
            states[cache_name(kind, i)] = cache_out_name(kind, i)
    n_caches = 2 * (last - first)
    hidden, kv_heads, head_dim = ctx.hidden, ctx.kv_heads, ctx.head_dim

    def shapes(tokens: int, capacity: int) -> list[tuple[int, ...]]:
        return [(1, tokens, hidden), (1,)] + [(1,)] * len(rope_inputs) + \
            [(1, kv_heads, capacity, head_dim)] * n_caches

    example = (torch.zeros(1, 2, hidden), torch.zeros(1, dtype=torch.int64),
               *(torch.full((1,), 2, dtype=torch.int64) for _ in rope_inputs),
               *(torch.zeros(1, kv_heads, 4, head_dim) for _ in range(n_caches)))
    ov_model = ctx.writer.convert(chunk, example, shapes(-1, -1), in_names, out_names)
    if ctx.quant is not None:  # the graph now holds NNCF's copies of every linear weight
        ch.release_linears(chunk)
    stem = f"npu_layers_{first:02d}_{last - 1:02d}"
    variants = {f"{stem}_prefill": shapes(ctx.prefill_block, ctx.prefill_capacity)}
    variants.update({f"{stem}_kv{c}": shapes(1, c) for c in ctx.buckets})
    files = ctx.writer.write_variants(
        ov_model, {k: dict(zip(in_names, map(list, v), strict=True)) for k, v in variants.items()},
        states)
    del ov_model
    for layer in layers:
        ch.release(layer)
    logger.info("exported layers %d..%d", first, last - 1)
    return LayerGroup(first, last, files[f"{stem}_prefill"],
                      {str(c): files[f"{stem}_kv{c}"] for c in ctx.buckets})


def export_layers(ctx: ExportContext) -> None:
    """Every decoder layer, ``layers_per_chunk`` at a time (:func:`export_layer_group`)."""
    n_layers = ctx.config.num_hidden_layers
    for first in range(0, n_layers, ctx.layers_per_chunk):
        ctx.groups.append(export_layer_group(ctx, first, min(first + ctx.layers_per_chunk, n_layers)))


def export_head(ctx: ExportContext) -> None:
    """Final norm and LM head. Quantized formats convert the norm alone and append the LM
    matrix, streamed through NNCF's quantizer (:mod:`.vocab`)."""
    import torch

    from . import chunks as ch

    norm, lm_head, softcap = ctx.blocks["norm"], ctx.blocks["lm_head"], ctx.blocks["softcap"]
    hidden = ctx.hidden
    ch.materialize(ctx.model, norm, ctx.checkpoint)
    if ctx.quant is not None:
        from . import vocab

        q = _streamed_vocab(ctx, lm_head)
        normed = ctx.writer.convert(ch.NormChunk(norm).eval(), (torch.zeros(1, 1, hidden),),
                                    [(1, 1, hidden)], [X], ["normed"], compress_weights=False)
        head_model = vocab.append_lm_head(normed, q, ctx.quant, ctx.vocab_shape, softcap)
        name_ports(head_model, [X], [LOGITS])
        ctx.head = ctx.writer.save(head_model, "npu_head")
        del normed, head_model, q
    else:
        ch.materialize(ctx.model, lm_head, ctx.checkpoint)
        ctx.head = ctx.writer.write(ch.cast_linears(ch.HeadChunk(norm, lm_head, softcap).eval()),
                                    (torch.zeros(1, 1, hidden),), [X], [LOGITS], "npu_head")
        ch.release(lm_head)
    ch.release(norm)


def save_configs(ctx: ExportContext) -> None:
    """``config.json`` and ``generation_config.json`` (from the model's config when the checkpoint
    has none)."""
    from transformers import GenerationConfig

    ctx.config.save_pretrained(ctx.out)
    try:
        GenerationConfig.from_pretrained(ctx.src).save_pretrained(ctx.out)
    except OSError:
        GenerationConfig.from_model_config(ctx.config).save_pretrained(ctx.out)


def save_tokenizers(ctx: ExportContext) -> None:
    """The HF tokenizer and its OpenVINO pair (:func:`.convert.export_tokenizers`)."""
    ctx.tokenizer = export_tokenizers(ctx.src, ctx.out)


def write_manifest(ctx: ExportContext) -> None:
    """``npu_export.json``, written last: its presence marks a complete export."""
    import openvino
    import torch
    import transformers

    switch = ctx.longrope_switch
    manifest = NPUExportManifest(
        format_version=FORMAT_VERSION, model_type=ctx.config.model_type, max_seq_len=ctx.max_seq_len,
        prefill_block=ctx.prefill_block, kv_buckets=ctx.buckets, prefill_capacity=ctx.prefill_capacity,
        hidden_size=ctx.hidden, num_layers=ctx.config.num_hidden_layers, num_kv_heads=ctx.kv_heads,
        head_dim=ctx.head_dim, vocab_size=ctx.config.vocab_size, embedding=ctx.embed, head=ctx.head,
        layer_groups=ctx.groups, quantization=ctx.quant, tokenizer=ctx.tokenizer,
        longrope=None if switch is None else dict(original_max_position_embeddings=switch,
                                                  input=SEQUENCE_LENGTH),
        exporter=dict(aipc_plugins=_package_version(), openvino=openvino.__version__,
                      transformers=transformers.__version__, torch=torch.__version__,
                      target=ctx.target))
    manifest.write(ctx.out)


#: the export, step by step; each writes into ``ctx.out`` and records what it wrote in ``ctx``
EXPORT_STEPS = (export_embedding, export_layers, export_head, save_configs,
                save_tokenizers, write_manifest)


def export_npu_model(
    model_id: str | os.PathLike,
    output_dir: str | os.PathLike,
    *,
    max_seq_len: int = 2048,
    prefill_block: int = 64,
    kv_buckets: list[int] | None = None,
    layers_per_chunk: int = 2,
    weight_format: str = "fp16",
    sym: bool | None = None,
    group_size: int | None = None,
    ratio: float | None = None,
    all_layers: bool | None = None,
    target: str = "NPU",
    revision: str | None = None,
    token: Any = None,
    cache_dir: str | None = None,
    local_files_only: bool = False,
) -> Path:
    """Exports ``model_id`` (a local directory or Hub id of a safetensors checkpoint) into
    ``output_dir`` as static, stateful OpenVINO chunks; returns the directory.

    ``max_seq_len``: tokens a sequence may hold (prompt + generated); ``prefill_block``: prompt
    tokens per prefill call; ``kv_buckets``: decode KV capacities (default 256, 384, 512, 640,
    896, ..., each ~1.25x the last, up to ``max_seq_len``); ``layers_per_chunk``: decoder layers
    per IR (bounds export memory: 2 keeps a 1B model's export near 1 GiB);
    ``weight_format``: fp32 / fp16 (storage only) / int8 / int4 through NNCF (int4 defaults to
    symmetric, group 128, ratio 1.0, all layers; INT4 asymmetric is refused for ``target="NPU"``).
    """
    from transformers import AutoConfig

    from . import chunks as ch

    o = parse(ExportOptions, dict(
        max_seq_len=max_seq_len, prefill_block=prefill_block, kv_buckets=kv_buckets,
        layers_per_chunk=layers_per_chunk, weight_format=weight_format, sym=sym, group_size=group_size,
        ratio=ratio, all_layers=all_layers, target=target), NAMING)
    max_seq_len, prefill_block, buckets, layers_per_chunk = validate_shape_args(
        o.max_seq_len, o.prefill_block, o.kv_buckets, o.layers_per_chunk)
    quant = WeightCompression(weight_format, sym, group_size, ratio, all_layers).resolved(target)
    src = resolve_model_dir(model_id, revision, token, cache_dir, local_files_only)
    config = AutoConfig.from_pretrained(src)
    ch.check_architecture(config)
    max_pos = getattr(config, "max_position_embeddings", None)
    if max_pos and max_seq_len > max_pos:
        raise ValueError(f"max_seq_len={max_seq_len} exceeds the model's "
                         f"max_position_embeddings={max_pos}; choose max_seq_len <= {max_pos}")
    checkpoint = HFCheckpoint(src)

    out = Path(output_dir)
    with atomic_output_dir(out, what="export", redo="export again", param="output_dir",
                           keep_others=True, always_writes=ALWAYS_WRITTEN,
                           legacy_owned=legacy_export_files) as part:
        ctx = ExportContext(out=part, src=src, config=config, checkpoint=checkpoint, quant=quant,
                            weight_format=weight_format, target=target, max_seq_len=max_seq_len,
                            prefill_block=prefill_block, buckets=buckets,
                            layers_per_chunk=layers_per_chunk)
        for step in EXPORT_STEPS:
            step(ctx)
    return out


def copy_export(src: str | os.PathLike, dst: str | os.PathLike) -> Path:
    """Copies the files of an exported directory (those the export wrote; not the compile cache or
    files added later) to ``dst``, like an export: whole or not at all, replacing only files this
    package wrote there."""
    from aipc_kernels.core.atomic_output import RECORD_NAME, read_record

    from .manifest import COMPILE_CACHE_DIR

    src, dst = Path(src), Path(dst)
    record = read_record(src)
    ours = None if record is None else set(record.get("files", ()))
    with atomic_output_dir(dst, what="export", redo="save again", param="save_directory",
                           keep_others=True, always_writes=ALWAYS_WRITTEN,
                           legacy_owned=legacy_export_files) as part:
        for p in src.iterdir():
            if p.name in (COMPILE_CACHE_DIR, RECORD_NAME) or (ours is not None and p.name not in ours):
                continue
            if p.is_dir():
                shutil.copytree(p, part / p.name)
            else:
                shutil.copy2(p, part / p.name)
    return dst


def _package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("aipc-plugins")
    except PackageNotFoundError:
        return "unknown"
