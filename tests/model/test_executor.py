"""The executor interface in one process: ``LocalExecutor`` runs the local part of a step and only
registered worker commands; an executor runs only its own model; a command must be a module-level
function (it travels to the other ranks by reference)."""
from __future__ import annotations

import pickle

import pytest
from torch import nn

from invariant_infer.model.executor import LocalExecutor, RankState, executor_for, is_worker_command, worker_command

calls = []


@worker_command
def _record(rank: RankState, payload) -> None:
    calls.append((rank.model, payload))


def _not_registered(rank: RankState, payload) -> None:
    calls.append(payload)


def test_local_executor_runs_the_local_part_of_a_registered_command():
    model = nn.Linear(2, 2)
    executor = LocalExecutor(model)
    assert executor.tensor_parallel_size == 1 and executor.model is model
    assert executor.collective_rpc(_record, "payload", lambda: "here") == "here"
    assert calls == []  # no other rank: the command runs nowhere else
    with pytest.raises(ValueError, match="not a worker command"):
        executor.collective_rpc(_not_registered, None, lambda: None)


def test_a_command_travels_by_reference_and_runs_where_it_arrives():
    command = pickle.loads(pickle.dumps(_record))
    assert command is _record and is_worker_command(command)
    command(RankState(model="shard"), 3)
    assert calls.pop() == ("shard", 3)


def test_a_command_must_be_a_module_level_function():
    with pytest.raises(ValueError, match="module-level function"):
        worker_command(lambda rank, payload: None)

    def local(rank, payload):
        return None
    with pytest.raises(ValueError, match="module-level function"):
        worker_command(local)


def test_an_executor_runs_only_its_own_model():
    model, other = nn.Linear(2, 2), nn.Linear(2, 2)
    executor = LocalExecutor(model)
    assert executor_for(model, executor) is executor
    assert isinstance(executor_for(other, None), LocalExecutor)
    with pytest.raises(ValueError, match="runs another model"):
        executor_for(other, executor)
