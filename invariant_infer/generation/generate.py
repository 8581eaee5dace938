"""Deterministic, batch-invariant generation.

* ``make_invariant`` wraps ``model.generate`` per instance (``install_generate_checks``): options
  that would make a row's tokens depend on its batch-mates raise ``NonInvariantInputError``
  before any forward pass.
* ``seeded_sampling(seeds, temperature, top_k, top_p)`` samples without ``torch.multinomial``:
  each row adds Gumbel noise hashed from (its own seed, step, token id) to its filtered logits,
  and greedy decoding takes the argmax, which is an exact draw from the filtered softmax.
* ``generate_invariant(model, prompts, ...)`` left-pads prompts and calls ``generate``.

``max_length`` is accepted with padded prompts, as transformers treats it: it counts the padded
width, so it sets how many new tokens every row of the batch gets (all rows share one width), never
which tokens; each row's tokens are a prefix of what it generates alone. lm-evaluation-harness
passes ``max_length = padded width + max_gen_toks``, so every row gets ``max_gen_toks``. Use
``max_new_tokens`` for a count independent of the padding.

Why decode equals prefill: every kernel computes a row from that row alone, and attention walks
the same fixed-size KV blocks from each row's first real key whether it serves 1 query or many
(see ``invariant_infer.kernels.attention``).
"""
from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence

import torch
from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList, StaticCache

from ..errors import InvalidArgumentError, NonInvariantInputError
from ..model.checks import base_model
from ..model.input_checks import checked_call
from ..model.linear_attention import check_cache_continuation
from ..model.image_inputs import placeholder_token_ids
from ..model.padding import check_left_padded, left_pad
from ..model.patch import make_invariant, register_instance_extension
from .sampling import _MASK64, penalize_repetitions, seeded_scores_rows

_SEEDED_SAMPLING_HINT = ("use invariant_infer.generation.generate.seeded_sampling(seeds=[...], temperature=, top_k=, top_p=) "
                         "as generate(do_sample=False, logits_processor=...)")


# ---- seeded sampling -------------------------------------------------------------------------------

class SeededSampling(LogitsProcessor):
    """Temperature / top-k / top-p sampling as Gumbel-max, with one seed per row.

    Row ``i`` of the batch uses ``seeds[i]``; at generation step ``s`` its noise depends only on
    ``(seeds[i], s)``. Every operation reduces over that row's values alone (``seeded_scores_rows``),
    so neither the batch size nor the other rows can change a bit of it. Use with ``do_sample=False``:
    the greedy argmax of the returned scores is the sample. Steps count from this processor's first call in a
    ``generate``; the wrapped ``generate`` resets it, so the same list can be reused."""

    def __init__(self, seeds: Sequence[int], temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0):
        if not len(seeds):
            raise InvalidArgumentError("seeded sampling needs one seed per sequence")
        if not temperature > 0:
            raise InvalidArgumentError(f"temperature must be > 0 (use greedy decoding for 0), got {temperature}")
        if top_k < 0 or not 0.0 < top_p <= 1.0:
            raise InvalidArgumentError(f"need top_k >= 0 and 0 < top_p <= 1, got top_k={top_k}, top_p={top_p}")
        self.seeds = [int(seed) & _MASK64 for seed in seeds]
        self.temperature, self.top_k, self.top_p = float(temperature), int(top_k), float(top_p)
        self._first_length: int | None = None

    def reset(self) -> None:
        self._first_length = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if scores.shape[0] != len(self.seeds):
            raise NonInvariantInputError(f"seeded sampling has {len(self.seeds)} seeds for {scores.shape[0]} "
                                         "sequences; pass one seed per sequence (for several samples of one prompt, "
                                         "repeat the prompt with different seeds)")
        if self._first_length is None or input_ids.shape[1] < self._first_length:
            self._first_length = input_ids.shape[1]
        step = input_ids.shape[1] - self._first_length
        rows = len(self.seeds)  # every row at once, each as it is alone (the engine's sampler shares this)
        return seeded_scores_rows(scores, self.seeds, [step] * rows, [self.temperature] * rows, [self.top_k] * rows,
                                  [self.top_p] * rows)


class RowRepetitionPenalty(LogitsProcessor):
    """HF's repetition penalty (divide positive, multiply negative scores of tokens already in
    the sequence), applied to each row's own tokens only: its left padding is skipped, so the pad
    token is not penalised in padded rows. The wrapped ``generate`` puts it in place of HF's."""

    def __init__(self, penalty: float, pad_counts: Sequence[int]):
        if not penalty > 0:
            raise InvalidArgumentError(f"repetition_penalty must be > 0, got {penalty}")
        self.penalty, self.pad_counts = float(penalty), [int(c) for c in pad_counts]

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        out = scores.clone()
        for row, pads in enumerate(self.pad_counts):
            out[row] = penalize_repetitions(out[row], input_ids[row, pads:], self.penalty)
        return out


def seeded_sampling(seeds: Sequence[int], temperature: float = 1.0, top_k: int = 0,
                    top_p: float = 1.0) -> LogitsProcessorList:
    """``generate(..., do_sample=False, logits_processor=seeded_sampling([...]))`` samples each row
    with its own seed, identically in any batch."""
    return LogitsProcessorList([SeededSampling(seeds, temperature, top_k, top_p)])


# ---- input checks for generate ------------------------------------------------------------------------

def _option(options: dict, generation_config, name: str):
    if name in options:
        return options[name]
    return getattr(generation_config, name, None)


def _unsupported(options: dict, generation_config) -> str | None:
    """The first generate option that is not batch-invariant, as a message; None if all are fine."""
    def get(name):
        return _option(options, generation_config, name)

    if (get("num_beams") or 1) > 1 or (get("num_beam_groups") or 1) > 1:
        return "beam search is not supported (its hypothesis bookkeeping and cache reordering are not verified " \
               "batch-invariant); use greedy decoding or seeded sampling"
    if get("penalty_alpha"):
        return "contrastive search (penalty_alpha) is not supported"
    if get("dola_layers") is not None:
        return "DoLa decoding (dola_layers) is not supported"
    if (options.get("assistant_model") is not None or get("prompt_lookup_num_tokens") or get("assistant_early_exit")
            or get("use_mtp")):
        return "assisted / speculative decoding (an assistant model, prompt lookup, use_mtp: multi-token " \
               "prediction) is not supported; the engine's speculative decoding is exact"
    if options.get("custom_generate") is not None:
        return "custom_generate is not supported"
    if options.get("negative_prompt_ids") is not None or (get("guidance_scale") or 1.0) != 1.0:
        return "classifier-free guidance (guidance_scale, negative_prompt_ids) is not supported"
    if get("max_time") is not None:
        return "max_time stops on wall-clock time, which depends on the batch; use max_new_tokens"
    if get("watermarking_config") is not None:
        return "watermarking is not supported"
    cache_implementation = get("cache_implementation")
    if cache_implementation not in (None, "dynamic", "static"):
        return f"cache_implementation={cache_implementation!r} is not supported; use the default or 'static'"
    cache = options.get("past_key_values", options.get("cache"))
    if cache is not None and type(cache) not in (DynamicCache, StaticCache):
        return f"a {type(cache).__name__} is not supported; pass a DynamicCache, a StaticCache or no cache"
    return None


# Options that read the padded prompt length or the pad tokens themselves and so change which tokens
# a row gets. max_length is not one: it counts the padded width, which every row of a batch shares,
# so it only sets how many tokens all rows get (a prefix of each row's tokens alone).
def _unsupported_with_padding(options: dict, generation_config) -> str | None:
    def get(name):
        return _option(options, generation_config, name)

    if (get("min_length") or 0) > 0:
        return "min_length counts left padding; use min_new_tokens"
    if get("no_repeat_ngram_size"):
        return "no_repeat_ngram_size also counts n-grams made of pad tokens; unset it"
    return None


def _seeded_processors(logits_processor) -> list[SeededSampling]:
    return [p for p in (logits_processor or []) if isinstance(p, SeededSampling)]


def check_generate_options(model, options: dict) -> dict:
    """Validate ``generate`` options (by name) for batch invariance; return them, adjusted:
    ``do_sample`` is set to False when seeded sampling is used and the model's generation config
    samples, and the CUDA compile config keeps eager rounding (see ``invariant_compile_config``)."""
    options = dict(options)
    generation_config = options.get("generation_config") or model.generation_config
    problem = _unsupported(options, generation_config)
    if problem:
        raise NonInvariantInputError(f"generate: {problem}")

    seeded = _seeded_processors(options.get("logits_processor"))
    if seeded:
        if options.get("do_sample"):
            raise NonInvariantInputError(
                "generate: do_sample=True draws with torch.multinomial after seeded sampling; pass do_sample=False "
                "(the seeded processor already samples)")
        options["do_sample"] = False  # the seeded processor replaces HF's temperature/top-k/top-p and draw
        for processor in seeded:
            processor.reset()
    elif _option(options, generation_config, "do_sample"):
        raise NonInvariantInputError(
            "generate: do_sample=True samples with torch.multinomial over the whole batch, so a row's draw depends "
            f"on its batch-mates. For batch-invariant sampling {_SEEDED_SAMPLING_HINT}; for greedy decoding pass "
            "do_sample=False (the model's generation_config may set do_sample=True).")

    inputs = options.get("inputs")
    if inputs is None:
        inputs = options.get("input_ids")
    if inputs is None:
        inputs = options.get("inputs_embeds")
    mask = options.get("attention_mask")
    padded = False
    if mask is not None:
        padded = check_left_padded(mask)
    elif isinstance(inputs, torch.Tensor) and not inputs.is_floating_point():
        pad = _option(options, generation_config, "pad_token_id")
        if pad is not None and bool((inputs == pad).any()):
            raise NonInvariantInputError(
                "generate: input_ids contain pad_token_id but no attention_mask was passed; pass the "
                "attention_mask of left-padded prompts")
    if padded:
        problem = _unsupported_with_padding(options, generation_config)
        if problem:
            raise NonInvariantInputError(f"generate with padded prompts: {problem}")

    image_token = getattr(model.config, "image_token_id", None)
    if image_token is not None and options.get("image_grid_thw") is not None \
            and options.get("mm_token_type_ids") is None \
            and isinstance(inputs, torch.Tensor) and not inputs.is_floating_point():
        # Without them transformers gives image tokens text positions: derived as the model's forward does.
        options["mm_token_type_ids"] = (inputs == image_token).to(torch.int32)
    placeholders = placeholder_token_ids(model.config)
    if placeholders:  # a vision-language model never samples its image or video placeholders
        given = _option(options, generation_config, "suppress_tokens") or []
        options["suppress_tokens"] = list(dict.fromkeys([*given, *placeholders]))
    rows = inputs.shape[0] * (_option(options, generation_config, "num_return_sequences") or 1) \
        if isinstance(inputs, torch.Tensor) else None
    penalty = _option(options, generation_config, "repetition_penalty")
    if penalty is not None and penalty != 1.0:
        # Replace HF's processor, which would also penalise the pad token of padded rows.
        repeats = _option(options, generation_config, "num_return_sequences") or 1
        has_prompt_ids = isinstance(inputs, torch.Tensor) and not inputs.is_floating_point()
        if mask is not None and has_prompt_ids:
            pad_counts = (mask.shape[-1] - mask.to(torch.int64).sum(-1)).repeat_interleave(repeats).tolist()
        else:
            pad_counts = [0] * (rows or 0)
        options["repetition_penalty"] = 1.0
        options["logits_processor"] = LogitsProcessorList(
            [RowRepetitionPenalty(penalty, pad_counts), *(options.get("logits_processor") or [])])
    for processor in seeded:
        if rows is not None and rows != len(processor.seeds):
            raise NonInvariantInputError(f"seeded sampling has {len(processor.seeds)} seeds for {rows} sequences; "
                                         "pass one seed per sequence")

    cache = options.get("past_key_values", options.get("cache"))
    if cache is not None:  # a continued Gated DeltaNet state must not end in right padding
        check_cache_continuation(cache, None, 1)
    compiles = _option(options, generation_config, "cache_implementation") == "static" \
        or getattr(cache, "is_compileable", False)
    if compiles and model.device.type == "cuda" and "compile_config" not in options \
            and getattr(generation_config, "compile_config", None) is None:
        compile_config = invariant_compile_config()
        if compile_config is not None:
            options["compile_config"] = compile_config
    return options


def invariant_compile_config():
    """The config ``generate`` compiles decode steps with on CUDA (static cache): CUDA graphs, as HF's
    default ``reduce-overhead``, plus inductor's ``emulate_precision_casts``, which keeps eager's
    per-op rounding and turns off FMA contraction, so fused pointwise code (RoPE) matches the
    eager prefill bit for bit. None when this torch has no such switch."""
    import torch._inductor.config as inductor_config
    from transformers import CompileConfig

    if not hasattr(inductor_config, "emulate_precision_casts"):
        return None
    return CompileConfig(mode=None, options={"triton.cudagraphs": True, "emulate_precision_casts": True})


# ---- the per-instance generate wrapper ---------------------------------------------------------------

def _invariant_generate(model, *args, **kwargs):
    generate = type(model).generate
    bound = inspect.signature(generate).bind(model, *args, **kwargs)
    options = dict(bound.arguments)
    options.pop(next(iter(inspect.signature(generate).parameters)))  # self
    options.update(options.pop("kwargs", {}))
    options = check_generate_options(model, options)
    with checked_call(base_model(model)):  # checked here, once: no decode step reads values back to check them
        return generate(model, **options)


def install_generate_checks(model) -> None:
    """Shadow ``model.generate`` on this instance only with the checked version."""
    model.generate = functools.partial(_invariant_generate, model)


def remove_generate_checks(model) -> None:
    if isinstance(model.__dict__.get("generate"), functools.partial):
        del model.generate


def _install_if_generative(model) -> None:
    if hasattr(model, "generate"):
        install_generate_checks(model)


register_instance_extension(_install_if_generative, remove_generate_checks)


# ---- convenience -------------------------------------------------------------------------------------

def generate_invariant(model, prompts, tokenizer=None, *, max_new_tokens: int, seeds: Sequence[int] | None = None,
                       temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, **generate_kwargs):
    """Generate for a list of prompts (strings with ``tokenizer``, or token-id lists), left-padded.

    Greedy without ``seeds``; with ``seeds`` (one per prompt), seeded temperature/top-k/top-p
    sampling. Every row's tokens and logits are the same in any batch. Returns what ``generate`` does."""
    make_invariant(model)
    if tokenizer is not None and prompts and isinstance(prompts[0], str):
        prompts = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in prompts]
    pad_token_id = generate_kwargs.pop("pad_token_id", None)
    if pad_token_id is None and tokenizer is not None:
        pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad_token_id is None:
        pad_token_id = model.generation_config.pad_token_id or 0
    input_ids, attention_mask = left_pad(prompts, pad_token_id, model.device)
    processors = LogitsProcessorList(generate_kwargs.pop("logits_processor", None) or [])
    if seeds is not None:
        processors.extend(seeded_sampling(seeds, temperature, top_k, top_p))  # last: it samples
    if processors:
        generate_kwargs["logits_processor"] = processors
    return model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
                          do_sample=False, pad_token_id=pad_token_id, **generate_kwargs)
