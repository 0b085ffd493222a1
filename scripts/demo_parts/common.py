"""What every demo part shares: the embedded model, the command line, and how a part reports.

A part prints what it does, then one result line (``RESULT_PREFIX`` + JSON: ``status`` and the
one-line measured ``figure`` or the ``reason`` it refused) that scripts/demo.py collects. Exit
status: 0 done, ``EXIT_REFUSED`` when the plugin refused the model before any work, anything else
a failure (with its traceback).
"""
from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

# The embedded model: a tiny random Llama (2 layers, hidden 256, K of every linear a multiple of
# the lowbit2 group size 64) with an offline-trained tokenizer, built once into the per-machine cache.
EMBEDDED = dict(arch="llama", hidden=256, layers=2, heads=4, intermediate=512)
RESULT_PREFIX = "@@demo-result "
EXIT_REFUSED = 3
CHAT = [{"role": "user", "content": "Tell me about the small model on this laptop."}]


class Refused(Exception):
    """The plugin (or its framework) refused this model; the message says why."""


def parse_args(description: str) -> argparse.Namespace:
    """``--model DIR`` (default: the embedded model) and ``--new-tokens N``."""
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="a Hugging Face checkpoint directory (default: the embedded tiny Llama)")
    ap.add_argument("--new-tokens", type=int, default=32, help="tokens to generate (default 32)")
    return ap.parse_args()


def resolve_model(model: Path | None) -> Path:
    """``model``, or the embedded tiny model (built on first use, then reused from the cache)."""
    if model is not None:
        return model
    from aipc_kernels.tools.tiny_model import build_tiny_model

    t0 = time.time()
    path = build_tiny_model(**EMBEDDED)
    print(f"embedded model: {path} ({time.time() - t0:.1f} s)", flush=True)
    return path


def report(status: str, text: str) -> None:
    """Prints the result line for scripts/demo.py."""
    key = "figure" if status == "ok" else "reason"
    print(RESULT_PREFIX + json.dumps({"status": status, key: text}), flush=True)


def run_part(main: Callable[[argparse.Namespace, Path], str], description: str) -> None:
    """Runs ``main(args, model_dir) -> figure`` and reports it. SIGTERM becomes SystemExit so that
    the part's ``finally`` blocks (stopping a server) run when scripts/demo.py stops it."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    args = parse_args(description)
    try:
        figure = main(args, resolve_model(args.model))
    except Refused as e:
        print(f"refused: {e}", flush=True)
        report("refused", str(e))
        sys.exit(EXIT_REFUSED)
    report("ok", figure)


def same_prefix(got: list[int], want: list[int], what: str, strict: bool) -> int:
    """How many leading tokens ``got`` and ``want`` share; with ``strict`` (the embedded model, where
    the tests assert equality) anything short of all of them raises."""
    same = next((i for i, (x, y) in enumerate(zip(got, want)) if x != y), min(len(got), len(want)))
    if strict and (same != len(want) or len(got) != len(want)):
        raise RuntimeError(f"{what}: only the first {same} of {len(want)} greedy tokens are identical\n"
                           f"  got  {got}\n  want {want}")
    return same
