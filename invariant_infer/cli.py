"""The ``invariant-infer`` command: ``demo`` (stock vs invariant drift) and ``score`` (scoring jobs)."""
from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="invariant-infer", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    from . import demo
    demo.add_parser(sub)
    try:
        from . import scoring_cli
    except ImportError:  # scoring lands separately
        scoring_cli = None
    if scoring_cli is not None:
        scoring_cli.add_parser(sub)
    args = parser.parse_args(argv)
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
