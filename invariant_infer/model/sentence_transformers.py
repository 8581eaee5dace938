"""sentence-transformers models on the invariant kernels: ``make_invariant(SentenceTransformer(...))`` and
``make_invariant(CrossEncoder(...))`` patch the object in place and return it.

What changes, per instance:
  * each ``Transformer`` module's Hugging Face model goes through ``make_invariant``, and the module
    calls it through ``__call__`` (sentence-transformers calls ``model.forward``, which would skip the
    pre-forward hooks that derive positions from the mask and check the inputs);
  * each ``Pooling`` module pools with ``invariant_infer.model.pooling.pool`` in its configured
    mode(s), each ``Normalize`` with ``pooling.normalize``;
  * a ``CrossEncoder``'s ``torch.nn.Sigmoid`` activation runs as a kernel (torch's CPU sigmoid rounds
    an element differently in its vectorised body and its scalar tail, so by its place in the batch).
``LogitScore`` (a causal LM's yes/no logits) subtracts two logits, exact, and stays as it is. Any other
module (``Dense``, ``Router``, ``LayerNorm``, static embeddings ...) is refused by name, as are
pooling that excludes the prompt and packed (flattened) inputs. sentence_transformers is imported by
no module of this package: the objects are recognised by their classes' names and modules.
``restore`` undoes all of it.
"""
from __future__ import annotations

import functools
import threading
import types
from dataclasses import dataclass, field

import torch
from torch import nn

from ..errors import NonInvariantInputError, UnsupportedModelError
from ..kernels import sigmoid_mul
from .pooling import POOLING_MODES, normalize, pool

_STATE_ATTR = "_invariant_infer_sentence_transformers"
_ROOT_CLASSES = ("SentenceTransformer", "CrossEncoder")
_KEPT_MODULES = ("LogitScore",)


def _st_class_name(obj) -> str | None:
    """The class name of ``obj`` when its class is sentence-transformers' own (not a subclass)."""
    cls = type(obj)
    return cls.__name__ if cls.__module__.split(".")[0] == "sentence_transformers" else None


def is_sentence_transformers_model(obj) -> bool:
    """Whether ``obj``'s class or one of its bases is sentence-transformers' (a model or one of its modules)."""
    return any(c.__module__.split(".")[0] == "sentence_transformers" for c in type(obj).__mro__)


@dataclass
class SentenceTransformersPatch:
    """What ``patch_sentence_transformers`` changed; ``restore_sentence_transformers`` undoes it."""
    forwards: list = field(default_factory=list)    # (module, its instance-level forward before, or None)
    patched_models: list = field(default_factory=list)  # the Hugging Face models this patch made invariant
    activation: object = None                       # a CrossEncoder's activation_fn before (None: unchanged)


class InvariantSigmoid(nn.Module):
    """torch.nn.Sigmoid as a kernel: every element runs the same code wherever it sits in the batch."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sigmoid_mul(torch.ones_like(x), x)


def _root_name(obj) -> str:
    for cls in type(obj).__mro__:
        if cls.__module__.split(".")[0] == "sentence_transformers" and cls.__name__ in _ROOT_CLASSES:
            return cls.__name__
    raise UnsupportedModelError(
        f"{type(obj).__name__}: of sentence-transformers' objects, make_invariant takes a SentenceTransformer or a "
        "CrossEncoder (not sparse or multi-vector encoders, nor one of their modules: pass the whole model, or a "
        "Transformer module's auto_model)")


def _check_module(name: str, module: nn.Module) -> str:
    kind = _st_class_name(module)
    if kind == "Transformer":
        if getattr(module, "backend", "torch") != "torch":
            raise UnsupportedModelError(f"sentence-transformers module {name} (Transformer) runs the "
                                        f"{module.backend!r} backend; invariant inference needs the 'torch' backend")
        methods = {config.get("method") for config in getattr(module, "modality_config", {}).values()}
        if methods - {"forward"}:
            raise UnsupportedModelError(f"sentence-transformers module {name} (Transformer) calls the model's "
                                        f"{sorted(methods - {'forward'})}; only its forward is supported")
    elif kind == "Pooling":
        modes = (module.pooling_mode,) if isinstance(module.pooling_mode, str) else tuple(module.pooling_mode)
        unknown = [mode for mode in modes if mode not in POOLING_MODES]
        if unknown:
            raise UnsupportedModelError(f"sentence-transformers module {name} (Pooling): pooling mode(s) {unknown} "
                                        f"are not supported; supported: {POOLING_MODES}")
        if not module.include_prompt:
            raise UnsupportedModelError(f"sentence-transformers module {name} (Pooling) has include_prompt=False "
                                        "(prompt tokens excluded from pooling), which is not supported")
    elif kind not in ("Normalize", *_KEPT_MODULES):
        raise UnsupportedModelError(
            f"sentence-transformers module {name} ({type(module).__name__}) is not supported: invariant models "
            "take Transformer, Pooling, Normalize and LogitScore modules")
    return kind


def _pooling_forward(self, features: dict, **kwargs) -> dict:
    if "cu_seq_lens_q" in features:
        raise NonInvariantInputError("sentence-transformers' flattened (unpadded) inputs are not supported: load the "
                                     "model without flash attention so its inputs are padded")
    if "token_weights_sum" in features:
        raise NonInvariantInputError("Pooling with token_weights_sum is not supported")
    hidden = features["token_embeddings"]
    mask = features.get("attention_mask")
    if not isinstance(mask, torch.Tensor) or mask.shape[-1] != hidden.shape[1]:
        mask = None
    modes = (self.pooling_mode,) if isinstance(self.pooling_mode, str) else tuple(self.pooling_mode)
    pooled = [features["cls_token_embeddings"] if mode == "cls" and "cls_token_embeddings" in features
              else pool(hidden, mask, mode) for mode in modes]
    features["sentence_embedding"] = pooled[0] if len(pooled) == 1 else torch.cat(pooled, dim=-1)
    return features


def _normalize_forward(self, features: dict, **kwargs) -> dict:
    x = features.get(self.module_input_name)
    if x is not None:
        features[self.module_output_name] = normalize(x)
    return features


def _transformer_forward(self, features: dict, call_lock: threading.Lock, **kwargs) -> dict:
    """sentence-transformers' forward, with the model's ``forward`` looked up once as a function that
    calls the model through ``__call__``, so its pre-forward hooks run. ``call_lock``: the module's own
    (its model's forward is swapped for the duration of a call)."""
    model = self.auto_model
    with call_lock:
        previous = model.__dict__.get("forward")

        def put_back():
            if previous is None:
                model.__dict__.pop("forward", None)
            else:
                model.forward = previous

        def through_call(*args, **call_kwargs):
            put_back()
            return model(*args, **call_kwargs)

        model.forward = through_call
        try:
            return type(self).forward(self, features, **kwargs)
        finally:
            put_back()


_FORWARDS = {"Pooling": _pooling_forward, "Normalize": _normalize_forward, "Transformer": _transformer_forward}


def patch_sentence_transformers(obj: nn.Module, make_invariant, is_invariant, restore,
                                strict: bool = False) -> nn.Module:
    """Patch a SentenceTransformer or CrossEncoder in place; returns ``obj``. ``make_invariant``,
    ``is_invariant`` and ``restore`` are ``invariant_infer.model.patch``'s, for each Hugging Face model
    inside. Idempotent."""
    root = _root_name(obj)
    if getattr(obj, _STATE_ATTR, None) is not None:
        return obj
    kinds = {module: _check_module(name, module) for name, module in obj.named_children()}
    activation = getattr(obj, "activation_fn", None) if root == "CrossEncoder" else None
    if activation is not None and type(activation) not in (nn.Sigmoid, nn.Identity, InvariantSigmoid):
        raise UnsupportedModelError(f"CrossEncoder activation_fn {type(activation).__name__} is not supported: "
                                    "invariant cross-encoders take torch.nn.Sigmoid or torch.nn.Identity")
    state = SentenceTransformersPatch()
    try:
        for module, kind in kinds.items():
            if kind == "Transformer" and not is_invariant(module.auto_model):
                make_invariant(module.auto_model, strict=strict)
                state.patched_models.append(module.auto_model)
        for module, kind in kinds.items():
            if kind in _FORWARDS:
                state.forwards.append((module, module.__dict__.get("forward")))
                forward = _FORWARDS[kind]
                if kind == "Transformer":  # one lock per module
                    forward = functools.partial(forward, call_lock=threading.Lock())
                module.forward = types.MethodType(forward, module)
    except BaseException:
        _undo(state, restore)
        raise
    if type(activation) is nn.Sigmoid:
        state.activation = activation
        obj.activation_fn = InvariantSigmoid()
    setattr(obj, _STATE_ATTR, state)
    return obj


def _undo(state: SentenceTransformersPatch, restore=None) -> None:
    for module, previous in reversed(state.forwards):
        del module.forward
        if previous is not None:
            module.forward = previous
    if restore is not None:
        for model in state.patched_models:
            restore(model)


def restore_sentence_transformers(obj: nn.Module, restore) -> nn.Module:
    """Undo ``patch_sentence_transformers`` (``restore``: ``invariant_infer.model.patch``'s, for the
    Hugging Face models it patched); returns ``obj``."""
    state = getattr(obj, _STATE_ATTR, None)
    if state is None:
        return obj
    _undo(state, restore)
    if state.activation is not None:
        obj.activation_fn = state.activation
    delattr(obj, _STATE_ATTR)
    return obj


def sentence_transformers_patched(obj) -> bool:
    return getattr(obj, _STATE_ATTR, None) is not None
