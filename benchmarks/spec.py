"""Speculative decoding: acceptance length, target forwards per generated token and wall time, with
and without speculation, on the same weights and prompts, every output checked bitwise equal to
plain decoding's (token ids and logprobs, ``==``).

Workloads (random weights of the preset's shapes, greedy, ``ignore_eos``):

* ``code_edit`` (method ``ngram``): each prompt is a random "file" followed by the same file again
  with a few tokens changed, as an editing request repeats most of its input; prompt lookup proposes
  from both copies and from the model's own repeats.
* ``free_text`` (method ``draft_model``): random prompts; the draft is the target's first quarter of
  layers with its embeddings, final norm and head (a layer-skip draft: no second checkpoint needed).

Each at batch 1 and 32 (quick: 1 and 2): all requests in flight at once. ``target_forwards`` counts
the target's forwards (the draft's are not counted; ``draft_forwards`` are). On CPU (the Triton
interpreter) only the forward counts mean anything.
"""
from __future__ import annotations

import copy
import time

import torch

from invariant_infer.engine import Engine, SamplingParams
from invariant_infer.testing.random_checkpoints import random_model

from .e2e import build_model, preset_config
from .engine import kv_cache_bytes, random_prompts
from .matmul import DEFAULT_FAMILY, DEFAULT_PRESET
from .timing import Run, _sync, free_memory

BATCHES, QUICK_BATCHES = (1, 32), (1, 2)
FILE_TOKENS, QUICK_FILE_TOKENS = 192, 16
MAX_TOKENS, QUICK_MAX_TOKENS = 64, 6
K, QUICK_K = 4, 3
EDITS = 4  # tokens changed in the second copy of the file
PROMPT_SEED = 5


def code_edit_prompts(count: int, tokens: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    prompts = []
    for _ in range(count):
        file = torch.randint(1, vocab, (tokens,), generator=g)
        edited = file.clone()
        edited[torch.randint(0, tokens, (EDITS,), generator=g)] = torch.randint(1, vocab, (EDITS,), generator=g)
        prompts.append(file.tolist() + edited.tolist())
    return prompts


def layer_skip_draft(target, config, device, dtype):
    """The target's first quarter of layers (at least one), its embeddings, final norm and head."""
    draft_config, layers = copy.deepcopy(config), max(1, config.num_hidden_layers // 4)
    draft_config.num_hidden_layers = layers
    if getattr(draft_config, "layer_types", None):
        draft_config.layer_types = draft_config.layer_types[:layers]
    with torch.device(device):
        draft = random_model(draft_config, seed=1, dtype=dtype)
    draft.load_state_dict(target.state_dict(), strict=False)  # the layers it has take the target's weights
    return draft.eval()


def count_forwards(engine: Engine) -> list[int]:
    count, forward = [0], engine.core.runner.forward

    def counted(inputs):
        count[0] += 1
        return forward(inputs)
    engine.core.runner.forward = counted
    return count


def generate(model, prompts, params, kv_bytes: int, speculative, device) -> tuple[list, dict]:
    engine = Engine(model, max_num_seqs=len(prompts), max_num_batched_tokens=max(2048, sum(map(len, prompts))),
                    kv_cache_memory=kv_bytes, speculative=speculative)
    forwards = count_forwards(engine)
    _sync(device)
    start = time.perf_counter()
    outputs = engine.generate(prompts, params)
    _sync(device)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outputs)
    spec = engine.core.speculative
    row = {"output_tokens": tokens, "target_forwards": forwards[0], "forwards_per_token": forwards[0] / tokens,
           "elapsed_s": elapsed, "tokens_per_s": tokens / max(elapsed, 1e-9),
           "acceptance_length": spec.stats.mean_acceptance_length if spec else None,
           "draft_tokens": spec.stats.num_draft_tokens if spec else None,
           "accepted_tokens": spec.stats.num_accepted_tokens if spec else None,
           "draft_forwards": getattr(spec.proposer, "num_forwards", None) if spec else None}
    return outputs, row


def run(ctx: Run, config=None, dtype=torch.bfloat16, family: str = DEFAULT_FAMILY,
        preset: str = DEFAULT_PRESET) -> dict:
    config, name = preset_config(family, "tiny" if ctx.quick else preset, config)
    batches = QUICK_BATCHES if ctx.quick else BATCHES
    file_tokens = QUICK_FILE_TOKENS if ctx.quick else FILE_TOKENS
    max_tokens, k = (QUICK_MAX_TOKENS, QUICK_K) if ctx.quick else (MAX_TOKENS, K)
    model = build_model(ctx, config, dtype)
    draft = layer_skip_draft(model, config, ctx.device, dtype)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    workloads = {
        "code_edit": ({"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2, "prompt_lookup_max": 4},
                      code_edit_prompts(max(batches), file_tokens, config.vocab_size, PROMPT_SEED)),
        "free_text": ({"method": "draft_model", "model": draft, "num_speculative_tokens": k},
                      random_prompts(max(batches), (file_tokens, 2 * file_tokens), config.vocab_size, PROMPT_SEED)),
    }
    rows = []
    for workload, (speculative, pool) in workloads.items():
        for batch in batches:
            item = f"spec {workload} batch={batch}"
            if ctx.out_of_time(item):
                continue
            prompts = pool[:batch]
            kv_bytes = kv_cache_bytes(config, ctx.device, dtype, batch, max(map(len, prompts)) + max_tokens + k)
            try:
                if ctx.on_gpu:  # warm-up: compiles the kernels for both step shapes
                    generate(model, prompts, SamplingParams(max_tokens=k + 2, ignore_eos=True), kv_bytes,
                             speculative, ctx.device)
                plain, plain_row = generate(model, prompts, params, kv_bytes, None, ctx.device)
                spec, spec_row = generate(model, prompts, params, kv_bytes, speculative, ctx.device)
            except Exception as exc:
                ctx.failed(item, exc)
                continue
            equal = all(a.token_ids == b.token_ids and a.logprobs == b.logprobs for a, b in zip(plain, spec))
            shared = {"workload": workload, "method": speculative["method"], "batch": batch, "k": k,
                      "prompt_tokens": sum(map(len, prompts)), "max_tokens": max_tokens, "preset": name,
                      "dtype": str(dtype)[6:], "bitwise_equal": equal}
            rows.append({**shared, "speculative": False, **plain_row, "speedup": None})
            rows.append({**shared, "speculative": True, **spec_row,
                         "speedup": plain_row["elapsed_s"] / max(spec_row["elapsed_s"], 1e-9)})
            free_memory(ctx.device)
    del model, draft
    free_memory(ctx.device)
    return {"spec": rows}
