"""bench/quality.py --smoke: the whole recipe (corpus, tokenizer, training, evaluation) runs on a CPU in
seconds and writes the results files with every planned row of the activation and output-projection
sections and the progressive form's rows (the weights section, 64 rows of the same code, takes too long for a test on a busy CPU)."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CODEBOOKS = ("affine", "int2", "sym", "ternary", "binary", "int4", "affine4", "e0m4", "int8")


def test_quality_smoke_writes_every_row(tmp_path):
    pytest.importorskip("transformers")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "shared"), os.environ.get("PYTHONPATH")])))
    res = subprocess.run([sys.executable, str(ROOT / "bench" / "quality.py"), "--smoke", "--device", "cpu", "--no-lock",
                          "--rows", "activations,head,progressive", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)  # fmt: skip
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    # the trained proxy's results are named apart from the real-model table (bench/results/quality/quality.md)
    data = json.loads((tmp_path / "quality_trained_proxy.json").read_text())
    md = (tmp_path / "quality_trained_proxy.md").read_text()
    rows, recipe = data["rows"], data["recipe"]
    assert not data["skipped"] and recipe["training"]["steps"] == recipe["steps"]
    assert data["machine"]["cpu"] and "Smoke run" in md

    acts = {(r["weights"], r["act"]) for r in rows if r["section"] == "activations"}
    assert {r["codebook"] for r in rows if r["section"] == "activations"} == set(CODEBOOKS) - {"sym"}
    assert ("int4 g128 optimized", "A8 token") in acts and ("int4 g128 optimized", "A16") in acts
    assert ("affine g64 optimized", "A8 g64") in acts and ("int4 g128 optimized", "A8 g64") not in acts  # 64 % 128
    assert {("e0m4 g128 rtn", "A16"), ("e0m4 g128 rtn", "A8 token")} <= acts  # Transformer-Lite's FP4, W4A16 vs W4A8
    heads = {(r["weights"], r["head"]) for r in rows if r["section"] == "head"}
    assert {("bf16", "bf16"), ("bf16", "int8"), ("bf16", "int6"), ("bf16", "lowbit affine g64 optimized"),
            ("affine g64 optimized", "int8"), ("int4 g128 optimized", "int6")} <= heads  # fmt: skip
    assert len(rows) == 1 + 28 + 13 + 7
    prog = {r["weights"]: r for r in rows if r["section"] == "progressive"}
    assert {"min2 g64 progressive", "min4 g128 progressive", "affine g64 optimized"} <= set(prog)
    assert all(r["act"] == "A8 token" and r["ref_err"] < 1e-5 for r in prog.values())  # two-level weights, same math

    ref = rows[0]
    assert ref["section"] == "reference" and ref["kl"] == 0.0 and ref["top1"] == 1.0
    for r in rows:
        assert math.isfinite(r["ppl"]) and r["kl"] >= -1e-6, r
        if r["act"] != "A16" and r["section"] == "activations":
            assert r["ref_err"] < 1e-5, r  # the simulated A8 linear is reference_linear_w8's math
    by = {(r["weights"], r["act"], r["head"]): r for r in rows}
    # 8-bit rows lie far closer to the unquantized model than 2-bit ones
    assert by[("int8 row rtn", "A16", "bf16")]["kl"] < by[("affine g64 optimized", "A16", "bf16")]["kl"]
    assert by[("bf16", "A16", "int8")]["kl"] < by[("bf16", "A16", "lowbit affine g64 optimized")]["kl"]
    for section in ("## Activations", "## Output projection", "## The progressive two-level form"):
        assert section in md
    assert "| int4 g128 optimized | A8 token |" in md and "| bf16 | A16 | int8 | 8." in md
