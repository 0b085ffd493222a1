"""The output projection (``lm_head``) quantized: its formats and the weight each one makes.

Decode reads the output projection once per token, and in small models it weighs as much as every
other linear together (Llama-3.2-1B: 525 MB in bf16 against ~300 MB of 2-bit linears). The formats:

* ``auto`` (:data:`DEFAULT_HEAD_FORMAT`, the default of ``lowbit2`` / ``lowbit4``): ``int6`` where the CPU
  kernels run with AVX2 or AVX-VNNI and no AVX-512 (the Core Ultra class), else ``int8``
  (:func:`auto_head_format`, decided at load from the kernels' instruction set, ``AIPC_ISA`` included);
* ``int8``: the ``int8`` code book with one scale per output channel (round to nearest, the scale taking the
  row's extremes to levels 127 and -128), run by the same W·A8 kernels; half the bytes of bf16, with an error
  of the order of the int8 activations' own;
* ``int6``: the ``int6`` code book
  (GGUF's Q6_K levels, -32 .. 31) in groups of 32 with 16-bit scales, round to nearest: 6.5 bits a weight,
  0.77x int8's bytes (what a GGUF's Q6_K output projection reads, 6.56, and what llama.cpp's Q4_0 / Q4_K_M
  files carry), on the 6-bit W·A8 kernels. On the real models of ``bench/results/quality`` its perplexity
  is within 0.8% of ``int8``'s; vLLM's 1B decode 1.12x / 1.24x (lowbit4 / lowbit2, AVX2) and 1.23x / 1.27x
  (AVX-VNNI) faster than with ``int8``, but 0.92x / 0.94x with the CPU's own AVX-512 VNNI kernels
  (``bench/results/e2e/vllm_head_ab_epyc_zen5_*``, interleaved rounds): hence ``auto``;
* ``lowbit``: the code book and group size of the model's other linears (2 bits: a quarter of int8's
  bytes, at a quality cost);
* ``float``: left in the model dtype.

The input embedding stays a float gather in every case (a tied embedding keeps its float copy).
"""
from __future__ import annotations

from typing import Optional

import torch

from aipc_kernels.lowbit.formats import LowBitWeight, fitting_group_size
from aipc_kernels.lowbit.quantizers import quantize_rows

HEAD_FORMATS = ("int8", "int6", "lowbit", "float")
#: the output projection's setting where a serving plugin's config does not name one (``lm_head``): a
#: format chosen at load by :func:`auto_head_format`
DEFAULT_HEAD_FORMAT = "auto"
#: what ``lm_head`` accepts: ``auto`` or a format
HEAD_CHOICES = (DEFAULT_HEAD_FORMAT,) + HEAD_FORMATS
#: the kernels' instruction sets on which ``auto`` is ``int6``: every x86 one without AMX (measured faster with AVX2,
#: AVX-VNNI and Zen 4's AVX-512 VNNI; docs/vllm_lowbit.md, Options, says where it was not)
INT6_HEAD_ISAS = ("avx2", "avx_vnni", "avx512_vnni")
INT6_GROUP = 32  # the int6 head's group (or the largest supported below it that divides the hidden size)


def int8_scale_dtype(weight: torch.Tensor, group_size: int = -1, top: float = 127.0) -> torch.dtype:
    """float16 (10 fraction bits) when every group's scale ``max|w|/top`` (a group: a row, or ``group_size``
    columns) is zero (a padding row) or a normal float16, else bfloat16 (whose range holds any model's)."""
    w = weight.detach()
    groups = w.reshape(w.shape[0], -1, group_size) if group_size > 0 else w.unsqueeze(1)
    scale = groups.abs().amax(dim=-1).float() / top
    fp16 = torch.finfo(torch.float16)
    fits = (scale == 0) | ((scale >= fp16.tiny) & (scale <= fp16.max))
    return torch.float16 if bool(fits.all()) else torch.bfloat16


def auto_head_format(on_cpu: bool = True) -> str:
    """What ``lm_head: auto`` is here: ``int6`` on a CPU whose kernels run with AVX2, AVX-VNNI or
    AVX-512 VNNI (:data:`INT6_HEAD_ISAS`; ``AIPC_ISA`` counts), else ``int8`` (AMX, portable C, GPUs)."""
    if not on_cpu:
        return "int8"
    from aipc_kernels.core import native

    return "int6" if native.available() and native.get_isa() in INT6_HEAD_ISAS else "int8"


def resolve_head_format(head_format: str, on_cpu: bool = True) -> str:
    """``head_format`` with ``auto`` replaced by :func:`auto_head_format`."""
    return auto_head_format(on_cpu) if head_format == DEFAULT_HEAD_FORMAT else head_format


def head_act_group(head_format: str, act_group: int) -> int:
    """The op's ``act_group`` for a head in ``head_format``: the linears' for ``lowbit``; 0 (per-token
    activation scales) for ``int8``, whose one group per row admits no other, and ``int6``."""
    return act_group if head_format == "lowbit" else 0


def quantize_output_projection(
    weight: torch.Tensor,
    head_format: str,
    name: str = "lm_head",
    codebook: Optional[str] = None,
    group_size: Optional[int] = None,
    quantizer: str = "optimized",
    scale_dtype: torch.dtype = torch.float16,
) -> Optional[LowBitWeight]:
    """``weight [vocab, hidden]`` in ``head_format``; None for ``float``. ``codebook``, ``group_size``,
    ``quantizer`` and ``scale_dtype`` are the other linears' (``lowbit`` needs them; a group that does not
    divide the hidden size falls back as theirs do, :func:`~aipc_kernels.lowbit.formats.fitting_group_size`).
    Errors name ``name``."""
    if head_format not in HEAD_FORMATS:
        raise ValueError(f"{name}: head format {head_format!r} is unknown; use one of {HEAD_FORMATS}")
    if head_format == "float":
        return None
    if head_format == "lowbit" and (codebook is None or group_size is None):
        raise ValueError(f"{name}: head format 'lowbit' needs the linears' codebook and group_size")
    try:
        if head_format == "int8":
            return quantize_rows(weight, "int8", -1, "rtn", int8_scale_dtype(weight), name=name)
        if head_format == "int6":
            group = fitting_group_size(INT6_GROUP, weight.shape[1])
            return quantize_rows(weight, "int6", group, "rtn", int8_scale_dtype(weight, group, 31.0), name=name)
        return quantize_rows(weight, codebook, fitting_group_size(group_size, weight.shape[1]), quantizer, scale_dtype,
                             name=name)
    except ValueError as e:
        raise ValueError(f"cannot quantize the output projection {name} to {head_format}: {e}; or keep it "
                         f"float (lm_head: float)") from None  # fmt: skip


__all__ = ["DEFAULT_HEAD_FORMAT", "HEAD_CHOICES", "HEAD_FORMATS", "INT6_HEAD_ISAS", "auto_head_format", "resolve_head_format", "INT6_GROUP", "head_act_group", "int8_scale_dtype", "quantize_output_projection"]
