"""How every benchmark writes its results: ``<out>/<name>.md`` (title, the machine sentence, the
command, then the bench's summary and tables) and ``<out>/<name>.json`` (``machine``, ``command``,
``rows``, and whatever else the bench keeps)."""
from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import Any, Optional

from harness.machine import describe


def markdown_table(rows: list[dict], cols: list[str], float_fmt: str = ".2f") -> str:
    """``rows`` as a markdown table of ``cols`` (floats as ``float_fmt``, missing values empty)."""
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(format(r[c], float_fmt) if isinstance(r.get(c), float) else
                                        ("" if r.get(c) is None else str(r[c])) for c in cols) + " |")
    return "\n".join(lines)


def command_line(argv: Optional[list[str]] = None) -> str:
    """The command that ran this bench, as a user types it from the repository root."""
    argv = sys.argv if argv is None else argv
    script = Path(argv[0])
    try:
        script = script.resolve().relative_to(Path.cwd())
    except ValueError:
        pass
    return shlex.join(["python", str(script), *argv[1:]])


def write_results(out: str | Path, name: str, title: str, machine: dict, rows: list | dict, body: str,
                  notes: str = "", extra: Optional[dict[str, Any]] = None, echo: bool = True,
                  command: Optional[str] = None) -> Path:
    """Writes ``<out>/<name>.md`` ("# title", "Machine: ..." + ``notes``, "Command: ...", ``body``) and
    ``<out>/<name>.json`` (``machine``, ``command``, ``rows``: a list of table rows or a dict of named
    sections, and the ``extra`` keys); folders are
    created. ``command``: the command that measured the rows (default: this process's, see
    :func:`command_line`). Prints the markdown when ``echo``. Returns the path stem."""
    if not name or "/" in name:
        raise ValueError(f"write_results: name={name!r} must be a file name without folders")
    stem = Path(out) / name
    stem.parent.mkdir(parents=True, exist_ok=True)
    cmd = command or command_line()
    text = (f"# {title}\n\nMachine: {describe(machine)}." + (f" {notes}" if notes else "")
            + f"\nCommand: `{cmd}`\n\n{body.rstrip()}\n")
    stem.parent.joinpath(name + ".md").write_text(text)
    stem.parent.joinpath(name + ".json").write_text(json.dumps(dict(machine=machine, command=cmd, rows=rows, **(extra or {})),
                                                    indent=1) + "\n")
    if echo:
        print(text)
    return stem


def read_results(out: str | Path, name: str) -> dict:
    """``<out>/<name>.json`` as :func:`write_results` writes it. Files written before the harness keep
    their rows as a bare list or under ``results``: both are read into ``rows``."""
    data = json.loads((Path(out) / f"{name}.json").read_text())
    if isinstance(data, list):
        return dict(machine={}, rows=data)
    if "rows" not in data:
        data["rows"] = data.pop("results", [])
    return data
