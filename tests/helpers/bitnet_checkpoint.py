"""BitNet b1.58 checkpoints in their published layouts, written from a float model directory.

The families (``FAMILIES``), each as its hub repos store it:

* ``autobitlinear``: microsoft/bitnet-b1.58-2B-4T: packed uint8 ``[N/4, K]`` weights written by
  transformers' own ``pack_weights``, ``weight_scale = mean|W|`` (bf16, shape [1]),
  ``quantization_config: {quant_method: bitnet, linear_class: autobitlinear, quantization_mode: offline}``;
* ``bitlinear``: Falcon3-*-1.58bit / Falcon-E: the same packing, ``weight_scale = 1 / mean|W|``,
  ``quantization_config: {quant_method: bitnet, modules_to_not_convert: [lm_head]}`` (BitLinear is
  transformers' default class);
* ``online``: bitnet-b1.58-2B-4T-bf16: the float masters unchanged,
  ``{quant_method: bitnet, linear_class: autobitlinear, quantization_mode: online}``.

The ternary values are BitNet's absmean rule per tensor (``round(W / mean|W|)`` clamped to [-1, 1]),
computed by transformers' own ``WeightQuant``, so the three families of one source hold the same values. What they mean is checked by the tests against transformers' own BitNet forward passes
(``AutoModelForCausalLM.from_pretrained``), not against this module.

CLI: ``python -m tests.helpers.bitnet_checkpoint SRC OUT --family autobitlinear``.
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

import torch

from aipc_kernels.core.hf_checkpoint import CONFIG_NAME, INDEX_NAME, HFCheckpoint, read_config

FAMILIES: dict[str, dict[str, Any]] = {
    "autobitlinear": {"quant_method": "bitnet", "linear_class": "autobitlinear", "quantization_mode": "offline"},
    "bitlinear": {"quant_method": "bitnet", "modules_to_not_convert": ["lm_head"]},
    "online": {"quant_method": "bitnet", "linear_class": "autobitlinear", "quantization_mode": "online"},
}
# the linears BitNet quantizes (transformers keeps the output projection and embeddings float)
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _is_linear(name: str) -> bool:
    prefix, _, leaf = name.rpartition(".")
    return leaf == "weight" and prefix.rpartition(".")[2] in LINEARS


def _packed(weight: torch.Tensor, family: str) -> tuple[torch.Tensor, torch.Tensor]:
    """One float weight -> (transformers-packed uint8 values, its ``weight_scale`` as the family stores
    it): BitNet's absmean ternarization by transformers' own ``WeightQuant`` (uncompiled: the same
    arithmetic), packed by its ``pack_weights``."""
    from transformers.integrations.bitnet import WeightQuant, pack_weights

    quant = getattr(WeightQuant.forward, "_torchdynamo_orig_callable", WeightQuant.forward)
    w = quant(None, weight.float())  # values * mean|W|, float32
    mean = w.abs().amax().clamp(min=1e-5)  # every nonzero value is +-mean|W| (clamped as WeightQuant does)
    packed = pack_weights(torch.sign(w))  # pack_weights adds 1 in place: sign() is a fresh tensor
    scale = mean if family == "autobitlinear" else 1.0 / mean
    return packed, scale.reshape(1).to(torch.bfloat16)


def write_bitnet_checkpoint(src: str | Path, out: str | Path, family: str) -> Path:
    """Writes ``src`` (a float Hugging Face model directory) as a BitNet checkpoint of ``family`` to
    ``out`` (one ``model.safetensors``, tokenizer and side files copied); returns ``out``."""
    from safetensors.torch import save_file

    if family not in FAMILIES:
        raise ValueError(f"family={family!r} is unknown; use one of {sorted(FAMILIES)}")
    src, out = Path(src), Path(out)
    config = read_config(src)
    if "quantization_config" in config:
        method = config["quantization_config"].get("quant_method")
        raise ValueError(f"{src} is already quantized ({method}); pass a float model")
    out.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for name, t in HFCheckpoint(src).tensors():
        if family != "online" and _is_linear(name):
            tensors[name], tensors[name + "_scale"] = _packed(t, family)
        else:
            tensors[name] = t.contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name not in (INDEX_NAME, CONFIG_NAME):
            shutil.copy2(f, out / f.name)
    config["quantization_config"] = dict(FAMILIES[family])
    (out / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", help="float Hugging Face model directory")
    ap.add_argument("out", help="output directory")
    ap.add_argument("--family", choices=sorted(FAMILIES), required=True)
    args = ap.parse_args(argv)
    print(write_bitnet_checkpoint(args.src, args.out, args.family))


if __name__ == "__main__":
    main()
