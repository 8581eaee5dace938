"""Tensor-parallel loading: the sizes a model and the machine can serve, and one rank's start (its
place in the ``torch.distributed`` group, then its shard of the invariant model). Rank 0
(``supervisor``) and every other rank (``worker``) start the same way."""
from __future__ import annotations

import datetime
import inspect
import os

import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM

from ..errors import CheckpointLoadError, InvalidArgumentError, TensorParallelError, UnsupportedModelError
from ..model.families import family_of
from ..model.kinds import config_kinds
from ..model.patch import make_invariant
from ..model.support import require
from ..model.tensor_parallel import tp_size_of, tp_size_refusal

# A collective that waits this long for a peer that is alive but out of step raises. Dead peers
# are seen at once; this bounds only a live rank stuck elsewhere.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)


def check_tensor_parallel_size(path: str, size: int, device: torch.device) -> None:
    """Refuse, before any process starts, a size the model or the machine cannot serve."""
    if type(size) is not int or size < 1:
        raise InvalidArgumentError(f"tensor_parallel_size must be a positive integer, got {size!r}")
    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as exc:
        raise CheckpointLoadError(f"cannot load the config of {path}: {exc}") from None
    family_of(config)  # an unsupported family is refused as make_invariant refuses it
    require(config_kinds(config), "tensor_parallel", config.model_type)
    problem = tp_size_refusal(config, size)
    if problem:
        raise UnsupportedModelError(problem)
    if device.type == "cpu" and size > 1 and torch.cuda.is_available():
        raise UnsupportedModelError("tensor parallelism on cpu on a machine with CUDA GPUs: transformers shards onto "
                                    "the GPUs whatever the device; use device cuda, or hide the GPUs "
                                    "(CUDA_VISIBLE_DEVICES='')")
    if device.type == "cuda" and size > torch.cuda.device_count():
        raise UnsupportedModelError(f"tensor_parallel_size {size} needs {size} GPUs (one per rank); this machine "
                                    f"has {torch.cuda.device_count()}")


def threads_per_rank(size: int) -> int:
    return max(1, len(os.sched_getaffinity(0)) // size)


def start_rank(store_path: str, rank: int, size: int, device: torch.device, path: str, dtype: torch.dtype):
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
    if tp_size_of(model) != size:
        raise TensorParallelError(f"transformers loaded {path} at tensor-parallel size {tp_size_of(model)}, not {size}")
    return make_invariant(model)
