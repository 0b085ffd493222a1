"""A llama.cpp GGUF file -> a ``lowbit2`` checkpoint that ``vllm serve OUT`` loads without flags (no vLLM
needed): ``python -m vllm_lowbit.quantize X.gguf OUT [--verify]``.

The same reader as serving the file (``vllm serve X.gguf``, :mod:`vllm_lowbit.gguf`), not a second one:
:func:`vllm_lowbit.gguf_source.open_gguf` checks the file (the same refusals, naming file and tensor),
:func:`~vllm_lowbit.gguf_source.config_folder` gives config.json, tokenizer and chat template (transformers'
GGUF conversion of the metadata, cached), :class:`~vllm_lowbit.gguf_source.GGUFTensors` the tensors under
Hugging Face names (llama's q / k rows put back in Hugging Face order), and
:func:`aipc_kernels.checkpoints.gguf.relayout` re-lays each quantized tensor out exactly onto the canonical
format. What is written:

* every quantized linear as its exact re-layout (``X.qweight``/``X.scales``/``X.zeros``): Q4_1 as ``min4``
  g32 fp16, Q8_0 as ``int8`` g32, the K-quants with groups of 16 or 32 and their two levels of scales, as
  serving the file holds them (int8 sub-block scales and mins, and ``X.supers``: float32 ``d`` / ``-dmin``
  per super-block of 256; ``scale_dtype: int8`` with ``super_block: 256``), ...; the
  linears vLLM merges (q / k / v, gate / up) in runs of one code book and group
  (:func:`~aipc_kernels.checkpoints.gguf.form_runs`), each run in one form (fp16 with float32 scales: float32),
  as serving does: a Q4_K_M file's Q4_K q / k and its Q6_K v keep their own forms, served as two segments
  (:class:`vllm_lowbit.lowbit2.LowBit2SegmentedLinearMethod`), exact either way. ``quantization_config`` (``source: gguf``, ``prequantized: true``) records the most
  common form as ``codebook`` / ``group_size`` / ``scale_dtype`` (/ ``super_block``) and every other linear's in
  ``layer_formats``; the min form, groups of 16, float32 scales and the two-level form are accepted in such
  checkpoints only;
* ``act_group: 32``, as serving the GGUF (int8 activation scales per 32 inputs, as llama.cpp's CPU dot
  products; a layer whose group is larger takes its group: :func:`vllm_lowbit.options.gguf_layer_act_group`);
* float tensors (norms, biases, F16 / F32 linears: listed in ``modules_to_not_convert``) as transformers'
  GGUF processing gives them, in the file's dtype where that is exact, else float32;
* a quantized token embedding and untied output projection as their exact re-layout too, under
  ``layer_formats`` :data:`~vllm_lowbit.options.STORED_EMBEDDING` / :data:`~vllm_lowbit.options.STORED_HEAD`
  (always listed), with ``lm_head: stored`` where the output projection is one of them (its own, or tied to
  the embedding): served as serving the file serves them (:class:`vllm_lowbit.lowbit2.LowBit2EmbeddingMethod`:
  rows looked up from the packed blocks, the head on the W·A8 kernels, a tied head the embedding's one
  tensor), so ``LLM(OUT)`` computes what ``LLM(X.gguf)`` computes; a float one as the other float tensors
  (``lm_head: float`` for a float head);

``verify``: every written weight, read back from the output files and dequantized
(:meth:`aipc_kernels.lowbit.formats.LowBitWeight.dequantize`, or the float tensor), is compared with
``gguf.quants.dequantize`` of the file's original blocks (rows in Hugging Face order); the largest
difference is logged per GGUF type and overall, and anything but 0 fails the conversion (nothing written).
The output appears whole or not at all (:func:`aipc_kernels.core.atomic_output.atomic_output_dir`); an
existing non-empty ``out_dir`` is refused.
"""
from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from aipc_kernels.core.atomic_output import RECORD_NAME, atomic_output_dir
from aipc_kernels.lowbit.formats import FORMAT_NAME, LowBitWeight, load_lowbit
from aipc_kernels.lowbit.modules import DEFAULT_SKIP

from .checkpoint import CONVERTER, _linear_names, _progress, _ShardWriter
from .options import (GGUF_ACT_GROUP, GGUF_SOURCE, STORED, STORED_EMBEDDING, STORED_HEAD,
                      quantization_config_dict)  # fmt: skip

#: the Hugging Face linears that vLLM loads as one merged layer (qkv_proj, gate_up_proj)
MERGED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32", torch.int8: "int8"}
_FILE_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32}


def _siblings(prefix: str, linears: set[str]) -> tuple[str, ...]:
    """The linears merged with ``prefix`` by vLLM (itself included), in merge order."""
    parent, _, leaf = prefix.rpartition(".")
    for group in MERGED:
        if leaf in group:
            names = tuple(f"{parent}.{g}" for g in group if f"{parent}.{g}" in linears)
            return names or (prefix,)
    return (prefix,)


def _form(w: LowBitWeight) -> dict[str, Any]:
    """``w``'s stored form as a ``layer_formats`` entry (``super_block`` for the two-level form only)."""
    form = {"codebook": w.codebook, "group_size": w.group_size, "scale_dtype": _DTYPE_NAMES[w.scales.dtype]}
    return form if w.supers is None else dict(form, super_block=w.super_block)


def _form_label(form: dict[str, Any]) -> str:
    """A ``layer_formats`` entry as the log names it, e.g. ``min4 g32 int8 x float32 per 256``."""
    two_level = f" x float32 per {form['super_block']}" if "super_block" in form else ""
    return f"{form['codebook']} g{form['group_size']} {form['scale_dtype']}{two_level}"


def convert_gguf(
    gguf_path: str | Path,
    out_dir: str | Path,
    verify: bool = False,
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> Path:
    """Writes the ``lowbit2`` checkpoint of the GGUF file ``gguf_path`` to ``out_dir`` (new or empty) and
    returns ``out_dir``. ``verify``: compares every written weight with ``gguf.quants.dequantize`` of the
    file's blocks and raises (writing nothing) unless the largest difference is 0."""
    from transformers import AutoConfig

    from aipc_kernels.checkpoints.gguf import common_form, form_runs, relayout

    from . import gguf_source

    ck = gguf_source.open_gguf(gguf_path)  # every refusal of serving, naming file and tensor
    out = Path(out_dir)
    folder = gguf_source.config_folder(ck)
    config = json.loads((folder / "config.json").read_text())
    tensors = gguf_source.GGUFTensors(ck, AutoConfig.from_pretrained(folder))
    if tensors.missing:
        m = tensors.missing
        raise ValueError(f"GGUF file {str(ck.path)!r} lacks the tensors of {m[0]}"
                         + (f" and {len(m) - 1} more" if len(m) > 1 else "") + f" ({ck.architecture})")  # fmt: skip
    linears = _linear_names(config, tuple(DEFAULT_SKIP))

    def where(hf: str) -> str:
        return f"GGUF file {str(ck.path)!r}: tensor {tensors.gguf_name(hf)!r} ({hf})"

    with atomic_output_dir(out, what=f"{FORMAT_NAME} checkpoint", redo="convert again", param="out_dir") as part:
        writer = _ShardWriter(part)
        bar = _progress(len(ck.tensor_names()), "lowbit2 from GGUF") if progress else None
        forms: dict[str, dict[str, Any]] = {}
        held: dict[str, LowBitWeight] = {}  # linears waiting for their merged siblings
        float_linears: list[str] = []
        stored: dict[str, dict[str, Any]] = {}  # the token embedding and an untied head, packed: their forms
        raw = None
        for name, t in tensors.weights():
            base, _, leaf = name.rpartition(".")
            if leaf == "qweight":
                raw = t
                continue
            if bar is not None:
                bar.update(1)
            if leaf != "qweight_type":  # a float tensor, as transformers' GGUF processing gives it
                gname = tensors.gguf_name(name)
                dtype = _FILE_DTYPES.get(ck.tensor_type(gname).name, torch.float32)
                if not torch.equal(t.to(dtype).float(), t):
                    dtype = torch.float32
                writer.add(name, t.to(dtype))
                if leaf == "weight" and base in linears:
                    float_linears.append(base)
                continue
            gname = tensors.gguf_name(f"{base}.weight")
            try:
                w = relayout(raw, int(t), (raw.shape[0], ck.tensor_shape(gname)[1]), base)
            except ValueError as e:
                raise ValueError(f"{where(base + '.weight')}: {e}") from None
            if base not in linears:  # the token embedding, an untied output projection: as the file has them
                if base not in (STORED_EMBEDDING, STORED_HEAD):
                    raise ValueError(f"{where(base + '.weight')} is quantized but is neither a linear layer nor "
                                     f"{STORED_EMBEDDING} / {STORED_HEAD}; {CONVERTER} cannot store it")  # fmt: skip
                writer.add_lowbit(base, w)
                stored[base] = _form(w)
                continue
            held[base] = w
            group = _siblings(base, linears)
            if all(s in held for s in group):
                # as served: runs of parts of one code book and group in one form (K-quants keep their two
                # levels: int8 sub-block scales and mins, float32 supers), each run its own segment
                parts = [held.pop(s) for s in group]
                for run in form_runs(parts):
                    for i, one in zip(run, common_form([parts[i] for i in run])):
                        writer.add_lowbit(group[i], one)
                        forms[group[i]] = _form(one)
        if bar is not None:
            bar.close()
        if held:
            first = sorted(held)[0]
            raise ValueError(f"{where(first + '.weight')} is quantized but the layers vLLM merges it with "
                             f"({list(_siblings(first, linears))}) are not all quantized in the file")  # fmt: skip
        if not forms:
            raise ValueError(f"GGUF file {str(ck.path)!r} has no quantized linear weight: nothing to convert "
                             f"(serve the file itself, or its float model)")  # fmt: skip
        writer.close()
        worst = _verify(part, ck, tensors, log) if verify else None
        for f in folder.iterdir():  # tokenizer files and chat template, as serving the file gets them
            if f.is_file() and f.name not in ("config.json", RECORD_NAME, gguf_source.SOURCE_NAME):
                shutil.copy2(f, part / f.name)
        top = Counter(json.dumps(v, sort_keys=True) for v in forms.values()).most_common(1)[0][0]
        top = json.loads(top)
        tied = bool(config.get("tie_word_embeddings"))
        head_stored = STORED_HEAD in stored or (tied and STORED_EMBEDDING in stored)
        layer_formats = {**{k: v for k, v in forms.items() if v != top}, **stored}
        config["quantization_config"] = quantization_config_dict(
            top["codebook"], top["group_size"], scale_dtype=top["scale_dtype"], act_group=GGUF_ACT_GROUP,
            modules_to_not_convert=sorted(float_linears), source=GGUF_SOURCE,
            lm_head=STORED if head_stored else "float", layer_formats=dict(sorted(layer_formats.items())),
            super_block=top.get("super_block"),
        )  # fmt: skip
        (part / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    kinds = Counter(_form_label(v) for v in forms.values())
    log(f"wrote {len(forms)} {FORMAT_NAME} linears from {ck.path.name} ({', '.join(f'{n} {k}' for k, n in kinds.items())}) "
        f"to {out}" + (f"; kept float: {len(float_linears)} linears" if float_linears else ""))  # fmt: skip
    for name, form in stored.items():
        log(f"{name} stored as the file has it ({_form_label(form)})"
            + ("; the tied output projection multiplies it" if tied and name == STORED_EMBEDDING else ""))  # fmt: skip
    if worst is not None:
        log(worst)
    return out


def _verify(part: Path, ck, tensors, log: Callable[[str], None]) -> str:
    """The largest |written - gguf.quants.dequantize(original blocks)| per GGUF type and overall, every
    written weight read back from the files in ``part``; raises unless it is 0."""
    import gguf
    import numpy as np

    from aipc_kernels.checkpoints.gguf import FLOAT_TYPES, llama_unpermute

    per_type: dict[str, list] = {}
    for path in sorted(part.glob("*.safetensors")):
        weights, plain = load_lowbit(str(path))
        items = [(f"{p}.weight", w.dequantize(torch.float32)) for p, w in weights.items()]
        items += [(n, t) for n, t in plain.items() if n.endswith(".weight")]
        for hf, got in items:
            gname = tensors.gguf_name(hf)
            qtype = ck.tensor_type(gname)
            if qtype in FLOAT_TYPES:  # written as transformers' GGUF processing gives them (e.g. Gemma's norms)
                continue
            ref = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(ck.raw(gname), qtype)))
            ref = ref.reshape(ck.tensor_shape(gname)).float()
            heads = tensors._unpermute_heads(gname)
            if heads is not None:
                ref = ref[llama_unpermute(ref.shape[0], heads)]
            diff = (got.float() - ref).abs()
            diff[torch.isnan(got) & torch.isnan(ref)] = 0.0
            worst = float(diff.max()) if diff.numel() else 0.0
            if got.shape != ref.shape:
                worst = float("inf")
            entry = per_type.setdefault(qtype.name, [0.0, 0, ""])
            if not worst <= entry[0]:
                entry[0], entry[2] = worst, gname
            entry[1] += 1
    values = [v[0] for v in per_type.values()]
    overall = float("nan") if any(x != x for x in values) else max(values, default=0.0)
    line = (f"verify: largest |written - gguf.quants.dequantize| per type: "
            + ", ".join(f"{k} {v[0]:.3g} ({v[1]} tensors)" for k, v in sorted(per_type.items()))
            + f"; overall {overall:.3g}")  # fmt: skip
    if not overall == 0.0:
        bad = max(per_type.items(), key=lambda kv: (kv[1][0] != kv[1][0], kv[1][0]))
        raise ValueError(f"{line}\nverify failed: the written weights differ from the file's (largest at GGUF "
                         f"tensor {bad[1][2]!r}, {bad[0]}); nothing was written. {CONVERTER} re-lays GGUF blocks "
                         f"out exactly: please report this file")  # fmt: skip
    return line


__all__ = ["convert_gguf"]
