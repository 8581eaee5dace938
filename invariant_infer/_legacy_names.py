"""The module names of releases before the package was laid out by layer, kept importable:
``import invariant_infer.patch`` gives ``invariant_infer.model.patch`` itself (the same module
object, so monkeypatching either name patches both), with a DeprecationWarning naming the new
path. Only names are listed here; each module is imported when its old name is."""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings

MOVED = {
    "patch": "model.patch", "hf_attention": "model.attention", "hf_experts": "model.experts",
    "padding": "model.padding", "packing": "model.packing", "tensor_parallel": "model.tensor_parallel",
    "families": "model.families", "random_checkpoints": "testing.random_checkpoints", "drift": "testing.drift",
    "loading": "checkpoints.loading", "sampling": "generation.sampling", "weight_update": "training.weight_update",
    "integrations": "training.integrations", "tensor_parallel_ranks": "parallel",
    "scoring_job": "scoring.job.run", "scoring_backends": "scoring.job.backends", "distributed": "scoring.job.ray",
    "scoring_cli": "cli.score", "serve_cli": "cli.serve", "demo": "cli.demo",
}
PACKAGE = __name__.rpartition(".")[0]


def new_name(fullname: str) -> str | None:
    """``invariant_infer.<old>[.<sub>]`` -> the module's name now, or None if it did not move."""
    head, _, rest = fullname.removeprefix(PACKAGE + ".").partition(".")
    if not fullname.startswith(PACKAGE + ".") or head not in MOVED:
        return None
    return f"{PACKAGE}.{MOVED[head]}" + (f".{rest}" if rest else "")


class _Alias(importlib.abc.Loader):
    def __init__(self, target: str):
        self.target = target

    def create_module(self, spec):
        module = importlib.import_module(self.target)
        self.spec = module.__spec__
        return module

    def exec_module(self, module):
        module.__spec__ = self.spec  # the import system set the old name's spec on it


class LegacyNameFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        moved = new_name(fullname)
        if moved is None:
            return None
        warnings.warn(f"{fullname} is now {moved}", DeprecationWarning, stacklevel=2)
        return importlib.machinery.ModuleSpec(fullname, _Alias(moved))


def names_of(module, package_name: str):
    """A package's ``__getattr__`` that gives every name of ``module``, which the package's name
    once held as a flat module (``invariant_infer.scoring`` was ``scoring/core.py``)."""
    def __getattr__(name: str):
        try:
            return getattr(module, name)
        except AttributeError:
            raise AttributeError(f"module {package_name!r} has no attribute {name!r}") from None
    return __getattr__


def install() -> None:
    if not any(isinstance(finder, LegacyNameFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, LegacyNameFinder())  # before the path finder, which would load a second copy
