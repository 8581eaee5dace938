"""Runs one engine step: packs the scheduled tokens as ``[1, T]``, runs the model's own modules
over them with attention on the paged KV cache, and turns the rows that need them into logits.

The Hugging Face modules run unchanged (one engine for every family): projections, norms and
MLP see ``T`` packed rows, which is all they need since each row is computed alone; RoPE looks up
each token's absolute position. The step reaches the layers as one ``StepContext``
(``invariant_infer.model.step_context``), built by ``load`` before the forward and active during
it: its ``attention`` (``PagedBatch``) lets each attention call write the step's K/V into the pages
and attend over each sequence's own pages, through its KV cache group's block table
(``kv_cache_layout``: one K and one V tensor per position in a group, one block table per group);
layers with a linear-attention state (Gated DeltaNet) hold no pages and read its
``linear_attention`` step over the engine's state slots, a sequence's slot being its block-table
row (``linear_state_slots``); projections with adapter slots read its ``lora_groups``
(``lora_slots``). A request's prompt inputs (``model.prompt_inputs``: a prompt with images) give its
tokens' positions on each rope axis and replace its overridden rows' input embeddings.

Under tensor parallelism (a model that ``TensorParallelRanks`` drives), each rank holds its shard of
the KV heads in its own pages; rank 0 schedules, and each step's metadata (plain lists: token ids,
positions, slots, block tables) goes to every rank through the executor's ``collective_rpc``
(``invariant_infer.model.executor``), so all ranks run the same forward and the same logits rows.

The step's metadata is copied into buffers allocated once, and ``decode_buckets`` pads a
decode-only step to a fixed number of rows. With ``cuda_graphs``, such a step takes its bucket's
fixed shapes (block tables at full width, the worst case's host ints) and replays the bucket's
captured forward (``decode_graphs.py``), which reads only those buffers.

``kernels="invariant"`` (the model is wrapped by ``make_invariant``) runs the paged Triton
attention kernel, bitwise equal to the padded kernel ``model(...)`` uses; ``kernels="stock"``
(an unwrapped model) runs stock linear layers and torch SDPA per sequence, for benchmarks (both in
``engine/paged_batch.py``).
"""
from __future__ import annotations

import itertools
import warnings
import weakref

import torch
from transformers import AttentionInterface

from ..model.checks import base_model
from ..model.cache_specs import attention_head_dims, linear_attention_layers
from ..model.families import attention_setting, rope_position_axes, text_config
from ..model.logits import head_logits, logit_softcap
from ..kernels import attention_config, token_logprobs
from ..model.padding import sequence_bounds
from ..model.prompt_inputs import decoder_token_inputs
from ..model.step_context import StepContext
from ..model.executor import Executor, RankState, executor_for, worker_command
from ..model.tensor_parallel import tp_layout
from .decode_graphs import DecodeGraphs, cuda_graphs_refusal
from .kv_cache_layout import kv_cache_layout
from .kv_cache_manager import block_table_rows
from .linear_state import QueuedStateCopies
from .linear_state_slots import LinearAttentionSlots
from .lora_slots import LoraSlots
from .paged_batch import PagedBatch, paged_stock_attention
from .step_inputs import StepInputs, StepMetadata
from .scheduler import ScheduledChunk
from ..errors import InvalidArgumentError

STOCK_ATTN_IMPLEMENTATION = "invariant_infer_paged_stock"
_RUNNER_IDS = itertools.count()  # names a runner to the other ranks (one engine's KV pages there)


class ModelRunner:
    def __init__(self, model, *, num_pages: int, page_size: int, invariant: bool, max_num_seqs: int,
                 max_num_batched_tokens: int, decode_buckets: tuple[int, ...] = (), executor: Executor | None = None,
                 max_loras: int = 0, max_lora_rank: int = 16, saved_states: int = 0, cuda_graphs: bool = False):
        """``saved_states``: room for that many saved linear-attention states (hybrid models' prefix
        caching). ``cuda_graphs``: replay decode steps of the ``decode_buckets`` as CUDA graphs
        (``decode_graphs.py``; ``decode_graphs.cuda_graphs_refusal`` says where they cannot run)."""
        self.model, self.invariant = model, invariant
        self.executor = executor_for(model, executor)
        config = text_config(model.config)
        self.base = base_model(model)  # the decoder (a vision-language model's language model)
        self.position_axes = rope_position_axes(model.config)
        self.lm_head = model.get_output_embeddings()
        self.device, self.dtype = self.lm_head.weight.device, self.lm_head.weight.dtype
        self.softcap = logit_softcap(model.config)  # Gemma 4 caps its final logits
        self.num_layers = config.num_hidden_layers
        layout = tp_layout(model)
        self.tp_size = layout.size if layout else 1
        if self.tp_size > 1 and not invariant:
            raise InvalidArgumentError("kernels='stock' runs one process only (stock tensor parallelism is not "
                                       "invariant)")
        self.page_size, self.num_pages = page_size, num_pages
        self.decode_buckets = sorted(set(decode_buckets))
        if any(type(b) is not int or b < 1 for b in self.decode_buckets):
            raise InvalidArgumentError(f"decode_buckets must be positive integers, got {decode_buckets!r}")
        if self.decode_buckets and config.max_position_embeddings < page_size:
            raise InvalidArgumentError(f"decode_buckets: padding rows take positions up to the page size {page_size}, "
                                       f"more than max_position_embeddings {config.max_position_embeddings}")
        # Padding row i writes slot i of the scratch pages that follow the block manager's pages.
        max_bucket = max(self.decode_buckets, default=0)
        self.scratch_pages = -(-max_bucket // page_size)
        self.padding_rows = 0  # padding rows run, since start
        # One K and one V tensor per position in a KV cache group (or each group's view of the pages);
        # layer (group g, position j) uses tensor j through group g's block table, a KV-shared layer its
        # source's. Layers without pages get None.
        self.layout = kv_cache_layout(model.config)
        self.num_groups = len(self.layout.groups)
        self.k_caches, self.v_caches = self.layout.allocate(num_pages + self.scratch_pages, self.page_size, self.dtype,
                                                            self.device, self.num_layers, self.tp_size)
        places = [self.layout.place(layer) for layer in range(self.num_layers)]
        self.layer_groups = [p[0] if p else None for p in places]
        self.writes_kv = [self.layout.writes_kv(layer) for layer in range(self.num_layers)]
        # Step metadata lives in buffers allocated once (a captured graph reads fixed addresses).
        max_tokens, max_seqs = max(max_num_batched_tokens, max_bucket), max(max_num_seqs, max_bucket)
        max_pages = self.max_pages = -(-config.max_position_embeddings // page_size)

        def buffer(*size, dtype):
            return torch.zeros(size, dtype=dtype, device=self.device)
        self.input_ids, self.positions = buffer(max_tokens, dtype=torch.long), buffer(max_tokens, dtype=torch.long)
        self.positions_by_axis = buffer(self.position_axes, max_tokens, dtype=torch.long) \
            if self.position_axes > 1 else None
        self.slot_mapping = buffer(self.num_groups, max_tokens, dtype=torch.int64)
        self.query_starts, self.seq_lens = buffer(max_seqs + 1, dtype=torch.int32), buffer(max_seqs, dtype=torch.int32)
        self.block_tables = buffer(self.num_groups, max_seqs, max_pages, dtype=torch.int32)
        # The persistent block tables, one per group: a row per sequence holding pages (updated by
        # the cache manager's writes), then one per scratch page, which padding rows read.
        self.num_table_rows = block_table_rows(max_num_seqs)
        self.table = buffer(self.num_groups, self.num_table_rows + self.scratch_pages, max_pages, dtype=torch.int32)
        self.table[:, self.num_table_rows:, 0] = torch.arange(num_pages, num_pages + self.scratch_pages,
                                                              dtype=torch.int32)
        self.table_row_ids = buffer(max_seqs, dtype=torch.long)
        # Linear-attention layers' state: a slot per block-table row, so a sequence's slot is its row
        # (held from its first page until it finishes, is aborted or preempted); None without such layers.
        self.linear_slots = LinearAttentionSlots.for_layers(
            self.base.layers, self.num_table_rows + self.scratch_pages, self.device, self.dtype,
            saved_states) if linear_attention_layers(model.config) else None
        # Every step's metadata goes to the device in one copy, from a pinned staging buffer on CUDA:
        # ids, positions, slots per group, query starts, lengths, block-table rows, LoRA rows.
        self.max_staged = (3 + self.num_groups) * max_tokens + 3 * max_seqs + 1
        self.staged = buffer(self.max_staged, dtype=torch.long)
        self.staging = torch.zeros(self.max_staged, dtype=torch.long, pin_memory=self.device.type == "cuda")
        self.staging_copied = torch.cuda.Event() if self.device.type == "cuda" else None
        self.pending_writes: list[tuple[int, int, int]] = []  # taken from the block manager, not yet applied
        self.state_copies = QueuedStateCopies()
        if not invariant:  # the stock baseline's paged attention, until the runner goes
            AttentionInterface.register(STOCK_ATTN_IMPLEMENTATION, paged_stock_attention)
            weakref.finalize(self, model.set_attn_implementation, attention_setting(model.config))
            model.set_attn_implementation(attention_setting(model.config, STOCK_ATTN_IMPLEMENTATION))
        # Every other rank builds the same runner over its shard, held there under runner_id.
        self.runner_id = next(_RUNNER_IDS)
        options = dict(num_pages=num_pages, page_size=page_size, invariant=invariant, max_num_seqs=max_num_seqs,
                       max_num_batched_tokens=max_num_batched_tokens, decode_buckets=tuple(decode_buckets),
                       saved_states=saved_states)
        self.executor.collective_rpc(_start_runner, (self.runner_id, options), lambda: None)
        weakref.finalize(self, self.executor.release, self.runner_id)
        # LoRA adapter slots (max_loras 0: none): this runner's registry and slots, which give every
        # other rank's runner its slots over its shard (lora_slots.py).
        self.loras = LoraSlots(self, max_loras, max_lora_rank) if max_loras else None
        self.decode_graphs: DecodeGraphs | None = None  # the captured decode buckets (decode_graphs.py)
        if cuda_graphs:
            refusal = cuda_graphs_refusal(self.device, invariant=invariant, tensor_parallel_size=self.tp_size,
                                          max_loras=max_loras)
            if refusal or not self.decode_buckets:
                raise InvalidArgumentError(f"cuda_graphs: {refusal or 'no decode_buckets to capture'}")
            self.decode_graphs = DecodeGraphs()


    @staticmethod
    def page_size_for(config, device: torch.device, dtype: torch.dtype) -> int:
        """The attention kernel's KV block: a page never splits one (the largest block, a power of two,
        where layers have different head_dims)."""
        return max(attention_config(device.type, dtype, d).block_n for d in attention_head_dims(config))

    def bucket(self, chunks: list[ScheduledChunk]) -> int:
        """Rows of the step: a decode-only step is padded to the smallest bucket that holds it."""
        if all(chunk.num_tokens == 1 for chunk in chunks):
            for size in self.decode_buckets:
                if size >= len(chunks):
                    return size
        return len(chunks)

    def graph_bucket(self, chunks: list[ScheduledChunk]) -> int:
        """The bucket whose CUDA graph runs this step, or 0 (eager): decode-only steps that a bucket holds."""
        if self.decode_graphs is None or not all(chunk.num_tokens == 1 for chunk in chunks):
            return 0
        return next((size for size in self.decode_buckets if size >= len(chunks)), 0)

    def prepare(self, chunks: list[ScheduledChunk], table_writes: list[tuple[int, int, int, int]]) -> StepInputs:
        """The step's inputs; ``table_writes``: the cache manager's writes since the last step."""
        self.pending_writes += table_writes
        metadata = self.step_metadata(chunks)
        if metadata.graph_bucket and metadata.graph_bucket not in self.decode_graphs:
            try:
                self._capture(metadata.graph_bucket)
            except Exception as exc:  # noqa: BLE001  (graphs are speed only: the same bits run eager)
                warnings.warn(f"CUDA graphs turned off: capturing the decode bucket of {metadata.graph_bucket} "
                              f"rows failed ({type(exc).__name__}: {exc}); decode steps run eager", stacklevel=2)
                self.decode_graphs, metadata.graph_bucket = None, 0
        metadata.state_copies, self.state_copies.pending = self.state_copies.pending, []
        if self.loras is not None:
            metadata.lora_groups = self.loras.groups_for(chunks)
        inputs = self.load(metadata)
        self.pending_writes = []
        return inputs

    def step_metadata(self, chunks: list[ScheduledChunk], rows: int | None = None) -> StepMetadata:
        """The chunks' packed tokens and pages: O(tokens + sequences) work, whatever the lengths.
        Padding rows (one token each, at position i % page_size of scratch page i // page_size,
        attending to the scratch keys before it) compute alone, like every row, so no real row's
        bits change. ``rows``: pad to that many rows instead of the step's bucket. A step that a
        CUDA graph replays has the graph's shapes: its block tables at their full width."""
        page_size = self.page_size
        ids, positions, starts, lens, table_rows = [], [], [0], [], []
        slots = [[] for _ in range(self.num_groups)]
        width = 1
        by_axis, overrides = [], []
        for chunk in chunks:
            seq, start, end = chunk.seq, chunk.start, chunk.start + chunk.num_tokens
            if self.position_axes > 1:
                by_axis.append(self._positions_by_axis(seq, start, end))
            if seq.prompt_inputs is not None:
                chunk_overrides = seq.prompt_inputs.overrides_of(start, end)
                if chunk_overrides is not None:
                    overrides.append((len(ids), chunk_overrides))
            ids += chunk.token_ids
            positions += range(start, end)
            for group, pages in zip(slots, seq.pages):
                group += [pages[p // page_size] * page_size + p % page_size for p in range(start, end)]
            starts.append(starts[-1] + chunk.num_tokens)
            lens.append(end)
            table_rows.append(seq.block_row)
            width = max(width, -(-end // page_size))
        num_real = len(ids)
        # A graph embeds token ids only: a step with embedding overrides (a prompt's image rows) runs eager.
        graph_bucket = (0 if overrides else self.graph_bucket(chunks)) if rows is None else rows
        if graph_bucket:
            width = self.max_pages
        for i in range((self.bucket(chunks) if rows is None else rows) - len(chunks)):
            page, offset = self.num_pages + i // page_size, i % page_size
            ids.append(0)
            positions.append(offset)
            for group in slots:
                group.append(page * page_size + offset)
            starts.append(starts[-1] + 1)
            lens.append(offset + 1)
            table_rows.append(self.num_table_rows + i // page_size)
        self.padding_rows += len(ids) - num_real
        metadata = StepMetadata(ids, positions, [slot for group in slots for slot in group], starts, lens, table_rows,
                                width, list(self.pending_writes), num_real, graph_bucket=graph_bucket)
        if self.position_axes > 1:
            padding = torch.tensor(positions[num_real:], dtype=torch.long)[None].expand(self.position_axes, -1)
            metadata.positions_by_axis = torch.cat(by_axis + [padding], dim=1).flatten().tolist()
        metadata.embedding_overrides = overrides
        return metadata

    def _positions_by_axis(self, seq, start: int, end: int) -> torch.Tensor:
        """long [axes, end - start]: a request's positions per rope axis (its prompt inputs', or else its
        index on every axis)."""
        if seq.prompt_inputs is not None:
            return seq.prompt_inputs.positions_of(start, end)
        return torch.arange(start, end)[None].expand(self.position_axes, -1)

    def load(self, metadata: StepMetadata) -> StepInputs:
        """Apply the block-table writes, copy the step's metadata into the persistent buffers (one
        host-to-device copy, then copies on the device) and build the step's context."""
        m = metadata
        tokens, seqs, width = len(m.ids), len(m.seq_lens), m.table_width
        writes = m.table_writes
        lora_sizes = [len(rows) for _, rows in m.lora_groups]
        flat = m.ids + m.positions + m.slots + m.query_starts + m.seq_lens + m.table_rows
        flat += [row for _, rows in m.lora_groups for row in rows]
        flat += [value for write in writes for value in write]
        if len(flat) > self.max_staged:  # many writes at once (a long prefix hit): a larger staging copy
            staged = torch.tensor(flat, dtype=torch.long).to(self.device)
        else:
            host = torch.tensor(flat, dtype=torch.long)
            if self.staging_copied is not None:
                self.staging_copied.synchronize()  # the last step's copy has left the staging buffer
                self.staging[:len(flat)].copy_(host)
                host = self.staging[:len(flat)]
            staged = self.staged[:len(flat)]
            staged.copy_(host, non_blocking=True)
            if self.staging_copied is not None:
                self.staging_copied.record()
        groups = self.num_groups
        pieces = torch.split(staged, [tokens, tokens, groups * tokens, seqs + 1, seqs, seqs, sum(lora_sizes),
                                      4 * len(writes)])
        if writes:
            write = pieces[7].view(-1, 4)
            self.table[write[:, 0], write[:, 1], write[:, 2]] = write[:, 3].to(torch.int32)
        self.input_ids[:tokens].copy_(pieces[0])
        self.positions[:tokens].copy_(pieces[1])
        position_ids = self.positions[:tokens][None]
        if self.positions_by_axis is not None:
            self.positions_by_axis[:, :tokens].copy_(torch.tensor(m.positions_by_axis).view(-1, tokens))
            position_ids = self.positions_by_axis[:, None, :tokens]
        self.slot_mapping[:, :tokens].copy_(pieces[2].view(groups, tokens))
        self.query_starts[:seqs + 1].copy_(pieces[3])
        self.seq_lens[:seqs].copy_(pieces[4])
        self.table_row_ids[:seqs].copy_(pieces[5])
        tables = self.block_tables[:, :seqs, :width]
        tables.copy_(self.table[:, :, :width].index_select(1, self.table_row_ids[:seqs]))
        starts = m.query_starts
        # A graph's step: the host ints of its bucket's worst case (one query each, the tables' whole
        # width), so that every step of the bucket replays the same launches.
        max_query_len = 1 if m.graph_bucket else max(starts[s + 1] - starts[s] for s in range(seqs))
        max_seq_len = width * self.page_size if m.graph_bucket else max(m.seq_lens, default=0)
        attention = PagedBatch(self.k_caches, self.v_caches, tuple(self.slot_mapping[:, :tokens].unbind(0)),
                               self.query_starts[:seqs + 1], self.seq_lens[:seqs], tuple(tables.unbind(0)),
                               self.layer_groups, self.writes_kv, max_query_len, max_seq_len, starts, m.seq_lens,
                               self.invariant)
        linear = None
        if self.linear_slots is not None and m.graph_bucket:  # the graph lays the step out (_capture)
            self.linear_slots.copy_states(m.state_copies)
        elif self.linear_slots is not None:
            linear = self.linear_slots.step_of(m.state_copies, pieces[5], pieces[3], pieces[4], tokens,
                                               self.num_table_rows)
        lora_groups = tuple(zip((slot for slot, _ in m.lora_groups), torch.split(pieces[6], lora_sizes)))
        context = StepContext(attention, linear, lora_groups)
        return StepInputs(self.input_ids[:tokens][None], position_ids, context, m.num_real_tokens, m)

    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """Final hidden states [T, H] of the step's real packed tokens (on every rank, in step)."""
        return self.executor.collective_rpc(_forward_on_rank, (self.runner_id, inputs.metadata),
                                            lambda: self._forward(inputs))

    @torch.inference_mode()
    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        bucket = inputs.metadata.graph_bucket if inputs.metadata is not None else 0
        if bucket:  # a copy: the graph's output is overwritten by its next replay
            return self.decode_graphs.replay(bucket)[:inputs.num_real_tokens].clone()
        tokens = decoder_token_inputs(self.base.embed_tokens, inputs.input_ids, inputs.metadata.embedding_overrides)
        return self._run_decoder(tokens, inputs.position_ids, inputs.context)[:inputs.num_real_tokens]

    def _run_decoder(self, tokens: dict, position_ids: torch.Tensor, context: StepContext) -> torch.Tensor:
        """The decoder's final hidden states [T, H] of the packed step, its linear-attention state committed."""
        # A prepared 4-D mask: transformers passes it through untouched (attention ignores it here).
        mask = sequence_bounds(None, 1, position_ids.shape[-1], 0, self.device)
        with context.active():
            out = self.base(**tokens, position_ids=position_ids, attention_mask=mask, use_cache=False)
        if context.linear_attention is not None:
            context.linear_attention.commit()
        return out.last_hidden_state[0]

    def _capture(self, bucket: int) -> None:
        """Capture the forward of a decode step of ``bucket`` rows: load a step of padding rows alone
        (which the capture's warm-up runs: it writes scratch pages and slots only), then capture a
        forward that reads the persistent buffers, laying out the Gated DeltaNet step from them too."""
        padding = self.step_metadata([], rows=bucket)
        padding.table_writes = []  # the next real step applies them
        inputs = self.load(padding)
        attention, input_ids, position_ids = inputs.context.attention, inputs.input_ids, inputs.position_ids
        rows, starts, lens = self.table_row_ids[:bucket], self.query_starts[:bucket + 1], self.seq_lens[:bucket]

        def forward() -> torch.Tensor:
            linear = None if self.linear_slots is None else self.linear_slots.step_of(
                (), rows, starts.long(), lens.long(), bucket, self.num_table_rows)
            return self._run_decoder(dict(input_ids=input_ids), position_ids, StepContext(attention, linear))
        self.decode_graphs.capture(bucket, forward)

    def hidden_states(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        return self.forward(self.prepare(chunks, []))

    def logits_of(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """Logits [R, V] of the rows ``rows`` of a forward's hidden states (on every rank, in step:
        under tensor parallelism each rank computes its vocabulary slice)."""
        def local():
            return self.logits(hidden[torch.tensor(rows, device=hidden.device)])
        return self.executor.collective_rpc(_logits_on_rank, (self.runner_id, rows), local)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [R, V] (model dtype) of hidden rows [R, H]. Under tensor parallelism, the sharded
        head's own forward: its slice, then an all-gather (copies)."""
        return head_logits(hidden, self.lm_head.weight, self.lm_head.bias,
                           head=self.lm_head if self.tp_size > 1 else None, invariant=self.invariant,
                           softcap=self.softcap)

    @torch.inference_mode()
    def logprobs(self, logits: torch.Tensor, targets: torch.Tensor,
                 temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """(fp32 [R] log_softmax(logits.float() / temperature)[r, targets[r]], bool [R] target is the
        row's first argmax)."""
        if self.invariant:
            return token_logprobs(logits, targets, temperature)
        targets = targets.to(logits.device)
        scaled = logits.float() / temperature
        logprobs = torch.log_softmax(scaled, dim=-1).gather(1, targets[:, None])[:, 0]
        return logprobs, scaled.argmax(-1) == targets


# ---- the other ranks' part of each step (under tensor parallelism) ---------------------------------

@worker_command
def _start_runner(rank: RankState, payload) -> None:
    runner_id, options = payload
    rank.held[runner_id] = [ModelRunner(rank.model, **options), None]  # [runner, its last hidden states]


@worker_command
def _forward_on_rank(rank: RankState, payload) -> None:
    runner_id, metadata = payload
    entry = rank.held[runner_id]
    entry[1] = entry[0].forward(entry[0].load(metadata))  # its own LocalExecutor: this rank's part


@worker_command
def _logits_on_rank(rank: RankState, payload) -> None:
    runner_id, rows = payload
    runner, hidden = rank.held[runner_id]
    runner.logits_of(hidden, rows)
