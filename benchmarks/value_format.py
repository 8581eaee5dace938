"""How the reports write one value in a Markdown cell; no torch import, so the GPU check's runner
can use it before any section has run."""
from __future__ import annotations

import math


def fmt(value) -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "**no**"
    if isinstance(value, float):
        if value == 0:
            return "0"
        if not math.isfinite(value):
            return str(value)
        return f"{value:.3g}" if abs(value) < 1e5 else f"{value:.3e}"
    if isinstance(value, (list, tuple)):
        return "/".join(map(str, value)) if len(value) <= 8 else f"{len(value)} rows"
    return str(value)
