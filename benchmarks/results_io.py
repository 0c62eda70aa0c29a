"""What the benchmarks write: `results/NAME.json` (meta and rows, for machines) and `results/NAME.md` (a caption
and a Markdown table, for people)."""

from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def markdown_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def write_results(name: str, meta: dict, rows: list[dict], caption: str, table: str) -> None:
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    (RESULTS / f"{name}.md").write_text(f"{caption}\n\n{table}\n")
    print(table)
