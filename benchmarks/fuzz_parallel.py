"""A fuzz's indices in N worker processes, split by index (worker k runs indices[k::N]).

``outcomes(work, args, indices, workers)`` yields ``(worker, item)`` for every item that
``work(args, indices)`` yields, in whatever order the workers produce them; callers aggregate
order-independently, so N workers give the same summary as one. With one worker, ``work`` runs
in this process. A worker that raises or dies stops every worker and raises ``WorkerFailed``;
so do Ctrl-C (workers ignore SIGINT and are terminated here) and SIGTERM. A worker whose parent
disappears (killed with SIGKILL) exits on its own within a second.
"""
from __future__ import annotations

import multiprocessing
import os
import queue
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence

JOIN_S = 5.0


class WorkerFailed(RuntimeError):
    pass


def outcomes(work: Callable, args, indices: Sequence[int], workers: int) -> Iterator[tuple[int, object]]:
    if workers <= 1:
        for item in work(args, list(indices)):
            yield 0, item
        return
    ctx = multiprocessing.get_context("spawn")  # no fork of a process that holds torch's threads
    results = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(work, args, list(indices[k::workers]), results, k, os.getpid()),
                         name=f"fuzz-worker-{k}", daemon=True) for k in range(workers)]
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        for p in procs:
            p.start()
        running = set(range(workers))
        while running:
            try:
                kind, k, payload = results.get(timeout=1.0)
            except queue.Empty:  # a worker flushes its last message before it exits
                dead = [k for k in running if not procs[k].is_alive()]
                if dead:
                    raise WorkerFailed(f"worker {dead[0]} exited with status {procs[dead[0]].exitcode} "
                                       "without finishing") from None
                continue
            if kind == "item":
                yield k, payload
            elif kind == "done":
                running.discard(k)
            else:
                raise WorkerFailed(f"worker {k} failed:\n{payload}")
    finally:
        signal.signal(signal.SIGTERM, previous)
        _stop(procs)
        results.close()


def _stop(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + JOIN_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def _worker(work, args, indices, results, k: int, parent: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the parent, which stops the workers
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
    try:
        for item in work(args, indices):
            results.put(("item", k, item))
        results.put(("done", k, None))
    except BaseException:
        results.put(("error", k, traceback.format_exc()))
    finally:
        results.close()
        results.join_thread()


def _exit_with_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def run_or_stop(tag: str, run: Callable, args, partial_out=None):
    """``run(args)``'s summary, or the exit status when it stopped: 2 when a worker failed, 130 on
    Ctrl-C / SIGTERM (every worker is stopped either way; ``partial_out`` keeps a partial summary)."""
    try:
        return run(args)
    except WorkerFailed as error:
        print(f"[{tag}] STOPPED: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"[{tag}] interrupted; every worker stopped" + (f", partial summary in {partial_out}" if partial_out
                                                               else ""), file=sys.stderr)
        return 130


def exit_status(tag: str, summary: dict, *, unequal: str, unit: str, groups: str, what: str,
                negative_control: bool) -> int:
    """A fuzz run's verdict on stderr and its exit status: 1 on any ``unequal`` count; with the
    negative control, 1 when it caught nothing. ``unit`` names what is compared (rows,
    requests), ``groups`` what is drawn (batchings, schedules), ``what`` the reference."""
    caught = summary[unequal]
    if negative_control:
        if caught == 0:
            print(f"[{tag}] NEGATIVE CONTROL FAILED: the batch-variant linear went undetected", file=sys.stderr)
            return 1
        print(f"[{tag}] negative control caught the batch-variant linear in {summary[groups + '_unequal']} "
              f"of {summary[groups]} {groups}", file=sys.stderr)
        return 0
    if caught:
        print(f"[{tag}] FAILED: {caught} {unit} differ from {what}; first: {summary['failures'][0]['replay']}",
              file=sys.stderr)
        return 1
    return 0
