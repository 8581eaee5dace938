"""What ``--help`` prints: docstrings without reST markup, and the exit-status table."""
import re

from .exit_codes import MEANINGS


def plain(docstring: str) -> str:
    """A docstring as ``--help`` shows it: reST's double backticks dropped."""
    return re.sub(r"``([^`]*)``", r"\1", docstring)


def exit_status_epilog() -> str:
    return "exit status:\n" + "\n".join(f"  {code}  {meaning}" for code, meaning in MEANINGS.items())
