"""One process per tensor-parallel rank, started and stopped from this one (rank 0):

    with TensorParallelRanks("ckpt", tensor_parallel_size=2) as ranks:
        engine = Engine(ranks.model, tokenizer)        # rank 0 schedules; every rank runs each step
        outputs = engine.generate(prompts, SamplingParams(max_tokens=16))
        scores = score_sequences(ranks.model, sequences)

Every rank loads the checkpoint with transformers' ``tp_plan="auto"`` and ``make_invariant``
(``invariant_infer.tensor_parallel``: the logits of one process, bitwise, at any supported size).
The ranks form a ``torch.distributed`` group (gloo on CPU, NCCL on CUDA; rendezvous through a file,
sockets on 127.0.0.1 only). Rank 0's model carries this object as its rank mirror: the engine and
scoring hand each step to ``call``, which sends the step's metadata (token ids, positions, KV
slots and pages, rows; a few KiB) to every other rank over a pipe, runs the step here, and waits
for each rank's acknowledgement. Sampling, scheduling and the requests stay on rank 0.

Failures are never a hang:
  * a rank that dies (killed, out of memory) is seen at once, by its socket and its pidfd:
    a step in flight raises ``TensorParallelError`` naming the rank (gloo's collectives return
    when a peer's socket closes), every other rank is stopped, and every later call raises it too;
    ``on_failure(message)`` is called once, from a watchdog thread, also when no step runs;
  * a step that raises on any rank breaks the ranks' lockstep: it is handled the same way;
  * the other ranks die with rank 0 (``PR_SET_PDEATHSIG`` and end of file on their pipe), and
    ``close()`` (or leaving the ``with`` block, or interpreter exit) stops them: no orphans.
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
import threading
import traceback
import warnings
from multiprocessing.connection import Connection, wait
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM

from .engine.model_runner import ModelRunner
from .errors import TensorParallelError, UnsupportedModelError
from .families import family_of
from .loading import resolve_device, resolve_dtype
from .patch import make_invariant
from .scoring import score_batch_here
from .tensor_parallel import RANK_MIRROR_ATTR, moe_refusal, tp_size_refusal

# A collective that waits this long for a peer that is alive but out of step raises. Dead peers
# are seen at once; this bounds only a live rank stuck elsewhere.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)
STOP_TIMEOUT_S = 10.0         # a rank asked to stop gets this long, then SIGKILL
DEATH_NOTICE_S = 2.0          # after a failed step: how long to wait for a rank's exit to name it
PR_SET_PDEATHSIG = 1
WATCH_POLL_S = 0.5            # where pidfds are missing, the watchdog polls the ranks this often


class _Rank:
    """A worker process (``python -m invariant_infer.tensor_parallel_ranks``) and its socket."""

    def __init__(self, rank: int, config: dict):
        ours, theirs = socket.socketpair()
        command = [sys.executable, "-m", __name__, "--fd", str(theirs.fileno()), "--parent", str(os.getpid())]
        self.rank = rank
        self.process = subprocess.Popen(command, pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL)
        theirs.close()
        self.pid = self.process.pid
        self.pipe = Connection(ours.detach())
        try:
            self.exit_fd = os.pidfd_open(self.pid)  # readable once the process exits
        except (AttributeError, OSError):
            self.exit_fd = None
        # sys.path first, so that rank_init (pickled by reference) unpickles there.
        self.pipe.send(list(sys.path))
        self.pipe.send({**config, "rank": rank})

    @property
    def exitcode(self) -> int | None:
        return self.process.poll()

    def join(self, timeout: float) -> None:
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()

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
    if device.type == "cuda" and size > torch.cuda.device_count():
        raise UnsupportedModelError(f"tensor_parallel_size {size} needs {size} GPUs (one per rank); this machine "
                                    f"has {torch.cuda.device_count()}")


def _init_group(store_path: str, rank: int, size: int, device: torch.device) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo's sockets on the loopback interface only
    if device.type == "cuda":
        torch.cuda.set_device(rank)
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.FileStore(store_path, size), rank=rank, world_size=size,
                            timeout=COLLECTIVE_TIMEOUT)


def _from_pretrained_sharded(path: str, dtype: torch.dtype, size: int):
    """``tp_plan="auto"``, which every transformers 5 release takes (later ones warn that it moves
    into ``distributed_config``, and take that too)."""
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*tp_plan.*deprecated", category=FutureWarning)
            return AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=dtype)
    except TypeError:
        from transformers.distributed import DistributedConfig
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype,
                                                    distributed_config=DistributedConfig(tp_size=size, tp_plan="auto"))


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
    step on every rank; a direct ``model(...)`` call on rank 0 alone is refused. One per process.

    ``rank_init``: a picklable function every rank calls first (before loading), e.g. to register
    custom code; ``on_failure(message)``: called once when the ranks fail."""

    def __init__(self, path: str, tensor_parallel_size: int, *, dtype: str | None = None,
                 device: str | None = None, rank_init=None, on_failure=None):
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        check_tensor_parallel_size(path, tensor_parallel_size, self.device)
        if dist.is_available() and dist.is_initialized():
            raise RuntimeError("TensorParallelRanks starts its own process group, and this process has one already")
        self.size, self.on_failure = tensor_parallel_size, on_failure
        self.failure: str | None = None
        self._started = False  # on_failure is for failures after the start (a failed start raises)
        self._lock = threading.Lock()  # one step at a time
        self._failure_lock = threading.Lock()
        self._closing = False
        self._in_call = False
        self._tmp = tempfile.TemporaryDirectory(prefix="invariant-infer-tp-")
        store_path = str(Path(self._tmp.name) / "rendezvous")
        config = dict(path=path, store_path=store_path, size=tensor_parallel_size, device=str(self.device),
                      dtype=self.dtype, rank_init=rank_init)
        self.workers: list[_Rank] = []
        atexit.register(self.close)
        self._wake_r, self._wake_w = socket.socketpair()
        try:
            for rank in range(1, tensor_parallel_size):
                self.workers.append(_Rank(rank, config))
        except BaseException:
            self.close()
            raise
        self.pipes = [worker.pipe for worker in self.workers]
        self._watchdog = threading.Thread(target=self._watch, name="invariant-infer-tp-watchdog", daemon=True)
        self._watchdog.start()
        try:
            if rank_init is not None:
                rank_init()
            self._collect("starting")  # every rank is up before any waits in the rendezvous
            _init_group(store_path, 0, tensor_parallel_size, self.device)
            self.model = _load(path, self.dtype, 0, tensor_parallel_size)
            self._collect("loading the model")
        except TensorParallelError:
            self.close()
            raise
        except BaseException as exc:
            self._fail(f"rank 0 failed loading {path}: {type(exc).__name__}: {exc}")
            self.close()
            raise TensorParallelError(self.failure) from exc
        setattr(self.model, RANK_MIRROR_ATTR, self)
        self.model.model.register_forward_pre_hook(self._refuse_alone)
        self._started = True

    # ---- steps ---------------------------------------------------------------------------------

    def call(self, command: str, payload, local):
        """Have every other rank run ``command`` on ``payload`` while this one runs ``local()``;
        returns ``local()``'s result once every rank has acknowledged the step. A failure of any
        rank raises ``TensorParallelError`` and stops the ranks."""
        with self._lock:
            if self.failure:
                raise TensorParallelError(self.failure)
            try:
                for pipe in self.pipes:
                    pipe.send((command, payload))
            except (BrokenPipeError, ConnectionError, EOFError, OSError):
                raise TensorParallelError(self._fail(self._death_notice() or f"a rank stopped before {command}")) \
                    from None
            self._in_call = True
            try:
                result = local()
            except BaseException as exc:
                here = f"{type(exc).__name__}: {exc}"[:300]
                notice = self._death_notice()
                message = self._fail(f"{notice}; rank 0's {command} then raised {here}" if notice
                                     else f"rank 0 failed in {command}: {here}")
                if isinstance(exc, (KeyboardInterrupt, SystemExit)):  # the ranks are stopped; the exit goes on
                    raise
                raise TensorParallelError(message) from exc
            finally:
                self._in_call = False
            self._collect(command)
            return result

    def _collect(self, command: str) -> None:
        """Wait for each rank's reply to the last message (a dead rank or an error reply fails)."""
        for worker in self.workers:
            try:
                reply = worker.pipe.recv()  # end of file as soon as the process is gone
            except (EOFError, OSError):
                reply = None
            if reply is not None and reply[0] == "ok":
                continue
            if reply is not None:
                raise TensorParallelError(self._fail(f"tensor-parallel rank {worker.rank} (pid {worker.pid}) failed "
                                                     f"in {command}: {reply[1]}"))
            worker.join(DEATH_NOTICE_S)
            raise TensorParallelError(self._fail(self._exit_notice(worker, command)))

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
        return f"tensor-parallel rank {worker.rank} (pid {worker.pid}) {how}" + (f" during {during}" if during else "")

    def _death_notice(self) -> str | None:
        """Which rank died, if one did or does within DEATH_NOTICE_S (a failed collective is
        usually a peer's death)."""
        for _ in range(int(DEATH_NOTICE_S / 0.1)):
            for worker in self.workers:
                if worker.exitcode is not None:
                    return self._exit_notice(worker)
            threading.Event().wait(0.1)
        return None

    def _fail(self, message: str) -> str:
        """Record the first failure, stop every other rank and tell ``on_failure``; returns the
        message the caller raises."""
        with self._failure_lock:
            first = self.failure is None
            if first:
                self.failure = f"{message}; every rank is stopped: start them again"
        for worker in self.workers:
            worker.kill()
        if first and self.on_failure is not None and self._started and not self._closing:
            self.on_failure(self.failure)
        return self.failure

    def _watch(self) -> None:
        """A rank's exit while the ranks run is a failure, seen within moments, also when idle."""
        fds = [w.exit_fd for w in self.workers]
        poll = None if all(fd is not None for fd in fds) else WATCH_POLL_S
        while not self._closing:
            wait([fd for fd in fds if fd is not None] + [self._wake_r], timeout=poll)
            if self._closing:
                return
            dead = [w for w in self.workers if w.exitcode is not None]
            if dead:
                self._fail(self._exit_notice(dead[0]))
                return

    # ---- shutdown -------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop every rank (a few seconds at most) and leave the process group; idempotent."""
        if self._closing:
            return
        self._closing = True
        atexit.unregister(self.close)
        if hasattr(self, "_wake_w"):
            self._wake_w.send(b"x")
        for worker in getattr(self, "workers", []):
            try:
                worker.pipe.send(("stop", None))
            except (BrokenPipeError, ConnectionError, EOFError, OSError):
                pass
        for worker in getattr(self, "workers", []):
            worker.join(STOP_TIMEOUT_S)
            worker.kill()
            worker.join(STOP_TIMEOUT_S)
            worker.close()
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001  (a group whose peers died may not shut down cleanly)
                pass
        self._tmp.cleanup()

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
    pipe closes: rank 0 is gone). A step that raises is reported to rank 0 and ends this rank."""
    _die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is rank 0's to handle
    try:
        sys.path[:] = pipe.recv()
        config = pipe.recv()
    except (EOFError, OSError):
        os._exit(0)
    except BaseException as exc:  # noqa: BLE001  (rank_init that does not unpickle here)
        _reply(pipe, ("error", f"{type(exc).__name__}: {exc}"))
        os._exit(1)
    path, store_path, rank, size = config["path"], config["store_path"], config["rank"], config["size"]
    device, dtype, rank_init = config["device"], config["dtype"], config["rank_init"]
    where = torch.device(device)
    if where.type == "cpu":  # the ranks share the cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    try:
        if rank_init is not None:
            rank_init()
        _reply(pipe, ("ok",))  # started
        _init_group(store_path, rank, size, where)
        model = _load(path, dtype, rank, size)
    except BaseException as exc:  # noqa: BLE001
        _reply(pipe, ("error", f"{type(exc).__name__}: {exc}"))
        os._exit(1)
    _reply(pipe, ("ok",))  # loaded
    state = {"runner": None, "hidden": None}
    while True:
        try:
            command, payload = pipe.recv()
        except (EOFError, OSError):
            os._exit(0)
        if command == "stop":
            break
        try:
            _run(model, state, command, payload)
        except BaseException:  # noqa: BLE001
            _reply(pipe, ("error", traceback.format_exc(limit=-4).strip()))
            os._exit(1)
        _reply(pipe, ("ok",))
    dist.destroy_process_group()


def _reply(pipe, message) -> None:
    try:
        pipe.send(message)
    except (BrokenPipeError, ConnectionError, EOFError, OSError):
        os._exit(0)


def _run(model, state: dict, command: str, payload) -> None:
    """The share of one step that this rank runs."""
    if command == "runner":
        state["runner"], state["hidden"] = ModelRunner(model, **payload), None
    elif command == "forward":
        runner = state["runner"]
        state["hidden"] = runner.forward(runner.load(payload))
    elif command == "logits":
        state["runner"].logits_of(state["hidden"], payload)
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
