"""The engine: requests in, tokens, logprobs and text out, each bitwise a function of its own request.

    engine = Engine(model, tokenizer)                 # wraps the model with make_invariant
    outputs = engine.generate(["The capital of France is"], SamplingParams(max_tokens=16))
    scores = engine.score([[1, 2, 3, 4]])              # == score_sequences(model, ...)

``add_request`` / ``step`` / ``abort`` drive it one step at a time (a server does);
``generate`` and ``score`` run until their requests finish. Each request's outputs are of its
``SamplingParams.output_kind``: cumulative (the default), deltas, or the final one only.

``Engine`` is the core (``core.py``: token ids in, ``SequenceDelta``s out) plus a frontend: it
encodes text prompts, and an ``OutputProcessor`` per request decodes the text, applies stop strings
and builds its outputs. ``AsyncEngine`` runs the core on its engine thread and the processors
outside the engine's lock.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence as SequenceABC

import torch
from tqdm import tqdm

from ..errors import InvalidArgumentError, RequestError, RequestFailedError
from ..scoring.core import ScoreResult
from .core import EngineCore
from .multimodal import ImageInputs
from ..model.image_inputs import expanded_position, split_multimodal
from .output import OutputProcessor, RequestOutput
from .sampling_params import RequestOutputKind, SamplingParams


class Engine(EngineCore):
    """Continuous batching over one causal LM, with text (see the module's docstring); ``options``
    are ``EngineCore``'s: max_num_seqs, max_num_batched_tokens, kv_cache_memory,
    enable_prefix_caching, kernels, decode_buckets, executor, speculative, max_loras, max_lora_rank."""

    def __init__(self, model, tokenizer=None, **options):
        """``tokenizer``: the model's tokenizer, or a vision-language model's processor (its ``image_processor``
        and ``tokenizer``), through which requests with images go (``multimodal.py``)."""
        processor = tokenizer if hasattr(tokenizer, "image_processor") else None
        super().__init__(model, getattr(tokenizer, "tokenizer", None) if processor is not None else tokenizer,
                         **options)
        self.images = ImageInputs(model, processor) if getattr(model.config, "vision_config", None) else None
        self.processors: dict[str, OutputProcessor] = {}  # of the requests add_request queued

    # ---- requests ---------------------------------------------------------------------------------

    def encode(self, prompt) -> list[int]:
        """A prompt's token ids (a string needs the tokenizer; a list of ids is checked and copied)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("a text prompt needs a tokenizer: Engine(model, tokenizer)")
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        prompt = prompt.tolist() if isinstance(prompt, torch.Tensor) else prompt
        if not isinstance(prompt, SequenceABC) or not all(type(t) is int for t in prompt):
            raise RequestError("a prompt is a string or a list of token ids")
        return list(prompt)

    def split_prompt(self, prompt) -> tuple[list[int], list | None]:
        """(token ids, images or None) of a prompt: a string, token ids, or vLLM's multimodal form
        ``{"prompt_token_ids": ids (or "prompt": text), "multi_modal_data": {"image": image or [images]}}``."""
        if not isinstance(prompt, dict):
            return self.encode(prompt), None
        content, images = split_multimodal(prompt)
        return self.encode(content), images

    def prepare_images(self, prompt_ids: list[int], images) -> tuple[list[int], object]:
        """(the prompt with its image tokens expanded, its MultimodalPrompt); (prompt_ids, None) without images."""
        if not images:
            return prompt_ids, None
        if self.images is None:
            raise RequestError("this model takes no images", param="multi_modal_data")
        return self.images.prepare(prompt_ids, images)

    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None, lora=None) -> str:
        """Queue a request on adapter ``lora`` (None: the base model); returns its id, or raises ``RequestError``.
        ``prompt``: text, token ids, or with images ``split_prompt``'s form. ``step`` returns its outputs,
        with text and stop strings when the engine has a tokenizer."""
        return self._queue(*self.prepare_images(*self.split_prompt(prompt)), params or SamplingParams(), request_id,
                           lora)

    def _queue(self, prompt_ids: list[int], multimodal, params: SamplingParams, request_id, lora) -> str:
        seq = self._add(prompt_ids, params, request_id, lora, multimodal)
        self.processors[seq.request_id] = OutputProcessor(seq.request_id, seq.prompt_ids, params, seq.seed,
                                                          self.tokenizer)
        return seq.request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its pages; returns its output (of its output kind: for DELTA,
        what the last output did not hold; None for an unknown request or one ``add_token_request``
        queued)."""
        delta = super().abort(request_id)
        processor = self.processors.pop(request_id, None)
        return processor.process(delta)[0] if processor is not None and delta is not None else None

    # ---- one step ----------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one step; returns the outputs of the requests ``add_request`` queued that advanced
        (of each one's output kind: FINAL_ONLY requests only when they finish). Out of memory or a
        device error raises ``DeviceError`` (no request's fault: none is retried)."""
        outputs = []
        for delta in self.step_deltas():
            processor = self.processors.get(delta.request_id)
            if processor is None:
                continue
            out, stopped = processor.process(delta)
            if stopped:  # a stop string: the core stops it now
                self._stop(delta.request_id)
            if processor.finished:
                del self.processors[delta.request_id]
            if out is not None:
                outputs.append(out)
        return outputs

    def _stop(self, request_id: str) -> None:
        seq = self.sequences.pop(request_id, None)
        if seq is not None and not seq.finished:
            self._finish(seq, "stop")

    def _loras_for(self, lora, count: int) -> list:
        """One adapter name (or None) per prompt, checked before any request is added."""
        names = list(lora) if isinstance(lora, (list, tuple)) else [lora] * count
        if len(names) != count:
            raise InvalidArgumentError(f"{len(names)} adapter names for {count} prompts")
        for name in names:
            self._lora_fields(name)
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
        """``generate`` on prompts ``prepare_images`` prepared: (token ids, MultimodalPrompt or None) each."""
        loras = self._loras_for(lora, len(prepared))
        for i, ((prompt_ids, _), p) in enumerate(zip(prepared, params_list)):
            try:
                self.check_request(prompt_ids, p)
            except RequestError as exc:
                raise RequestError(f"request {i}: {exc}", param=exc.param) from None
        # One output per request, when it finishes: no step copies a request's output so far.
        final = [dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY) for p in params_list]
        ids = [self._queue(prompt_ids, multimodal, p, None, name)
               for (prompt_ids, multimodal), p, name in zip(prepared, final, loras)]
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
        prompt_lengths = [start if mm is None else expanded_position(
            ids, self.images.image_token, [end - first for first, end, _ in mm.image_spans], start)
            for (ids, _), (_, mm), start in zip(split, prepared, prompt_lengths)]
        outputs = self._run(prepared, [SamplingParams(max_tokens=0, prompt_logprobs=0)] * len(prepared), False,
                            lora)
        results = []
        for out, start in zip(outputs, prompt_lengths):
            if out.error:
                raise RequestFailedError(f"request {out.request_id} failed: {out.error}")
            logprobs = torch.tensor(out.prompt_logprobs[start - 1:], dtype=torch.float32)
            results.append(ScoreResult(logprobs, all(out.prompt_greedy[start - 1:])))
        return results
