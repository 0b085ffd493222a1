"""Tiny GGUF files of several architectures, written by llama.cpp's own converter, for tests.

Each fixture is a tiny random Hugging Face model (:func:`aipc_kernels.tools.tiny_model.build_tiny_model`,
with every norm weight, and Qwen2's q / k / v biases, set to random values: with all-ones norms or zero
biases a loader that skipped them would compute the same tokens), converted by llama.cpp's
``convert_hf_to_gguf.py`` (``--outtype f32``: its tensor names, its Llama q / k row permutation, Phi-3's
fused ``attn_qkv`` / ``ffn_up``, its metadata and tokenizer fields) and then re-written with the ``gguf``
package, each weight matrix quantized by ``gguf.quants.quantize`` to the type of :data:`PLANS` (Q4_0,
Q4_1, Q5_0, Q5_1, Q8_0, F16: the types that package quantizes; the K-quants are covered by the real
Gemma-3 Q4_K_M file in tests/vllm_lowbit/test_gguf.py). No llama.cpp build is needed.

The converter comes from the ``llama-cpp-python`` sdist (:data:`LLAMA_CPP_PYTHON`, the version the bench
harness builds): the source tree the harness unpacked under ``<cache>/llamacpp/src`` when present,
otherwise the sdist is fetched from the package registry with ``pip download`` (76 MB, about 6 s) and
only the converter (``convert_hf_to_gguf.py``, ``conversion/``, ``gguf-py/``) is unpacked, into
``<cache>/llamacpp/converter-<version>``. ``<cache>`` is ``$AIPC_CACHE_DIR`` or ``~/.cache/aipc-plugins``.

Tokenizers the converter knows offline: a SentencePiece ``tokenizer.model`` (the bench harness's
:func:`sentencepiece_model`) for the llama-family files (``llama``, ``mistral``, ``phi3``), read by its
``_set_vocab_sentencepiece``; for ``qwen2`` / ``qwen3`` the tiny model's byte-level BPE ``tokenizer.json``
(its pre-tokenizer is Qwen2's split regex, :data:`aipc_kernels.tools.tiny_model._SPLIT_REGEX`), whose
pre-tokenizer the converter identifies by hashing how a known tokenizer encodes a test string
(``get_vocab_base_pre``): a freshly trained vocabulary is in no table, so the converter is run with that
one method answering ``"qwen2"`` (the ``tokenizer.ggml.pre`` it writes; the rest of its code unchanged).

Files are cached under ``<cache>/gguf-fixtures/<name>-<key>/model.gguf`` (key: the spec, the builder
version and the converter version) and written atomically (a temporary name, then renamed).

CLI: ``python -m tests.helpers.gguf_fixtures [NAME ...]`` prints the paths.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

#: the llama-cpp-python sdist whose vendored llama.cpp converts (bench/harness/llamacpp.py builds it too)
LLAMA_CPP_PYTHON = "0.3.36"
#: bumped whenever the files written for the same spec change
BUILDER_VERSION = 1

#: the tiny models' geometry: head_dim 64, GQA 4 -> 2, K multiples of 32 for every block type
GEOMETRY = dict(hidden=256, layers=2, heads=4, kv_heads=2, intermediate=512)

#: GGUF tensor (the part after ``blk.N.``, or the whole name) -> its type; anything 2-D not named is Q8_0,
#: 1-D tensors (norms, biases) stay F32. Merged layers mix code books (q / k Q4_0 with v Q8_0: two segments of one layer).
PLANS: dict[str, dict[str, Any]] = {
    # Llama-3.x / SmolLM2 style: tied embeddings
    "llama": dict(arch="llama", tie=True, types={
        "attn_q": "Q4_0", "attn_k": "Q4_0", "attn_v": "Q8_0", "attn_output": "Q4_1",
        "ffn_gate": "Q5_0", "ffn_up": "Q5_0", "ffn_down": "Q5_1", "token_embd": "Q8_0"}),
    # Mistral: written as general.architecture = llama; untied, a float (F16) token embedding
    "mistral": dict(arch="mistral", tie=False, types={
        "attn_q": "Q5_1", "attn_k": "Q5_1", "attn_v": "Q5_1", "attn_output": "Q8_0",
        "ffn_gate": "Q4_1", "ffn_up": "Q4_1", "ffn_down": "Q4_0", "token_embd": "F16", "output": "Q8_0"}),
    # Qwen2.5 style: q / k / v biases, tied embeddings; q Q4_1 beside k / v Q8_0: two segments, each with its
    # slice of the bias
    "qwen2": dict(arch="qwen2", tie=True, types={
        "attn_q": "Q4_1", "attn_k": "Q8_0", "attn_v": "Q8_0", "attn_output": "Q4_1",
        "ffn_gate": "Q4_0", "ffn_up": "Q4_0", "ffn_down": "Q8_0", "token_embd": "Q8_0"}),
    # Qwen3: q / k RMSNorms; untied; head_dim 64, not Qwen3Config's default 128 (transformers' GGUF config
    # reader does not read qwen3.attention.key_length: a reader of the file must)
    "qwen3": dict(arch="qwen3", tie=False, types={
        "attn_q": "Q5_0", "attn_k": "Q5_0", "attn_v": "Q5_0", "attn_output": "Q5_0",
        "ffn_gate": "Q4_1", "ffn_up": "Q4_1", "ffn_down": "Q5_1", "token_embd": "Q8_0", "output": "Q4_0"}),
    # Phi-3: fused attn_qkv and ffn_up (gate and up); untied
    "phi3": dict(arch="phi3", tie=False, types={
        "attn_qkv": "Q4_1", "attn_output": "Q8_0", "ffn_up": "Q4_0", "ffn_down": "Q5_1",
        "token_embd": "Q8_0", "output": "Q5_0"}),
}

_BPE_ARCHS = ("qwen2", "qwen3")


def cache_root() -> Path:
    return Path(os.environ.get("AIPC_CACHE_DIR") or Path.home() / ".cache" / "aipc-plugins")


# ---------------------------------------------------------------------- the converter


def _harness_tree(cache: Path) -> Path:
    return cache / "llamacpp" / "src" / f"llama_cpp_python-{LLAMA_CPP_PYTHON}" / "vendor" / "llama.cpp"


def _usable(tree: Path) -> bool:
    return (tree / "convert_hf_to_gguf.py").is_file() and (tree / "conversion").is_dir() and (tree / "gguf-py").is_dir()


def converter_dir(cache: Path | None = None) -> Path:
    """The folder holding llama.cpp's ``convert_hf_to_gguf.py`` (with ``conversion/`` and ``gguf-py/``):
    the bench harness's unpacked source when there, else unpacked from the sdist (fetched if absent)."""
    cache = cache or cache_root()
    if _usable(_harness_tree(cache)):
        return _harness_tree(cache)
    out = cache / "llamacpp" / f"converter-{LLAMA_CPP_PYTHON}"
    if _usable(out):
        return out
    src = cache / "llamacpp" / "src"
    src.mkdir(parents=True, exist_ok=True)
    sdist = src / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
    if not sdist.exists():
        with tempfile.TemporaryDirectory(dir=src) as tmp:
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                            f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", tmp], check=True, capture_output=True)  # fmt: skip
            os.replace(Path(tmp) / sdist.name, sdist)
    prefix = f"llama_cpp_python-{LLAMA_CPP_PYTHON}/vendor/llama.cpp/"
    keep = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")
    staging = Path(tempfile.mkdtemp(dir=out.parent, prefix=out.name + ".part-"))
    try:
        with tarfile.open(sdist) as tar:
            members = []
            for m in tar.getmembers():
                if m.name.startswith(prefix) and m.name[len(prefix):].startswith(keep):
                    m.name = m.name[len(prefix):]
                    members.append(m)
            tar.extractall(staging, members=members, filter="data")
        if not _usable(staging):
            raise RuntimeError(f"{sdist} has no {prefix}convert_hf_to_gguf.py + conversion/ + gguf-py/")
        try:
            os.replace(staging, out)
        except OSError:  # another process unpacked it first
            if not _usable(out):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


_RUN_CONVERTER = """
import runpy, sys
tree, pre = sys.argv[1], sys.argv[2]
sys.path[:0] = [tree, tree + "/gguf-py"]
if pre:  # the tokenizer's pre-tokenizer, which the converter otherwise identifies by known tokenizers' hashes
    import conversion.base as base
    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
sys.argv = [tree + "/convert_hf_to_gguf.py"] + sys.argv[3:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def convert(hf_dir: Path, out: Path, pre: str = "", outtype: str = "f32", cache: Path | None = None) -> Path:
    """``convert_hf_to_gguf.py hf_dir --outtype outtype --outfile out`` (``pre``: the BPE pre-tokenizer name)."""
    tree = converter_dir(cache)
    res = subprocess.run([sys.executable, "-c", _RUN_CONVERTER, str(tree), pre, str(hf_dir), "--outtype", outtype,
                          "--outfile", str(out)], capture_output=True, text=True, cwd=tree)  # fmt: skip
    if res.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py {hf_dir} failed:\n{res.stderr[-4000:]}")
    return out


# ---------------------------------------------------------------------- the Hugging Face model


def stage_hf_model(name: str, out: Path, seed: int = 0) -> Path:
    """The tiny float model of :data:`PLANS` ``name`` as the converter reads it, in ``out``: config.json,
    model.safetensors with random norms (and Qwen2 biases), and the tokenizer files."""
    import torch
    from safetensors.torch import load_file, save_file

    from aipc_kernels.tools.tiny_model import build_tiny_model

    plan = PLANS[name]
    geometry = {**GEOMETRY, **plan.get("geometry", {})}
    src = build_tiny_model(plan["arch"], seed=seed, tie_embeddings=plan["tie"], dtype="float32", **geometry)
    out.mkdir(parents=True)
    shutil.copy(src / "config.json", out / "config.json")
    tensors = load_file(str(src / "model.safetensors"))
    g = torch.Generator().manual_seed(1000 + seed)
    for n in sorted(tensors):
        if n.endswith("norm.weight"):  # input / post-attention / final norms, Qwen3's q_norm / k_norm
            tensors[n] = 0.5 + torch.rand(tensors[n].shape, generator=g)
        elif n.endswith("_proj.bias"):  # Qwen2's q / k / v biases (written as zeros)
            tensors[n] = 0.5 * torch.randn(tensors[n].shape, generator=g)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    if plan["arch"] in _BPE_ARCHS:
        for f in src.iterdir():
            if f.name.startswith(("tokenizer", "special_tokens")) or f.name in ("vocab.json", "merges.txt"):
                shutil.copy(f, out / f.name)
    else:
        sentencepiece_model(out / "tokenizer.model")
    return out


def sentencepiece_model(path: Path) -> None:
    """A small SentencePiece BPE ``tokenizer.model`` trained on the tiny models' corpus (as the bench
    harness's ``sentencepiece_model``); the converter pads it with [PAD] tokens up to the vocabulary."""
    import io

    import sentencepiece as spm

    from aipc_kernels.tools.tiny_model import _corpus

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(_corpus()), model_writer=buf, vocab_size=512,
                                   model_type="bpe", character_coverage=1.0, num_threads=1, hard_vocab_limit=False,
                                   minloglevel=2)  # fmt: skip
    path.write_bytes(buf.getvalue())


# ---------------------------------------------------------------------- quantizing


def tensor_type(plan: dict[str, Any], name: str, ndim: int):
    """The GGML type :data:`PLANS` gives tensor ``name``."""
    import gguf

    if ndim < 2:
        return gguf.GGMLQuantizationType.F32
    key = name.rsplit(".", 1)[0]
    if key.startswith("blk."):
        key = key.split(".", 2)[2]
    return gguf.GGMLQuantizationType[plan["types"].get(key, "Q8_0")]


def requantize(src: Path, dst: Path, plan: dict[str, Any]) -> Path:
    """``src`` (an F32 GGUF) re-written to ``dst`` with every tensor of the type ``plan`` gives it
    (``gguf.quants.quantize``), metadata copied as it is."""
    import gguf
    import numpy as np

    T = gguf.GGMLQuantizationType
    reader = gguf.GGUFReader(str(src))
    arch = reader.get_field("general.architecture").contents()
    writer = gguf.GGUFWriter(str(dst), arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in ("general.architecture", "general.alignment"):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    for t in reader.tensors:
        if t.tensor_type != T.F32:
            raise ValueError(f"{src}: {t.name} is {t.tensor_type.name}; requantize reads an F32 file")
        data = np.array(t.data, dtype=np.float32).reshape([int(x) for x in reversed(t.shape)])
        qtype = tensor_type(plan, t.name, data.ndim)
        if qtype == T.F32:
            writer.add_tensor(t.name, data)
        elif qtype == T.F16:
            writer.add_tensor(t.name, data.astype(np.float16))
        else:
            writer.add_tensor(t.name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


# ---------------------------------------------------------------------- the fixtures


def _key(name: str, seed: int) -> str:
    spec = {"plan": PLANS[name], "geometry": GEOMETRY, "seed": seed, "builder": BUILDER_VERSION,
            "llama_cpp_python": LLAMA_CPP_PYTHON}  # fmt: skip
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]


def build_gguf_fixture(name: str, seed: int = 0, cache: Path | None = None) -> Path:
    """The tiny GGUF file of :data:`PLANS` ``name`` (built once into the cache, then reused)."""
    if name not in PLANS:
        raise ValueError(f"gguf fixture {name!r}: use one of {sorted(PLANS)}")
    cache = cache or cache_root()
    folder = cache / "gguf-fixtures" / f"{name}-{_key(name, seed)}"
    path = folder / "model.gguf"
    if path.is_file():
        return path
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder, prefix=".build-") as tmp:
        hf = stage_hf_model(name, Path(tmp) / "hf", seed)
        f32 = convert(hf, Path(tmp) / "model-f32.gguf", pre="qwen2" if PLANS[name]["arch"] in _BPE_ARCHS else "",
                      cache=cache)  # fmt: skip
        part = Path(tmp) / "model.gguf"
        requantize(f32, part, PLANS[name])
        os.replace(part, path)
    return path


def main(argv: list[str] | None = None) -> None:
    names = (argv if argv is not None else sys.argv[1:]) or sorted(PLANS)
    for n in names:
        print(n, build_gguf_fixture(n))


if __name__ == "__main__":
    main()


__all__ = ["GEOMETRY", "LLAMA_CPP_PYTHON", "PLANS", "build_gguf_fixture", "convert", "converter_dir", "requantize",
           "stage_hf_model"]  # fmt: skip
