"""One process per tensor-parallel rank, started and stopped from this one (rank 0):

    with TensorParallelRanks("ckpt", tensor_parallel_size=2) as ranks:
        engine = Engine(ranks.model, tokenizer, executor=ranks)   # rank 0 schedules; every rank runs each step
        outputs = engine.generate(prompts, SamplingParams(max_tokens=16))
        scores = score_sequences(ranks.model, sequences, executor=ranks)

Every rank loads the checkpoint with transformers' ``tp_plan="auto"`` and ``make_invariant``
(``invariant_infer.model.tensor_parallel``: the logits of one process, bitwise, at any supported size).
The ranks form a ``torch.distributed`` group (gloo on CPU, NCCL on CUDA; rendezvous through a file,
sockets on 127.0.0.1 only). This object is the ranks' ``Executor`` (``invariant_infer.model.executor``):
the engine and scoring hand each step to ``collective_rpc``, which sends the step's worker command
(by reference) and metadata (token ids, positions, KV slots and pages, rows; a few KiB) to every
other rank over a socket, runs the step here, and waits for each rank's acknowledgement. Sampling,
scheduling and the requests stay on rank 0. The other ranks run ``invariant_infer.parallel.worker``.

Failures are never a hang:
  * a rank that dies (killed, out of memory) is seen at once, by its socket and its pidfd:
    a step in flight raises ``TensorParallelError`` naming the rank (gloo's collectives return
    when a peer's socket closes; an NCCL communicator is aborted), every other rank is stopped,
    and every later call raises it too; ``on_failure(message)`` is called once, also when no
    step runs;
  * a step that raises on any rank breaks the ranks' lockstep: it is handled the same way;
  * a failed start raises, naming the rank and its error, as soon as a rank fails;
  * the other ranks run in their own session, ignore SIGINT and SIGTERM (rank 0's to handle),
    and die with rank 0 (``PR_SET_PDEATHSIG``, and end of file on their socket); ``close()``
    (or leaving the ``with`` block, or interpreter exit) stops them: no orphans.
"""
from __future__ import annotations

import atexit
import os
import signal
import socket
import tempfile
import threading
import time
from multiprocessing.connection import wait
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import torch
import torch.distributed as dist

from ..checkpoints.loading import resolve_device, resolve_dtype
from ..errors import TensorParallelError
from ..model.executor import check_worker_command
from .loading import check_tensor_parallel_size, start_rank, threads_per_rank
from .worker import STOP, WorkerProcess

START_TIMEOUT_S = 1800.0      # a rank silent this long while it starts or loads has failed
STOP_TIMEOUT_S = 10.0         # the ranks asked to stop get this long, then SIGKILL
DEATH_NOTICE_S = 2.0          # after a failed step: how long to wait for a rank's exit to name it
WATCH_POLL_S = 0.5            # where pidfds are missing, the watchdog polls the ranks this often


def _step_name(command) -> str:
    return command.__name__.strip("_")


class TensorParallelRanks:
    """Starts ``tensor_parallel_size - 1`` worker processes, joins them as rank 0 and loads the
    sharded invariant model on every rank (see the module's docstring). It is the ranks'
    ``Executor``; ``model`` is rank 0's: pass both to ``Engine(ranks.model, tokenizer,
    executor=ranks)``, ``score_sequences(ranks.model, sequences, executor=ranks)`` and the other
    scoring functions, which run each step on every rank; a call of the model, its lm_head or its
    embedding on rank 0 alone (without ``executor=ranks``) is refused. One per process. On CPU every rank, this one included, gets an equal share of the
    cores (``torch.set_num_threads``, given back by ``close``).

    ``rank_init``: a picklable function every rank calls first (before loading), e.g. to register
    custom code; ``on_failure(message)``: called once when the ranks fail after the start, from the
    thread that saw it (the watchdog's, or the step's); a failed start raises ``TensorParallelError``."""

    def __init__(self, path: str, tensor_parallel_size: int, *, dtype: str | None = None,
                 device: str | None = None, rank_init=None, on_failure=None):
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        check_tensor_parallel_size(path, tensor_parallel_size, self.device)
        if dist.is_available() and dist.is_initialized():
            raise TensorParallelError("TensorParallelRanks starts its own process group, and this process has one "
                                      "already")
        self.tensor_parallel_size, self.on_failure = tensor_parallel_size, on_failure
        self.failure: str | None = None
        self._pid = os.getpid()  # a forked child inherits the atexit hook: close() is rank 0's only
        self._threads = torch.get_num_threads()  # given back by close()
        self._started = False
        self._lock = threading.Lock()  # one step at a time
        self._failure_lock = threading.Lock()
        self._closing = False
        self._in_call = False
        self._released: list[int] = []  # runners gone on rank 0, dropped on the others with the next step
        self._tmp = tempfile.TemporaryDirectory(prefix="invariant-infer-tp-")
        store_path = str(Path(self._tmp.name) / "rendezvous")
        config = dict(path=path, store_path=store_path, size=tensor_parallel_size, device=self.device.type,
                      dtype=self.dtype, rank_init=rank_init)
        self.workers: list[WorkerProcess] = []
        self._wake_r, self._wake_w = socket.socketpair()
        atexit.register(self.close)
        # The watchdog thread starts the workers and lives as long as they do: PR_SET_PDEATHSIG
        # fires when the thread that started a process ends, not the process.
        spawned, spawn_error = threading.Event(), []
        self._watchdog = threading.Thread(target=self._spawn_and_watch, args=(config, spawned, spawn_error),
                                          name="invariant-infer-tp-watchdog", daemon=True)
        self._watchdog.start()
        spawned.wait()
        if spawn_error:
            self.close()
            raise spawn_error[0]
        try:
            if self.device.type == "cpu":
                torch.set_num_threads(threads_per_rank(tensor_parallel_size))
            if rank_init is not None:
                rank_init()
            self._collect("starting", START_TIMEOUT_S)  # every rank is up before any waits in the rendezvous
            self.model = self._unless_failed(lambda: start_rank(store_path, 0, tensor_parallel_size, self.device,
                                                                 path, self.dtype))
            self._collect("loading the model", START_TIMEOUT_S)
        except TensorParallelError:
            self.close()
            raise
        except BaseException as exc:
            notice = self._death_notice()
            self._fail(notice or f"rank 0 failed loading {path}: {type(exc).__name__}: {exc}")
            self.close()
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            raise TensorParallelError(self.failure) from exc
        for module in (self.model.model, self.model.get_output_embeddings(), self.model.get_input_embeddings()):
            if module is not None:
                module.register_forward_pre_hook(self._refuse_alone)
        self._started = True

    # ---- steps ---------------------------------------------------------------------------------

    def collective_rpc(self, command, payload, local):
        """Have every other rank run the worker command ``command(its RankState, payload)`` while
        this one runs ``local()``; returns ``local()``'s result once every rank has acknowledged the
        step. A failure of any rank, or an exception in ``local()``, raises ``TensorParallelError``
        and stops the ranks (the ranks would be out of step); KeyboardInterrupt and SystemExit stop
        them and go on."""
        check_worker_command(command)
        step = _step_name(command)
        with self._lock:
            if self.failure:
                raise TensorParallelError(self.failure)
            released, self._released = self._released, []
            message = ForkingPickler.dumps((command, payload, released))  # once, before any rank gets it
            self._in_call = True
            try:
                for worker in self.workers:
                    worker.pipe.send_bytes(message)
                result = local()
                self._collect(step)
            except TensorParallelError:
                raise
            except BaseException as exc:
                here = f"{type(exc).__name__}: {exc}"[:300]
                notice = self._death_notice()
                failure = self._fail(f"{notice}; rank 0's {step} then raised {here}" if notice
                                     else f"rank 0 failed in {step}: {here}")
                if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                    raise
                raise TensorParallelError(failure) from exc
            finally:
                self._in_call = False
            return result

    def release(self, key: int) -> None:
        """State held under ``key`` (a runner on rank 0 that is gone): the other ranks drop theirs
        (and its KV pages) with the next step."""
        self._released.append(key)

    def _collect(self, command: str, timeout: float | None = None) -> None:
        """Wait for each rank's reply to the last message (a dead rank or an error reply fails;
        ``timeout``: a rank that says nothing for that long fails too)."""
        for worker in self.workers:
            with worker.read_lock:
                try:
                    if timeout is not None and not worker.pipe.poll(timeout):
                        raise TensorParallelError(self._fail(f"tensor-parallel rank {worker.rank} (pid {worker.pid}) "
                                                  f"said nothing for {timeout:.0f} s during {command}"))
                    reply = worker.pipe.recv()  # end of file as soon as the process is gone
                except (EOFError, OSError):
                    reply = None
            if reply is not None and reply[0] == "ok":
                continue
            if reply is not None:
                failed = f"tensor-parallel rank {worker.rank} (pid {worker.pid}) failed during {command}: {reply[1]}"
                first = self._first_dead(excluding=worker)  # a peer's death makes the others' collectives fail
                raise TensorParallelError(self._fail(f"{self._exit_notice(first)}; then {failed}" if first else failed))
            worker.join(DEATH_NOTICE_S)
            raise TensorParallelError(self._fail(self._exit_notice(worker, command)))

    def _unless_failed(self, start):
        """``start()`` in a helper thread, given up on as soon as a rank fails: a rendezvous or a
        collective whose peer died would otherwise wait for its timeout."""
        outcome: list = []

        def run() -> None:
            try:
                outcome.append((True, start()))
            except BaseException as exc:  # noqa: BLE001  (handed to the caller)
                outcome.append((False, exc))
        helper = threading.Thread(target=run, name="invariant-infer-tp-start", daemon=True)
        helper.start()
        while helper.is_alive():
            helper.join(0.1)
            if self.failure and helper.is_alive():
                raise TensorParallelError(self.failure)
        ok, value = outcome[0]
        if not ok:
            raise value
        return value

    def _refuse_alone(self, module, args):
        if not self._in_call:
            raise TensorParallelError("rank 0's model of TensorParallelRanks runs only through its executor, the "
                                      "ranks (each step must run on every rank; rank 0 alone would wait for ranks "
                                      "that never join it): pass executor=ranks, as in Engine(ranks.model, tokenizer, "
                                      "executor=ranks) and score_sequences(ranks.model, sequences, executor=ranks)")

    # ---- failures ------------------------------------------------------------------------------

    @staticmethod
    def _exit_notice(worker: WorkerProcess, during: str | None = None) -> str:
        code = worker.exitcode
        if code is None:
            how = "closed its connection"
        elif code < 0:
            how = f"was killed by {signal.Signals(-code).name}"
        else:
            how = f"exited with code {code}"
        notice = f"tensor-parallel rank {worker.rank} (pid {worker.pid}) {how}" + (f" during {during}" if during else "")
        error = worker.pending_error()
        return f"{notice}: {error}" if error else notice

    def _death_notice(self) -> str | None:
        """Which rank died, if one did or does within DEATH_NOTICE_S (a failed collective is
        usually a peer's death)."""
        deadline = time.monotonic() + DEATH_NOTICE_S
        while True:
            dead = self._first_dead()
            if dead is not None:
                return self._exit_notice(dead)
            if time.monotonic() > deadline:
                return None
            time.sleep(0.05)

    def _first_dead(self, excluding: WorkerProcess | None = None) -> WorkerProcess | None:
        """A rank that has exited, those killed by a signal first (the others' collectives then
        fail, and they exit with an error of their own)."""
        dead = [w for w in self.workers if w is not excluding and w.exitcode is not None]
        return min(dead, key=lambda w: (w.exitcode >= 0, w.rank), default=None)

    def _fail(self, message: str) -> str:
        """Record the first failure, stop every other rank and tell ``on_failure``; returns the
        message the caller raises."""
        with self._failure_lock:
            first = self.failure is None
            if first:
                self.failure = f"{message}; every rank is stopped: start them again"
        for worker in self.workers:
            worker.kill()
        if first and self.device.type == "cuda":
            # NCCL's collectives do not return when a peer dies; aborting the communicator makes
            # a step in flight raise (gloo's return by themselves).
            abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
            if abort is not None and dist.is_initialized():
                try:
                    abort()
                except Exception:  # noqa: BLE001  (the commands end in seconds all the same)
                    pass
        if first and self.on_failure is not None and self._started and not self._closing:
            self.on_failure(self.failure)
        return self.failure

    def _spawn_and_watch(self, config: dict, spawned: threading.Event, spawn_error: list) -> None:
        """Start the workers, then watch them: a rank's exit while the ranks run is a failure,
        seen within moments, also when idle."""
        try:
            for rank in range(1, self.tensor_parallel_size):
                self.workers.append(WorkerProcess(rank, config))
        except BaseException as exc:  # noqa: BLE001  (raised by the constructor)
            spawn_error.append(exc)
        finally:
            spawned.set()
        if spawn_error:
            return
        fds = [w.exit_fd for w in self.workers]
        poll = None if all(fd is not None for fd in fds) else WATCH_POLL_S
        while not self._closing:
            wait([fd for fd in fds if fd is not None] + [self._wake_r], timeout=poll)
            dead = self._first_dead()
            if self._closing or self.failure:
                break
            if dead is not None:
                # A step or the start reading this rank's socket names the failure with the
                # rank's own error; give it a moment, then name it here.
                deadline = time.monotonic() + DEATH_NOTICE_S
                while (self._in_call or not self._started) and not self.failure and time.monotonic() < deadline:
                    time.sleep(0.05)
                self._fail(self._exit_notice(self._first_dead()))
                break
        while not self._closing:  # until close(): the workers live as long as this thread
            wait([self._wake_r])

    # ---- shutdown -------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop every rank (STOP_TIMEOUT_S at most, then SIGKILL) and leave the process group;
        idempotent."""
        if self._closing or os.getpid() != self._pid:
            return
        self._closing = True
        atexit.unregister(self.close)
        idle = self._lock.acquire(timeout=STOP_TIMEOUT_S)  # a step in flight ends first
        try:
            if not idle:  # a step is stuck: kill the ranks under it
                for worker in self.workers:
                    worker.kill()
            elif self.failure is None:
                stop = ForkingPickler.dumps((STOP, None, []))
                for worker in self.workers:
                    try:
                        worker.pipe.send_bytes(stop)
                    except (BrokenPipeError, ConnectionError, EOFError, OSError):
                        pass
            deadline = time.monotonic() + STOP_TIMEOUT_S
            for worker in self.workers:
                worker.join(deadline - time.monotonic())
            for worker in self.workers:
                worker.kill()
                worker.join(STOP_TIMEOUT_S)
            try:
                self._wake_w.send(b"x")
            except OSError:
                pass
            self._watchdog.join(STOP_TIMEOUT_S)
            if idle:  # no other thread is reading the sockets
                for worker in self.workers:
                    worker.close()
                self._wake_r.close()
                self._wake_w.close()
            if dist.is_initialized():
                try:
                    dist.destroy_process_group()
                except Exception:  # noqa: BLE001  (a group whose peers died may not shut down cleanly)
                    pass
            self._tmp.cleanup()
            torch.set_num_threads(self._threads)
        finally:
            if idle:
                self._lock.release()

    def __enter__(self) -> TensorParallelRanks:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
