"""What a GGUF file gives vLLM, without vLLM: its config and tokenizer as a Hugging Face folder, its
tensors under the Hugging Face names vLLM's models load (no vLLM import; :mod:`vllm_lowbit.gguf`
is the vLLM side).

* :func:`open_gguf` opens and checks a file before any work: the structure (magic, version,
  truncation, split files: :class:`aipc_kernels.checkpoints.gguf.GGUFCheckpoint`), the architecture
  (:data:`ARCHITECTURES`; any other is refused naming it), every tensor's type (a type without an
  exact re-layout, e.g. IQ4_NL, is refused with :func:`aipc_kernels.checkpoints.gguf.unsupported_type_error`,
  naming the file and the tensor) and the tensors vLLM merges into one layer (q / k / v, gate / up:
  refused when their types re-lay out into different code books or groups, :func:`check_merges`).
* :func:`config_folder` writes, once per file, ``config.json`` and the tokenizer files that
  transformers' own GGUF conversion derives from the file's metadata (``AutoConfig`` /
  ``AutoTokenizer.from_pretrained(folder, gguf_file=name)``, chat template included; BOS / EOS added as
  the file's ``tokenizer.ggml.add_bos_token`` / ``add_eos_token`` say, which that conversion drops:
  Gemma would lose its BOS; ``head_dim`` from the file's ``attention.key_length`` where transformers'
  reader leaves its default, :func:`file_head_dim`) into a cache folder keyed by the file's identity
  (resolved path, size, mtime, and the transformers / gguf versions that converted it):
  ``$AIPC_GGUF_CACHE`` or ``~/.cache/aipc-plugins/gguf``, ``<stem>-<key>``. Nothing is written next to
  the .gguf; the folder appears whole or not at all (:func:`aipc_kernels.core.atomic_output.atomic_output_dir`).
* :class:`GGUFTensors` maps GGUF tensor names to Hugging Face ones with transformers' maintained
  mapping (``get_gguf_hf_weights_map``: gguf's ``TensorNameMap`` applied to the Hugging Face model's
  own parameter names, built on the meta device) and yields the weights as vLLM's ``load_weights``
  takes them: float tensors under their name (``...weight``, through transformers' per-architecture
  tensor processor, e.g. Gemma's norm offset), quantized ones as their raw blocks under
  ``...qweight`` plus their GGML type under ``...qweight_type`` (the ``vllm-gguf-plugin``'s names).
  llama.cpp stores the q / k projections of the ``llama`` architecture in interleaved-RoPE row order;
  their rows are put back in Hugging Face's order (:func:`aipc_kernels.checkpoints.gguf.llama_unpermute`)
  on the raw blocks, where transformers' ``LlamaTensorProcessor`` does it on the dequantized floats.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import warnings
from pathlib import Path
from typing import Any, Iterator, Optional

#: GGUF ``general.architecture`` values served (Mistral models are written as ``llama``)
ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3", "phi3")
#: bumped when what :func:`config_folder` writes changes (old cache folders are then not reused)
FOLDER_VERSION = 3
CACHE_ENV = "AIPC_GGUF_CACHE"
SOURCE_NAME = "gguf_source.json"
#: how long a process waits for another one that is writing the same config folder
WAIT_S = 300.0


def is_gguf_reference(model: Any) -> bool:
    """Whether ``model`` (vLLM's ``model`` argument) names a local ``.gguf`` file (by its suffix:
    a file that is not GGUF is then refused by :func:`open_gguf`, naming it)."""
    return isinstance(model, (str, os.PathLike)) and str(model).lower().endswith(".gguf")


#: GGUF tensors of one block that vLLM's models run as one merged layer (qkv_proj, gate_up_proj)
MERGED = (("attn_q", "attn_k", "attn_v"), ("ffn_gate", "ffn_up"))


def open_gguf(path: str | os.PathLike):
    """The checked :class:`~aipc_kernels.checkpoints.gguf.GGUFCheckpoint` of ``path``: ValueErrors name the
    file (and the tensor or the architecture) for every refusal, before anything is converted."""
    from aipc_kernels.checkpoints.gguf import SUPPORTED_TYPES, GGUFCheckpoint, unsupported_type_error

    ck = GGUFCheckpoint.open(path)
    if ck.architecture not in ARCHITECTURES:
        raise ValueError(
            f"GGUF file {str(ck.path)!r} has architecture {ck.architecture!r}, which vllm_lowbit does not serve; "
            f"supported architectures are {list(ARCHITECTURES)} (Mistral models are written as 'llama')"
        )
    for name in ck.tensor_names():
        qtype = ck.tensor_type(name)
        if qtype not in SUPPORTED_TYPES:
            raise ValueError(f"GGUF file {str(ck.path)!r}: {unsupported_type_error(name, qtype)}")
    check_merges(ck)
    return ck


def layout_of(qtype) -> tuple:
    """What a tensor of GGML type ``qtype`` becomes: ``("float",)`` or its (code book, group size)."""
    from aipc_kernels.checkpoints.gguf import FLOAT_TYPES, LOWBIT_TYPES

    return ("float",) if qtype in FLOAT_TYPES else LOWBIT_TYPES[qtype]


def merge_refusal(path, layer: str, parts: list[tuple[str, Any]]) -> ValueError:
    """The refusal of tensors (``(name, GGML type)``) that one vLLM layer would merge, float with quantized."""
    def fmt(t) -> str:
        layout = layout_of(t)
        return f"{t.name} -> {layout[0]}" + (f" g{layout[1]}" if len(layout) > 1 else "")

    desc = ", ".join(f"{n}: {fmt(t)}" for n, t in parts)
    return ValueError(f"GGUF file {str(path)!r}: {layer} merges float and quantized tensors ({desc}); float with "
                      f"quantized parts in one layer is not served yet: re-quantize the file with "
                      f"one type for them (llama-quantize --pure, or --tensor-type), or serve it with llama.cpp")  # fmt: skip


def check_merges(ck) -> None:
    """Refuses, before loading, the blocks whose q / k / v or gate / up tensors (:data:`MERGED`) would
    become one vLLM layer of float and quantized tensors. Quantized types merge: of one code book and
    group as they are, of different ones as segments, each in its own form (Q4_K_M's Q4_K q / k beside its
    Q6_K v: :func:`aipc_kernels.checkpoints.gguf.form_runs`)."""
    names = set(ck.tensor_names())
    for b in range(int(ck.field(f"{ck.architecture}.block_count", 0) or 0)):
        for group in MERGED:
            parts = [(f"blk.{b}.{g}.weight", ck.tensor_type(f"blk.{b}.{g}.weight")) for g in group
                     if f"blk.{b}.{g}.weight" in names]  # fmt: skip
            kinds = {layout_of(t)[0] == "float" for _, t in parts}
            if len(kinds) > 1:
                raise merge_refusal(ck.path, f"block {b}'s {'/'.join(group)}", parts)


# ---------------------------------------------------------------------- config and tokenizer


def cache_root() -> Path:
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "aipc-plugins" / "gguf"


def _identity(path: Path) -> dict[str, Any]:
    from importlib.metadata import version

    import transformers

    st = path.stat()
    return {"gguf_file": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "transformers": transformers.__version__, "gguf": version("gguf"), "folder_version": FOLDER_VERSION}  # fmt: skip


def config_folder(ck) -> Path:
    """The Hugging Face folder (config.json, tokenizer files, :data:`SOURCE_NAME`) of the open file
    ``ck``, written on first use into :func:`cache_root`; later calls reuse it."""
    from aipc_kernels.core.atomic_output import OutputDirError, abandoned_staging_dirs, atomic_output_dir

    ck.check_tokenizer_conversion()  # before the cache: a folder an older transformers wrote is keyed by its version
    path = ck.path.resolve()
    ident = _identity(path)
    key = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]
    dest = cache_root() / f"{path.stem}-{key}"
    deadline = time.monotonic() + WAIT_S
    while True:
        if _complete(dest):
            return dest
        for stale in abandoned_staging_dirs(dest):  # a writer killed before it finished
            shutil.rmtree(stale, ignore_errors=True)
        if dest.exists() and not _complete(dest):  # written by nothing of ours: start again
            shutil.rmtree(dest, ignore_errors=True)
        try:
            with atomic_output_dir(dest, what="GGUF config folder", redo="load the .gguf file again") as part:
                _write_folder(ck, part, ident)
            return dest
        except OutputDirError:  # another process writes it now (or just did)
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def _complete(dest: Path) -> bool:
    from aipc_kernels.core.atomic_output import read_record

    record = read_record(dest)
    return bool(record and record.get("complete") is True and (dest / "config.json").is_file()
                and (dest / SOURCE_NAME).is_file())  # fmt: skip


def file_head_dim(ck, config) -> Optional[int]:
    """The file's ``<arch>.attention.key_length`` where it differs from ``config.head_dim``, else None.
    transformers' GGUF config reader maps that key for gemma3 only: a Qwen3 file then gets Qwen3Config's
    default head_dim 128 whatever the file says (right for the published Qwen3 models, whose heads are 128
    wide; wrong for any other width: vLLM's q / k / v layer then expects other shapes and the load fails)."""
    key_length = ck.field(f"{ck.architecture}.attention.key_length")
    current = getattr(config, "head_dim", None)
    if key_length is None or current is None or int(current) == int(key_length):
        return None
    return int(key_length)


def _write_folder(ck, out: Path, ident: dict[str, Any]) -> None:
    from transformers import AutoConfig, AutoTokenizer
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    folder, name = str(ck.path.parent), ck.path.name
    # the file says whether its tokenizer adds BOS / EOS (Gemma: BOS); transformers' conversion leaves it out
    special = {f"{k}_token": ck.field(f"tokenizer.ggml.{k}_token") for k in ("add_bos", "add_eos")}
    special = {k: bool(v) for k, v in special.items() if v is not None}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            config = AutoConfig.from_pretrained(folder, gguf_file=name)
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, **special)
    except Exception as e:  # noqa: BLE001 - transformers' own errors do not name the file
        raise ValueError(f"GGUF file {str(ck.path)!r}: transformers cannot derive its config and tokenizer from "
                         f"the file's metadata ({type(e).__name__}: {e}); is it a complete llama.cpp model file?") from e
    arch = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
    if arch is None:
        raise ValueError(f"GGUF file {str(ck.path)!r}: transformers reads its config as model_type "
                         f"{config.model_type!r}, which has no causal-LM class")  # fmt: skip
    names = set(ck.tensor_names())
    updates: dict[str, Any] = {"architectures": [arch], "tie_word_embeddings": "output.weight" not in names}
    head_dim = file_head_dim(ck, config)
    if head_dim is not None:
        updates["head_dim"] = head_dim
    if "token_embd.weight" in names:  # the weights decide (a tokenizer list may be shorter than the table)
        updates["vocab_size"] = ck.tensor_shape("token_embd.weight")[0]
    config.update(updates)
    config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / SOURCE_NAME).write_text(json.dumps({**ident, "architecture": ck.architecture}, indent=1) + "\n")


# ---------------------------------------------------------------------- tensors


class GGUFTensors:
    """The tensors of an open GGUF file under the Hugging Face names of ``hf_config``'s model."""

    def __init__(self, ck, hf_config):
        import torch
        from transformers import AutoModelForCausalLM
        from transformers.modeling_gguf_pytorch_utils import (TENSOR_PROCESSORS, LlamaTensorProcessor,
                                                             TensorProcessor, get_gguf_hf_weights_map)  # fmt: skip

        self.ck = ck
        self.config = hf_config
        self.processor = TENSOR_PROCESSORS.get(ck.architecture, TensorProcessor)(config=hf_config.to_dict())
        self.unpermute_qk = isinstance(self.processor, LlamaTensorProcessor)
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = AutoModelForCausalLM.from_config(hf_config)
        self.name_map: dict[str, str] = get_gguf_hf_weights_map(model, self.processor, model_type=ck.architecture,
                                                                num_layers=hf_config.num_hidden_layers)  # fmt: skip
        self.gguf_of = {hf: g for g, hf in self.name_map.items()}
        del model
        present = set(ck.tensor_names())
        self.unmapped = [n for n in ck.tensor_names() if n not in self.name_map]
        tied = getattr(hf_config, "tie_word_embeddings", False)
        self.missing = sorted(hf for g, hf in self.name_map.items() if g not in present
                              and not (tied and hf.startswith("lm_head.")))  # fmt: skip

    def gguf_name(self, hf_name: str) -> Optional[str]:
        """The GGUF tensor a Hugging Face parameter (``...weight`` / ``...bias``) comes from."""
        return self.gguf_of.get(hf_name)

    def _unpermute_heads(self, gguf_name: str) -> Optional[int]:
        if not self.unpermute_qk:
            return None
        if ".attn_q." in gguf_name:
            return int(self.config.num_attention_heads)
        if ".attn_k." in gguf_name:
            return int(getattr(self.config, "num_key_value_heads", None) or self.config.num_attention_heads)
        return None

    def weights(self, float_dtype=None) -> Iterator[tuple[str, Any]]:
        """``(name, tensor)`` for vLLM's ``load_weights``, one file tensor at a time; float tensors processed
        in float32, then cast to ``float_dtype`` (the model's) when given."""
        import numpy as np
        import torch
        from aipc_kernels.checkpoints.gguf import FLOAT_TYPES, llama_unpermute, permute_rows

        ck = self.ck
        for gname in ck.tensor_names():
            hf = self.name_map.get(gname)
            if hf is None:
                continue
            qtype = ck.tensor_type(gname)
            if qtype in FLOAT_TYPES:
                t = ck.load(gname).float()
                t = torch.from_numpy(np.ascontiguousarray(self.processor.process(weights=t.numpy(), name=gname).weights))
                yield hf, t if float_dtype is None else t.to(float_dtype)
                continue
            with warnings.catch_warnings():  # the memory map is read-only; nothing writes to it
                warnings.simplefilter("ignore")
                raw = torch.from_numpy(ck.raw(gname))
            heads = self._unpermute_heads(gname)
            if heads is not None:
                raw = permute_rows(raw, llama_unpermute(raw.shape[0], heads))
            base, _, leaf = hf.rpartition(".")
            if leaf != "weight":
                raise ValueError(f"GGUF file {str(ck.path)!r}: tensor {gname!r} ({hf}) is {qtype.name}; only weight "
                                 f"matrices are quantized in GGUF files, this one should be F32")  # fmt: skip
            yield f"{base}.qweight", raw
            yield f"{base}.qweight_type", torch.tensor(int(qtype), dtype=torch.int64)


__all__ = ["ARCHITECTURES", "CACHE_ENV", "MERGED", "GGUFTensors", "cache_root", "check_merges", "config_folder",
           "file_head_dim", "is_gguf_reference", "layout_of", "merge_refusal", "open_gguf"]  # fmt: skip
