"""The ``invariant-infer`` command: ``demo`` (stock vs invariant drift) and ``score`` (scoring jobs)."""
from __future__ import annotations

import argparse
import sys

from . import demo, score, serve


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="invariant-infer", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo.add_parser(sub)
    score.add_parser(sub)
    serve.add_parser(sub)
    args = parser.parse_args(argv)
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
