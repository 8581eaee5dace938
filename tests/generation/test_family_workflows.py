"""The library built on make_invariant, for every family: generate (greedy and seeded, dynamic and
static cache) batched == alone and decode == one forward pass; score_sequences independent of
batching. The CLIs on top run on one family each besides the tiny Qwen2 of test_scoring_cli:
``invariant-infer score`` digests independent of --max-batch-tokens and equal to ``score_sequences``'
(also on the families with their own model tests), ``invariant-infer demo --model``."""
from __future__ import annotations

import json

import pytest
import torch

from helpers.models import OWN_TEST_FAMILY_NAMES, load_model
from invariant_infer import left_pad, make_invariant
from invariant_infer.cli import main as cli_main
from invariant_infer.generation.generate import seeded_sampling
from invariant_infer.scoring.core import score_sequences

NEW_TOKENS = 3


def prompts_for(vocab_size: int, lengths=(6, 11, 3), seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab_size, (n,), generator=g).tolist() for n in lengths]


def generate_rows(model, prompts, cache=None, seeds=None):
    """Per row (new tokens, per-step logits [N, V]) of one left-padded generate call."""
    ids, mask = left_pad(prompts)
    kwargs = {"cache_implementation": cache} if cache else {}
    if seeds is not None:
        kwargs["logits_processor"] = seeded_sampling(seeds, temperature=0.9, top_k=50, top_p=0.95)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                         pad_token_id=0, output_logits=True, return_dict_in_generate=True, **kwargs)
    logits = torch.stack(out.logits, dim=1)
    return [(out.sequences[row, ids.shape[1]:], logits[row]) for row in range(len(prompts))]


@pytest.mark.fast_cells(1)
@pytest.mark.parametrize("cache", [None, "static"], ids=["dynamic", "static"])
def test_generate_batched_equals_alone_and_decode_equals_prefill(family_checkpoint, cache):
    model = make_invariant(load_model(family_checkpoint, torch.bfloat16))
    prompts = prompts_for(model.config.vocab_size, lengths=(9, 3))
    batched = generate_rows(model, prompts, cache)
    for prompt, (tokens, logits) in zip(prompts, batched):
        alone_tokens, alone_logits = generate_rows(model, [prompt], cache)[0]
        assert torch.equal(tokens, alone_tokens) and torch.equal(logits, alone_logits)
        ids = torch.tensor([prompt + tokens.tolist()])
        with torch.no_grad():
            forward = model(input_ids=ids).logits[0, len(prompt) - 1:len(prompt) - 1 + NEW_TOKENS]
        assert torch.equal(logits, forward.float()), "decode != prefill"


@pytest.mark.fast_cells(1)
def test_seeded_sampling_batched_equals_alone(family_checkpoint):
    model = make_invariant(load_model(family_checkpoint, torch.bfloat16))
    prompts = prompts_for(model.config.vocab_size, lengths=(5, 9))
    seeds = [11, 12]
    batched = generate_rows(model, prompts, seeds=seeds)
    for i, prompt in enumerate(prompts):
        tokens, logits = generate_rows(model, [prompt], seeds=[seeds[i]])[0]
        assert torch.equal(batched[i][0], tokens) and torch.equal(batched[i][1], logits)


@pytest.mark.fast_cells(1)
def test_score_sequences_independent_of_batching(family_checkpoint):
    model = make_invariant(load_model(family_checkpoint, torch.bfloat16))
    sequences = prompts_for(model.config.vocab_size, lengths=(7, 12, 3, 9), seed=2)
    alone = score_sequences(model, sequences, max_batch_tokens=1)
    packed = score_sequences(model, sequences, max_batch_tokens=1000, chunk_rows=3)
    assert [a.digest for a in alone] == [p.digest for p in packed]
    assert all(torch.equal(a.token_logprobs, p.token_logprobs) for a, p in zip(alone, packed))


# The families with their own model tests run the CLI here too (heavy cells). The job's digests are
# score_sequences' in this process.
@pytest.mark.parametrize("family", ["llama", *(pytest.param(family, marks=pytest.mark.heavy)
                                              for family in OWN_TEST_FAMILY_NAMES)])
def test_score_command_digests_independent_of_batch_budget(family_checkpoints, family, tmp_path):
    family_checkpoint = family_checkpoints(family)
    rows = [{"id": i, "input_ids": ids} for i, ids in enumerate(prompts_for(512, lengths=(7, 12, 3, 9), seed=3))]
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    digests = []
    for budget in ("1", "4096"):
        out = tmp_path / f"out-{budget}.jsonl"
        assert cli_main(["score", "--model", str(family_checkpoint), "--input", str(inp), "--output", str(out),
                         "--dtype", "bf16", "--max-batch-tokens", budget]) == 0
        results = [json.loads(line) for line in out.read_text().splitlines()]
        assert len(results) == len(rows) and all("digest" in r for r in results)
        digests.append({r["id"]: r["digest"] for r in results})
    assert digests[0] == digests[1]
    model = make_invariant(load_model(family_checkpoint, torch.bfloat16))
    library = score_sequences(model, [r["input_ids"] for r in rows])
    assert digests[0] == {r["id"]: result.digest for r, result in zip(rows, library)}


def test_demo_with_model(family_checkpoints, capsys):
    family_checkpoint = family_checkpoints("mistral")
    assert cli_main(["demo", "--model", str(family_checkpoint), "--dtype", "bf16", "--device", "cpu"]) == 0
    assert "every row bitwise equal" in capsys.readouterr().out
