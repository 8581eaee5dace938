"""The ``invariant-infer`` command:

- ``demo``: one model stock and invariant, a batch against each row alone;
- ``score``: reproducible per-token logprobs and digests for a JSONL file;
- ``serve``: an OpenAI-compatible HTTP server over the continuous-batching engine;
- ``check``: whether a checkpoint is batch-invariant on this machine (the audit and a bitwise probe).

``invariant-infer COMMAND --help`` describes each."""
from __future__ import annotations

import argparse
import sys

from . import check, demo, score, serve
from .help_text import exit_status_epilog, plain


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="invariant-infer", description=plain(__doc__),
                                     epilog=exit_status_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo.add_parser(sub)
    score.add_parser(sub)
    serve.add_parser(sub)
    check.add_parser(sub)
    args = parser.parse_args(argv)
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
