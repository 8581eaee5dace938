"""One process per tensor-parallel rank, started and stopped from this one (rank 0):

    with TensorParallelRanks("ckpt", tensor_parallel_size=2) as ranks:
        engine = Engine(ranks.model, tokenizer)        # rank 0 schedules; every rank runs each step
        outputs = engine.generate(prompts, SamplingParams(max_tokens=16))
        scores = score_sequences(ranks.model, sequences)

Every rank loads the checkpoint with transformers' ``tp_plan="auto"`` and ``make_invariant``
(``invariant_infer.model.tensor_parallel``: the logits of one process, bitwise, at any supported size).
The ranks form a ``torch.distributed`` group (gloo on CPU, NCCL on CUDA; rendezvous through a file,
sockets on 127.0.0.1 only). Rank 0's model carries this object as its rank mirror: the engine and
scoring hand each step to ``call``, which sends the step's metadata (token ids, positions, KV
slots and pages, rows; a few KiB) to every other rank over a socket, runs the step here, and waits
for each rank's acknowledgement. Sampling, scheduling and the requests stay on rank 0.

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

import argparse
import atexit
import ctypes
import datetime
import os
import signal
import socket
import subprocess
import sys
import tempfile
import inspect
import threading
import time
import traceback
from multiprocessing.connection import Connection, wait
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM

from ..engine.model_runner import ModelRunner
from ..errors import TensorParallelError, UnsupportedModelError
from ..model.families import family_of
from ..checkpoints.loading import resolve_device, resolve_dtype
from ..model.patch import make_invariant
from ..scoring.core import score_batch_here
from ..model.tensor_parallel import RANK_MIRROR_ATTR, moe_refusal, tp_size_refusal

# A collective that waits this long for a peer that is alive but out of step raises. Dead peers
# are seen at once; this bounds only a live rank stuck elsewhere.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)
START_TIMEOUT_S = 1800.0      # a rank silent this long while it starts or loads has failed
STOP_TIMEOUT_S = 10.0         # the ranks asked to stop get this long, then SIGKILL
DEATH_NOTICE_S = 2.0          # after a failed step: how long to wait for a rank's exit to name it
PR_SET_PDEATHSIG = 1
WATCH_POLL_S = 0.5            # where pidfds are missing, the watchdog polls the ranks this often


class _Rank:
    """A worker process (``python -m invariant_infer.parallel.ranks``) and its socket."""

    def __init__(self, rank: int, config: dict):
        ours, theirs = socket.socketpair()
        command = [sys.executable, "-m", __name__, "--fd", str(theirs.fileno()), "--parent", str(os.getpid())]
        # The worker imports this package before it is sent sys.path: give it rank 0's path.
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        if config["device"] == "cpu":
            env["CUDA_VISIBLE_DEVICES"] = ""
        self.rank = rank
        self.read_lock = threading.Lock()  # one reader of the socket at a time (a call or the watchdog)
        self.exit_fd = None
        try:
            # Its own session: a signal to rank 0's process group (a terminal's Ctrl-C, a service
            # manager's SIGTERM) is rank 0's to handle; the worker ends with rank 0 in any case.
            self.process = subprocess.Popen(command, pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, env=env,
                                            start_new_session=True)
        finally:
            theirs.close()
        self.pid = self.process.pid
        self.pipe = Connection(ours.detach())
        try:
            self.exit_fd = os.pidfd_open(self.pid)  # readable once the process exits
        except (AttributeError, OSError):
            pass
        try:
            # sys.path first, so that rank_init (pickled by reference) unpickles there.
            self.pipe.send(list(sys.path))
            self.pipe.send({**config, "rank": rank})
        except BaseException:
            self.kill()
            self.close()
            raise

    @property
    def exitcode(self) -> int | None:
        return self.process.poll()

    def join(self, timeout: float) -> None:
        try:
            self.process.wait(max(0.0, timeout))
        except subprocess.TimeoutExpired:
            pass

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()

    def pending_error(self) -> str | None:
        """The error a dead worker sent before it exited, if it is there to read."""
        if not self.read_lock.acquire(blocking=False):
            return None
        try:
            while self.pipe.poll(0):
                reply = self.pipe.recv()
                if reply[0] == "error":
                    return reply[1]
        except (EOFError, OSError):
            pass
        finally:
            self.read_lock.release()
        return None

    def close(self) -> None:
        self.pipe.close()
        if self.exit_fd is not None:
            os.close(self.exit_fd)
            self.exit_fd = None


def check_tensor_parallel_size(path: str, size: int, device: torch.device) -> None:
    """Refuse, before any process starts, a size the model or the machine cannot serve."""
    if type(size) is not int or size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {size!r}")
    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as exc:
        raise OSError(f"cannot load the config of {path}: {exc}") from None
    problem = moe_refusal(family_of(config)) or tp_size_refusal(config, size)
    if problem:
        raise UnsupportedModelError(problem)
    if device.type == "cpu" and size > 1 and torch.cuda.is_available():
        raise UnsupportedModelError("tensor parallelism on cpu on a machine with CUDA GPUs: transformers shards onto "
                                    "the GPUs whatever the device; use device cuda, or hide the GPUs "
                                    "(CUDA_VISIBLE_DEVICES='')")
    if device.type == "cuda" and size > torch.cuda.device_count():
        raise UnsupportedModelError(f"tensor_parallel_size {size} needs {size} GPUs (one per rank); this machine "
                                    f"has {torch.cuda.device_count()}")


def _threads_per_rank(size: int) -> int:
    return max(1, len(os.sched_getaffinity(0)) // size)


def _start_rank(store_path: str, rank: int, size: int, device: torch.device, path: str, dtype: torch.dtype):
    _init_group(store_path, rank, size, device)
    return _load(path, dtype, rank, size)


def _init_group(store_path: str, rank: int, size: int, device: torch.device) -> None:
    # The ranks' sockets on the loopback interface only (the ranks are on this machine).
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    if device.type == "cuda":
        torch.cuda.set_device(rank)
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.FileStore(store_path, size), rank=rank, world_size=size,
                            timeout=COLLECTIVE_TIMEOUT)


def _from_pretrained_sharded(path: str, dtype: torch.dtype, size: int):
    """The rank's shard with the family's plan: ``DistributedConfig(tp_size=...)`` where
    transformers has it (5.17 on), else the older ``tp_plan="auto"``."""
    try:
        from transformers.distributed import DistributedConfig
        takes_size = "tp_size" in inspect.signature(DistributedConfig).parameters
    except (ImportError, TypeError, ValueError):
        takes_size = False
    if takes_size:
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype,
                                                    distributed_config=DistributedConfig(tp_size=size, tp_plan="auto"))
    return AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=dtype)


def _load(path: str, dtype: torch.dtype, rank: int, size: int):
    """The rank's shard: transformers reads the rank and the world size from the environment."""
    saved = {name: os.environ.get(name) for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(size))
    try:
        model = _from_pretrained_sharded(path, dtype, size).eval()
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    if (getattr(model, "_tp_size", None) or 1) != size:
        raise TensorParallelError(f"transformers loaded {path} at tensor-parallel size "
                                  f"{getattr(model, '_tp_size', None) or 1}, not {size}")
    return make_invariant(model)


class TensorParallelRanks:
    """Starts ``tensor_parallel_size - 1`` worker processes, joins them as rank 0 and loads the
    sharded invariant model on every rank (see the module's docstring). ``model`` is rank 0's:
    run it through ``Engine``, ``score_sequences`` and the other scoring functions, which run each
    step on every rank; a direct call of the model, its lm_head or its embedding on rank 0 alone
    is refused. One per process. On CPU every rank, this one included, gets an equal share of the
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
            raise RuntimeError("TensorParallelRanks starts its own process group, and this process has one already")
        self.size, self.on_failure = tensor_parallel_size, on_failure
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
        self.workers: list[_Rank] = []
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
                torch.set_num_threads(_threads_per_rank(tensor_parallel_size))
            if rank_init is not None:
                rank_init()
            self._collect("starting", START_TIMEOUT_S)  # every rank is up before any waits in the rendezvous
            self.model = self._unless_failed(lambda: _start_rank(store_path, 0, tensor_parallel_size, self.device,
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
        setattr(self.model, RANK_MIRROR_ATTR, self)
        for module in (self.model.model, self.model.get_output_embeddings(), self.model.get_input_embeddings()):
            if module is not None:
                module.register_forward_pre_hook(self._refuse_alone)
        self._started = True

    # ---- steps ---------------------------------------------------------------------------------

    def call(self, command: str, payload, local):
        """Have every other rank run ``command`` on ``payload`` while this one runs ``local()``;
        returns ``local()``'s result once every rank has acknowledged the step. A failure of any
        rank, or an exception in ``local()``, raises ``TensorParallelError`` and stops the ranks
        (the ranks would be out of step); KeyboardInterrupt and SystemExit stop them and go on."""
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
                self._collect(command)
            except TensorParallelError:
                raise
            except BaseException as exc:
                here = f"{type(exc).__name__}: {exc}"[:300]
                notice = self._death_notice()
                failure = self._fail(f"{notice}; rank 0's {command} then raised {here}" if notice
                                     else f"rank 0 failed in {command}: {here}")
                if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                    raise
                raise TensorParallelError(failure) from exc
            finally:
                self._in_call = False
            return result

    def release(self, runner_id: int) -> None:
        """A runner on rank 0 is gone: the other ranks drop theirs (and its KV pages) next step."""
        self._released.append(runner_id)

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
            raise TensorParallelError("rank 0's model of TensorParallelRanks runs only through Engine and the scoring "
                                      "functions (each step must run on every rank); a direct forward would wait "
                                      "for ranks that never join it")

    # ---- failures ------------------------------------------------------------------------------

    @staticmethod
    def _exit_notice(worker: _Rank, during: str | None = None) -> str:
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

    def _first_dead(self, excluding: _Rank | None = None) -> _Rank | None:
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
            for rank in range(1, self.size):
                self.workers.append(_Rank(rank, config))
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
                stop = ForkingPickler.dumps(("stop", None, []))
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


# ---- the other ranks ------------------------------------------------------------------------------

def _die_with_parent(parent_pid: int) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the pipe's end of file still ends the loop
        pass
    if os.getppid() != parent_pid:
        os._exit(1)


def _worker_main(pipe: Connection, parent_pid: int) -> None:
    """One rank: load the shard, then run each step rank 0 sends until it says stop (or its
    pipe closes: rank 0 is gone). A step that raises is reported to rank 0, and on stderr, and
    ends this rank."""
    _die_with_parent(parent_pid)
    # Rank 0 handles the signals (a drain on SIGTERM); this rank ends with rank 0 or when told.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        sys.path[:] = pipe.recv()
        config = pipe.recv()
    except (EOFError, OSError):
        os._exit(0)
    except BaseException as exc:  # noqa: BLE001  (rank_init that does not unpickle here)
        _fail_rank(pipe, f"{type(exc).__name__}: {exc}")
    path, store_path, rank, size = config["path"], config["store_path"], config["rank"], config["size"]
    device, dtype, rank_init = torch.device(config["device"]), config["dtype"], config["rank_init"]
    if device.type == "cpu":  # the ranks share the cores
        torch.set_num_threads(_threads_per_rank(size))
    try:
        if rank_init is not None:
            rank_init()
        _reply(pipe, ("ok",))  # started
        model = _start_rank(store_path, rank, size, device, path, dtype)
    except BaseException as exc:  # noqa: BLE001
        _fail_rank(pipe, f"{type(exc).__name__}: {exc}")
    _reply(pipe, ("ok",))  # loaded
    runners: dict[int, list] = {}  # rank 0's runner id -> [this rank's runner, its last hidden states]
    while True:
        try:
            command, payload, released = pipe.recv()
        except (EOFError, OSError):
            os._exit(0)
        if command == "stop":
            break
        for runner_id in released:
            runners.pop(runner_id, None)
        try:
            _run(model, runners, command, payload)
        except BaseException:  # noqa: BLE001
            _fail_rank(pipe, traceback.format_exc(limit=-4).strip())
        _reply(pipe, ("ok",))
    dist.destroy_process_group()


def _fail_rank(pipe, error: str) -> None:
    print(f"invariant-infer tensor-parallel rank (pid {os.getpid()}): {error}", file=sys.stderr, flush=True)
    _reply(pipe, ("error", error))
    os._exit(1)


def _reply(pipe, message) -> None:
    try:
        pipe.send(message)
    except (BrokenPipeError, ConnectionError, EOFError, OSError):
        os._exit(0)


def _run(model, runners: dict, command: str, payload) -> None:
    """The share of one step that this rank runs."""
    if command == "runner":
        runner_id, options = payload
        runners[runner_id] = [ModelRunner(model, **options), None]
    elif command == "forward":
        runner_id, metadata = payload
        entry = runners[runner_id]
        entry[1] = entry[0].forward(entry[0].load(metadata))
    elif command == "logits":
        runner_id, rows = payload
        runner, hidden = runners[runner_id]
        runner.logits_of(hidden, rows)
    elif command == "score_batch":
        sequences, prompt_lengths, chunk_rows = payload
        score_batch_here(model, sequences, prompt_lengths, chunk_rows=chunk_rows)
    else:
        raise ValueError(f"unknown command {command!r}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="one tensor-parallel rank, started by TensorParallelRanks")
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--parent", type=int, required=True)
    arguments = parser.parse_args()
    _worker_main(Connection(arguments.fd), arguments.parent)
