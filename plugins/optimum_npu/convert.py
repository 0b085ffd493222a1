"""From torch chunks and the source checkpoint to files: :class:`IRWriter` converts a chunk with
``openvino.convert_model`` and writes its static (optionally stateful, compressed) IRs;
:func:`export_tokenizers` writes the HF tokenizer and its OpenVINO tokenizer/detokenizer."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from .compression import compress
from .ir_surgery import make_stateful, merge_weights, name_ports
from .manifest import ChunkFile

logger = logging.getLogger(__name__)


class IRWriter:
    """Converts torch chunks to named, static (optionally stateful, compressed) IRs in ``out``.

    The OpenVINO model shares the torch chunk's weight memory (``convert_model`` does not copy
    them), so a chunk's torch weights may be released only after its IRs are written."""

    def __init__(self, out: Path, quant: dict[str, Any] | None, fp16: bool):
        self.out, self.quant, self.fp16 = out, quant, fp16

    def convert(self, module, example: tuple, shapes: list[tuple[int, ...]], inputs: list[str],
                outputs: list[str], compress_weights: bool = True):
        """``module`` traced once (``shapes``: -1 marks a dimension read from the input shape),
        ports named, weights compressed by NNCF when asked."""
        import openvino as ov
        import torch

        spec = [(ov.PartialShape(list(shape)),
                 {torch.int64: ov.Type.i64, torch.float32: ov.Type.f32}[t.dtype])
                for t, shape in zip(example, shapes, strict=True)]
        with torch.no_grad():
            ov_model = ov.convert_model(module, example_input=example, input=spec)
        name_ports(ov_model, inputs, outputs)
        return compress(ov_model, self.quant) if compress_weights else ov_model

    def save(self, ov_model, stem: str, share_with: ChunkFile | None = None) -> ChunkFile:
        """Writes ``stem.xml`` (and its ``.bin``, merged into ``share_with``'s when given)."""
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


def export_tokenizers(src: Path, out: Path) -> dict[str, str]:
    """Saves the HF tokenizer of ``src`` into ``out`` and, when openvino_tokenizers converts it,
    the OpenVINO tokenizer/detokenizer pair (``openvino_tokenizer.xml``,
    ``openvino_detokenizer.xml``); returns what was saved (the manifest's ``tokenizer``)."""
    from transformers import AutoTokenizer

    info: dict[str, str] = {}
    try:
        tok = AutoTokenizer.from_pretrained(src)
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
