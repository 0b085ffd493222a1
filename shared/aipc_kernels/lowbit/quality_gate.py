"""What post-training quantization may cost before a plugin says so: the 2-bit refusal and the
load-time reconstruction-error hint, shared by the server and the converter.

* 2 bits and fewer after training: a real trained model does not survive them (the figures below,
  from ``bench/results/quality/quality.md``). Weights that already lie on a 1/1.58/2-bit grid (quantization-aware
  trained checkpoints: BitNet b1.58, Falcon-1.58bit, ParetoQ) are stored exactly and need nothing;
  any other weight quantized to such a code book is refused unless the user opts in
  (:data:`OPT_IN_KEY`).
* The hint: after quantizing, the largest per-layer relative reconstruction error
  ``||W - Wq||_F / ||W||_F`` is logged beside :data:`UNUSABLE_REL_ERROR`, the value above which the
  quality table's real-model rows were noise, and :data:`SAFE_REL_ERROR`, below which they were usable.
"""
from __future__ import annotations

from typing import Optional

import torch

from aipc_kernels.lowbit.formats import CODEBOOKS, LowBitWeight

#: the quantization_config key (and the converter's ``--allow-2bit-ptq``) that quantizes non-grid weights
#: to a 1- or 2-bit code book anyway
OPT_IN_KEY = "allow_2bit_ptq"
#: where the figures of this module come from
QUALITY_TABLE = "bench/results/quality/quality.md"
#: SmolLM2-135M-Instruct (its GGUF dequantized by transformers), English text, int8 activations per token
#: as served: perplexity of the float model, of lowbit2's defaults (affine g64 optimized) and of lowbit4's
#: (affine4 g64 optimized)
REAL_MODEL_PPL = {"float": 15.22, "lowbit2": 336_864.0, "lowbit4": 19.28}
#: a load whose largest per-layer ||W - Wq|| / ||W|| is at most this: every real-model row of the quality
#: table that low was usable (perplexity at most twice the float model's)
SAFE_REL_ERROR = 0.13
#: ... and from this up every row was noise (perplexity over 100x the float model's)
UNUSABLE_REL_ERROR = 0.33


def needs_opt_in(codebook: str) -> bool:
    """Whether quantizing float weights after training to ``codebook`` needs :data:`OPT_IN_KEY`."""
    return CODEBOOKS[codebook].bits <= 2


def ptq_refusal(layer: str, codebook: str, method: str, opt_in: str) -> str:
    """The message that stops a load or a conversion at ``layer``; ``opt_in`` says how to set the key."""
    p, bits = REAL_MODEL_PPL, CODEBOOKS[codebook].bits
    width = f"{bits} bit{'s' if bits > 1 else ''}"
    return (
        f"{method}: layer {layer!r} does not lie on a 1/1.58/2-bit grid, so codebook={codebook!r} would quantize "
        f"its trained weights to {width} after training. Post-training quantization to "
        f"2 bits turns a real trained model into noise: SmolLM2-135M-Instruct's perplexity goes from "
        f"{p['float']:,.2f} to {p['lowbit2']:,.0f} with lowbit2's defaults ({QUALITY_TABLE}). Instead: "
        f"--quantization lowbit4 (4-bit weights: perplexity {p['lowbit4']:,.2f} on the same model), or a checkpoint "
        f"trained for low bits (BitNet b1.58, Falcon3-1.58bit, ParetoQ), served as published with no option. "
        f"To quantize to {width} anyway: {opt_in}"
    )


def relative_error(weight: torch.Tensor, w: LowBitWeight) -> float:
    """``||W - Wq||_F / ||W||_F`` of one layer (float64 sums; 0 for an all-zero ``weight``)."""
    ref = weight.detach().double()
    norm = float(ref.norm())
    return float((w.dequantize(torch.float64).to(ref.device) - ref).norm()) / norm if norm else 0.0


class ErrorReport:
    """The largest relative reconstruction error over a model's layers, and the line that reports it."""

    def __init__(self) -> None:
        self.worst: tuple[float, str] = (0.0, "")
        self.layers = 0

    def add(self, layer: str, error: float) -> None:
        self.layers += 1
        self.worst = max(self.worst, (error, layer))

    def line(self, method: str) -> Optional[str]:
        """None before any layer; else the hint, with the verdict of the quality table's bounds."""
        if not self.layers:
            return None
        err, layer = self.worst
        if err > UNUSABLE_REL_ERROR:
            verdict = f"above {UNUSABLE_REL_ERROR}, where every real-model row of {QUALITY_TABLE} was noise"
        elif err > SAFE_REL_ERROR:
            verdict = (f"between {SAFE_REL_ERROR} (every real-model row of {QUALITY_TABLE} below it was usable) and "
                       f"{UNUSABLE_REL_ERROR} (every row above it was noise): check the output")
        else:
            verdict = f"at most {SAFE_REL_ERROR}, where every real-model row of {QUALITY_TABLE} was usable"
        return (f"{method}: largest relative reconstruction error ||W - Wq|| / ||W|| over {self.layers} quantized "
                f"layers is {err:.3f} ({layer}): {verdict}")


__all__ = ["ErrorReport", "OPT_IN_KEY", "SAFE_REL_ERROR", "UNUSABLE_REL_ERROR", "needs_opt_in", "ptq_refusal", "relative_error"]
