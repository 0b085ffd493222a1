"""Export a transformers decoder LM to chunked, stateful, static-shape OpenVINO IRs (NITRO style).

Directory written by :func:`export_npu_model`::

    config.json, generation_config.json, tokenizer files, openvino_tokenizer/detokenizer.xml
    npu_export.json                       manifest (format version, shapes, chunks, names, quantization)
    npu_embed.xml/.bin                    token [1, B] -> x [1, B, H]            (B = prefill block)
    npu_layers_<a>_<b>_prefill.xml/.bin   x [1, B, H], position [1] -> x_out; KV states, capacity P
    npu_layers_<a>_<b>_kv<C>.xml          x [1, 1, H], position [1] -> x_out; KV states, capacity C
    npu_head.xml/.bin                     x [1, 1, H] -> logits [1, 1, V]

Every variant of a layer group has identical weights, so they share the group's one ``.bin``.
"""
from __future__ import annotations

import hashlib
import logging
import math
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aipc_kernels.atomic_output import atomic_output_dir
from aipc_kernels.config_schema import parse
from aipc_kernels.hf_checkpoint import HFCheckpoint

from .manifest import (ALWAYS_WRITTEN, FORMAT_VERSION, LOGITS, POSITION, SEQUENCE_LENGTH, TOKEN, X, X_OUT,
                       ChunkFile, LayerGroup, NPUExportManifest, cache_name, cache_out_name,
                       legacy_export_files)
from .options import NAMING, ExportOptions

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WeightCompression:
    """NNCF weight compression of every chunk. ``int4`` defaults to the NPU-safe settings:
    symmetric, group 128, ``ratio=1.0, all_layers=True`` (no layer silently kept in INT8)."""

    weight_format: str = "fp16"
    sym: bool | None = None
    group_size: int | None = None
    ratio: float | None = None
    all_layers: bool | None = None

    def resolved(self, target: str) -> dict[str, Any] | None:
        """The settings actually used (None: no compression); raises on NPU-unsafe or contradictory
        ones (each value's type and range: :class:`~optimum_npu.options.ExportOptions`)."""
        fmt = self.weight_format
        if fmt in ("fp32", "fp16"):
            given = {k: v for k, v in (("sym", self.sym), ("group_size", self.group_size),
                                        ("ratio", self.ratio), ("all_layers", self.all_layers))
                     if v is not None}
            if given:
                raise ValueError(f"{', '.join(given)} only apply to weight_format='int8'/'int4', "
                                 f"not {fmt!r}; drop them or choose an integer weight format")
            return None
        sym = True if self.sym is None else self.sym
        if fmt == "int4":
            if not sym and target == "NPU":
                raise ValueError(
                    "weight_format='int4' with sym=False (INT4 asymmetric) crashes the NPU compiler "
                    "(openvino#34450); use sym=True (the default), or weight_format='int8'")
            group = 128 if self.group_size is None else self.group_size
            if group != -1 and group <= 0:
                raise ValueError(f"group_size={group} must be positive or -1 (per channel)")
            ratio = 1.0 if self.ratio is None else self.ratio
            all_layers = True if self.all_layers is None else self.all_layers
            return dict(weight_format="int4", mode="int4_sym" if sym else "int4_asym",
                        group_size=group, ratio=ratio, all_layers=all_layers)
        if self.group_size not in (None, -1) or self.ratio not in (None, 1.0):
            raise ValueError("weight_format='int8' is per channel with ratio 1.0; drop group_size "
                             "and ratio (or use weight_format='int4')")
        return dict(weight_format="int8", mode="int8_sym" if sym else "int8_asym",
                    group_size=-1, ratio=1.0, all_layers=True)


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


def _name_ports(ov_model, inputs: list[str], outputs: list[str]) -> None:
    """Names every Parameter and Result (tensor names and friendly names) by convention."""
    for port, name in zip(ov_model.inputs, inputs, strict=True):
        port.get_tensor().set_names({name})
        port.get_node().set_friendly_name(name)
    for port, name in zip(ov_model.outputs, outputs, strict=True):
        port.get_tensor().set_names({name})
        port.get_node().set_friendly_name(name)


def make_stateful(ov_model, pairs: dict[str, str]) -> None:
    """Turns each (Parameter ``name``, Result ``pairs[name]``) into an OpenVINO state whose
    variable id is ``name``: a ReadValue without initialiser (zeros after ``reset_state()``)
    where the Parameter was, an Assign where the Result was."""
    import openvino.opset6 as ops
    from openvino.op import assign
    from openvino.op.util import Variable, VariableInfo

    params = {p.output(0).get_any_name(): p for p in ov_model.get_parameters()}
    results = {r.input_value(0).get_any_name(): r for r in ov_model.get_results()}
    results.update({r.output(0).get_any_name(): r for r in ov_model.get_results()})
    for pname, rname in pairs.items():
        param, result = params[pname], results[rname]
        info = VariableInfo()
        info.data_shape = param.get_partial_shape()
        info.data_type = param.get_element_type()
        info.variable_id = pname
        variable = Variable(info)
        read = ops.read_value(variable, name=pname)
        read.output(0).get_tensor().set_names({pname})
        for target in list(param.output(0).get_target_inputs()):
            target.replace_source_output(read.output(0))
        value = result.input_value(0)  # Assign takes a single-output Node
        node = value.get_node()
        if node.get_output_size() != 1:
            node = ops.convert(value, value.get_element_type())
        sink = assign(node, variable)
        sink.set_friendly_name(rname)
        ov_model.add_variables([variable])
        ov_model.add_sinks([sink])
        ov_model.remove_result(result)
        ov_model.remove_parameter(param)
    ov_model.validate_nodes_and_infer_types()


def _compress(ov_model, quant: dict[str, Any] | None):
    if quant is None:
        return ov_model
    import nncf

    mode = {"int8_sym": nncf.CompressWeightsMode.INT8_SYM,
            "int8_asym": nncf.CompressWeightsMode.INT8_ASYM,
            "int4_sym": nncf.CompressWeightsMode.INT4_SYM,
            "int4_asym": nncf.CompressWeightsMode.INT4_ASYM}[quant["mode"]]
    kw: dict[str, Any] = dict(mode=mode)
    if quant["weight_format"] == "int4":
        kw.update(group_size=quant["group_size"], ratio=quant["ratio"],
                  all_layers=quant["all_layers"])
    return nncf.compress_weights(ov_model, **kw)


class _Writer:
    """Converts torch chunks to named, static (optionally stateful, compressed) IRs on disk.

    The OpenVINO model shares the torch chunk's weight memory (``convert_model`` does not copy
    them), so a chunk's torch weights may be released only after its IRs are written."""

    def __init__(self, out: Path, quant: dict[str, Any] | None, fp16: bool):
        self.out, self.quant, self.fp16 = out, quant, fp16

    def convert(self, module, example: tuple, shapes: list[tuple[int, ...]], inputs: list[str],
                outputs: list[str], compress: bool = True):
        """``module`` traced once (``shapes``: -1 marks a dimension read from the input shape),
        ports named, weights compressed by NNCF when asked."""
        import openvino as ov
        import torch

        spec = [(ov.PartialShape(list(shape)),
                 {torch.int64: ov.Type.i64, torch.float32: ov.Type.f32}[t.dtype])
                for t, shape in zip(example, shapes, strict=True)]
        with torch.no_grad():
            ov_model = ov.convert_model(module, example_input=example, input=spec)
        _name_ports(ov_model, inputs, outputs)
        return _compress(ov_model, self.quant) if compress else ov_model

    def save(self, ov_model, stem: str, share_with: ChunkFile | None = None) -> ChunkFile:
        import openvino as ov

        xml = self.out / f"{stem}.xml"
        ov.save_model(ov_model, xml, compress_to_fp16=self.fp16)
        chunk = ChunkFile(xml=xml.name, weights=xml.with_suffix(".bin").name)
        if share_with is not None:
            merge_weights(xml, self.out / chunk.weights, self.out / share_with.weights)
            chunk.weights = share_with.weights
        return chunk

    def write(self, module, example: tuple, inputs: list[str], outputs: list[str],
              stem: str) -> ChunkFile:
        """A static, stateless chunk with the example's shapes."""
        ov_model = self.convert(module, example, [tuple(t.shape) for t in example], inputs, outputs)
        chunk = self.save(ov_model, stem)
        del ov_model
        return chunk

    def write_variants(self, ov_model, variants: dict[str, dict[str, list[int]]],
                       states: dict[str, str]) -> dict[str, ChunkFile]:
        """One static, stateful IR per ``variants`` entry (stem -> input shapes), each a reshaped
        clone of the converted and compressed ``ov_model``; all read the first one's ``.bin``."""
        files: dict[str, ChunkFile] = {}
        first = None
        for stem, shapes in variants.items():
            variant = ov_model.clone()
            variant.reshape(shapes)
            make_stateful(variant, states)
            files[stem] = self.save(variant, stem, share_with=first)
            first = first or files[stem]
            del variant
        return files


_CONST_DATA = re.compile(rb'(<data\b[^>]*?\boffset=")(\d+)("\s+size=")(\d+)(")')


def merge_weights(xml: Path, bin_path: Path, shared_bin: Path) -> None:
    """Makes ``xml`` read its constants from ``shared_bin``: each constant whose bytes are already
    there points at them, the others are appended (64-byte aligned); ``bin_path`` is deleted.
    Variants of one chunk differ only in a few small shape constants, so they share the weights."""
    shared = shared_bin.read_bytes()
    index: dict[bytes, int] = {}
    for m in _CONST_DATA.finditer(shared_bin.with_suffix(".xml").read_bytes()):
        off, size = int(m.group(2)), int(m.group(4))
        index.setdefault(hashlib.sha1(shared[off:off + size]).digest() + size.to_bytes(8, "little"), off)
    mine = bin_path.read_bytes()
    appended = bytearray()
    base = len(shared)

    def relocate(m: re.Match) -> bytes:
        nonlocal appended
        off, size = int(m.group(2)), int(m.group(4))
        blob = mine[off:off + size]
        key = hashlib.sha1(blob).digest() + size.to_bytes(8, "little")
        if key not in index:
            pad = (-(base + len(appended))) % 64
            appended += b"\0" * pad
            index[key] = base + len(appended)
            appended += blob
        return m.group(1) + str(index[key]).encode() + m.group(3) + m.group(4) + m.group(5)

    text = _CONST_DATA.sub(relocate, xml.read_bytes())
    if appended:
        with open(shared_bin, "ab") as f:
            f.write(appended)
    xml.write_bytes(text)
    bin_path.unlink()


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

    out = Path(output_dir)
    with atomic_output_dir(out, what="export", redo="export again", param="output_dir",
                           keep_others=True, always_writes=ALWAYS_WRITTEN,
                           legacy_owned=legacy_export_files) as part:
        _write_export(part, src, config, quant, weight_format, target, max_seq_len, prefill_block,
                      buckets, layers_per_chunk)
    return out


def _write_export(out: Path, src: Path, config, quant: dict[str, Any] | None, weight_format: str,
                  target: str, max_seq_len: int, prefill_block: int, buckets: list[int],
                  layers_per_chunk: int) -> None:
    """Writes every file of the export into the staging directory ``out``, the manifest last."""
    import torch
    from transformers import AutoTokenizer, GenerationConfig

    from . import chunks as ch

    reader = HFCheckpoint(src)
    model = ch.build_skeleton(config, ch.weight_dtype(weight_format, reader.floating_dtype()))
    blocks = ch.parts(model)
    rotary = ch.rotary_module(model, config)
    switch = ch.longrope_switch(config)
    rope_inputs = [SEQUENCE_LENGTH] if switch is not None else []  # LongRoPE: factors chosen in-graph
    windows = ch.sliding_windows(config)
    n_layers = config.num_hidden_layers
    hidden = config.hidden_size
    kv_heads = config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    prefill_capacity = math.ceil(max_seq_len / prefill_block) * prefill_block
    writer = _Writer(out, quant, fp16=(weight_format == "fp16"))

    # Embedding: one IR with the prefill block's width (decode uses its first row: a gather).
    # Quantized formats stream the vocabulary matrix through NNCF's quantizer a block of rows at
    # a time (optimum_npu.vocab) instead of materialising it.
    vocab_shape = (config.vocab_size, hidden)
    if quant is not None:
        from . import vocab

        key = ch.checkpoint_key(model, blocks["embed"], "weight", reader)
        q = vocab.quantize_rows(lambda a, b: reader.rows(key, a, b), vocab_shape, quant)
        emb = vocab.embedding_model(q, quant, vocab_shape, prefill_block,
                                    getattr(blocks["embed"], "scalar_embed_scale", None),
                                    (TOKEN, X))
        _name_ports(emb, [TOKEN], [X])
        embed = writer.save(emb, "npu_embed")
        del emb, q
    else:
        ch.materialize(model, blocks["embed"], reader)
        embed = writer.write(ch.EmbeddingChunk(blocks["embed"]).eval(),
                             (torch.zeros(1, prefill_block, dtype=torch.int64),),
                             [TOKEN], [X], "npu_embed")
        ch.release(blocks["embed"])

    groups = []
    for first in range(0, n_layers, layers_per_chunk):
        last = min(first + layers_per_chunk, n_layers)
        layers = blocks["layers"][first:last]
        for layer in layers:
            ch.materialize(model, layer, reader)
        chunk = ch.cast_linears(ch.LayersChunk(layers, first, rotary, windows).eval())
        in_names, out_names, states = [X, POSITION, *rope_inputs], [X_OUT], {}
        for i in range(first, last):
            for kind in ("k", "v"):
                in_names.append(cache_name(kind, i))
                out_names.append(cache_out_name(kind, i))
                states[cache_name(kind, i)] = cache_out_name(kind, i)
        n_caches = 2 * (last - first)

        def shapes(tokens: int, capacity: int) -> list[tuple[int, ...]]:
            return [(1, tokens, hidden), (1,)] + [(1,)] * len(rope_inputs) + \
                [(1, kv_heads, capacity, head_dim)] * n_caches

        # traced once with the token count and KV capacity read from the input shapes, compressed
        # once; the prefill and every decode bucket are static reshapes of that one graph
        example = (torch.zeros(1, 2, hidden), torch.zeros(1, dtype=torch.int64),
                   *(torch.full((1,), 2, dtype=torch.int64) for _ in rope_inputs),
                   *(torch.zeros(1, kv_heads, 4, head_dim) for _ in range(n_caches)))
        ov_model = writer.convert(chunk, example, shapes(-1, -1), in_names, out_names)
        if quant is not None:  # the graph now holds NNCF's copies of every linear weight
            ch.release_linears(chunk)
        stem = f"npu_layers_{first:02d}_{last - 1:02d}"
        variants = {f"{stem}_prefill": shapes(prefill_block, prefill_capacity)}
        variants.update({f"{stem}_kv{c}": shapes(1, c) for c in buckets})
        files = writer.write_variants(
            ov_model, {k: dict(zip(in_names, map(list, v), strict=True))
                       for k, v in variants.items()}, states)
        del ov_model
        groups.append(LayerGroup(first, last, files[f"{stem}_prefill"],
                                 {str(c): files[f"{stem}_kv{c}"] for c in buckets}))
        for layer in layers:
            ch.release(layer)
        logger.info("exported layers %d..%d", first, last - 1)

    ch.materialize(model, blocks["norm"], reader)
    if quant is not None:
        from . import vocab

        key = ch.checkpoint_key(model, blocks["lm_head"], "weight", reader)
        q = vocab.quantize_rows(lambda a, b: reader.rows(key, a, b), vocab_shape, quant)
        normed = writer.convert(ch.NormChunk(blocks["norm"]).eval(), (torch.zeros(1, 1, hidden),),
                                [(1, 1, hidden)], [X], ["normed"], compress=False)
        head_model = vocab.append_lm_head(normed, q, quant, vocab_shape, blocks["softcap"])
        _name_ports(head_model, [X], [LOGITS])
        head = writer.save(head_model, "npu_head")
        del normed, head_model, q
    else:
        ch.materialize(model, blocks["lm_head"], reader)
        head = writer.write(
            ch.cast_linears(ch.HeadChunk(blocks["norm"], blocks["lm_head"],
                                         blocks["softcap"]).eval()),
            (torch.zeros(1, 1, hidden),), [X], [LOGITS], "npu_head")
        ch.release(blocks["lm_head"])
    ch.release(blocks["norm"])

    config.save_pretrained(out)
    try:
        GenerationConfig.from_pretrained(src).save_pretrained(out)
    except OSError:
        GenerationConfig.from_model_config(config).save_pretrained(out)
    tokenizer_info = _save_tokenizers(src, out, AutoTokenizer)

    import openvino
    import transformers

    manifest = NPUExportManifest(
        format_version=FORMAT_VERSION, model_type=config.model_type, max_seq_len=max_seq_len,
        prefill_block=prefill_block, kv_buckets=buckets, prefill_capacity=prefill_capacity,
        hidden_size=hidden, num_layers=n_layers, num_kv_heads=kv_heads, head_dim=head_dim,
        vocab_size=config.vocab_size, embedding=embed, head=head, layer_groups=groups,
        quantization=quant, tokenizer=tokenizer_info,
        longrope=None if switch is None else dict(original_max_position_embeddings=switch,
                                                  input=SEQUENCE_LENGTH),
        exporter=dict(aipc_plugins=_package_version(), openvino=openvino.__version__,
                      transformers=transformers.__version__, torch=torch.__version__,
                      target=target))
    manifest.write(out)


def _save_tokenizers(src: Path, out: Path, auto_tokenizer) -> dict[str, str]:
    """Saves the HF tokenizer and, when openvino_tokenizers converts it, the OpenVINO
    tokenizer/detokenizer pair (``openvino_tokenizer.xml``, ``openvino_detokenizer.xml``)."""
    info: dict[str, str] = {}
    try:
        tok = auto_tokenizer.from_pretrained(src)
    except (OSError, ValueError) as e:
        logger.warning("no tokenizer saved: %s", e)
        return {"hf": "missing"}
    tok.save_pretrained(out)
    info["hf"] = "saved"
    try:
        import openvino as ov
        from openvino_tokenizers import convert_tokenizer

        ov_tok, ov_detok = convert_tokenizer(tok, with_detokenizer=True)
        ov.save_model(ov_tok, out / "openvino_tokenizer.xml")
        ov.save_model(ov_detok, out / "openvino_detokenizer.xml")
        info["openvino"] = "openvino_tokenizer.xml"
        info["openvino_detokenizer"] = "openvino_detokenizer.xml"
    except Exception as e:  # noqa: BLE001 - the model is usable without them; say why they are absent
        logger.warning("OpenVINO tokenizer not converted (%s: %s)", type(e).__name__, e)
        info["openvino"] = f"not converted: {type(e).__name__}"
    return info


def copy_export(src: str | os.PathLike, dst: str | os.PathLike) -> Path:
    """Copies the files of an exported directory (those the export wrote; not the compile cache or
    files added later) to ``dst``, like an export: whole or not at all, replacing only files this
    package wrote there."""
    from aipc_kernels.atomic_output import RECORD_NAME, read_record

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
