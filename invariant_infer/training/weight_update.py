"""New weights for a loaded model, in place, from a checkpoint directory (``save_pretrained``'s
safetensors layout: ``model.safetensors``, or shards listed by ``model.safetensors.index.json``).

``plan_weight_update(model, path)`` opens the files and checks every tensor against the model
(names, shapes, dtypes) before anything is copied; ``WeightUpdate.apply()`` then copies them into
the model's own parameters and buffers under ``torch.no_grad()``, so every module, optimizer and
engine holding the model sees them. Floating-point tensors are cast to the model's dtype (as
``from_pretrained(dtype=...)`` casts them: bitwise the same values). Only tensors are read: the
model keeps its config, and a tokenizer is not reloaded.

    load_weights_from_disk(model, "ckpt/step-100")   # plan, then apply
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from ..errors import CheckpointError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
LISTED = 5  # names quoted per kind of problem
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}


def _quote(names) -> str:
    names = sorted(names)
    more = f" and {len(names) - LISTED} more" if len(names) > LISTED else ""
    return ", ".join(names[:LISTED]) + more


def _files_of(folder: Path) -> dict[str, Path]:
    """Tensor name -> the file holding it, as the index (or the single file) says."""
    if not folder.exists():
        raise CheckpointError(f"{folder} does not exist")
    if not folder.is_dir():
        raise CheckpointError(f"{folder} is not a directory")
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index} is not a safetensors index ({type(exc).__name__}: {exc})") from None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index}: 'weight_map' must map tensor names to file names")
        return {name: folder / file for name, file in weight_map.items()}
    if (folder / SINGLE_FILE).is_file():
        return {}  # every tensor of the one file
    raise CheckpointError(f"no {SINGLE_FILE} or {INDEX_FILE} in {folder} (only safetensors checkpoints, as "
                          "save_pretrained writes them, can be loaded)")


def _open(path: Path):
    if not path.is_file():
        raise CheckpointError(f"{path} is missing (listed in {INDEX_FILE})")
    try:
        return safe_open(str(path), framework="pt")
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from None


def _targets(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[int, list[str]]]:
    """Every state_dict entry by name, and the names of each distinct tensor (tied weights share one)."""
    entries = model.state_dict(keep_vars=True)
    names_of: dict[int, list[str]] = {}
    for name, tensor in entries.items():
        names_of.setdefault(id(tensor), []).append(name)
    return entries, names_of


@dataclass
class WeightUpdate:
    """A checked checkpoint: ``apply()`` copies it into the model."""
    copies: list[tuple[torch.Tensor, object, str]] = field(default_factory=list)  # (target, file handle, name)

    def apply(self) -> int:
        """Copy every tensor in place; returns how many model tensors were written."""
        with torch.no_grad():
            for target, handle, name in self.copies:
                target.copy_(handle.get_tensor(name))
        return len(self.copies)


def _dtype(handle, name: str) -> torch.dtype:
    code = handle.get_slice(name).get_dtype()
    if code not in DTYPES:
        raise CheckpointError(f"tensor {name} has the dtype {code}; supported: {', '.join(DTYPES)}")
    return DTYPES[code]


def plan_weight_update(model: nn.Module, path: str | Path) -> WeightUpdate:
    """Open the checkpoint at ``path`` and check it against ``model``; raises ``CheckpointError``
    naming every kind of problem found (missing, unexpected or wrongly shaped tensors, dtypes
    that cannot be cast). Copies nothing."""
    folder = Path(path)
    listed = _files_of(folder)
    located = {}  # tensor name -> the open file that holds it
    for file in sorted(set(listed.values())) or [folder / SINGLE_FILE]:
        handle = _open(file)
        for name in handle.keys():
            if not listed or listed.get(name) == file:
                located[name] = handle
    absent = [name for name, file in listed.items() if name not in located]
    if absent:
        raise CheckpointError(f"{INDEX_FILE} lists tensors its files do not hold: {_quote(absent)}")

    entries, names_of = _targets(model)
    ignored = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []]
    unexpected = [n for n in located if n not in entries and not any(p.search(n) for p in ignored)]
    missing, wrong_shape, wrong_dtype, differing_ties = [], [], [], []
    update = WeightUpdate()
    for names in names_of.values():
        target = entries[names[0]]
        present = [n for n in names if n in located]
        if not present:
            missing.append(" = ".join(names))
            continue
        fits = True
        for name in present:
            handle = located[name]
            shape = tuple(handle.get_slice(name).get_shape())
            dtype = _dtype(handle, name)
            if shape != tuple(target.shape):
                wrong_shape.append(f"{name} {list(shape)} (the model's is {list(target.shape)})")
                fits = False
            elif dtype != target.dtype and not (dtype.is_floating_point and target.dtype.is_floating_point):
                wrong_dtype.append(f"{name} {dtype} (the model's is {target.dtype})")
                fits = False
        if fits and len(present) > 1:
            first = located[present[0]].get_tensor(present[0])
            if any(not torch.equal(first, located[n].get_tensor(n)) for n in present[1:]):
                differing_ties.append(" = ".join(present))
        update.copies.append((target, located[present[0]], present[0]))
    problems = [f"{kind}: {_quote(names)}" for kind, names in (
        ("missing tensors", missing), ("unexpected tensors", unexpected), ("wrong shapes", wrong_shape),
        ("dtypes that cannot be cast", wrong_dtype), ("tied tensors that differ", differing_ties)) if names]
    if problems:
        raise CheckpointError(f"the checkpoint in {folder} does not match the model ({'; '.join(problems)}); "
                              "nothing was copied")
    return update


def load_weights_from_disk(model: nn.Module, path: str | Path) -> int:
    """Check the checkpoint at ``path`` against ``model``, then copy it in place; returns the number
    of tensors written. An engine on the model needs ``reset_prefix_cache()`` afterwards."""
    return plan_weight_update(model, path).apply()
