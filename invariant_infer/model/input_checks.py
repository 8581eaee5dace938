"""Where a forward's inputs are checked: once, at the entry point of the caller's call, never inside
the decoder's forward.

The checks that read tensor values (a mask with holes, real tokens' positions out of range, position_ids
that disagree with the mask, a cache continued after right padding, multimodal positions) sync with
the device. They run:
  * in a pre-hook on the model the caller calls (``model(...)`` on a causal LM), before its decoder
    runs, or, for a decoder called alone, in the decoder's own pre-hook;
  * for ``generate``, once at its entry (``checked_call``: left padding, checked there, and a mask
    that only grows keep every decode step valid), so no decode step reads anything back;
  * for the engine, at admission: its steps pass a ``sequence_bounds`` mask, which is never checked.
The decoder's pre-hook then derives positions without a host read. Two paths still read inside the
decoder: packed rows (their regrouped layout has a size that is a function of the values) and
multimodal positions that a vision-language model computes between its entry and its decoder.
"""
from __future__ import annotations

import contextlib
import contextvars
import inspect

import torch
from torch import nn

from ..errors import NonInvariantInputError
from .linear_attention import check_cache_continuation
from .module_state import state_of
from .packing import FLASH_KWARGS
from .padding import cache_length, check_multimodal_positions, is_sequence_bounds, resolve_positions

_FORWARD_NAMES: dict[type, list[str]] = {}

# The decoders whose calls now running in this thread (or asyncio task) were checked at their entry
# point, and those running a ``generate`` call checked at its entry: per thread, so a call another
# thread makes on the same model at the same time is checked on its own.
_CHECKED_AT_ENTRY: contextvars.ContextVar[tuple[nn.Module, ...]] = contextvars.ContextVar(
    "invariant_infer_checked_at_entry", default=())
_GENERATING: contextvars.ContextVar[tuple[nn.Module, ...]] = contextvars.ContextVar(
    "invariant_infer_generating", default=())


def _entering(calls: contextvars.ContextVar, base: nn.Module) -> None:
    calls.set(calls.get() + (base,))


def _leaving(calls: contextvars.ContextVar, base: nn.Module) -> None:
    """Drop the latest entry of ``base`` (calls nest: the latest is the one ending)."""
    running = calls.get()
    for i in range(len(running) - 1, -1, -1):
        if running[i] is base:
            calls.set(running[:i] + running[i + 1:])
            return


def _running(calls: contextvars.ContextVar, base: nn.Module) -> bool:
    return any(module is base for module in calls.get())


def bind_forward_arguments(module: nn.Module, args: tuple, kwargs: dict) -> dict:
    """The forward's arguments by name (positional ones bound by the forward's signature, once per class)."""
    if not args:
        return dict(kwargs)
    cls = type(module)
    if cls not in _FORWARD_NAMES:
        _FORWARD_NAMES[cls] = [n for n in inspect.signature(cls.forward).parameters if n != "self"]
    return {**dict(zip(_FORWARD_NAMES[cls], args)), **kwargs}


def max_positions_of(base: nn.Module) -> int:
    return state_of(base.rotary_emb).rope_tables[0].shape[0]


def check_inputs(base: nn.Module, kwargs: dict) -> None:
    """Raise ``NonInvariantInputError`` for inputs no row of which can be invariant (one host sync for
    the padding checks); warn for position_ids that disagree with the mask. ``kwargs``: the call's
    arguments by name. Packed rows (no mask) are checked where their layout is built (``packing``)."""
    tokens = kwargs.get("input_ids")
    if tokens is None:
        tokens = kwargs.get("inputs_embeds")
    mask = kwargs.get("attention_mask")
    if tokens is None or is_sequence_bounds(mask):
        return
    max_positions = max_positions_of(base)
    position_ids = kwargs.get("position_ids")
    if isinstance(position_ids, torch.Tensor) and position_ids.dim() == 3:
        check_multimodal_positions(mask, position_ids, max_positions)
        if state_of(base.rotary_emb).mrope_axes is None:
            check_text_sections(position_ids)
    elif mask is not None:
        resolve_positions(mask, position_ids, query_length=tokens.shape[1], cache_length=cache_length(kwargs),
                          max_positions=max_positions, check=True)
    elif position_ids is None and not any(kwargs.get(name) is not None for name in FLASH_KWARGS):
        # Positions are the columns after the cache (packed rows are checked where their layout is built).
        _refuse_past_positions(cache_length(kwargs) + tokens.shape[1], max_positions)
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if cache is not None:
        check_cache_continuation(cache, mask if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None,
                                 tokens.shape[1])


def check_text_sections(position_ids: torch.Tensor) -> None:
    """A text-only multimodal rope (Qwen3.5) takes [3 or 4, B, L] positions whose rope sections are equal."""
    sections = position_ids[1:] if position_ids.shape[0] == 4 else position_ids
    if not bool((sections == sections[:1]).all()):
        raise NonInvariantInputError("multimodal rotary positions (images, videos) are not supported yet; "
                                     "pass text only")


def generating(base: nn.Module) -> bool:
    """Whether a ``generate`` call checked at its entry is running through ``base`` in this thread."""
    return _running(_GENERATING, base)


def checked_at_entry(base: nn.Module) -> bool:
    """Whether the call now running through ``base`` in this thread was checked at its entry point."""
    return _running(_CHECKED_AT_ENTRY, base)


def install_entry_checks(model: nn.Module, base: nn.Module) -> list:
    """Hooks on ``model`` (the model the caller calls, around ``base``) that check each call's inputs
    before the decoder runs; returns their handles."""

    def enter(module, args, kwargs):
        if torch.compiler.is_compiling():  # traced decode: generate() checked up front
            return
        _entering(_CHECKED_AT_ENTRY, base)  # ``leave`` runs even when a check raises
        kwargs = bind_forward_arguments(module, args, kwargs)
        if generating(base):
            _check_generate_step(base, kwargs)
        else:
            check_inputs(base, kwargs)

    def leave(module, args, output):
        if not torch.compiler.is_compiling():
            _leaving(_CHECKED_AT_ENTRY, base)
    return [model.register_forward_pre_hook(enter, with_kwargs=True),
            model.register_forward_hook(leave, always_call=True)]


def _check_generate_step(base: nn.Module, kwargs: dict) -> None:
    """A forward of a ``generate`` checked at its entry: only whether it could reach a position past the
    rope table. Positions counted from a left-padded mask lie below its width, and without a mask they
    are the columns after the cache, so host-side sizes bound them; only past that bound are values read."""
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        if mask.shape[-1] > max_positions_of(base):
            check_inputs(base, kwargs)
        return
    tokens = kwargs.get("input_ids")
    if tokens is None:
        tokens = kwargs.get("inputs_embeds")
    _refuse_past_positions(cache_length(kwargs) + (tokens.shape[1] if tokens is not None else 0),
                           max_positions_of(base))


def _refuse_past_positions(total: int, max_positions: int) -> None:
    if total > max_positions:
        raise NonInvariantInputError(f"sequence of {total} positions is longer than max_position_embeddings "
                                     f"({max_positions})")


@contextlib.contextmanager
def checked_call(base: nn.Module):
    """A ``generate`` call whose inputs were checked at its entry: its forwards are not checked again
    (unless a step could reach past the positions the rope table holds)."""
    _entering(_GENERATING, base)
    try:
        yield
    finally:
        _leaving(_GENERATING, base)
