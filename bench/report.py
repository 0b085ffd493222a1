"""How the benchmarks write their results: a markdown table, and the markdown + JSON files under bench/results/."""
from __future__ import annotations

import json
from pathlib import Path


def markdown_table(rows: list[dict], cols: list[str], float_fmt: str = ".2f") -> str:
    """``rows`` as a markdown table of ``cols`` (floats as ``float_fmt``, missing values empty)."""
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(format(r[c], float_fmt) if isinstance(r.get(c), float) else
                                        ("" if r.get(c) is None else str(r[c])) for c in cols) + " |")
    return "\n".join(lines)


def write_report(out: str, text: str, rows: list[dict]) -> None:
    """Writes ``text`` to ``out``.md and ``rows`` to ``out``.json (folders created), and prints the text."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".md").write_text(text)
    path.with_suffix(".json").write_text(json.dumps(rows, indent=1))
    print(text)
