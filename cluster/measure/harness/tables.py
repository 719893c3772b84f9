"""One set of rows, three files that agree: JSON (the rows and everything else), CSV (the rows,
raw values) and markdown (the rows formatted, one table per column subset).

A `Column` names a row key, its title and how the markdown shows a value; None is "" in the CSV
and "-" in markdown. The CSV keeps full precision (Python's float repr), so a reader gets back
exactly the JSON's numbers.
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lockserve.cluster.measure.harness.sizes import fmt_bytes, fmt_tokens


def f1(v) -> str:
    return f"{v:.1f}"


def f2(v) -> str:
    return f"{v:.2f}"


def f3(v) -> str:
    return f"{v:.3f}"


def commas(v) -> str:
    return f"{v:,.0f}"


def text(v) -> str:
    return str(v)


def yes_no(v) -> str:
    return "yes" if v else "no"


def size(v) -> str:
    return fmt_bytes(v)


def tokens(v) -> str:
    return fmt_tokens(int(v))


@dataclass(frozen=True)
class Column:
    key: str
    title: str
    fmt: Callable[[Any], str] = text

    def cell(self, value) -> str:
        return "-" if value is None else self.fmt(value).replace("|", "\\|")


def markdown_table(columns: Sequence[Column], rows: Iterable[dict]) -> str:
    lines = ["| " + " | ".join(c.title for c in columns) + " |", "|" + " --- |" * len(columns)]
    lines += ["| " + " | ".join(c.cell(row.get(c.key)) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def parse_markdown_table(lines: list[str]) -> list[list[str]]:
    """Cells of a markdown table's body rows (the header and the rule skipped); for tests."""
    body = [line for line in lines[2:] if line.startswith("|")]
    return [[cell.strip().replace("\\|", "|") for cell in line.strip()[1:-1].split(" | ")] for line in body]


def csv_value(value) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, float) else str(value)


def write_csv(path: Path, columns: Sequence[Column], rows: Iterable[dict]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow([c.key for c in columns])
        for row in rows:
            writer.writerow([csv_value(row.get(c.key)) for c in columns])


def write_atomic(path: Path, content: str) -> None:
    """Write through a temporary file: a run stopped mid-write leaves the previous version."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(content)
    os.replace(tmp, path)


def write_json(path: Path, payload: dict) -> None:
    write_atomic(path, json.dumps(payload, indent=1, default=str) + "\n")


def run_header(info: dict) -> list[str]:
    """Markdown lines naming the run: workload first (every figure says which workload made it)."""
    command = " ".join(info["command"])
    lines = [
        f"Workload: **{info['workload']}**.",
        "",
        f"Model `{info['model']}` ({info['dtype']}) on {info['device']}, torch {info['torch']}, commit "
        f"`{info['commit']}`, {info['date']}.",
        "",
        f"Command: `{command}`",
    ]
    if info.get("note"):  # what a reader must know about the run (added to its JSON afterwards)
        lines += ["", f"Note: {info['note']}"]
    return lines
