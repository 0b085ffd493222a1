"""aipc_kernels.lowbit.quality_gate: the reconstruction error the plugins log, its verdicts against the quality
table's bounds, which code books need the 2-bit opt-in and what the refusal says; the bounds and figures
it quotes against the committed real-model results file."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from aipc_kernels.lowbit import quality_gate as qg
from aipc_kernels.lowbit.formats import CODEBOOKS
from aipc_kernels.lowbit.quantizers import quantize_weight

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results" / "quality" / "quality.json"


@pytest.mark.parametrize("codebook, group", [("affine", 64), ("int4", 32), ("ternary", -1), ("int8", -1)])
def test_relative_error_is_the_frobenius_ratio(codebook, group):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(40, 192, generator=g, dtype=torch.float64).to(torch.bfloat16)
    lw = quantize_weight(w.float(), codebook, group)
    ref = w.double()
    want = ((lw.dequantize(torch.float64) - ref).norm() / ref.norm()).item()
    assert qg.relative_error(w, lw) == pytest.approx(want, rel=1e-12)
    assert qg.relative_error(torch.zeros(4, 32), quantize_weight(torch.zeros(4, 32), codebook, 32)) == 0.0


def test_needs_opt_in_is_two_bits_and_fewer():
    assert {n for n in CODEBOOKS if qg.needs_opt_in(n)} == {n for n, cb in CODEBOOKS.items() if cb.bits <= 2}
    assert not qg.needs_opt_in("affine4") and not qg.needs_opt_in("int8") and qg.needs_opt_in("binary")


@pytest.mark.parametrize("error, verdict", [
    (0.05, "at most 0.13"), (0.2, "between 0.13"), (0.45, "above 0.33"),
])  # fmt: skip
def test_error_report_line_and_verdict(error, verdict):
    r = qg.ErrorReport()
    assert r.line("lowbit4") is None
    r.add("a", error / 2)
    r.add("b", error)
    line = r.line("lowbit4")
    assert line.startswith(f"lowbit4: largest relative reconstruction error ||W - Wq|| / ||W|| over 2 quantized layers "
                           f"is {error:.3f} (b): ") and verdict in line  # fmt: skip


def test_refusal_names_the_layer_cost_alternatives_and_opt_in():
    msg = qg.ptq_refusal("model.layers.0.mlp.down_proj", "int2", "lowbit2", "SET THE KEY")
    assert msg.startswith("lowbit2: layer 'model.layers.0.mlp.down_proj' does not lie on a 1/1.58/2-bit grid")
    for needle in ("from 15.22 to 336,864", "--quantization lowbit4", "perplexity 19.28", "BitNet b1.58", "ParetoQ",
                   "bench/results/quality/quality.md", "anyway: SET THE KEY"):
        assert needle in msg, needle


def test_figures_and_bounds_are_the_committed_results():
    """The refusal quotes SmolLM2's rows and the hint the real-model bounds of bench/results/quality/quality.json,
    the file the README cites: a regenerated table that moves them fails here until the constants follow."""
    data = json.loads(RESULTS.read_text())
    rows = [r for r in data["rows"] if r["model"] == "smollm2-135m-instruct"]

    def row(section, weights, act):
        return next(r for r in rows if r["section"] == section and r["weights"] == weights and r["act"] == act
                    and r["head"] == "bf16")  # fmt: skip

    assert round(row("reference", "bf16", "A16")["ppl_english"], 2) == qg.REAL_MODEL_PPL["float"]
    assert round(row("activations", "affine g64 optimized", "A8 token")["ppl_english"]) == qg.REAL_MODEL_PPL["lowbit2"]
    assert round(row("activations", "affine4 g64 optimized", "A8 token")["ppl_english"], 2) == qg.REAL_MODEL_PPL["lowbit4"]
    weights = [r for r in data["rows"] if r["section"] == "weights"]
    ref = {r["model"]: r["ppl"] for r in data["rows"] if r["section"] == "reference"}
    for r in weights:  # every row under SAFE usable, every row over UNUSABLE noise
        ratio = r["ppl"] / ref[r["model"]]
        if r["rel_err"] <= qg.SAFE_REL_ERROR:
            assert ratio <= 2.0, r["weights"]
        if r["rel_err"] > qg.UNUSABLE_REL_ERROR:
            assert ratio > 100.0, r["weights"]
