"""GPTQ and AWQ 4-bit checkpoints in their published layouts, written from a float model directory,
and vLLM's own reading of them (the reference the tests hold :mod:`aipc_kernels.checkpoints.gptq` to).

Written with vLLM's own quantization test helpers (``vllm.model_executor.layers.quantization.utils.
quant_utils``): RTN by ``quantize_weights`` (symmetric ``uint4b8``, or ``uint4`` with zero points),
packed by ``gptq_pack`` / ``pack_cols`` (GPTQ) and ``awq_pack`` (AWQ's interleaved order), as the
published tools lay them out:

* GPTQ (AutoGPTQ 0.7's ``save_quantized``): per linear ``qweight`` int32 ``[K/8, N]``, ``qzeros``
  int32 ``[K/G, N/8]`` (``checkpoint_format: gptq`` stores zero - 1, ``gptq_v2`` the zero),
  ``scales`` fp16 ``[K/G, N]``, ``g_idx`` int32 ``[K]``; ``quantization_config`` (config.json) and
  ``quantize_config.json`` with AutoGPTQ's keys;
* AWQ GEMM (AutoAWQ 0.2's ``save_quantized``): ``qweight`` int32 ``[K, N/8]``, ``qzeros`` int32
  ``[K/G, N/8]``, ``scales`` fp16 ``[K/G, N]``; config.json's ``quantization_config`` and
  ``quant_config.json`` (``w_bit``, ``q_group_size``, ``version: GEMM``).

:func:`vllm_dequantize` is vLLM's reading: GPTQ codes by ``unpack_quantized_values_into_int32``
with ``uint4b8`` (zero 8) for ``sym: true`` as ``AutoGPTQConfig`` serves it, the v1 zero points by
the GPTQ branch of vLLM's ``moe_wna16`` loader (``convert_gptq_int4_qzeros``: stored + 1); AWQ by
``auto_awq._convert_awq_to_standard_format`` (what vLLM's CPU AWQ path runs) and the same unpacker.
(vLLM 0.32 has no ``gptq_v2`` reader: its zero points are the unpacked values as stored.)

CLI: ``python -m tests.helpers.gptq_checkpoint SRC OUT --method gptq --group-size 128 [--asym]``.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import shutil
from pathlib import Path
from typing import Any, Iterator

import torch

from aipc_kernels.core.hf_checkpoint import CONFIG_NAME, INDEX_NAME, HFCheckpoint, read_config

#: the linears GPTQ and AWQ quantize (the output projection and the embeddings stay float)
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _is_linear(name: str) -> bool:
    prefix, _, leaf = name.rpartition(".")
    return leaf == "weight" and prefix.rpartition(".")[2] in LINEARS


def gptq_config(group_size: int, sym: bool, desc_act: bool = False, checkpoint_format: str = "gptq") -> dict[str, Any]:
    """AutoGPTQ's ``BaseQuantizeConfig.to_dict()`` (0.7), as written to quantize_config.json and to
    config.json's ``quantization_config``; ``desc_act`` with ``static_groups`` (g_idx in input order)."""
    return {"bits": 4, "group_size": group_size, "damp_percent": 0.01, "desc_act": desc_act, "static_groups": desc_act,
            "sym": sym, "true_sequential": True, "model_name_or_path": None, "model_file_base_name": "model",
            "quant_method": "gptq", "checkpoint_format": checkpoint_format}  # fmt: skip


def awq_config(group_size: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """AutoAWQ's config.json ``quantization_config`` and its quant_config.json."""
    hf = {"quant_method": "awq", "zero_point": True, "group_size": group_size, "bits": 4, "version": "gemm",
          "modules_to_not_convert": None}  # fmt: skip
    return hf, {"zero_point": True, "q_group_size": group_size, "w_bit": 4, "version": "GEMM", "modules_to_not_convert": None}


def quantize_linear(weight: torch.Tensor, method: str, group_size: int, sym: bool,
                    checkpoint_format: str = "gptq") -> dict[str, torch.Tensor]:  # fmt: skip
    """One float weight ``[N, K]`` -> its checkpoint tensors (``qweight``, ``qzeros``, ``scales``,
    GPTQ's ``g_idx``), RTN-quantized and packed by vLLM's own helpers."""
    from vllm.model_executor.layers.quantization.utils.quant_utils import (awq_pack, gptq_pack, pack_cols,
                                                                           quantize_weights)  # fmt: skip
    from vllm.scalar_type import scalar_types

    N, K = weight.shape
    w = weight.detach().float().t().contiguous()  # [K, N], the checkpoints' orientation
    if sym:
        _, w_q, w_s, _ = quantize_weights(w, scalar_types.uint4b8, group_size)  # w_q: stored codes (bias 8 added)
        zeros = torch.full_like(w_s, 8, dtype=torch.int32)
    else:
        _, w_q, w_s, zeros = quantize_weights(w, scalar_types.uint4, group_size, zero_points=True)
    groups = w_s.shape[0]
    if method == "awq":
        return {"qweight": awq_pack(w_q, 4, K, N), "qzeros": awq_pack(zeros.int(), 4, groups, N),
                "scales": w_s.to(torch.float16).contiguous()}  # fmt: skip
    stored = zeros.int() - (1 if checkpoint_format == "gptq" else 0)
    if bool((stored < 0).any()):  # AutoGPTQ's v1 packing would corrupt the neighbouring zero points
        raise ValueError("a zero point of 0 cannot be stored in checkpoint_format gptq (v1); use gptq_v2")
    G = K if group_size == -1 else group_size
    return {"qweight": gptq_pack(w_q, 4, K, N), "qzeros": pack_cols(stored, 4, groups, N),
            "scales": w_s.to(torch.float16).contiguous(), "g_idx": torch.arange(K, dtype=torch.int32) // G}  # fmt: skip


def write_int4_checkpoint(src: str | Path, out: str | Path, method: str = "gptq", group_size: int = 128,
                          sym: bool = True, desc_act: bool = False, checkpoint_format: str = "gptq") -> Path:  # fmt: skip
    """Writes ``src`` (a float Hugging Face model directory) as a GPTQ or AWQ (``method``) checkpoint
    to ``out`` (one ``model.safetensors``; tokenizer and side files copied); returns ``out``. AWQ has
    zero points (``sym`` must be False)."""
    from safetensors.torch import save_file

    if method not in ("gptq", "awq"):
        raise ValueError(f"method={method!r}; use 'gptq' or 'awq'")
    if method == "awq" and sym:
        raise ValueError("AWQ GEMM checkpoints have zero points: pass sym=False")
    src, out = Path(src), Path(out)
    config = read_config(src)
    if "quantization_config" in config:
        raise ValueError(f"{src} is already quantized ({config['quantization_config'].get('quant_method')}); pass a float model")
    out.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for name, t in HFCheckpoint(src).tensors():
        if _is_linear(name):
            prefix = name.rpartition(".")[0]
            for part, v in quantize_linear(t, method, group_size, sym, checkpoint_format).items():
                tensors[f"{prefix}.{part}"] = v.contiguous()
        else:
            tensors[name] = t.contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name not in (INDEX_NAME, CONFIG_NAME):
            shutil.copy2(f, out / f.name)
    if method == "gptq":
        config["quantization_config"] = gptq_config(group_size, sym, desc_act, checkpoint_format)
        side = ("quantize_config.json", config["quantization_config"])
    else:
        config["quantization_config"], quant_config = awq_config(group_size)
        side = ("quant_config.json", quant_config)
    (out / side[0]).write_text(json.dumps(side[1], indent=2) + "\n")
    (out / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out


# ---------------------------------------------------------------------- vLLM's own reading


@contextlib.contextmanager
def _one_rank() -> Iterator[None]:
    """A tensor-parallel world of one rank for vLLM's parameter classes (which ask the rank of the
    process group an engine would have set up) outside an engine."""
    from vllm.model_executor import parameter

    saved = parameter.get_tensor_model_parallel_rank, parameter.get_tensor_model_parallel_world_size
    parameter.get_tensor_model_parallel_rank, parameter.get_tensor_model_parallel_world_size = lambda: 0, lambda: 1
    try:
        yield
    finally:
        parameter.get_tensor_model_parallel_rank, parameter.get_tensor_model_parallel_world_size = saved


def _gptq_v1_zeros(qzeros: torch.Tensor) -> torch.Tensor:
    """vLLM's moe_wna16 GPTQ loader's ``convert_gptq_int4_qzeros`` (stored 4-bit zero points + 1,
    repacked two per byte) on ``qzeros [G, N/8]``, unpacked -> ``[G, N]``."""
    from vllm.model_executor.layers.quantization.moe_wna16 import MoeWNA16Method

    loader = MoeWNA16Method.get_weight_loader(None, None)
    convert = dict(zip(loader.__code__.co_freevars, (c.cell_contents for c in loader.__closure__)))
    packed = convert["convert_gptq_int4_qzeros"](qzeros)  # uint8 [G, N/2]: column 2i low nibble, 2i+1 high
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(1).to(torch.int32)


def vllm_dequantize(quantization_config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """The float32 weight ``[N, K]`` that vLLM reads from one linear's checkpoint tensors."""
    from vllm.model_executor.layers.quantization.auto_awq import _convert_awq_to_standard_format
    from vllm.model_executor.layers.quantization.utils.quant_utils import unpack_quantized_values_into_int32
    from vllm.scalar_type import scalar_types

    scales = tensors["scales"].float()
    if quantization_config["quant_method"] == "awq":
        layer = torch.nn.Module()
        for part in ("qweight", "qzeros"):
            layer.register_parameter(part, torch.nn.Parameter(tensors[part].clone(), requires_grad=False))
        with _one_rank():
            _convert_awq_to_standard_format(layer, "qweight", "qzeros", 4)  # -> GPTQ-like [K/8, N], zeros [N/8, G]
        codes = unpack_quantized_values_into_int32(layer.qweight.data, scalar_types.uint4, 0)  # [K, N]
        zeros = unpack_quantized_values_into_int32(layer.qzeros.data, scalar_types.uint4, 0).t()  # [G, N]
        group = torch.arange(codes.shape[0]) // (codes.shape[0] // scales.shape[0])
    else:
        codes = unpack_quantized_values_into_int32(tensors["qweight"], scalar_types.uint4b8, 0)  # [K, N]
        if quantization_config["sym"]:  # AutoGPTQConfig: uint4b8, qzeros unused
            zeros = torch.full_like(scales, scalar_types.uint4b8.bias)
        elif quantization_config.get("checkpoint_format", "gptq") == "gptq":
            zeros = _gptq_v1_zeros(tensors["qzeros"])
        else:
            zeros = unpack_quantized_values_into_int32(tensors["qzeros"], scalar_types.uint4, 1)
        group = tensors["g_idx"].long()
    return ((codes.float() - zeros.float()[group]) * scales[group]).t().contiguous()


def vllm_dequantized_linears(directory: str | Path) -> dict[str, torch.Tensor]:
    """Every quantized linear of a GPTQ / AWQ checkpoint directory as vLLM reads it:
    ``{"<prefix>.weight": float32 [N, K]}`` (the state-dict names of the float model it came from)."""
    ckpt = HFCheckpoint(directory)
    config = ckpt.config()["quantization_config"]
    out = {}
    for name in sorted(n for n in ckpt.weight_map if n.endswith(".qweight")):
        prefix = name.rpartition(".")[0]
        parts = ("qweight", "qzeros", "scales") + (("g_idx",) if config["quant_method"] == "gptq" else ())
        out[f"{prefix}.weight"] = vllm_dequantize(config, {p: ckpt.get(f"{prefix}.{p}") for p in parts})
    return out


# ---------------------------------------------------------------------- what a vLLM engine serves

#: vLLM's merged linears -> the checkpoint linears they hold, in order
MERGED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def served_linears(model: torch.nn.Module) -> dict[str, list]:
    """For vLLM's ``LLM.apply_model`` (a module-level function: it pickles for the workers of TP>1):
    ``{linear or lm_head: [quant method class, code book, group size]}`` of this rank's model, ``"a16"``
    appended for a layer served on the activation-exact W4A16 op, ``"whole_row_amax"`` for a row-parallel
    slice that quantizes its activations with the whole token's absmax (TP>1, per-token scales)."""
    return {n: [type(x.quant_method).__name__, getattr(x, "lowbit_codebook", None), getattr(x, "lowbit_group_size", None)]
            + (["a16"] if getattr(x, "lowbit_a16", False) else [])
            + (["whole_row_amax"] if getattr(x, "lowbit_split_rows", False) else [])
            for n, x in model.named_modules()
            if n.endswith(("_proj", "lm_head")) and getattr(x, "quant_method", None) is not None}  # fmt: skip


def served_equals_checkpoint(directory: str, model: torch.nn.Module) -> dict[str, bool]:
    """For ``LLM.apply_model(functools.partial(served_equals_checkpoint, directory))``: whether each
    low-bit linear of this rank's model dequantizes bit for bit to its slice of the weight vLLM's own
    code reads from the checkpoint (:func:`vllm_dequantized_linears`; merged q/k/v and gate/up shards
    concatenated, each cut for this tensor-parallel rank: rows of column-parallel layers, input
    features of row-parallel ones)."""
    from vllm.model_executor.layers.linear import RowParallelLinear

    from aipc_kernels.lowbit.packing import PackedLowBit, to_canonical

    ref = vllm_dequantized_linears(directory)
    out = {}
    for n, x in model.named_modules():
        if not (n.endswith("_proj") and getattr(x, "lowbit_layout", None)):
            continue
        parent, _, last = n.rpartition(".")
        whole = [ref[f"{parent}.{c}.weight"] for c in MERGED.get(last, (last,))]
        r, tp = x.tp_rank, x.tp_size
        if isinstance(x, RowParallelLinear):
            expect = torch.cat(whole).tensor_split(tp, dim=1)[r]
        else:
            expect = torch.cat([w.tensor_split(tp, dim=0)[r] for w in whole])
        k = expect.shape[1]
        packed = PackedLowBit(x.lowbit_layout, x.qweight, x.scales, x.zeros, x.lowbit_codebook, x.lowbit_group_size,
                              x.lowbit_out_features, k)  # fmt: skip
        out[n] = torch.equal(to_canonical(packed).dequantize(), expect)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", help="float Hugging Face model directory")
    ap.add_argument("out", help="output directory")
    ap.add_argument("--method", choices=("gptq", "awq"), default="gptq")
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--asym", action="store_true", help="zero points per group (AWQ always)")
    ap.add_argument("--checkpoint-format", choices=("gptq", "gptq_v2"), default="gptq")
    args = ap.parse_args(argv)
    sym = not args.asym and args.method == "gptq"
    print(write_int4_checkpoint(args.src, args.out, args.method, args.group_size, sym,
                                checkpoint_format=args.checkpoint_format))  # fmt: skip


if __name__ == "__main__":
    main()
