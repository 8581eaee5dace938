"""The README's front door: what it is, install, use, the demo and the check on its first screen, and
no prose paragraph (a list item counts as one) over 120 words anywhere in it."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_WORDS = 120
FIRST_SCREEN = 50  # lines


def prose_paragraphs(markdown: str) -> list[str]:
    """Runs of prose lines outside code fences, tables, headings and comments; each list item starts one."""
    paragraphs, current, fenced = [], [], False

    def flush():
        if current:
            paragraphs.append(" ".join(current))
            current.clear()
    for line in markdown.splitlines():
        text = line.strip()
        if text.startswith("```"):
            fenced = not fenced
            flush()
        elif fenced or not text or text.startswith(("|", "#", "<!--")):
            flush()
        else:
            if re.match(r"([-*] |\d+\. )", text):
                flush()
            current.append(text)
    flush()
    return paragraphs


def long_paragraphs(markdown: str) -> list[str]:
    return [p[:80] + "..." for p in prose_paragraphs(markdown) if len(p.split()) > MAX_WORDS]


def test_no_readme_paragraph_is_over_120_words():
    assert not long_paragraphs((ROOT / "README.md").read_text())


def test_negative_control_a_long_paragraph_is_found_and_code_is_not():
    words = " ".join(["word"] * (MAX_WORDS + 1))
    assert long_paragraphs(f"# Title\n\n{words[:200]}\n{words[200:]}\n") != []
    assert long_paragraphs(f"- short\n- {words}\n") != []
    assert long_paragraphs(f"```\n{words}\n```\n\n| {words} |\n\n- short\n- item\n") == []


def test_the_first_screen_installs_uses_demos_and_checks():
    first = "\n".join((ROOT / "README.md").read_text().splitlines()[:FIRST_SCREEN])
    for needed in ("pip install", "make_invariant(", "invariant-infer demo", "invariant-infer check --model",
                   "audit(model)", "strict=True"):
        assert needed in first, f"{needed!r} is not in the README's first {FIRST_SCREEN} lines"
