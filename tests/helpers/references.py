"""transformers references for the plugins' tests and the demo: the checkpoint in float32, as it is
or with its linears replaced by lowbit2 (same quantizer and op as the vLLM plugin), and its greedy
continuations."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

KINDS = ("float", "float_a8", "lowbit", "dequantized")


def hf_model(model_dir: Path | str, kind: str, codebook: str = "affine", group_size: int = 64, act_group: int = 0,
             attn_implementation: Optional[str] = None, lm_head: Optional[str] = None,
             weights: Optional[dict[str, "torch.Tensor"]] = None, activations: str = "int8"):  # fmt: skip
    """The transformers model of ``model_dir`` in float32:

    * ``float``: the checkpoint's weights as they are;
    * ``float_a8``: the checkpoint's weights as they are, the input of every linear that the plugins
      quantize rounded to int8 per token (or per ``act_group`` of K) as the native W2A8 kernel does
      (:func:`aipc_kernels.lowbit.quantizers.quantize_activations`): the exact reference for a checkpoint
      whose weights already lie on a lowbit2 grid (no weight of ours in it);
    * ``lowbit``: linears replaced by :class:`aipc_kernels.lowbit.modules.LowBitLinear`, the op and native
      W2A8 kernel that the vLLM plugin calls (activations quantized to int8 per token, or per
      ``act_group`` of K), weights quantized from the bf16 checkpoint as the plugin does;
    * ``dequantized``: ``nn.Linear`` holding the dequantized lowbit2 weights (float activations).

    ``attn_implementation`` is passed to ``from_pretrained`` (None: transformers' default). ``lm_head``:
    the output projection as the plugins serve it with that ``lm_head`` setting (:func:`with_output_projection`;
    None: their default, ``auto``, resolved for the kernels' instruction set as serving does), in every kind but ``float``. ``weights`` (``float`` and ``float_a8``):
    state-dict entries that replace the checkpoint's, e.g. the linears of a GPTQ checkpoint of
    ``model_dir`` as its format's own code dequantizes them. ``activations="float"`` (``lowbit``, 4-bit code
    books): the linears on the activation-exact W4A16 op instead."""
    import torch
    from transformers import AutoModelForCausalLM

    from aipc_kernels.lowbit.output_projection import DEFAULT_HEAD_FORMAT

    lm_head = DEFAULT_HEAD_FORMAT if lm_head is None else lm_head  # with_output_projection resolves auto

    if kind not in KINDS:
        raise ValueError(f"kind={kind!r}; use one of {KINDS}")
    kw = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    if weights is not None and kind not in ("float", "float_a8"):
        raise ValueError(f"weights= replaces checkpoint tensors of the float kinds only, not kind={kind!r}")
    if kind in ("float", "float_a8"):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **kw).eval()
        if weights:
            state = model.state_dict()
            unknown = sorted(set(weights) - set(state))
            if unknown:
                raise ValueError(f"weights= names tensors the model does not have: {unknown[:3]}")
            with torch.no_grad():
                for name, t in weights.items():
                    state[name].copy_(t)
        if kind == "float":
            return model
        return with_output_projection(_int8_inputs(model, act_group), lm_head)

    from aipc_kernels.lowbit.modules import LowBitLinear, dequantized_linear, quantize_linears

    def lowbit(lin, w):
        return LowBitLinear(w, None if lin.bias is None else lin.bias.detach().float(), act_group=act_group,
                            activations=activations)  # fmt: skip

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, **kw).eval()
    quantize_linears(model, codebook, group_size, replace=dequantized_linear if kind == "dequantized" else lowbit)
    return with_output_projection(model.float(), lm_head, codebook, group_size, act_group, kind == "dequantized")


def with_output_projection(model, lm_head: str, codebook: str = "affine", group_size: int = 64, act_group: int = 0,
                           dequantized: bool = False):  # fmt: skip
    """``model`` (float32) with its output projection quantized as the plugins do on CPU for ``lm_head``
    (:func:`aipc_kernels.lowbit.output_projection.quantize_output_projection`) and run by the same op (:class:`~aipc_kernels.lowbit.modules.LowBitLinear`, int8
    activations per token; ``act_group`` for ``lowbit`` heads), or as float weights holding the
    quantized values (``dequantized``). The input embedding is left as it is (tied or not)."""
    import torch

    from aipc_kernels.lowbit.modules import LowBitLinear, dequantized_linear
    from aipc_kernels.lowbit.output_projection import head_act_group, quantize_output_projection, resolve_head_format

    lm_head = resolve_head_format(lm_head)  # auto: int6 or int8 by the kernels' instruction set, as served on CPU
    head = model.get_output_embeddings()
    w = quantize_output_projection(head.weight.detach().float(), lm_head, codebook=codebook,
                                   group_size=group_size, quantizer="optimized", scale_dtype=torch.float16)  # fmt: skip
    if w is None:
        return model
    bias = None if head.bias is None else head.bias.detach().float()
    new = dequantized_linear(head, w) if dequantized else LowBitLinear(w, bias, act_group=head_act_group(lm_head, act_group))
    model.set_output_embeddings(new)
    return model


def _int8_inputs(model, act_group: int):
    """``model`` with the input of each quantizable linear (``aipc_kernels.lowbit.modules.linear_names``)
    replaced by its int8 rounding (``xq * scale``, float32)."""
    from aipc_kernels.lowbit.modules import linear_names
    from aipc_kernels.lowbit.quantizers import quantize_activations

    def hook(module, args):
        x = args[0]
        xq, s = quantize_activations(x, act_group or None)
        g = x.shape[-1] // s.shape[-1]
        return ((xq.float().unflatten(-1, (-1, g)) * s.unsqueeze(-1)).flatten(-2).to(x.dtype),) + tuple(args[1:])

    for name in linear_names(model):
        model.get_submodule(name).register_forward_pre_hook(hook)
    return model


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
