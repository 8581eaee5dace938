"""The batched seeded sampler: ``seeded_scores_rows`` gives every row bitwise what ``seeded_scores`` gives it
alone, over many rows, seeds, steps, temperatures, top-k and top-p (ties, -inf, fp32 and bf16 logits), in
any subset and order; the engine's picks are ``sample_next_token``'s. Suppressed token ids are never
picked, greedy or seeded, and leave the other rows' bits and the reported logprobs as they were."""
from __future__ import annotations

import pytest
import torch

from invariant_infer import make_invariant
from invariant_infer.engine import SamplingParams
from invariant_infer.engine.core import EngineCore
from invariant_infer.engine.sampler import pick_alone, pick_rows
from invariant_infer.engine.sequence import Sequence
from invariant_infer.generation.sampling import sample_next_token, seeded_scores, seeded_scores_rows
from invariant_infer.testing.random_checkpoints import random_config, random_model

ROWS = 48


def row_params(vocab: int, g: torch.Generator) -> list[tuple[int, int, float, int, float]]:
    """(seed, step, temperature, top_k, top_p) per row: every filter alone and together, k past V."""
    return [(int(torch.randint(0, 2 ** 62, (1,), generator=g)), i % 5, (0.25, 0.7, 1.0, 1.9)[i % 4],
             (0, 1, 7, 40, vocab, vocab + 5)[i % 6], (1.0, 0.95, 0.5, 0.02, 0.999)[i % 5]) for i in range(ROWS)]


def logits_rows(vocab: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(ROWS, vocab, generator=g) * 4
    logits[2, :9] = logits[2, 9]                   # ties at the top
    logits[3, 100:] = float("-inf")               # a row already filtered
    return logits.to(dtype)


@pytest.mark.parametrize("vocab, dtype", [(1003, torch.float32), (512, torch.bfloat16)], ids=["1003-fp32", "512-bf16"])
def test_rows_at_once_are_each_row_alone(vocab, dtype):
    logits = logits_rows(vocab, dtype)
    params = row_params(vocab, torch.Generator().manual_seed(1))
    alone = torch.stack([seeded_scores(logits[i].float(), *p) for i, p in enumerate(params)])
    assert torch.equal(seeded_scores_rows(logits.float(), *zip(*params)), alone)
    subset = [17, 3, 40, 2]  # any rows, in any order: no row depends on the others
    assert torch.equal(seeded_scores_rows(logits[subset].float(), *zip(*[params[i] for i in subset])), alone[subset])


def test_control_rows_keyed_by_their_place_give_other_draws():
    """The comparison can fail: noise drawn for the row's place in the batch, not its seed, differs."""
    logits = logits_rows(512, torch.float32)
    params = row_params(512, torch.Generator().manual_seed(1))
    by_place = [(i, *p[1:]) for i, p in enumerate(params)]
    assert not torch.equal(seeded_scores_rows(logits, *zip(*by_place)).argmax(-1),
                           seeded_scores_rows(logits, *zip(*params)).argmax(-1))


def sequences(params: list[SamplingParams]) -> list[Sequence]:
    return [Sequence(f"r{i}", [1, 2, 3], p, seed=40 + i, arrival=i) for i, p in enumerate(params)]


def test_engine_picks_are_sample_next_token_with_suppression():
    logits = logits_rows(512, torch.bfloat16)
    seqs = sequences([SamplingParams(temperature=(0.0, 0.8, 1.3)[i % 3], top_k=(0, 20)[i % 2], top_p=(1.0, 0.9)[i % 2])
                      for i in range(ROWS)])
    rows = [(i, seq, i % 4) for i, seq in enumerate(seqs)]
    picked = pick_rows(logits, rows)
    alone = {i: sample_next_token(logits[i].float(), seq.token_ids, step=step, seed=seq.seed,
                                  temperature=seq.params.temperature, top_k=seq.params.top_k, top_p=seq.params.top_p)
             for i, seq, step in rows}
    assert picked == alone
    # Suppress row 0's (greedy) and row 1's (seeded) tokens: they pick others; rows that never picked
    # those ids keep their tokens.
    banned = (picked[0], picked[1])
    suppressed = pick_rows(logits, rows, suppressed=banned)
    assert suppressed[0] not in banned and suppressed[1] not in banned
    assert all(suppressed[i] == picked[i] for i in picked if picked[i] not in banned)
    assert all(token not in banned for token in suppressed.values())
    # A row picked alone (repetition penalty) suppresses the same ids.
    seq = sequences([SamplingParams(repetition_penalty=1.3)])[0]
    token = pick_alone(seq, logits[0], 0, [])
    assert pick_alone(seq, logits[0], 0, [], suppressed=(token,)) != token


def test_an_engine_never_samples_a_suppressed_token_and_reports_the_same_logprobs():
    config = random_config("qwen2", "tiny", num_hidden_layers=1)
    model = make_invariant(random_model(config, dtype=torch.bfloat16).eval())
    params = [SamplingParams(max_tokens=2, ignore_eos=True, logprobs=3, prompt_logprobs=1),
              SamplingParams(max_tokens=2, ignore_eos=True, logprobs=3, temperature=1.0, seed=7)]

    def run(suppressed=()):
        core = EngineCore(model, max_num_seqs=4, kv_cache_memory=1 << 22)
        core.suppressed_token_ids = suppressed
        for i, p in enumerate(params):
            core.add_token_request([3 + i, 9, 4, 11], p)
        out = {}
        while core.has_unfinished():
            for delta in core.step_deltas():
                got = out.setdefault(delta.request_id, {"tokens": [], "top": [], "prompt": []})
                got["tokens"] += delta.token_ids
                got["top"] += list(delta.top_logprobs)
                got["prompt"] += list(delta.prompt_logprobs)
        return [out[str(i)] for i in range(len(params))]
    plain = run()
    firsts = tuple(dict.fromkeys(got["tokens"][0] for got in plain))
    banned = run(firsts)
    for was, now in zip(plain, banned):
        assert now["tokens"][0] not in firsts  # the control: without suppression it picks them
        assert now["prompt"] == was["prompt"] and now["top"][0] == was["top"][0]  # logprobs of the logits as given
