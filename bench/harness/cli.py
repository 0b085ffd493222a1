"""The command line every benchmark shares: ``--rows`` (any subset of the bench's rows), ``--list-rows``,
``--out`` (results folder: by default the bench's group under ``bench/results/``), ``--name`` (results file
name) and ``--no-lock``."""
from __future__ import annotations

import argparse
import fnmatch
import os
from typing import Optional, Sequence

RESULTS_DIR = "bench/results"
#: the groups of ``bench/results/`` (``bench/results/README.md`` indexes each): what a bench measures decides its group
GROUPS = ("cpu", "gpu", "e2e", "quality")
#: the repository the benches live in: the default --out is its bench/results/<group> from any working directory
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


def results_dir(group: str) -> str:
    """The results folder of a bench group, relative to the repository root: ``bench/results/<group>``."""
    if group not in GROUPS:
        raise ValueError(f"results group {group!r} is not one of {', '.join(GROUPS)}")
    return f"{RESULTS_DIR}/{group}"


class BenchParser(argparse.ArgumentParser):
    """An argument parser with the common options; ``parse_args`` turns ``--rows`` into the list of
    selected row names (in the bench's order); ``--list-rows`` prints the available ones and exits.
    ``group`` (one of :data:`GROUPS`) names the bench's results folder: the default ``--out`` is
    ``bench/results/<group>`` of this repository."""

    def __init__(self, name: str, doc: Optional[str], rows: Sequence[str], default_rows: Optional[Sequence[str]] = None,
                 what: str = "rows", *, group: str):
        super().__init__(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
        self.default_out = results_dir(group)
        self.available_rows = list(rows)
        default = ",".join(default_rows if default_rows is not None else rows)
        self.add_argument("--rows", default=default,
                          help=f"comma list of {what} to run, names or patterns such as 'int2*' (default: {default})")
        self.add_argument("--list-rows", action=_ListRows, nargs=0, help=f"print the available {what} and exit")
        self.add_argument("--out", default=self.default_out,
                          help="results folder (default: %(default)s of this repository, from any working directory)")
        self.add_argument("--name", default=name, help="results file name, without suffix (default: %(default)s)")
        self.add_argument("--no-lock", action="store_true",
                          help="do not take the bench lock (smoke runs that hold the test lock)")

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        ns = super().parse_args(args, namespace)
        if ns.out == self.default_out:  # the default: not relative to the working directory
            ns.out = os.path.join(REPO_ROOT, self.default_out)
        try:
            ns.rows = select(ns.rows, self.available_rows)
        except ValueError as e:
            self.error(str(e))
        return ns
