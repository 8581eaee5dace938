"""Where a model's steps run: ``Executor`` is what the engine and scoring hand each step to.

``LocalExecutor`` runs a model in this process. ``invariant_infer.parallel.TensorParallelRanks``
runs it on several ranks: rank 0 (this process) schedules, and each step's command runs on every
other rank too, in step. A command is a module-level function registered with ``worker_command``;
it travels to the other ranks by reference (its module and name, as pickle sends functions), and
each rank calls that function with its own ``RankState`` and the step's payload:

    @worker_command
    def _score_on_rank(rank: RankState, payload) -> None:
        score_here(rank.model, *payload)

    executor.collective_rpc(_score_on_rank, payload, lambda: score_here(executor.model, *payload))
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, TypeVar

from torch import nn

from .tensor_parallel import tp_size_of
from ..errors import InvalidArgumentError

T = TypeVar("T")
_WORKER_COMMANDS: set[Callable] = set()


@dataclass
class RankState:
    """What one rank keeps between commands: its shard of the model, and the state commands leave
    under a key (a model runner and its KV pages) until rank 0 releases that key."""
    model: nn.Module
    held: dict[int, Any] = field(default_factory=dict)


def worker_command(function: Callable[[RankState, Any], None]) -> Callable[[RankState, Any], None]:
    """Register ``function(rank_state, payload)`` as a command the other ranks may run. It must be
    a module-level function (it is sent by reference); its return value is not sent back."""
    if "<locals>" in function.__qualname__ or "<lambda>" in function.__qualname__:
        raise InvalidArgumentError(f"a worker command must be a module-level function, not {function.__qualname__}")
    _WORKER_COMMANDS.add(function)
    return function


def is_worker_command(function) -> bool:
    return function in _WORKER_COMMANDS


def check_worker_command(function) -> None:
    if not is_worker_command(function):
        raise InvalidArgumentError(f"{getattr(function, '__qualname__', function)!r} is not a worker command: "
                                   "register it with @worker_command")


class Executor(Protocol):
    """Runs a model's steps: on this process alone, or on every rank of a sharded model."""
    model: nn.Module                 # this process's (rank 0's) model
    tensor_parallel_size: int

    def collective_rpc(self, command: Callable[[RankState, Any], None], payload, local: Callable[[], T]) -> T:
        """Have every other rank run ``command(its RankState, payload)`` while this one runs
        ``local()``; returns ``local()``'s result once every rank has run its part."""

    def release(self, key: int) -> None:
        """State held under ``key`` (``RankState.held``) is no longer needed on any rank."""

    def close(self) -> None:
        """Stop whatever the executor started (other ranks); idempotent."""


class LocalExecutor:
    """One process: ``collective_rpc`` runs the local part only. For a model sharded by the
    caller's own launcher (torchrun), every process runs its own ``LocalExecutor`` in step."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.tensor_parallel_size = tp_size_of(model)

    def collective_rpc(self, command, payload, local: Callable[[], T]) -> T:
        check_worker_command(command)
        return local()

    def release(self, key: int) -> None:
        pass

    def close(self) -> None:
        pass


def executor_for(model: nn.Module, executor: Executor | None) -> Executor:
    """``executor`` (which must run ``model``), or one process on ``model``."""
    if executor is None:
        return LocalExecutor(model)
    if executor.model is not model:
        raise InvalidArgumentError("the executor runs another model: pass the executor's own model (e.g. ranks.model "
                                   "with executor=ranks)")
    return executor
