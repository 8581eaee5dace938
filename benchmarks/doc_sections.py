"""The generated sections of docs/benchmarks.md: each report rewrites the text between its own begin
and end markers, and nothing else."""
from __future__ import annotations

from pathlib import Path

DOC = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"


def replace_section(text: str, begin: str, end: str, doc: Path = DOC) -> None:
    """Put ``text`` (ending with a newline) between ``begin`` and ``end`` in ``doc``."""
    body = doc.read_text()
    if begin not in body:
        raise SystemExit(f"{doc} has no {begin} ... {end} section to replace")
    head, rest = body.split(begin, 1)
    doc.write_text(f"{head}{begin}\n{text}{end}{rest.split(end, 1)[1]}")
