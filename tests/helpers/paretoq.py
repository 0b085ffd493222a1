"""ParetoQ-style checkpoints for tests: float weights fake-quantized by ParetoQ's own quantizers and
stored as bf16, with no quantization config (what a user exporting a ParetoQ model to a plain
Hugging Face checkpoint holds).

:func:`lsq_binary_ternary` and :func:`stretched_elastic_quant` are the ``forward`` of ParetoQ's
``LsqBinaryTernaryExtension`` and ``StretchedElasticQuant``, copied from facebookresearch/ParetoQ
``models/utils_quant.py`` at commit 655e3386617845e1e3516198437ebad8dab8dc68 (only the autograd
``ctx`` bookkeeping and the unused ``grad_scale`` are left out); :func:`paretoq_weight` dispatches as
its ``QuantizeLinear.forward`` does and :func:`init_clip_val` is the clip initialisation of its
``train.py``.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Optional

import torch

from aipc_kernels.tools.tiny_model import MANIFEST


def lsq_binary_ternary(input: torch.Tensor, alpha: torch.Tensor, num_bits: int) -> torch.Tensor:
    """``LsqBinaryTernaryExtension.forward`` (ParetoQ ``models/utils_quant.py``)."""
    if num_bits >= 16:
        return input
    if num_bits == 1 or num_bits == 0:
        Qn = -1
        Qp = 1
    else:
        Qn = -(2 ** (num_bits - 1))
        Qp = 2 ** (num_bits - 1) - 1

    eps = torch.tensor(0.00001, device=alpha.device).float()

    alpha = torch.where(alpha > eps, alpha, eps)

    if num_bits == 1:
        q_w = input.sign()
    else:
        q_w = (input / alpha).round().clamp(Qn, Qp)
    w_q = q_w * alpha
    return w_q


def stretched_elastic_quant(input: torch.Tensor, alpha: torch.Tensor, num_bits: int) -> torch.Tensor:
    """``StretchedElasticQuant.forward`` (ParetoQ ``models/utils_quant.py``)."""
    if num_bits >= 16:
        return input

    eps = torch.tensor(0.00001, device=alpha.device).float()
    alpha = torch.where(alpha > eps, alpha, eps)

    clip_val = 1 - 1e-2
    if num_bits == 0:
        n_levels = 1.5
        shift = 0
    else:
        n_levels = 2 ** (num_bits - 1)
        shift = 0.5
    if num_bits == 1:
        q_w = input.sign()
    else:
        q_w = (
            torch.round(
                torch.clamp(input / alpha, -clip_val, clip_val) * n_levels - shift
            )
            + shift
        ) / n_levels
    w_q = q_w * alpha
    return w_q


def paretoq_weight(weight: torch.Tensor, alpha: torch.Tensor, w_bits: int) -> torch.Tensor:
    """The weight ``QuantizeLinear.forward`` multiplies by (``weight_clip_val`` = ``alpha`` [N, 1])."""
    if w_bits >= 16:
        return weight
    if w_bits == 2 or w_bits == 0:
        return stretched_elastic_quant(weight, alpha, w_bits)
    if w_bits <= 4:
        return lsq_binary_ternary(weight, alpha, w_bits)
    raise NotImplementedError


def init_clip_val(weight: torch.Tensor, w_bits: int) -> torch.Tensor:
    """``weight_clip_val`` as ParetoQ's ``train.py`` initialises it (per output row)."""
    if w_bits == 1:
        return torch.mean(weight.abs(), dim=-1, keepdim=True).detach()
    if w_bits == 0 or w_bits == 2:
        return torch.max(torch.abs(weight), dim=-1, keepdim=True)[0]
    if w_bits == 3 or w_bits == 4:
        xmax, _ = torch.max(torch.abs(weight), dim=-1, keepdim=True)
        return xmax / (2 ** (w_bits - 1) - 1)
    raise NotImplementedError


def random_clip_val(weight: torch.Tensor, w_bits: int, generator: torch.Generator) -> torch.Tensor:
    """A "trained" clip value: the initial one times a random factor in [0.6, 1) per row (training
    moves it; its exact value is arbitrary), float32."""
    jitter = 0.6 + 0.4 * torch.rand(weight.shape[0], 1, generator=generator)
    return init_clip_val(weight.float(), w_bits) * jitter


def write_paretoq_checkpoint(src: str | Path, out: str | Path, bits: dict[str, int], seed: int = 0,
                             dtype: torch.dtype = torch.bfloat16) -> dict[str, Optional[int]]:  # fmt: skip
    """Copies the Hugging Face directory ``src`` to ``out`` with every linear weight
    ``model.layers.*.<fragment>.*_proj.weight`` whose name contains a key of ``bits`` (e.g.
    ``{"layers.0.self_attn": 0, "mlp": 2}``; the first matching key wins) fake-quantized by
    :func:`paretoq_weight` in float32 with random per-row clip values, stored as ``dtype``. The
    config gets no quantization_config. Returns ``{linear prefix: w_bits or None}``."""
    from safetensors.torch import load_file, save_file

    src, out = Path(src), Path(out)
    shutil.copytree(src, out)
    (out / MANIFEST).unlink(missing_ok=True)  # no longer the tiny model that manifest describes
    g = torch.Generator().manual_seed(seed)
    done: dict[str, Optional[int]] = {}
    for path in sorted(out.glob("*.safetensors")):
        tensors = load_file(str(path))
        for name in sorted(tensors):
            if not (name.startswith("model.layers.") and name.endswith("_proj.weight")):
                continue
            prefix = name[: -len(".weight")]
            w_bits = next((b for frag, b in bits.items() if frag in name), None)
            done[prefix] = w_bits
            if w_bits is not None:
                w = tensors[name].float()
                tensors[name] = paretoq_weight(w, random_clip_val(w, w_bits, g), w_bits).to(dtype)
        save_file(tensors, str(path), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return done


__all__ = ["init_clip_val", "lsq_binary_ternary", "paretoq_weight", "random_clip_val", "stretched_elastic_quant",
           "write_paretoq_checkpoint"]  # fmt: skip
