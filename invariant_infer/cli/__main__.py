"""``python -m invariant_infer.cli``: the ``invariant-infer`` command."""
import sys

from . import main

sys.exit(main())
