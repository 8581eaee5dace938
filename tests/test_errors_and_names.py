"""One error hierarchy: every error class the package defines derives from ``InvariantInferError``
and from a built-in type callers already catch, is exported at the top level, and no module raises
a bare built-in error. The names users import exist where the docs say."""
from __future__ import annotations

import ast
import builtins
import importlib
from pathlib import Path

import pytest

import invariant_infer
from invariant_infer import errors

PACKAGE = Path(invariant_infer.__file__).parent
# Built-in exceptions a module may raise: attribute lookups (a module's __getattr__, a proxy's)
# and a missing optional dependency, which are not refusals of a request.
ALLOWED_BUILTINS = {"AttributeError", "ImportError"}
# Exception classes that never leave their module: control flow inside the server's streaming.
INTERNAL_CLASSES = {("server/streaming.py", "StreamStalled")}


def bare_builtin_raises(source: str) -> list[tuple[int, str]]:
    """(line, name) of each ``raise X(...)`` / ``raise X`` whose X is a built-in exception."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Raise) and node.exc is not None:
            target = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            name = target.id if isinstance(target, ast.Name) else None
            builtin = getattr(builtins, name, None) if name else None
            if isinstance(builtin, type) and issubclass(builtin, BaseException) and name not in ALLOWED_BUILTINS:
                found.append((node.lineno, name))
    return sorted(found)


def package_sources():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path.relative_to(PACKAGE).as_posix(), path.read_text()


def test_the_scan_finds_a_bare_builtin_raise():
    # negative control: the scan below would pass on anything if it found nothing here
    source = "def f(x):\n    if x:\n        raise ValueError('no')\n    raise KeyError\n"
    assert bare_builtin_raises(source) == [(3, "ValueError"), (4, "KeyError")]
    assert bare_builtin_raises("raise InvalidArgumentError('no')\nraise AttributeError('x')\n") == []


def test_no_module_raises_a_bare_builtin_error():
    offenders = [f"{rel}:{line} raises {name}" for rel, source in package_sources()
                 for line, name in bare_builtin_raises(source)]
    assert not offenders, "raise an invariant_infer.errors class instead:\n" + "\n".join(offenders)


def test_every_exception_class_derives_from_the_base():
    defined = []
    for rel, source in package_sources():
        module = "invariant_infer." + rel.removesuffix(".py").replace("/", ".").removesuffix(".__init__")
        for node in ast.parse(source).body:
            if isinstance(node, ast.ClassDef) and (rel, node.name) not in INTERNAL_CLASSES:
                cls = getattr(importlib.import_module(module), node.name)
                if isinstance(cls, type) and issubclass(cls, BaseException):
                    defined.append(cls)
    assert len(defined) >= len(errors.__all__)  # the scan saw the classes at all
    outside = [cls.__qualname__ for cls in defined if not issubclass(cls, invariant_infer.InvariantInferError)]
    assert not outside, outside


@pytest.mark.parametrize("name", errors.__all__)
def test_each_error_is_exported_at_the_top_and_is_also_a_builtin_type(name):
    cls = getattr(invariant_infer, name)
    assert cls is getattr(errors, name) and name in invariant_infer.__all__
    assert issubclass(cls, invariant_infer.InvariantInferError)
    if cls is not invariant_infer.InvariantInferError:
        assert any(base in cls.__mro__ for base in (ValueError, TypeError, RuntimeError, OSError)), cls.__mro__


def test_refusals_from_each_layer_are_caught_by_the_base():
    import torch

    from invariant_infer.engine import SamplingParams
    from invariant_infer.engine.speculative import SpeculativeConfig
    from invariant_infer.kernels import rms_norm
    from invariant_infer.scoring.core import check_sequence

    with pytest.raises(invariant_infer.InvariantInferError):  # a kernel
        rms_norm(torch.ones(2, 8), torch.ones(4), 1e-6)
    with pytest.raises(invariant_infer.InvariantInferError):  # scoring
        check_sequence([], 1, 10, 10)
    with pytest.raises(invariant_infer.InvariantInferError):  # speculative config
        SpeculativeConfig.from_value({"method": "ngram", "num_speculative_tokens": 2, "medusa_heads": 4})
    with pytest.raises(ValueError):  # and still the built-in type
        SpeculativeConfig.from_value({"method": "ngram", "num_speculative_tokens": 2, "medusa_heads": 4})
    assert SamplingParams(max_tokens=1)  # the engine's import is clean


def test_names_users_import():
    from invariant_infer import (generate_invariant, make_invariant, restore, score_sequences,  # noqa: F401
                                 seeded_sampling)
    from invariant_infer.engine import AsyncEngine, Engine, EngineBusyError, RequestError, SamplingParams  # noqa: F401
    from invariant_infer.kernels import attention, linear, rms_norm, token_logprobs  # noqa: F401
    from invariant_infer.parallel import TensorParallelRanks  # noqa: F401
    from invariant_infer.scoring import ScoreResult, score_sequences  # noqa: F401,F811
    from invariant_infer.training import token_logprobs as training_logprobs  # noqa: F401
    assert invariant_infer.InvariantInferError is errors.InvariantInferError
