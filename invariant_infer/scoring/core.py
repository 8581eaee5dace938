"""Score sequences with a batch-invariant model: per-token logprobs that do not depend on batching.

Because every kernel is batch-invariant, sequences may be sorted and packed into batches any
way that is fast, and each sequence's logprobs keep the same bits. Logits are never held as
one [tokens x vocab] fp32 tensor: the lm_head runs on row chunks with the M-invariant linear
kernel, and each chunk is reduced to logprobs at once by the ``token_logprobs`` kernel
(``invariant_infer.model.logits``, which the engine and training share).

    model = make_invariant(AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval())
    results = score_sequences(model, [[1, 2, 3], [4, 5, 6, 7]], prompt_lengths=[1, 2])
    results[1].token_logprobs  # logprobs of tokens 6 and 7
"""
from __future__ import annotations

import hashlib
import math
import sys
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from ..errors import InvalidArgumentError, RequestError, TensorParallelError, raise_if_device_failure
from ..model.logits import logit_softcap
from ..model.logits import LOGITS_CHUNK_ELEMENTS, token_logprobs_from_hidden  # noqa: F401  (its public home)
from ..model.lora import unwrap_peft
from ..model.families import is_vision_language, text_config
from ..model.image_inputs import PromptImages, expanded_position, prepare_prompt_images, split_multimodal
from ..model.kinds import model_kinds
from ..model.support import require
from ..model.patch import is_invariant
from ..model.executor import Executor, RankState, executor_for, worker_command
from ..model.tensor_parallel import tp_layout

DEFAULT_MAX_BATCH_TOKENS = 8192


def logprob_digest(token_logprobs: torch.Tensor | Sequence[float]) -> str:
    """sha256 hex of the float32 little-endian bytes of the logprobs."""
    values = token_logprobs.numpy() if isinstance(token_logprobs, torch.Tensor) else token_logprobs
    return hashlib.sha256(np.asarray(values, dtype="<f4").tobytes()).hexdigest()


@dataclass(frozen=True)
class ScoreResult:
    """Logprobs of the scored tokens of one sequence (fp32, on CPU)."""
    token_logprobs: torch.Tensor
    greedy: bool  # every scored token is the argmax of its distribution (ties: the first index)

    @property
    def num_tokens(self) -> int:
        return self.token_logprobs.numel()

    @property
    def logprob(self) -> float:
        return math.fsum(self.token_logprobs.tolist())  # exactly rounded: no order to depend on

    @property
    def digest(self) -> str:
        return logprob_digest(self.token_logprobs)


def check_sequence(ids: Sequence[int], prompt_length: int, vocab_size: int, max_positions: int) -> None:
    """Raise ValueError unless ``ids`` can be scored from position ``prompt_length`` on."""
    if not ids:
        raise InvalidArgumentError("empty sequence")
    if prompt_length < 1:
        raise InvalidArgumentError("empty prompt: the first token has no context, so it has no logprob")
    if prompt_length >= len(ids):
        raise InvalidArgumentError("nothing to score: need at least one token after the prompt (or after the first "
                                   "token)")
    if len(ids) > max_positions:
        raise InvalidArgumentError(f"sequence of {len(ids)} tokens is longer than the model's {max_positions} "
                                   "positions")
    bad = [t for t in ids if type(t) is not int or not 0 <= t < vocab_size]
    if bad:
        raise InvalidArgumentError(f"token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")


def plan_batches(lengths: Sequence[int], max_batch_tokens: int) -> list[list[int]]:
    """Indices grouped into batches, longest sequences first, each holding at most
    ``max_batch_tokens`` padded tokens (rows x longest). A sequence over the budget runs alone."""
    if max_batch_tokens < 1:
        raise InvalidArgumentError("max_batch_tokens must be at least 1")
    batches: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        # Sorted by decreasing length, so a batch's first row is its longest.
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= max_batch_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def naive_token_logprobs(hidden: torch.Tensor, lm_head_weight: torch.Tensor, targets: torch.Tensor,
                         lm_head_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The usual way, for benchmarks: full fp32 [T x V] logits, then torch.log_softmax and a gather."""
    logits = torch.nn.functional.linear(hidden, lm_head_weight, lm_head_bias).float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return logprobs.gather(1, targets[:, None])[:, 0], logits.argmax(-1) == targets


def score_batch(model, sequences: Sequence[Sequence[int]], prompt_lengths: Sequence[int], *,
                chunk_rows: int | None = None, executor: Executor | None = None,
                images: Sequence[PromptImages | None] | None = None) -> list[ScoreResult]:
    """Score one batch (right-padded) in one forward of the base model, through ``executor``
    (default: this process alone; ``TensorParallelRanks``: on every rank, in step). ``images``: per
    sequence, its processed images (``sequences[i]`` is then ``images[i].token_ids``) or None."""
    executor = executor_for(model, executor)
    return executor.collective_rpc(
        _score_batch_on_rank, (list(sequences), list(prompt_lengths), chunk_rows, images),
        lambda: score_batch_here(model, sequences, prompt_lengths, chunk_rows=chunk_rows, images=images))


@worker_command
def _score_batch_on_rank(rank: RankState, payload) -> None:
    sequences, prompt_lengths, chunk_rows, images = payload
    score_batch_here(rank.model, sequences, prompt_lengths, chunk_rows=chunk_rows, images=images)


def _image_inputs(images: Sequence[PromptImages | None] | None, device) -> dict:
    """The multimodal model's image arguments for a batch's rows, in row order (each row's images in its
    order): what fills the image tokens of the batch row by row."""
    prompts = [p for p in images or () if p is not None]
    if not prompts:
        return {}
    return {"pixel_values": torch.cat([p.pixel_values for p in prompts]).to(device),
            "image_grid_thw": torch.cat([p.image_grid_thw for p in prompts]).to(device)}


@torch.inference_mode()
def score_batch_here(model, sequences: Sequence[Sequence[int]], prompt_lengths: Sequence[int], *,
                     chunk_rows: int | None = None,
                     images: Sequence[PromptImages | None] | None = None) -> list[ScoreResult]:
    """``score_batch`` in this process alone (a rank of a tensor-parallel model runs its share)."""
    lm_head = model.get_output_embeddings()
    device = lm_head.weight.device
    longest = max(len(s) for s in sequences)
    # The pad id is masked out, any id would do but the image token's, which would count as an image's.
    pad = 1 if getattr(model.config, "image_token_id", None) == 0 else 0
    ids = torch.full((len(sequences), longest), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    rows, positions = [], []
    for r, (seq, start) in enumerate(zip(sequences, prompt_lengths)):
        ids[r, :len(seq)] = torch.tensor(seq, dtype=torch.long)
        mask[r, :len(seq)] = 1
        rows += [r] * (len(seq) - start)
        positions += range(start - 1, len(seq) - 1)  # hidden state at p predicts token p + 1
    ids, mask = ids.to(device), mask.to(device)
    rows_t = torch.tensor(rows, dtype=torch.long, device=device)
    positions_t = torch.tensor(positions, dtype=torch.long, device=device)
    # The base model only: the CausalLM forward would build the full logits.
    hidden = model.model(input_ids=ids, attention_mask=mask, use_cache=False,
                         **_image_inputs(images, device)).last_hidden_state
    logprobs, is_argmax = token_logprobs_from_hidden(
        hidden[rows_t, positions_t], lm_head.weight, ids[rows_t, positions_t + 1], lm_head_bias=lm_head.bias,
        chunk_rows=chunk_rows, head=lm_head if tp_layout(model) is not None else None,
        softcap=logit_softcap(model.config))
    logprobs, is_argmax = logprobs.cpu(), is_argmax.cpu()
    results, offset = [], 0
    for seq, start in zip(sequences, prompt_lengths):
        n = len(seq) - start
        results.append(ScoreResult(logprobs[offset:offset + n].clone(), bool(is_argmax[offset:offset + n].all())))
        offset += n
    return results


def split_sequence(sequence) -> tuple[list[int], list | None]:
    """(token ids, images or None) of a sequence: token ids (a list, tensor or array), or vLLM's multimodal
    form ``{"prompt_token_ids": ids, "multi_modal_data": {"image": image or [images]}}``."""
    if not isinstance(sequence, dict):
        return (sequence.tolist() if hasattr(sequence, "tolist") else list(sequence)), None
    ids, images = split_multimodal(sequence, "scoring")
    if isinstance(ids, str):
        raise InvalidArgumentError("score_sequences takes token ids ('prompt_token_ids'), not text")
    return split_sequence(ids)[0], images


def prepare_sequence(config, processor, ids: list[int], prompt_length: int,
                     images) -> tuple[list[int], int, PromptImages | None]:
    """(token ids, prompt length, processed images) of a sequence whose ``images`` fill its image tokens
    (one per image, or each image's tokens); the prompt length counts one token per image, the ids and
    length returned count every image token. Raises ``RequestError`` (a ValueError)."""
    if not images:
        return ids, prompt_length, None
    if not is_vision_language(config):
        raise RequestError(f"{config.model_type} takes no images", param="multi_modal_data")
    prompt = prepare_prompt_images(getattr(processor, "image_processor", processor), config, ids, images)
    return prompt.token_ids, expanded_position(ids, config.image_token_id, prompt.counts, prompt_length), prompt


def score_sequences(model, sequences: Sequence, *, prompt_lengths: Sequence[int] | None = None,
                    processor=None, max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS, chunk_rows: int | None = None,
                    progress: bool | Callable[[int], None] = False,
                    executor: Executor | None = None) -> list[ScoreResult]:
    """Per-token logprobs of each sequence, in input order, bitwise the same for any batching.

    ``prompt_lengths[i]`` tokens of sequence i are context only; the rest are scored. The
    default, 1, scores every token after the first. ``model`` must be patched by
    ``make_invariant``. ``progress``: True for a tqdm bar on stderr, or a callable given the
    number of tokens each batch processed. ``executor``: where each batch runs (default: this
    process; for the model of ``TensorParallelRanks``, pass the ranks: ``executor=ranks``).

    With a vision-language model, a sequence may hold images in vLLM's form, ``{"prompt_token_ids":
    ids, "multi_modal_data": {"image": [...]}}`` (HxWx3 uint8 arrays or PIL images, the ids holding
    one image token per image), processed one by one by ``processor`` (the checkpoint's
    ``AutoProcessor`` or image processor). Its prompt length counts one token per image; its scores
    start after the prompt with every image token, as the engine's ``score`` gives them."""
    model = unwrap_peft(model)  # a PeftModel scores through the model inside (its LoRA layers unmerged)
    executor = executor_for(model, executor)
    if not is_invariant(model):
        raise InvalidArgumentError("score_sequences needs a batch-invariant model: call make_invariant(model) first")
    require(model_kinds(model), "scoring", getattr(model.config, "model_type", None))
    if prompt_lengths is None:
        prompt_lengths = [1] * len(sequences)
    if len(prompt_lengths) != len(sequences):
        raise InvalidArgumentError(f"{len(prompt_lengths)} prompt_lengths for {len(sequences)} sequences")
    config = model.config
    prepared = []
    for i, (sequence, start) in enumerate(zip(sequences, prompt_lengths)):
        try:
            ids, images = split_sequence(sequence)
            ids, start, images = prepare_sequence(config, processor, ids, start, images)
            check_sequence(ids, start, text_config(config).vocab_size, text_config(config).max_position_embeddings)
        except ValueError as exc:
            raise InvalidArgumentError(f"sequence {i}: {exc}") from None
        prepared.append((ids, start, images))
    sequences, prompt_lengths, images = (list(column) for column in zip(*prepared)) if prepared else ([], [], [])
    bar = None
    if progress is True:
        from tqdm import tqdm
        bar = tqdm(total=sum(len(s) for s in sequences), unit="tok", unit_scale=True, file=sys.stderr)
        progress = bar.update
    results: list[ScoreResult | None] = [None] * len(sequences)
    for batch in plan_batches([len(s) for s in sequences], max_batch_tokens):
        scored = score_batch(model, [sequences[i] for i in batch], [prompt_lengths[i] for i in batch],
                             chunk_rows=chunk_rows, executor=executor, images=[images[i] for i in batch])
        for i, result in zip(batch, scored):
            results[i] = result
        if progress:
            progress(sum(len(sequences[i]) for i in batch))
    if bar is not None:
        bar.close()
    return results


def _score_or_error(model, sequences, prompt_lengths, executor, images) -> list[ScoreResult] | str:
    try:
        return score_batch(model, sequences, prompt_lengths, executor=executor, images=images)
    except TensorParallelError:  # not a row's fault: the ranks stopped
        raise
    except Exception as exc:  # reported per row by score_group; a device failure is no row's
        raise_if_device_failure(exc, "scoring a batch")
        return f"scoring failed: {type(exc).__name__}: {exc}"


def score_group(model, sequences: Sequence[Sequence[int]], prompt_lengths: Sequence[int], *,
                executor: Executor | None = None,
                images: Sequence[PromptImages | None] | None = None) -> list[ScoreResult | str]:
    """``score_batch``, except that a batch whose scoring raises is scored again row by row (which
    changes no bit of a row): one bad row never fails the others. A row that raises alone gets the
    message of its exception, a str, in place of its ``ScoreResult``. Out of memory and device
    errors are no row's fault: they raise ``DeviceError`` at once, and no row is retried."""
    images = list(images) if images is not None else [None] * len(sequences)
    scored = _score_or_error(model, sequences, prompt_lengths, executor, images)
    if not isinstance(scored, str):
        return scored
    if len(sequences) == 1:
        return [scored]
    alone = [_score_or_error(model, [seq], [start], executor, [prompt])
             for seq, start, prompt in zip(sequences, prompt_lengths, images)]
    return [r if isinstance(r, str) else r[0] for r in alone]
