"""``optimum-cli export openvino-npu -m MODEL OUT``: the NPU export from optimum's CLI.

Registered through optimum's PEP 420 namespace ``optimum.commands.register`` (the file
``optimum/commands/register/register_openvino_npu.py`` of this package); also runnable as
``python -m optimum_npu.cli -m MODEL OUT``.
"""
from __future__ import annotations

import argparse
import sys

from .options import TARGETS, WEIGHT_FORMATS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's options (mirroring export_npu_model's keywords)."""
    req = parser.add_argument_group("Required arguments")
    req.add_argument("-m", "--model", required=True, help="checkpoint directory or Hub model id")
    req.add_argument("output", help="directory to write the exported model to")
    opt = parser.add_argument_group("Optional arguments")
    opt.add_argument("--max-seq-len", type=int, default=2048,
                     help="tokens a sequence may hold, prompt + generated (default 2048)")
    opt.add_argument("--prefill-block", type=int, default=64,
                     help="prompt tokens per prefill call (default 64)")
    opt.add_argument("--kv-buckets", type=lambda s: [int(v) for v in s.split(",") if v],
                     default=None, help="comma-separated decode KV capacities "
                     "(default 256,384,512,640,896,... up to --max-seq-len)")
    opt.add_argument("--layers-per-chunk", type=int, default=2,
                     help="decoder layers per IR chunk (default 2; bounds export memory)")
    opt.add_argument("--weight-format", choices=WEIGHT_FORMATS, default="fp16",
                     help="weight storage / NNCF compression (default fp16)")
    opt.add_argument("--sym", action=argparse.BooleanOptionalAction, default=None,
                     help="symmetric integer weights (default: symmetric)")
    opt.add_argument("--group-size", type=int, default=None,
                     help="int4 group size, -1 per channel (default 128)")
    opt.add_argument("--ratio", type=float, default=None, help="int4 ratio (default 1.0)")
    opt.add_argument("--target", choices=TARGETS, default="NPU",
                     help="device the export is meant for (NPU refuses INT4 asymmetric)")


def run(args: argparse.Namespace) -> None:
    """Runs the export for parsed ``args`` and prints the directory."""
    from .check import check_npu_ready
    from .export import export_npu_model

    out = export_npu_model(
        args.model, args.output, max_seq_len=args.max_seq_len, prefill_block=args.prefill_block,
        kv_buckets=args.kv_buckets, layers_per_chunk=args.layers_per_chunk,
        weight_format=args.weight_format, sym=args.sym, group_size=args.group_size,
        ratio=args.ratio, target=args.target)
    report = check_npu_ready(out)
    print(f"exported {args.model} -> {out} ({report.files} static IRs, {report.states} KV states)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="optimum-cli export openvino-npu",
                                     description="Export a causal LM to chunked, stateful, "
                                     "static-shape OpenVINO IRs for Intel NPUs")
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        run(args)
    except ValueError as e:
        parser.error(str(e))


if __name__ == "__main__":
    main(sys.argv[1:])
