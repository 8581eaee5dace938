"""The other ranks' processes. ``WorkerProcess`` is rank 0's handle on one; the process itself
(``python -m invariant_infer.parallel.worker``, started by ``TensorParallelRanks``) loads its shard
and then runs, in a loop, the worker commands rank 0 sends (``invariant_infer.model.executor``):
each arrives as a reference to a registered module-level function, which it calls with this
rank's ``RankState`` and the step's payload. One file holds both ends of the socket's messages:
rank 0 sends sys.path, then the config, then ``(command, payload, released keys)`` per step;
the worker answers ``("ok",)`` or ``("error", text)``."""
from __future__ import annotations

import argparse
import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import traceback
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from ..model.executor import RankState, check_worker_command
from .loading import start_rank, threads_per_rank

PR_SET_PDEATHSIG = 1
STOP = None  # the command that ends a worker's loop


class WorkerProcess:
    """Rank 0's handle on one worker process (``python -m invariant_infer.parallel.worker``): the
    process, its socket and its pidfd."""

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


# ---- the worker process ---------------------------------------------------------------------------

def _die_with_parent(parent_pid: int) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the pipe's end of file still ends the loop
        pass
    if os.getppid() != parent_pid:
        os._exit(1)


def _worker_main(pipe: Connection, parent_pid: int) -> None:
    """One rank: load the shard, then run each worker command rank 0 sends until it says stop (or
    its pipe closes: rank 0 is gone). A command that raises (or that does not unpickle here) is
    reported to rank 0, and on stderr, and ends this rank."""
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
        torch.set_num_threads(threads_per_rank(size))
    try:
        if rank_init is not None:
            rank_init()
        _reply(pipe, ("ok",))  # started
        model = start_rank(store_path, rank, size, device, path, dtype)
    except BaseException as exc:  # noqa: BLE001
        _fail_rank(pipe, f"{type(exc).__name__}: {exc}")
    _reply(pipe, ("ok",))  # loaded
    state = RankState(model)
    while True:
        try:
            command, payload, released = pipe.recv()  # the command unpickles by reference: its module's function
        except (EOFError, OSError):
            os._exit(0)
        except BaseException:  # noqa: BLE001  (a command whose module does not import here)
            _fail_rank(pipe, traceback.format_exc(limit=-4).strip())
        if command is STOP:
            break
        for key in released:
            state.held.pop(key, None)
        try:
            check_worker_command(command)
            command(state, payload)
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


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="one tensor-parallel rank, started by TensorParallelRanks")
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--parent", type=int, required=True)
    arguments = parser.parse_args()
    _worker_main(Connection(arguments.fd), arguments.parent)
