"""The engine: requests in, tokens, logprobs and text out, each bitwise a function of its own request.

    engine = Engine(model, tokenizer)                 # wraps the model with make_invariant
    outputs = engine.generate(["The capital of France is"], SamplingParams(max_tokens=16))
    scores = engine.score([[1, 2, 3, 4]])              # == score_sequences(model, ...)

``add_request`` / ``step`` / ``abort`` drive it one step at a time (a server does);
``generate`` and ``score`` run until their requests finish. Each request's outputs are of its
``SamplingParams.output_kind``: cumulative (the default), deltas, or the final one only.

``Engine`` holds a core (``engine.core``, ``core.py``: token ids in, ``SequenceDelta``s out) and a
frontend (``engine.frontend``, ``frontend.py``): the frontend encodes text prompts and images, and an
``OutputProcessor`` per request decodes the text, applies stop strings and builds its outputs.
``AsyncEngine`` drives the same core through the same frontend, on its engine thread.

Besides its methods, an engine shows these of its core, read-only: ``model``, ``tokenizer``,
``vocab_size``, ``max_positions``, ``tensor_parallel_size`` and ``page_bytes`` (the bytes of one KV
page, to size ``kv_cache_memory``). The core's state (``engine.core.scheduler``, ``.blocks`` with the
KV pages and prefix-cache counters, ``.runner``, ``.sequences``, ``.speculative`` with its stats,
``.loras``, ``.timer``) is the core's.
"""
from __future__ import annotations

import dataclasses

import torch
from tqdm import tqdm

from ..errors import InvalidArgumentError, RequestError, RequestFailedError
from ..scoring.core import ScoreResult
from .core import EngineCore
from .frontend import Frontend
from ..model.image_inputs import expanded_position
from .output import OutputProcessor, RequestOutput
from .sampling_params import RequestOutputKind, SamplingParams


def _core_value(name: str) -> property:
    """The engine's read-only view of its core's attribute ``name``."""
    return property(lambda engine: getattr(engine.core, name), doc=f"``EngineCore.{name}`` (read-only).")


class Engine:
    """Continuous batching over one causal LM, with text (see the module's docstring); ``options``
    are ``EngineCore``'s: max_num_seqs, max_num_batched_tokens, kv_cache_memory,
    enable_prefix_caching, kernels, decode_buckets, executor, speculative, max_loras, max_lora_rank,
    cuda_graphs."""

    def __init__(self, model, tokenizer=None, **options):
        """``tokenizer``: the model's tokenizer, or a vision-language model's processor (its ``image_processor``
        and ``tokenizer``), through which requests with images go (``Frontend.prepare_images``)."""
        processor = tokenizer if hasattr(tokenizer, "image_processor") else None
        self.core = EngineCore(model, getattr(tokenizer, "tokenizer", None) if processor is not None else tokenizer,
                               **options)
        self.frontend = Frontend(self.core, processor)
        self.processors: dict[str, OutputProcessor] = {}  # of the requests add_request queued

    # ---- the core's, read-only (see the module's docstring) ----------------------------------------

    model = _core_value("model")
    tokenizer = _core_value("tokenizer")
    vocab_size = _core_value("vocab_size")
    max_positions = _core_value("max_positions")
    tensor_parallel_size = _core_value("tensor_parallel_size")
    page_bytes = _core_value("page_bytes")

    # ---- requests ---------------------------------------------------------------------------------

    def encode(self, prompt) -> list[int]:
        """A prompt's token ids (``Frontend.encode``)."""
        return self.frontend.encode(prompt)

    def split_prompt(self, prompt) -> tuple[list[int], list | None]:
        """(token ids, images or None) of a prompt: a string, token ids, or vLLM's multimodal form
        ``{"prompt_token_ids": ids (or "prompt": text), "multi_modal_data": {"image": image or [images]}}``."""
        return self.frontend.split_prompt(prompt)

    def prepare_images(self, prompt_ids: list[int], images) -> tuple[list[int], object]:
        """(the prompt with its image tokens expanded, its ``PromptInputs``); (prompt_ids, None) without images."""
        return self.frontend.prepare_images(prompt_ids, images)

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise ``RequestError`` if the request cannot run (``EngineCore.check_request``)."""
        self.core.check_request(prompt_ids, params)

    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None, lora=None) -> str:
        """Queue a request on adapter ``lora`` (None: the base model); returns its id, or raises ``RequestError``.
        ``prompt``: text, token ids, or with images ``split_prompt``'s form. ``step`` returns its outputs,
        with text and stop strings when the engine has a tokenizer."""
        return self._queue(*self.prepare_images(*self.split_prompt(prompt)), params or SamplingParams(), request_id,
                           lora)

    def _queue(self, prompt_ids: list[int], prompt_inputs, params: SamplingParams, request_id, lora) -> str:
        request_id, seed = self.core.add_token_request(prompt_ids, params, request_id, lora=lora,
                                                       prompt_inputs=prompt_inputs)
        self.processors[request_id] = self.frontend.output_processor(request_id, prompt_ids, params, seed)
        return request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its pages; returns its output (of its output kind: for DELTA,
        what the last output did not hold; None for an unknown request or one queued on the core alone)."""
        delta = self.core.abort(request_id)
        processor = self.processors.pop(request_id, None)
        return processor.process(delta)[0] if processor is not None and delta is not None else None

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    def reset_prefix_cache(self) -> int:
        """``EngineCore.reset_prefix_cache``: drop every cached prefix page (after a weight update)."""
        return self.core.reset_prefix_cache()

    # ---- one step ----------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one step; returns the outputs of the requests ``add_request`` queued that advanced
        (of each one's output kind: FINAL_ONLY requests only when they finish). Out of memory or a
        device error raises ``DeviceError`` (no request's fault: none is retried)."""
        outputs = []
        for delta in self.core.step_deltas():
            processor = self.processors.get(delta.request_id)
            if processor is None:
                continue
            out, stopped = processor.process(delta)
            if stopped:  # a stop string: the core stops it now
                self.core.finish(delta.request_id, "stop")
            if processor.finished:
                del self.processors[delta.request_id]
            if out is not None:
                outputs.append(out)
        return outputs

    # ---- LoRA adapters (``EngineCore``'s) -------------------------------------------------------------

    def add_lora(self, name: str, source):
        """``EngineCore.add_lora``: load an adapter under ``name``."""
        return self.core.add_lora(name, source)

    def remove_lora(self, name: str) -> None:
        """``EngineCore.remove_lora``: unload an adapter; refused while unfinished requests use it."""
        self.core.remove_lora(name)

    def list_loras(self) -> list:
        return self.core.list_loras()

    def _loras_for(self, lora, count: int) -> list:
        """One adapter name (or None) per prompt, checked before any request is added."""
        names = list(lora) if isinstance(lora, (list, tuple)) else [lora] * count
        if len(names) != count:
            raise InvalidArgumentError(f"{len(names)} adapter names for {count} prompts")
        for name in names:
            self.core.check_lora(name)
        return names

    # ---- offline jobs --------------------------------------------------------------------------------

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 progress: bool = False, lora: str | list[str | None] | None = None) -> list[RequestOutput]:
        """Run the prompts to completion on adapter(s) ``lora``; outputs in prompt order. Bad requests raise first."""
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(params_list) != len(prompts):
            raise InvalidArgumentError(f"{len(params_list)} SamplingParams for {len(prompts)} prompts")
        prepared = []
        for i, prompt in enumerate(prompts):
            try:
                prepared.append(self.prepare_images(*self.split_prompt(prompt)))  # images encoded here, once
            except RequestError as exc:
                raise RequestError(f"request {i}: {exc}", param=exc.param) from None
        return self._run(prepared, params_list, progress, lora)

    def _run(self, prepared: list, params_list: list[SamplingParams], progress: bool, lora) -> list[RequestOutput]:
        """``generate`` on prompts ``prepare_images`` prepared: (token ids, PromptInputs or None) each."""
        loras = self._loras_for(lora, len(prepared))
        for i, ((prompt_ids, _), p) in enumerate(zip(prepared, params_list)):
            try:
                self.core.check_request(prompt_ids, p)
            except RequestError as exc:
                raise RequestError(f"request {i}: {exc}", param=exc.param) from None
        # One output per request, when it finishes: no step copies a request's output so far.
        final = [dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY) for p in params_list]
        ids = [self._queue(prompt_ids, prompt_inputs, p, None, name)
               for (prompt_ids, prompt_inputs), p, name in zip(prepared, final, loras)]
        finished: dict[str, RequestOutput] = {}
        wanted = set(ids)
        with tqdm(total=len(ids), unit="req", disable=not progress) as bar:  # disabled: every call does nothing
            while wanted - finished.keys():
                for output in self.step():
                    if output.finished and output.request_id in wanted:
                        finished[output.request_id] = output
                        bar.update(1)
        return [finished[i] for i in ids]

    def score(self, sequences, prompt_lengths: list[int] | None = None, lora=None) -> list[ScoreResult]:
        """Logprobs of every token after ``prompt_lengths[i]`` (default 1): bitwise what
        ``score_sequences`` gives for the same model (with ``lora``: its ``PeftModel``). A sequence with
        images (``split_prompt``'s form) counts its prompt length in its own token ids, one image token per
        image; its images' tokens are expanded, and the scores (``token_logprobs``' at temperature 1) start
        after the expanded prompt."""
        split = [self.split_prompt(s) for s in sequences]
        prompt_lengths = prompt_lengths or [1] * len(split)
        if any(not 1 <= start < len(ids) for (ids, _), start in zip(split, prompt_lengths)):
            raise RequestError("each sequence needs 1 <= prompt_length < its length")
        prepared = [self.prepare_images(ids, images) for ids, images in split]
        prompt_lengths = [start if inputs is None else expanded_position(
            ids, self.frontend.images.image_token, [end - first for first, end, _ in inputs.image_spans], start)
            for (ids, _), (_, inputs), start in zip(split, prepared, prompt_lengths)]
        outputs = self._run(prepared, [SamplingParams(max_tokens=0, prompt_logprobs=0)] * len(prepared), False,
                            lora)
        results = []
        for out, start in zip(outputs, prompt_lengths):
            if out.error:
                raise RequestFailedError(f"request {out.request_id} failed: {out.error}")
            logprobs = torch.tensor(out.prompt_logprobs[start - 1:], dtype=torch.float32)
            results.append(ScoreResult(logprobs, all(out.prompt_greedy[start - 1:])))
        return results
