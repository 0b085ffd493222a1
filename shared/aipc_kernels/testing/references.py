"""transformers references for the plugins' tests and the demo: the checkpoint in float32, as it is
or with its linears replaced by lowbit2 (same quantizer and op as the vLLM plugin), and its greedy
continuations."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

KINDS = ("float", "lowbit", "dequantized")


def hf_model(model_dir: Path | str, kind: str, codebook: str = "affine", group_size: int = 64, act_group: int = 0,
             attn_implementation: Optional[str] = None):  # fmt: skip
    """The transformers model of ``model_dir`` in float32:

    * ``float``: the checkpoint's weights as they are;
    * ``lowbit``: linears replaced by :class:`aipc_kernels.modules.LowBitLinear`, the op and native
      W2A8 kernel that the vLLM plugin calls (activations quantized to int8 per token, or per
      ``act_group`` of K), weights quantized from the bf16 checkpoint as the plugin does;
    * ``dequantized``: ``nn.Linear`` holding the dequantized lowbit2 weights (float activations).

    ``attn_implementation`` is passed to ``from_pretrained`` (None: transformers' default)."""
    import torch
    from transformers import AutoModelForCausalLM

    if kind not in KINDS:
        raise ValueError(f"kind={kind!r}; use one of {KINDS}")
    kw = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    if kind == "float":
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **kw).eval()

    from aipc_kernels.modules import LowBitLinear, dequantized_linear, quantize_linears

    def lowbit(lin, w):
        return LowBitLinear(w, None if lin.bias is None else lin.bias.detach().float(), act_group=act_group)

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, **kw).eval()
    quantize_linears(model, codebook, group_size, replace=dequantized_linear if kind == "dequantized" else lowbit)
    return model.float()


def greedy(model, prompts: list[list[int]], n: int) -> list[list[int]]:
    """``n`` greedy tokens after each prompt (one at a time, no EOS stop) from a transformers model."""
    import torch

    out = []
    with torch.inference_mode():
        for ids in prompts:
            o = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=None)
            out.append(o[0, len(ids) :].tolist())
    return out


def hf_greedy(model_dir: Path | str, prompts: list[list[int]], n: int, kind: str, **kw) -> list[list[int]]:
    """Greedy continuations of ``hf_model(model_dir, kind, **kw)``."""
    return greedy(hf_model(model_dir, kind, **kw), prompts, n)
