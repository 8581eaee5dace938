"""The engine's core: token ids in, each step's ``SequenceDelta``s out, each request's bitwise a
function of the request alone.

``add_token_request`` queues a request, ``step_deltas`` runs one step (schedule, one packed forward,
prompt logprobs, sampling, stop tokens) and returns what it added to every request that advanced,
O(new tokens) per request whatever its length; ``abort`` stops one, ``finish`` ends one its caller found
finished (a stop string). The core neither encodes nor decodes: ``Engine`` (``engine.py``) holds a core
and the frontend (``frontend.py``: text prompts and images in, the outputs built from the deltas out:
text, stop strings, output kinds), which ``AsyncEngine`` shares, and adds the offline jobs.

On ``TensorParallelRanks`` (``invariant_infer.parallel``), the core runs in rank 0's process: it
schedules, samples and keeps the requests; every step's forward and logits run on all ranks in
step, and each result is bitwise that of one process.
"""
from __future__ import annotations

import itertools
import secrets

import torch

from ..errors import (DeviceError, EngineBusyError, InvalidArgumentError, LoraAdapterError, RequestError,
                      TensorParallelError, raise_if_device_failure)
from ..model.executor import Executor, executor_for
from ..model.lora import is_peft_model
from ..model.families import text_config
from ..model.image_inputs import placeholder_token_ids
from ..model.patch import is_invariant, make_invariant
from .decode_graphs import cuda_graphs_refusal, default_decode_buckets
from .kv_cache_layout import kv_cache_layout
from .kv_cache_manager import KVCacheManager, block_table_rows
from .linear_state import PrefixStates, saved_state_interval
from .model_support import check_engine_support
from .lora_slots import LoraAdapter, LoraSlots
from .model_runner import ModelRunner
from .logprob_rows import record_prompt_logprobs, record_top_logprobs, row_logprobs
from .output import SequenceDelta
from .sampler import pick_alone, pick_rows, picks_alone
from .sampling_params import SamplingParams
from .scheduler import ScheduledChunk, Scheduler
from .sequence import Sequence, Status
from .speculative import speculative_decoder, verify
from .step_timer import NULL_TIMER, StepTimer

DEFAULT_CPU_KV_CACHE_MEMORY = 1 << 28  # 256 MiB
DEFAULT_CUDA_KV_CACHE_FRACTION = 0.5   # of the free memory at start


class EngineCore:
    """Continuous batching over one causal LM, on token ids (see the module's docstring).

    ``suppressed_token_ids``: token ids no request ever samples (the sampler sets their logits to
    -inf before picking, each row alone; reported logprobs are unchanged).

    Weight updates: the engine keeps no copy of any weight, nor anything derived from one but the
    KV cache. Each step reads the parameters of the model's own modules, so an in-place update (an
    optimizer step, ``param.data.copy_``, ``load_state_dict``, ``weight_update.load_weights_from_disk``)
    reaches the next step. Cached prefix pages hold KV computed under the weights of their time:
    call ``reset_prefix_cache()`` after an update, with no request in the engine, and every later
    result equals that of an engine freshly built on the updated model, bitwise."""

    suppressed_token_ids: tuple[int, ...] = ()

    def __init__(self, model, tokenizer=None, *, max_num_seqs: int = 64, max_num_batched_tokens: int = 2048,
                 kv_cache_memory: int | None = None, enable_prefix_caching: bool = True, kernels: str = "invariant",
                 decode_buckets: tuple[int, ...] = (), executor: Executor | None = None, speculative=None,
                 max_loras: int = 0, max_lora_rank: int = 16, cuda_graphs: bool | None = None):
        """``decode_buckets``: decode-only steps padded to the smallest that holds them (default: none,
        or ``default_decode_buckets`` with CUDA graphs). ``cuda_graphs``: replay each bucket's decode
        steps as a captured CUDA graph (``decode_graphs.py``); None (default): on where the engine
        can (a CUDA device, invariant kernels, one process, no LoRA slots), off
        elsewhere; True where it cannot raises, naming why."""
        executor = executor_for(model, executor)  # where each step runs (default: this process)
        if kernels not in ("invariant", "stock"):
            raise InvalidArgumentError(f"kernels must be 'invariant' or 'stock', got {kernels!r}")
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise InvalidArgumentError("max_num_seqs and max_num_batched_tokens must be at least 1")
        check_engine_support(model, kernels, speculative, max_loras, executor.tensor_parallel_size)
        if kernels == "invariant":
            make_invariant(model)
        elif is_invariant(model):
            raise InvalidArgumentError("kernels='stock' needs a model that make_invariant has not wrapped (restore it "
                                       "first)")
        if model.get_output_embeddings() is None or not hasattr(model, "model"):
            raise InvalidArgumentError("the engine runs causal LMs (AutoModelForCausalLM), not base models")
        self.model, self.tokenizer = model.eval(), tokenizer
        config = text_config(model.config)
        self.vocab_size, self.max_positions = config.vocab_size, config.max_position_embeddings
        dtype, device = model.get_output_embeddings().weight.dtype, model.get_output_embeddings().weight.device
        page_size = ModelRunner.page_size_for(config, device, dtype)
        refusal = cuda_graphs_refusal(device, invariant=kernels == "invariant",
                                      tensor_parallel_size=executor.tensor_parallel_size, max_loras=max_loras)
        if cuda_graphs and refusal:
            raise InvalidArgumentError(f"cuda_graphs=True: {refusal}")
        self.cuda_graphs = refusal is None if cuda_graphs is None else bool(cuda_graphs)
        if self.cuda_graphs and not decode_buckets:
            decode_buckets = default_decode_buckets(max_num_seqs)
        self.tensor_parallel_size = executor.tensor_parallel_size
        # kv_cache_memory is per rank; a rank holds 1 / tensor_parallel_size of the KV heads. A page
        # holds page_size tokens of one KV cache group's layers (kv_cache_layout.py).
        layout = kv_cache_layout(model.config)
        self.page_bytes = page_bytes = layout.page_bytes(dtype, page_size, self.tensor_parallel_size)
        if kv_cache_memory is None:
            kv_cache_memory = DEFAULT_CPU_KV_CACHE_MEMORY if device.type != "cuda" else \
                int(torch.cuda.mem_get_info(device)[0] * DEFAULT_CUDA_KV_CACHE_FRACTION)
        # No more pages than max_num_seqs sequences of max_position_embeddings tokens can use.
        most = sum(layout.pages_for_request(self.max_positions, page_size, max_num_batched_tokens))
        num_pages = min(kv_cache_memory // page_bytes, max_num_seqs * most)
        if num_pages < 1:
            raise InvalidArgumentError(f"kv_cache_memory={kv_cache_memory} bytes holds no page ({page_bytes} bytes "
                                       "each)")
        if is_peft_model(model):
            raise InvalidArgumentError("the engine runs a base model: pass the PeftModel's base and "
                                       "engine.add_lora(name, peft_model) with max_loras >= 1")
        # Linear-attention layers' prefix caching: their state saved where prefill chunks end at a
        # multiple of the chunk and page sizes (linear_state.py), room for max_num_seqs states.
        saved_states = max_num_seqs if enable_prefix_caching else 0
        self.runner = ModelRunner(model, num_pages=num_pages, page_size=page_size, invariant=kernels == "invariant",
                                  max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                  decode_buckets=decode_buckets, executor=executor, max_loras=max_loras,
                                  max_lora_rank=max_lora_rank, saved_states=saved_states, cuda_graphs=self.cuda_graphs)
        self.loras: LoraSlots | None = self.runner.loras  # LoRA adapter slots (lora_slots.py); None serves none
        prefix_states = None
        if self.runner.linear_slots is not None and saved_states:
            prefix_states = PrefixStates(self.runner.state_copies, saved_states, saved_state_interval(page_size))
        # One manager per KV cache group over one page pool (kv_cache_manager.py): the "blocks" the
        # server's stats, the scheduler and the tests read.
        self.blocks = KVCacheManager(num_pages, page_size, enable_prefix_caching,
                                     num_table_rows=block_table_rows(max_num_seqs),
                                     group_specs=self.runner.layout.group_specs, prefix_states=prefix_states)
        self.scheduler = Scheduler(self.blocks, max_num_seqs, max_num_batched_tokens, admission=self.loras)
        self.sequences: dict[str, Sequence] = {}
        self._arrivals = itertools.count()
        eos = model.generation_config.eos_token_id if getattr(model, "generation_config", None) else None
        eos = tokenizer.eos_token_id if eos is None and tokenizer is not None else eos
        self.eos_token_ids = set([eos] if isinstance(eos, int) else (eos or []))
        # Never sampled by any request (a vision-language model's image and video placeholders).
        self.suppressed_token_ids: tuple[int, ...] = placeholder_token_ids(model.config)
        self.timer = None  # off (the null timer); set a StepTimer to time each step's phases (benchmarks)
        self.speculative = speculative_decoder(self, speculative, kernels)  # None: off (see speculative.py)

    @property
    def timer(self) -> StepTimer:
        return self._timer

    @timer.setter
    def timer(self, timer: StepTimer | None) -> None:
        self._timer = NULL_TIMER if timer is None else timer

    # ---- requests ---------------------------------------------------------------------------------

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
        # Per KV cache group: full attention holds the whole context, a window its pages and a chunk's
        # (chunks under windows shrink to the free pages: one token's).
        need = self.blocks.pages_to_run(total, self.scheduler.max_num_batched_tokens)
        if need > self.blocks.num_pages:
            raise RequestError(f"prompt + max_tokens needs {need} KV pages; the cache has "
                               f"{self.blocks.num_pages} in all (raise kv_cache_memory)", param="max_tokens")
        if params.stop and self.tokenizer is None:
            raise RequestError("stop strings need a tokenizer: Engine(model, tokenizer)", param="stop")

    def add_token_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
                          lora=None, prompt_inputs=None) -> tuple[str, int]:
        """Queue a request for the core alone (``prompt_inputs``: what its prompt brings besides its ids, as
        ``Engine.prepare_images`` makes them of its images); returns its id and seed. ``step_deltas`` returns
        its deltas; the caller makes outputs (the core does not decode)."""
        seq = self._add(list(prompt_ids), params, request_id, lora, prompt_inputs)
        return seq.request_id, seq.seed

    def _add(self, prompt_ids: list[int], params: SamplingParams, request_id, lora, prompt_inputs=None) -> Sequence:
        lora_fields = self._lora_fields(lora)
        self.check_request(prompt_ids, params)
        arrival = next(self._arrivals)
        request_id = str(arrival) if request_id is None else str(request_id)
        if request_id in self.sequences:
            raise RequestError(f"request id {request_id!r} is already in use")
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        seq = Sequence(request_id, prompt_ids, params, seed, arrival, prompt_inputs=prompt_inputs, **lora_fields)
        self.sequences[request_id] = seq
        self.scheduler.add(seq)
        return seq

    def abort(self, request_id: str) -> SequenceDelta | None:
        """Stop a request and free its pages; returns what it gained since its last delta (None for
        an unknown request)."""
        seq = self.sequences.pop(request_id, None)
        if seq is None:
            return None
        self.scheduler.remove(seq)
        self._release_draft(seq)
        if not seq.finished:
            seq.status, seq.finish_reason = Status.FINISHED, "abort"
        return self._delta(seq)

    def finish(self, request_id: str, reason: str) -> None:
        """End a request the caller found finished (a stop string: ``reason`` "stop") and free its pages;
        its deltas so far were returned, so none is made. Nothing for an unknown or finished request."""
        seq = self.sequences.pop(request_id, None)
        if seq is not None and not seq.finished:
            self._finish(seq, reason)

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
        seq.num_reported_tokens = seq.num_output_tokens
        prompt_logprobs = prompt_top = prompt_greedy = ()
        if p < len(seq.prompt_logprobs):  # a prompt chunk's logprobs, before the request's first token
            seq.num_reported_prompt_logprobs = len(seq.prompt_logprobs)
            prompt_logprobs, prompt_top = seq.prompt_logprobs[p:], seq.prompt_top_logprobs[p:]
            prompt_greedy = seq.prompt_greedy[p:]
        return SequenceDelta(seq.request_id, seq.token_ids[seq.num_prompt_tokens + t:], seq.logprobs[t:],
                             seq.top_logprobs[t:] if seq.top_logprobs else (), prompt_logprobs, prompt_top,
                             prompt_greedy, seq.status is Status.FINISHED, seq.finish_reason, seq.error)

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
                                       if not picks_alone(seq) for i in range(len(draft) + 1)],
                              self.suppressed_token_ids)
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
            picked_rows = [row for row, _, _ in picked]
            every_row = len(picked_rows) == logits.shape[0] and picked_rows == list(range(len(picked_rows)))
            temperatures = [seq.params.logprob_temperature for _, seq, _ in picked]
            values = row_logprobs(self.runner, logits if every_row else logits[picked_rows],
                                  [t for _, _, t in picked], temperatures)[0]
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
            return pick_alone(seq, logits[row + i], seq.num_output_tokens + i, before, self.suppressed_token_ids)
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

    def check_lora(self, name: str | None) -> None:
        """Raise ``RequestError`` unless requests can name adapter ``name`` (None: the base model)."""
        self._lora_fields(name)

    def _lora_fields(self, name: str | None) -> dict:
        """The Sequence fields of a request for adapter ``name`` (None: the base model)."""
        if name is None:
            return {}
        if self.loras is None:
            raise RequestError("this engine serves no adapters (Engine(..., max_loras=N))", param="lora")
        return {"lora": name, "hash_seed": bytes.fromhex(self.loras.get(name).sha256)}
