"""Converter CLI: a Hugging Face checkpoint -> a ``lowbit2`` checkpoint that ``vllm serve`` loads
without flags.

    python -m vllm_lowbit.quantize MODEL_DIR OUT_DIR --codebook affine4 --group-size 64
    python -m vllm_lowbit.quantize MODEL_DIR OUT_DIR --allow-2bit-ptq   # 2-bit after training: see --help
    python -m vllm_lowbit.quantize MODEL_DIR OUT_DIR --quantizer progressive --codebook min4   # int8 levels per group
    python -m vllm_lowbit.quantize BITNET_DIR OUT_DIR --codebook ternary --verify   # BitNet b1.58 import
    python -m vllm_lowbit.quantize PARETOQ_DIR OUT_DIR   # weights on a 1/1.58/2-bit grid: written exactly
    python -m vllm_lowbit.quantize X.gguf OUT_DIR --verify   # a llama.cpp GGUF file, its blocks re-laid out exactly

A .gguf file is converted as it is stored (vllm_lowbit.gguf_convert: the reader that serves it; the token
embedding and an untied output projection too, served as serving the file serves them); the quantization
options do not apply to it, and --verify checks that every written weight equals gguf.quants.dequantize of
the file's.
"""
from __future__ import annotations

import argparse
import sys
import time

from aipc_kernels.core.config_schema import OptionError, choices_of, field_names, parse

from .checkpoint import convert_checkpoint
from .options import CLI_NAMING, ConverterOptions


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vllm_lowbit.quantize", description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir", help="Hugging Face model directory (safetensors; bf16/fp16/fp32, or BitNet b1.58), "
                                      "or a llama.cpp .gguf file")
    ap.add_argument("out_dir", help="new or empty output directory")
    ap.add_argument("--codebook", default="affine", choices=choices_of(ConverterOptions, "codebook"))
    ap.add_argument("--group-size", type=int, default=64, choices=choices_of(ConverterOptions, "group_size"),
                    help="weights per scale along K (-1: one group per row)")
    ap.add_argument("--quantizer", default="optimized", choices=choices_of(ConverterOptions, "quantizer"),
                    help="optimized: least-squares scale/zero fit (default); rtn: min-max round to nearest; "
                         "progressive: the progressive two-level form with --codebook min4 (or min2): a float16 scale "
                         "per row, int8 levels per group, which the CPU kernels accumulate in int32 (faster prefill)")
    ap.add_argument("--scale-dtype", default="float16", choices=choices_of(ConverterOptions, "scale_dtype"))
    ap.add_argument("--modules-to-not-convert", nargs="*", default=[], metavar="NAME",
                    help="name fragments of linear layers to keep unquantized (lm_head and embeddings always are)")
    ap.add_argument("--act-group", type=int, default=0,
                    help="int8 activation scale per token (0, default) or per this many K: a multiple of the "
                         "group size that divides K/tp makes tensor-parallel results identical to TP=1")
    ap.add_argument("--no-detect-grid", dest="detect_grid", action="store_false",
                    help="quantize every linear, also those whose weights already lie on a binary/ternary/2-bit "
                         "grid (by default those are written exactly, e.g. ParetoQ checkpoints)")
    ap.add_argument("--allow-2bit-ptq", dest="allow_2bit_ptq", action="store_true",
                    help="quantize linears that lie on no low-bit grid to a 1- or 2-bit code book anyway (refused by "
                         "default: 2-bit post-training quantization turns a real trained model into noise, see "
                         "bench/results/quality/quality.md; use a 4-bit --codebook, or a checkpoint trained for 2 bits)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads for the quantizer (>= 1)")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--verify", action="store_true",
                    help="print the largest reconstruction error max|W - Wq| / max|W| against the source's weights "
                         "(a .gguf file: the largest |written - gguf.quants.dequantize| per type, which must be 0)")
    args = ap.parse_args(argv)
    if str(args.model_dir).lower().endswith(".gguf"):
        return _convert_gguf(ap, args)
    try:  # the checks the server applies to the same keys, before any work
        opts = parse(ConverterOptions, {k: getattr(args, k) for k in field_names(ConverterOptions)}, CLI_NAMING)
    except OptionError as e:
        ap.error(str(e))  # usage + message, exit status 2
    if opts.threads is not None:
        import torch

        torch.set_num_threads(opts.threads)
    t0 = time.time()
    try:
        convert_checkpoint(
            args.model_dir, args.out_dir, codebook=args.codebook, group_size=args.group_size,
            quantizer=args.quantizer, scale_dtype=args.scale_dtype,
            modules_to_not_convert=args.modules_to_not_convert, act_group=args.act_group,
            progress=not args.no_progress, detect_grid=args.detect_grid, verify=args.verify,
            allow_2bit_ptq=args.allow_2bit_ptq,
        )  # fmt: skip
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"done in {time.time() - t0:.1f} s; serve with: vllm serve {args.out_dir}")
    return 0


def _convert_gguf(ap: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """A .gguf file: written as it is stored; the quantization options are refused (they would be ignored)."""
    given = [f"--{k.replace('_', '-')}" for k in ("codebook", "group_size", "quantizer", "scale_dtype",
             "modules_to_not_convert", "act_group", "detect_grid", "allow_2bit_ptq") if getattr(args, k) != ap.get_default(k)]  # fmt: skip
    if given:
        ap.error(f"{args.model_dir} is a GGUF file, converted as it is stored (its blocks re-laid out exactly, "
                 f"act_group 32 as serving it); drop {' '.join(given)}")  # fmt: skip
    if args.threads is not None:
        if args.threads < 1:
            ap.error(f"--threads={args.threads} must be >= 1")
        import torch

        torch.set_num_threads(args.threads)
    from .gguf_convert import convert_gguf

    t0 = time.time()
    try:
        convert_gguf(args.model_dir, args.out_dir, verify=args.verify, progress=not args.no_progress)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"done in {time.time() - t0:.1f} s; serve with: vllm serve {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
