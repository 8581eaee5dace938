"""``python -m invariant_infer.cli``: the ``invariant-infer`` command (as the tests and benchmarks run it)."""
import sys

from . import main

sys.exit(main())
