"""Interpreted launches at the start of a fresh CPython frame-stack chunk.

CPython (3.11 and later) keeps Python frames in chunks of at least 16 KiB: a call that does not fit
in the current chunk maps a new one, and the return of the first frame in a chunk unmaps it. Triton's
interpreter makes many short calls per kernel program, so where the call depth of a launch swings
across a chunk's end, every swing maps a chunk, faults its first page in and unmaps it again. In the
test suite that cost a third of the CPU time (system time, page faults); which launches hit it depends
only on how deep the caller's stack happens to be.

``call_on_fresh_chunk`` calls through a frame too large for a 16 KiB chunk, so CPython maps a chunk
of its own for it (64 KiB), and the call's frames fill the ~31 KiB left behind it: one mapping per
launch, whatever the caller's depth. Older Pythons allocate each frame on the heap: it is a plain call.
"""
from __future__ import annotations

# 4200 locals: a frame larger than a 16 KiB chunk (2048 slots), so it always opens a chunk of its
# own; CPython sizes that chunk for the frame plus 1000 slots, doubling from 16 KiB: 64 KiB.
_LOCALS = 4200
_SOURCE = ("def call_on_fresh_chunk(fn, args, kwargs):\n"
           "    return fn(*args, **kwargs)\n"
           "    " + " = ".join(f"_{i}" for i in range(_LOCALS)) + " = None  # never runs: only sizes the frame\n")
_namespace: dict = {}
exec(compile(_SOURCE, __file__, "exec"), _namespace)
call_on_fresh_chunk = _namespace["call_on_fresh_chunk"]
call_on_fresh_chunk.__doc__ = "``fn(*args, **kwargs)``, its frames at the start of a fresh frame-stack chunk."
call_on_fresh_chunk.__module__ = __name__
