"""The last resort after a rank's failure: gloo's collectives return when a peer dies, so a command
normally ends by itself; an NCCL collective waits for its timeout, and would hold the process.
``exit_later`` ends the process after a while whatever still runs."""
from __future__ import annotations

import os
import sys
import threading

FORCED_EXIT_AFTER_S = 15.0


def exit_later(code: int, message: str | None = None, after_s: float = FORCED_EXIT_AFTER_S) -> threading.Timer:
    """End the process with exit status ``code`` in ``after_s`` seconds (``message`` first, on
    stderr), unless it ends by itself before; returns the (daemon) timer, started."""
    def end() -> None:
        if message:
            print(message, file=sys.stderr, flush=True)
        os._exit(code)
    timer = threading.Timer(after_s, end)
    timer.daemon = True
    timer.start()
    return timer
