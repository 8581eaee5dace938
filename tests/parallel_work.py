"""Work functions for the worker-pool tests of benchmarks.fuzz_parallel: plain stdlib, so that the
spawned workers start fast. Each yields (index, pid) per index, as a fuzz yields an outcome."""
import os
import time


def squares(args, indices):
    for i in indices:
        yield {"index": i, "square": i * i, "pid": os.getpid()}


def fails_at_3(args, indices):
    for i in indices:
        if i == 3:
            raise ValueError("index 3 is poison")
        yield {"index": i, "pid": os.getpid()}
        time.sleep(0.2)


def forever(args, indices):
    """One item per worker, then runs until stopped."""
    yield {"index": indices[0], "pid": os.getpid()}
    while True:
        time.sleep(0.1)
