"""The engine: requests in, tokens and logprobs out, each bitwise a function of its own request.

    engine = Engine(model, tokenizer)                 # wraps the model with make_invariant
    outputs = engine.generate(["The capital of France is"], SamplingParams(max_tokens=16))
    scores = engine.score([[1, 2, 3, 4]])              # == score_sequences(model, ...)

``add_request`` / ``step`` / ``abort`` drive it one step at a time (a server does);
``generate`` and ``score`` run until their requests finish. Each request's outputs are of its
``SamplingParams.output_kind``: cumulative (the default), deltas, or the final one only.

The core (``add_token_request``, ``step_deltas``) takes token ids and returns each step's
``SequenceDelta``s; an ``OutputProcessor`` per request decodes the text, applies stop strings and
builds its outputs. ``step`` does both; ``AsyncEngine`` runs the core on its engine thread and the
processors outside the engine's lock.

On ``TensorParallelRanks`` (``invariant_infer.parallel``), ``Engine(ranks.model, tokenizer,
executor=ranks)`` runs in rank 0's process: it schedules, samples and keeps the requests; every
step's forward and logits run on all ranks in step, and each result is bitwise that of one process.
"""
from __future__ import annotations

import dataclasses
import itertools
import secrets
from collections.abc import Sequence as SequenceABC

import torch
from tqdm import tqdm

from ..errors import (DeviceError, EngineBusyError, InvalidArgumentError, LoraAdapterError, RequestError,
                      RequestFailedError, TensorParallelError, raise_if_device_failure)
from ..model.executor import Executor, executor_for
from ..model.lora import is_peft_model
from ..model.patch import is_invariant, make_invariant
from ..scoring.core import ScoreResult
from .block_manager import BlockManager, block_table_rows
from .lora_slots import LoraAdapter, LoraSlots
from .model_runner import ModelRunner
from .logprob_rows import record_prompt_logprobs, record_top_logprobs, row_logprobs
from .output import OutputProcessor, RequestOutput, SequenceDelta
from .sampler import pick_alone, pick_rows, picks_alone
from .sampling_params import RequestOutputKind, SamplingParams
from .scheduler import ScheduledChunk, Scheduler
from .sequence import Sequence, Status
from .speculative import speculative_decoder, verify
from .step_timer import NULL_TIMER, StepTimer

DEFAULT_CPU_KV_CACHE_MEMORY = 1 << 28  # 256 MiB
DEFAULT_CUDA_KV_CACHE_FRACTION = 0.5   # of the free memory at start


class Engine:
    """Continuous batching over one causal LM (see the module's docstring).

    Weight updates: the engine keeps no copy of any weight, nor anything derived from one but the
    KV cache. Each step reads the parameters of the model's own modules, so an in-place update (an
    optimizer step, ``param.data.copy_``, ``load_state_dict``, ``weight_update.load_weights_from_disk``)
    reaches the next step. Cached prefix pages hold KV computed under the weights of their time:
    call ``reset_prefix_cache()`` after an update, with no request in the engine, and every later
    result equals that of an engine freshly built on the updated model, bitwise."""

    def __init__(self, model, tokenizer=None, *, max_num_seqs: int = 64, max_num_batched_tokens: int = 2048,
                 kv_cache_memory: int | None = None, enable_prefix_caching: bool = True, kernels: str = "invariant",
                 decode_buckets: tuple[int, ...] = (), executor: Executor | None = None, speculative=None,
                 max_loras: int = 0, max_lora_rank: int = 16):
        executor = executor_for(model, executor)  # where each step runs (default: this process)
        if kernels not in ("invariant", "stock"):
            raise InvalidArgumentError(f"kernels must be 'invariant' or 'stock', got {kernels!r}")
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise InvalidArgumentError("max_num_seqs and max_num_batched_tokens must be at least 1")
        if kernels == "invariant":
            make_invariant(model)
        elif is_invariant(model):
            raise InvalidArgumentError("kernels='stock' needs a model that make_invariant has not wrapped (restore it "
                                       "first)")
        if model.get_output_embeddings() is None or not hasattr(model, "model"):
            raise InvalidArgumentError("the engine runs causal LMs (AutoModelForCausalLM), not base models")
        self.model, self.tokenizer = model.eval(), tokenizer
        config = model.config
        self.vocab_size, self.max_positions = config.vocab_size, config.max_position_embeddings
        dtype, device = model.get_output_embeddings().weight.dtype, model.get_output_embeddings().weight.device
        page_size = ModelRunner.page_size_for(config, device, dtype)
        self.tensor_parallel_size = executor.tensor_parallel_size
        # kv_cache_memory is per rank; a rank holds 1 / tensor_parallel_size of the KV heads.
        self.page_bytes = page_bytes = ModelRunner.page_bytes(config, dtype, page_size, self.tensor_parallel_size)
        if kv_cache_memory is None:
            kv_cache_memory = DEFAULT_CPU_KV_CACHE_MEMORY if device.type != "cuda" else \
                int(torch.cuda.mem_get_info(device)[0] * DEFAULT_CUDA_KV_CACHE_FRACTION)
        # No more pages than max_num_seqs sequences of max_position_embeddings tokens can use.
        num_pages = min(kv_cache_memory // page_bytes, max_num_seqs * -(-self.max_positions // page_size))
        if num_pages < 1:
            raise InvalidArgumentError(f"kv_cache_memory={kv_cache_memory} bytes holds no page ({page_bytes} bytes "
                                       "each)")
        if is_peft_model(model):
            raise InvalidArgumentError("the engine runs a base model: pass the PeftModel's base and "
                                       "engine.add_lora(name, peft_model) with max_loras >= 1")
        self.runner = ModelRunner(model, num_pages=num_pages, page_size=page_size, invariant=kernels == "invariant",
                                  max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                  decode_buckets=decode_buckets, executor=executor, max_loras=max_loras,
                                  max_lora_rank=max_lora_rank)
        self.loras: LoraSlots | None = self.runner.loras  # LoRA adapter slots (lora_slots.py); None serves none
        self.blocks = BlockManager(num_pages, page_size, enable_prefix_caching,
                                   num_table_rows=block_table_rows(max_num_seqs))
        self.scheduler = Scheduler(self.blocks, max_num_seqs, max_num_batched_tokens, admission=self.loras)
        self.sequences: dict[str, Sequence] = {}
        self.processors: dict[str, OutputProcessor] = {}  # of the requests add_request queued
        self._arrivals = itertools.count()
        eos = model.generation_config.eos_token_id if getattr(model, "generation_config", None) else None
        eos = tokenizer.eos_token_id if eos is None and tokenizer is not None else eos
        self.eos_token_ids = set([eos] if isinstance(eos, int) else (eos or []))
        self.timer = None  # off (the null timer); set a StepTimer to time each step's phases (benchmarks)
        self.speculative = speculative_decoder(self, speculative, kernels)  # None: off (see speculative.py)

    @property
    def timer(self) -> StepTimer:
        return self._timer

    @timer.setter
    def timer(self, timer: StepTimer | None) -> None:
        self._timer = NULL_TIMER if timer is None else timer

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

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise ``RequestError`` if the request cannot run (checked before admission)."""
        params.check()
        if not prompt_ids:
            raise RequestError("empty prompt", param="prompt")
        bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(f"token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}", param="prompt")
        total = len(prompt_ids) + params.max_tokens
        if total > self.max_positions:
            raise RequestError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} is "
                               f"more than the model's {self.max_positions} positions", param="max_tokens")
        if self.blocks.pages_for(total) > self.blocks.num_pages:
            raise RequestError(f"prompt + max_tokens needs {self.blocks.pages_for(total)} KV pages; the cache has "
                               f"{self.blocks.num_pages} in all (raise kv_cache_memory)", param="max_tokens")
        if params.stop and self.tokenizer is None:
            raise RequestError("stop strings need a tokenizer: Engine(model, tokenizer)", param="stop")

    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None, lora=None) -> str:
        """Queue a request on adapter ``lora`` (None: the base model); returns its id, or raises ``RequestError``.
        ``step`` returns its outputs, with text and stop strings when the engine has a tokenizer."""
        params = params or SamplingParams()
        seq = self._add(self.encode(prompt), params, request_id, lora)
        self.processors[seq.request_id] = OutputProcessor(seq.request_id, seq.prompt_ids, params, seq.seed,
                                                          self.tokenizer)
        return seq.request_id

    def add_token_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
                          lora=None) -> tuple[str, int]:
        """Queue a request for the core alone: ``step_deltas`` returns its deltas, which the caller
        turns into outputs (its text and stop strings too: the core does not decode). Returns its id
        and seed."""
        seq = self._add(list(prompt_ids), params, request_id, lora)
        return seq.request_id, seq.seed

    def _add(self, prompt_ids: list[int], params: SamplingParams, request_id, lora) -> Sequence:
        lora_fields = self._lora_fields(lora)
        self.check_request(prompt_ids, params)
        arrival = next(self._arrivals)
        request_id = str(arrival) if request_id is None else str(request_id)
        if request_id in self.sequences:
            raise RequestError(f"request id {request_id!r} is already in use")
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        seq = Sequence(request_id, prompt_ids, params, seed, arrival, **lora_fields)
        self.sequences[request_id] = seq
        self.scheduler.add(seq)
        return seq

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its pages; returns its output (of its output kind: for DELTA,
        what the last output did not hold; None for an unknown request or one ``add_token_request``
        queued)."""
        seq = self.sequences.pop(request_id, None)
        if seq is None:
            return None
        self.scheduler.remove(seq)
        self._release_draft(seq)
        if not seq.finished:
            seq.status, seq.finish_reason = Status.FINISHED, "abort"
        processor = self.processors.pop(request_id, None)
        return processor.process(self._delta(seq))[0] if processor is not None else None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def reset_prefix_cache(self) -> int:
        """Drop every cached prefix page, so that no KV computed before (under old weights) is ever
        reused; returns how many pages were cached. Needs an idle engine: with requests waiting or
        running (their KV, or their tokens so far, came from the old weights) it raises
        ``EngineBusyError`` and changes nothing; let them finish or abort them first."""
        if self.has_unfinished():
            raise EngineBusyError(f"reset_prefix_cache needs an idle engine; {len(self.scheduler.running)} requests "
                                  f"are running and {len(self.scheduler.waiting)} waiting (finish or abort them)")
        return self.blocks.reset_prefix_cache()

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

    def step_deltas(self) -> list[SequenceDelta]:
        """Run one step of the core; returns what it added to every request that advanced (see
        ``step``). O(new tokens) per request, whatever its length."""
        timer = self.timer
        timer.start()
        if self.speculative is not None:
            self.speculative.propose(self.scheduler.running)
        chunks = self.scheduler.schedule()
        timer.mark("schedule")
        if not chunks:
            return []
        advanced: list[Sequence] = []
        for group, hidden, error in self._forward(chunks):
            if hidden is None:  # this request's forward failed alone
                self._finish(group[0].seq, "error", error=error)
                advanced.append(group[0].seq)
                continue
            try:
                advanced += self._process(group, hidden)
            except (TensorParallelError, DeviceError):
                raise
            except Exception as exc:  # noqa: BLE001  (logits of the group failed: fail its requests, go on)
                raise_if_device_failure(exc, "the engine's logits and sampling")
                for chunk in group:
                    self._finish(chunk.seq, "error", error=f"{type(exc).__name__}: {exc}")
                    advanced.append(chunk.seq)
        deltas = [self._delta(seq) for seq in advanced]
        for seq in advanced:
            if seq.finished:
                self.sequences.pop(seq.request_id, None)
        timer.end_step("output")
        return deltas

    @staticmethod
    def _delta(seq: Sequence) -> SequenceDelta:
        """What the sequence gained since its last delta (copies of those entries only)."""
        t, p = seq.num_reported_tokens, seq.num_reported_prompt_logprobs
        seq.num_reported_tokens, seq.num_reported_prompt_logprobs = seq.num_output_tokens, len(seq.prompt_logprobs)
        return SequenceDelta(seq.request_id, seq.token_ids[seq.num_prompt_tokens + t:], seq.logprobs[t:],
                             seq.top_logprobs[t:], seq.prompt_logprobs[p:], seq.prompt_top_logprobs[p:],
                             seq.prompt_greedy[p:], seq.finished, seq.finish_reason, seq.error)

    def _forward(self, chunks: list[ScheduledChunk]):
        """(chunks, hidden, error) triples: the whole step at once, or, if that raises, each request
        alone, so that an exception fails only the request that raises it (hidden None, error set).
        A generator: the step processes each group before the next forward runs (under tensor
        parallelism the other ranks keep one forward's hidden states, for its logits). Out of memory
        and device errors raise ``DeviceError``: no request is at fault, none is retried alone."""
        timer = self.timer
        try:
            inputs = self.runner.prepare(chunks, self.blocks.take_table_writes())
            timer.mark("metadata")
            hidden = self.runner.forward(inputs)
            timer.mark("forward")
            whole = (chunks, hidden, None)
        except TensorParallelError:  # the ranks are out of step: no request can run alone either
            raise
        except Exception as exc:  # noqa: BLE001
            raise_if_device_failure(exc, "the engine's forward")
            whole = None if len(chunks) > 1 else (chunks, None, f"{type(exc).__name__}: {exc}")
        if whole is not None:
            yield whole
            return
        for chunk in chunks:
            try:
                alone = ([chunk], self.runner.hidden_states([chunk]), None)
            except TensorParallelError:
                raise
            except Exception as exc:  # noqa: BLE001
                raise_if_device_failure(exc, "the engine's forward of one request")
                alone = ([chunk], None, f"{type(exc).__name__}: {exc}")
            yield alone

    def _process(self, chunks: list[ScheduledChunk], hidden: torch.Tensor) -> list[Sequence]:
        """Prompt logprobs, sampling and stop checks for the chunks of one forward."""
        rows, prompt_targets, prompt_owners, sample_rows = [], [], [], []
        offset = 0
        for chunk in chunks:
            seq = chunk.seq
            seq.num_computed += chunk.num_tokens - len(chunk.draft)  # proposals count once verified
            self.blocks.register_full_pages(seq)
            if seq.wants_prompt_logprobs:
                last = min(chunk.start + chunk.num_tokens, len(seq.prompt_ids) - 1)
                for position in range(max(chunk.start, len(seq.prompt_logprobs)), last):
                    rows.append(offset + position - chunk.start)
                    prompt_targets.append(seq.prompt_ids[position + 1])
                    prompt_owners.append(seq)
            if chunk.completes:  # its last row, and one per proposal, yield tokens
                sample_rows.append((len(rows), seq, chunk.draft))
                rows += range(offset + chunk.num_tokens - 1 - len(chunk.draft), offset + chunk.num_tokens)
            offset += chunk.num_tokens
        timer = self.timer
        timer.mark("output")
        if not rows:
            return []
        logits = self.runner.logits_of(hidden, rows)
        timer.mark("forward")
        if prompt_targets:
            sampled = {r + i for r, _, draft in sample_rows for i in range(len(draft) + 1)}
            prompt_rows = [i for i in range(len(rows)) if i not in sampled]
            record_prompt_logprobs(self.runner, logits[prompt_rows], prompt_targets, prompt_owners)
            timer.mark("logprobs")
        advanced, picked = [], []
        timer.mark("sampling")
        # Every row whose pick depends on its own logits alone, in one pass (sampler.py).
        try:
            known = pick_rows(logits, [(r + i, seq, seq.num_output_tokens + i) for r, seq, draft in sample_rows
                                       if not picks_alone(seq) for i in range(len(draft) + 1)])
        except Exception as exc:  # noqa: BLE001  (each row again alone: a failure stays its request's)
            raise_if_device_failure(exc, "the engine's sampling")
            known = {}
        for row, seq, draft in sample_rows:
            advanced.append(seq)
            try:
                tokens = self._pick(seq, logits, row, draft, known)
            except Exception as exc:  # noqa: BLE001  (one request's failure stays its own)
                raise_if_device_failure(exc, "the engine's sampling")
                self._finish(seq, "error", error=f"{type(exc).__name__}: {exc}")
                continue
            picked += [(row + i, seq, token) for i, token in enumerate(tokens)]
        timer.mark("sampling")
        if picked:  # the sampled tokens' logprobs, one launch per temperature they are taken at
            values = row_logprobs(self.runner, logits[[row for row, _, _ in picked]], [t for _, _, t in picked],
                                  [seq.params.logprob_temperature for _, seq, _ in picked])[0]
            timer.mark("logprobs")
            kept = []
            for (row, seq, token), value in zip(picked, values):
                if not seq.finished:  # a verified step's tokens after a stop are not kept
                    self._append(seq, token, value)
                    kept.append((row, seq))
            wants_top = [(row, seq) for row, seq in kept if seq.params.logprobs]
            if wants_top:
                record_top_logprobs(self.runner, logits, wants_top)
        if self.speculative is not None:
            self.speculative.settle(self.blocks, chunks)
        return advanced

    def _pick(self, seq: Sequence, logits: torch.Tensor, row: int, draft: list[int], known: dict[int, int]) -> list[int]:
        """The sequence's next token(s): row ``row``'s, and with proposals, those verification keeps;
        none when it has all it asked for (max_tokens = 0). ``known``: the rows already picked."""
        room = seq.params.max_tokens - seq.num_output_tokens
        if room <= 0:
            self._finish(seq, "length")
            return []

        def pick(i: int, before: list[int]) -> int | None:
            if i >= room:
                return None
            if row + i in known:
                return known[row + i]
            return pick_alone(seq, logits[row + i], seq.num_output_tokens + i, before)
        return verify(draft, pick)

    def _append(self, seq: Sequence, token: int, logprob: float) -> None:
        """Record a sampled token and finish the sequence if it stops here (a stop token, EOS or its
        length; stop strings are the output processor's)."""
        params = seq.params
        seq.append_token(token)
        seq.logprobs.append(logprob)
        if token in params.stop_token_ids or (token in self.eos_token_ids and not params.ignore_eos):
            self._finish(seq, "stop")
        elif seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_positions:
            self._finish(seq, "length")

    def _finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        seq.status, seq.finish_reason, seq.error = Status.FINISHED, reason, error
        self.scheduler.remove(seq)
        self._release_draft(seq)

    def _release_draft(self, seq: Sequence) -> None:
        if self.speculative is not None:  # a draft model's copy of the sequence frees its pages now
            self.speculative.proposer.release(seq.request_id)

    # ---- LoRA adapters -------------------------------------------------------------------------------

    def _slots(self) -> LoraSlots:
        if self.loras is None:
            raise LoraAdapterError("this engine serves no adapters: build it with Engine(..., max_loras=N)")
        return self.loras

    def add_lora(self, name: str, source) -> LoraAdapter:
        """Load an adapter under ``name``: a PEFT adapter folder, a ``PeftModel`` (its active adapter),
        or a ``(LoraConfig, state_dict)`` pair. Raises ``LoraAdapterError`` and changes nothing if it
        does not fit (targets, shapes, rank over ``max_lora_rank``, options not supported)."""
        return self._slots().add(name, source)

    def remove_lora(self, name: str) -> None:
        """Unload an adapter; refused while unfinished requests use it."""
        self._slots().remove(name, sum(seq.lora == name for seq in self.sequences.values() if not seq.finished))

    def list_loras(self) -> list[LoraAdapter]:
        return list(self.loras.adapters.values()) if self.loras is not None else []

    def _lora_fields(self, name: str | None) -> dict:
        """The Sequence fields of a request for adapter ``name`` (None: the base model)."""
        if name is None:
            return {}
        if self.loras is None:
            raise RequestError("this engine serves no adapters (Engine(..., max_loras=N))", param="lora")
        return {"lora": name, "hash_seed": bytes.fromhex(self.loras.get(name).sha256)}

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
        encoded, loras = [self.encode(p) for p in prompts], self._loras_for(lora, len(prompts))
        for i, (ids, p) in enumerate(zip(encoded, params_list)):
            try:
                self.check_request(ids, p)
            except RequestError as exc:
                raise RequestError(f"request {i}: {exc}", param=exc.param) from None
        # One output per request, when it finishes: no step copies a request's output so far.
        final = [dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY) for p in params_list]
        ids = [self.add_request(prompt, p, lora=name) for prompt, p, name in zip(encoded, final, loras)]
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
        ``score_sequences`` gives for the same model (with ``lora``: its ``PeftModel``)."""
        sequences = [self.encode(s) for s in sequences]
        prompt_lengths = prompt_lengths or [1] * len(sequences)
        if any(not 1 <= start < len(seq) for seq, start in zip(sequences, prompt_lengths)):
            raise RequestError("each sequence needs 1 <= prompt_length < its length")
        outputs = self.generate(sequences, SamplingParams(max_tokens=0, prompt_logprobs=0), lora=lora)
        results = []
        for out, start in zip(outputs, prompt_lengths):
            if out.error:
                raise RequestFailedError(f"request {out.request_id} failed: {out.error}")
            logprobs = torch.tensor(out.prompt_logprobs[start - 1:], dtype=torch.float32)
            results.append(ScoreResult(logprobs, all(out.prompt_greedy[start - 1:])))
        return results
