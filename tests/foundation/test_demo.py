"""scripts/demo.py's own checks, cheap enough for every venv (the demo itself runs the plugins):
a wrong ``--model`` is refused before any venv or part runs, and a failed ``vllm serve`` start is
reported by its root cause."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "files, message",
    [([], "no config.json"), (["config.json"], "no tokenizer files"),
     (["config.json", "tokenizer.json"], "no *.safetensors weights")],
)  # fmt: skip
def test_model_dir_is_checked_before_any_part(tmp_path, files, message):
    for name in files:
        (tmp_path / name).write_text("{}")
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "demo.py"), "--model", str(tmp_path)],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert res.returncode == 2, res.stdout + res.stderr
    assert message in res.stderr and str(tmp_path) in res.stderr
    assert "[demo]" not in res.stdout  # no part started, no venv touched


def test_unknown_part_is_refused():
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "demo.py"), "--parts", "vllm,npuu"],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert res.returncode == 2 and "npuu" in res.stderr and "segment_kv" in res.stderr


def test_server_start_failure_names_the_root_cause(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    from demo_parts.lowbit_serve import startup_error

    log = tmp_path / "vllm-serve.log"
    log.write_text(
        "(APIServer pid=1) WARNING [system_utils.py:255] This can cause `OSError: [Errno 24] Too many open files`.\n"
        "(Worker pid=2) ERROR [multiproc_executor.py:953]     raise ValueError(\n"
        "(Worker pid=2) ERROR [multiproc_executor.py:953] ValueError: lowbit2 cannot quantize layer 'x': "
        "group_size=64 does not divide in_features K=96\n"
        "RuntimeError: Engine core initialization failed. See root cause above.\n"
    )
    assert startup_error(log) == "ValueError: lowbit2 cannot quantize layer 'x': group_size=64 does not divide in_features K=96"
    log.write_text("INFO nothing went wrong\n")
    assert startup_error(log) is None
