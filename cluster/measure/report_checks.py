"""What `lockserve report` checks about the result files and the pages that cite them.

audit(folder): the result files that lack provenance (commit, command, device, torch) or whose
only token comparison is a mode with itself; such a file is stale (to be re-run). Files derived
from a JSON (its .csv, .md, .png) share its stem and its findings. The result files are the
plain files directly in the folder (result_files); its archive/ subfolder (ARCHIVE) holds files kept
for the history that docs/notes cite: they are listed (archive_section), never stale, never evidence.

unbacked_figures(text, folder, generated): the measured figures of a hand-written page ("12.66 ms",
"1.16 x", "13.54 s": a number with a decimal point and a unit) that no result file backs. A figure
is backed when its number, as printed, appears in a generated text (the report's own blocks, the
.md, .csv and .txt files beside the JSON) or is the value of a JSON field rounded to the figure's
decimals. Numbers inside lists of numbers (per-step samples) back nothing: among thousands of
samples almost any figure would find a match.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

# The bench's reference before files recorded it (workers/bench.py DEFAULT_REFERENCE).
OLD_DEFAULT_REFERENCE = "locks:hbm"
FIELDS = ("commit", "command", "device", "torch")
# Where older files keep a field under another name or inside a block ("machine", "environment").
ALIASES = {"command": ("command", "sweep_command"), "device": ("device", "gpu"), "torch": ("torch",)}
NESTED = ("machine", "environment")
# The pages (in the results folder) the report writes; they are never evidence for themselves.
PAGES = ("README.md", "AUDIT.md")
# The first line of a text log that carries its run's provenance (scripts/gpu_tests.py).
LOG_PROVENANCE = "# provenance: "
# NOTE: the subfolder of result files kept for the history docs/notes cite. They are no evidence for
# any claim: not result files of the folder (result_files skips every subfolder), so they are never
# stale, never in the results log's tables and never back a figure of a page; archive_section lists them.
ARCHIVE = "archive"

UNITS = r"ms|us|µs|s|x|TB/s|GB/s|MB/s|tok/s|tokens/s"
FIGURE = re.compile(rf"(?<![\w.,])(\d[\d,]*\.\d+)\s?({UNITS})(?![\w/])")


@dataclass(frozen=True)
class Finding:
    """One result file's problems: lacks (fields missing), self_only (its only comparison is a
    mode with itself), reference_row (its reference's row records a comparison with itself:
    shown as "reference", the other rows' comparisons stand)."""
    name: str
    lacks: tuple[str, ...]
    self_only: str | None = None
    reference_row: str | None = None

    @property
    def stale(self) -> bool:
        return bool(self.lacks or self.self_only)

    def says(self) -> str:
        parts = []
        if self.lacks:
            parts.append("lacks " + ", ".join(self.lacks))
        if self.self_only:
            parts.append(self.self_only)
        if self.reference_row:
            parts.append(self.reference_row)
        return "; ".join(parts)


def _has(data: dict, field: str) -> bool:
    names = ALIASES.get(field, (field,))
    blocks = [data] + [data[k] for k in NESTED if isinstance(data.get(k), dict)]
    return any(block.get(name) for block in blocks for name in names)


def file_reference(result: dict) -> str | None:
    """The mode a decode bench file compared the others with: its "reference" field, else its
    command's --reference, else the bench's old default."""
    if "reference" in result:
        return result["reference"]
    command = result.get("command")
    words = command.split() if isinstance(command, str) else list(command or [])
    if "--reference" in words[:-1]:
        return words[words.index("--reference") + 1]
    return OLD_DEFAULT_REFERENCE


def _comparisons(result: dict) -> tuple[str | None, str | None]:
    """(self_only, reference_row) of a decode bench file (modes) or a decode sweep (points)."""
    if isinstance(result.get("modes"), dict):
        reference, modes = file_reference(result), result["modes"]
        own = (modes.get(reference) or {}).get("same_tokens_as_reference") if reference else None
        if reference and set(modes) == {reference}:
            return f"its only mode ({reference}) is its reference: compared with itself", None
        if own is not None:
            return None, f"the reference's row ({reference}) records a comparison with itself"
    if result.get("kind") == "decode sweep":
        reference = result.get("reference")
        own = [p for p in result.get("points", []) if p.get("mode") == reference
               and (p.get("result") or {}).get("same_tokens_as_reference") is not None]
        if own:
            return None, f"the reference's points ({reference}) record a comparison with themselves"
    return None, None


def result_files(folder: Path) -> list[Path]:
    """The plain files directly in folder, by name: its result files (and the pages the report writes).
    Subfolders are not read, the archive (ARCHIVE) among them."""
    return sorted(path for path in folder.iterdir() if path.is_file())


def audit(folder: Path) -> list[Finding]:
    """A Finding for each result file in folder with something to say, by name."""
    findings = []
    for path in result_files(folder):
        if path.suffix == ".txt":
            header = log_provenance(path)
            lacks = tuple(f for f in FIELDS if not _has(header, f)) if header is not None else \
                ("commit, command, device and torch fields (a text log without a `# provenance:` line: "
                 "its provenance is what its text says)",)
            if lacks:
                findings.append(Finding(path.name, lacks))
            continue
        if path.suffix != ".json":
            continue
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            findings.append(Finding(path.name, ("everything: not readable JSON",)))
            continue
        if not isinstance(data, dict):
            continue
        lacks = tuple(f for f in FIELDS if not _has(data, f))
        self_only, reference_row = _comparisons(data)
        if lacks or self_only or reference_row:
            findings.append(Finding(path.name, lacks, self_only, reference_row))
    return findings


def log_provenance(path: Path) -> dict | None:
    """A text log's provenance: its first line `# provenance: {JSON}` (scripts/gpu_tests.py writes
    it), or None where the first line is not that."""
    with path.open(errors="replace") as f:
        first = f.readline()
    if not first.startswith(LOG_PROVENANCE):
        return None
    try:
        data = json.loads(first[len(LOG_PROVENANCE):])
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def stale_names(folder: Path) -> set[str]:
    return {f.name for f in audit(folder) if f.stale}


def audit_section(folder: Path) -> str:
    """The audit's generated text: the stale files, then the files whose reference row alone is wrong."""
    findings = audit(folder)
    stale = [f for f in findings if f.stale]
    minor = [f for f in findings if not f.stale]
    lines = [f"Stale: {len(stale)} files lack a field (commit, command, device, torch) or compare a mode "
             f"only with itself; re-run them or move them to `{ARCHIVE}/`. Their figures are not evidence "
             "for a new claim.", "", "| file | what it lacks |", "| --- | --- |"]
    lines += [f"| `{f.name}` | {f.says()} |" for f in stale]
    lines += ["", f"Not stale: {len(minor)} files whose reference mode's own row (or points) records a "
              "comparison with itself, written before the bench stopped doing so; the report shows "
              "those rows as \"reference\", and the other rows' comparisons stand.", "",
              "| file | what it says |", "| --- | --- |"]
    lines += [f"| `{f.name}` | {f.says()} |" for f in minor]
    return "\n".join(lines + archive_section(folder)) + "\n"


def archived(folder: Path) -> list[tuple[str, str]]:
    """(name, what it lacks, as the audit says it; "-" for nothing) of each result file (.json, .txt)
    under folder/archive/, by name; none where there is no archive."""
    archive = folder / ARCHIVE
    if not archive.is_dir():
        return []
    says = {f.name: f.says() for f in audit(archive)}
    return [(path.name, says.get(path.name, "-")) for path in result_files(archive)
            if path.suffix in (".json", ".txt")]


def archive_section(folder: Path) -> list[str]:
    """The audit's lines on the archived files (none without an archive)."""
    files = archived(folder)
    if not files:
        return []
    lines = ["", f"Archived: {len(files)} files under `{ARCHIVE}/`, kept for the history that docs/notes "
             "cite, not evidence: the results log's tables leave them out, no figure of a page is backed "
             "by them, and they are not counted as stale above.", "",
             "| file | what it lacks |", "| --- | --- |"]
    return lines + [f"| `{name}` | {says} |" for name, says in files]


# ---- figures ------------------------------------------------------------------------------------


def figures(text: str) -> Iterator[tuple[str, str]]:
    """(number, unit) of each measured figure in text."""
    for match in FIGURE.finditer(text):
        yield match.group(1), match.group(2)


def _scalars(value) -> Iterator[float]:
    """The numbers of a JSON value, skipping those inside lists of numbers (samples)."""
    if isinstance(value, dict):
        for v in value.values():
            yield from _scalars(v)
    elif isinstance(value, list):
        for v in value:
            if isinstance(v, (dict, list)):
                yield from _scalars(v)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        yield float(value)


@dataclass
class Evidence:
    """What the result files say, as text (generated tables) and as numbers (JSON fields)."""
    texts: list[str]
    numbers: list[float]

    @classmethod
    def of(cls, folder: Path, generated: list[str]) -> Evidence:
        texts, numbers = list(generated), []
        for path in result_files(folder):  # the archive's files back nothing (ARCHIVE)
            if path.name in PAGES:
                continue
            if path.suffix in (".md", ".csv", ".txt"):
                texts.append(path.read_text())
            elif path.suffix == ".json":
                try:
                    numbers.extend(_scalars(json.loads(path.read_text())))
                except ValueError:
                    continue
        return cls(texts, numbers)

    def backs(self, number: str) -> bool:
        plain = number.replace(",", "")
        pattern = re.compile(rf"(?<![\d.,]){re.escape(number)}(?![\d])")
        if any(pattern.search(t) for t in self.texts):
            return True
        decimals = len(plain.split(".")[1])
        return any(f"{v:.{decimals}f}" == plain for v in self.numbers)


def unbacked_figures(text: str, evidence: Evidence) -> list[str]:
    """The figures of text ("12.3 ms") that the evidence does not back, in order, once each."""
    out: list[str] = []
    for number, unit in figures(text):
        figure = f"{number} {unit}"
        if figure not in out and not evidence.backs(number):
            out.append(figure)
    return out
