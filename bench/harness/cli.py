"""The command line every benchmark shares: ``--rows`` (any subset of the bench's rows), ``--list-rows``,
``--out`` (results folder), ``--name`` (results file name) and ``--no-lock``."""
from __future__ import annotations

import argparse
import fnmatch
import os
from typing import Optional, Sequence

RESULTS_DIR = "bench/results"
#: the repository the benches live in: the default --out is its bench/results from any working directory
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def select(patterns: str, available: Sequence[str], option: str = "--rows") -> list[str]:
    """The names of ``available`` (in their order) that one of the comma-separated ``patterns`` matches:
    a name, or an ``fnmatch`` pattern such as ``'8B*'``. A pattern that matches nothing is an error
    naming it and the option."""
    wanted = [p.strip() for p in patterns.split(",") if p.strip()]
    if not wanted:
        raise ValueError(f"{option} is empty; available: {', '.join(available)}")
    for p in wanted:
        if not fnmatch.filter(available, p):
            raise ValueError(f"{option}: {p!r} matches none of: {', '.join(available)}")
    return [a for a in available if any(fnmatch.fnmatchcase(a, p) for p in wanted)]


class _ListRows(argparse.Action):
    """``--list-rows``: prints the bench's rows and exits, as ``--help`` does (before required options are checked)."""

    def __call__(self, parser, namespace, values, option_string=None):
        print("\n".join(parser.available_rows))
        parser.exit(0)


class BenchParser(argparse.ArgumentParser):
    """An argument parser with the common options; ``parse_args`` turns ``--rows`` into the list of
    selected row names (in the bench's order); ``--list-rows`` prints the available ones and exits."""

    def __init__(self, name: str, doc: Optional[str], rows: Sequence[str], default_rows: Optional[Sequence[str]] = None,
                 what: str = "rows"):
        super().__init__(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
        self.available_rows = list(rows)
        default = ",".join(default_rows if default_rows is not None else rows)
        self.add_argument("--rows", default=default,
                          help=f"comma list of {what} to run, names or patterns such as 'int2*' (default: {default})")
        self.add_argument("--list-rows", action=_ListRows, nargs=0, help=f"print the available {what} and exit")
        self.add_argument("--out", default=RESULTS_DIR,
                          help="results folder (default: %(default)s of this repository, from any working directory)")
        self.add_argument("--name", default=name, help="results file name, without suffix (default: %(default)s)")
        self.add_argument("--no-lock", action="store_true",
                          help="do not take the bench lock (smoke runs that hold the test lock)")

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        ns = super().parse_args(args, namespace)
        if ns.out == RESULTS_DIR:  # the default: not relative to the working directory
            ns.out = os.path.join(REPO_ROOT, RESULTS_DIR)
        try:
            ns.rows = select(ns.rows, self.available_rows)
        except ValueError as e:
            self.error(str(e))
        return ns
