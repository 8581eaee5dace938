"""Output kinds and the step's batched picks: DELTA outputs concatenate to the CUMULATIVE output bit
for bit, FINAL_ONLY gives that output once; the sampler's one-pass picks and the batched top
logprobs are bitwise the per-row computation."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from helpers.models import load_model
from helpers.tokenizer import train_tokenizer
from invariant_infer import make_invariant
from invariant_infer.engine import Engine, RequestOutputKind, SamplingParams
from invariant_infer.engine.logprob_rows import top_logprobs_rows
from invariant_infer.engine.sampler import pick_rows
from invariant_infer.engine.sequence import Sequence
from invariant_infer.generation.sampling import sample_next_token
from invariant_infer.kernels import token_logprobs

KINDS = (RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY)


def run_kinds(engine: Engine, prompt: str, params: SamplingParams) -> dict:
    """Every output of one request per kind, all three in the same engine."""
    ids = {kind: engine.add_request(prompt, SamplingParams(**{**vars(params), "output_kind": kind}))
           for kind in KINDS}
    outputs = {kind: [] for kind in KINDS}
    kind_of = {rid: kind for kind, rid in ids.items()}
    while engine.has_unfinished():
        for out in engine.step():
            outputs[kind_of[out.request_id]].append(out)
    return outputs


@pytest.fixture(scope="module")
def model(family_checkpoints):
    return make_invariant(load_model(family_checkpoints("qwen2"), torch.bfloat16))


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer
    path = tmp_path_factory.mktemp("tokenizer")
    train_tokenizer(path)  # 320 tokens, inside the model's vocabulary
    return AutoTokenizer.from_pretrained(path)


@pytest.mark.fast_cells(ids=["seeded"])
@pytest.mark.parametrize("sampling", [dict(seed=3), dict(temperature=0.9, seed=3)], ids=["greedy", "seeded"])
def test_deltas_concatenate_to_the_cumulative_output(model, tokenizer, sampling):
    engine = Engine(model, tokenizer)
    free = engine.generate(["the cat runs"], SamplingParams(max_tokens=8, ignore_eos=True, **sampling))[0]
    stop = free.text[len(free.text) // 2:][:3]  # a stop string that ends the request early
    params = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=2, prompt_logprobs=1, stop=[stop], **sampling)
    outputs = run_kinds(engine, "the cat runs", params)
    cumulative, deltas, final = (outputs[kind] for kind in KINDS)
    whole = cumulative[-1]
    assert whole.finished and whole.finish_reason == "stop" and stop not in whole.text
    assert len(deltas) == len(cumulative) and len(final) == 1
    assert dataclasses.replace(final[0], request_id=whole.request_id) == whole
    assert [out.finished for out in deltas] == [out.finished for out in cumulative]
    joined = {"token_ids": [], "logprobs": [], "top_logprobs": [], "prompt_logprobs": [], "prompt_top_logprobs": [],
              "prompt_greedy": []}
    text = ""
    for delta, so_far in zip(deltas, cumulative):
        for field, values in joined.items():
            values += getattr(delta, field)
            assert values == getattr(so_far, field), field  # exact: the same floats
        text += delta.text
        assert so_far.text.startswith(text) and whole.text.startswith(text)  # nothing sent is taken back
    assert text == whole.text
    assert deltas[-1].prompt_token_ids == whole.prompt_token_ids and deltas[-1].seed == whole.seed


def test_a_delta_holds_back_what_a_stop_string_could_cut(model, tokenizer):
    absent = "\u00a7" * 4  # never in the text: the request runs to its length
    outputs = run_kinds(Engine(model, tokenizer), "the cat runs",
                        SamplingParams(max_tokens=8, ignore_eos=True, stop=[absent]))
    cumulative, deltas = outputs[RequestOutputKind.CUMULATIVE], outputs[RequestOutputKind.DELTA]
    sent, held = "", []
    for delta, so_far in zip(deltas[:-1], cumulative[:-1]):
        sent += delta.text
        assert len(sent) <= max(0, len(so_far.text) - (len(absent) - 1))  # the stop string's length less one
        held.append(len(so_far.text) - len(sent))
    assert any(held)  # it did hold text back
    assert sent + deltas[-1].text == cumulative[-1].text and deltas[-1].finish_reason == "length"


def sequences(params: list[SamplingParams]) -> list[Sequence]:
    return [Sequence(f"r{i}", [1, 2, 3], p, seed=40 + i, arrival=i) for i, p in enumerate(params)]


PICK_PARAMS = [SamplingParams(), SamplingParams(temperature=0.7), SamplingParams(temperature=1.3, top_k=5),
               SamplingParams(temperature=0.9, top_p=0.8), SamplingParams(), SamplingParams(temperature=0.7)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_one_pass_picks_are_the_per_row_picks(dtype):
    logits = torch.randn(len(PICK_PARAMS), 512, generator=torch.Generator().manual_seed(0)).to(dtype)
    seqs = sequences(PICK_PARAMS)
    rows = [(i, seq, 2 + i) for i, seq in enumerate(seqs)]
    picked = pick_rows(logits, rows)
    alone = {i: sample_next_token(logits[i].float(), seq.token_ids, step=step, seed=seq.seed,
                                  temperature=seq.params.temperature, top_k=seq.params.top_k,
                                  top_p=seq.params.top_p) for i, seq, step in rows}
    assert picked == alone
    # Any subset, in any order, picks the same tokens: no row's pick depends on the others.
    subset = [rows[4], rows[1], rows[3]]
    assert pick_rows(logits, subset) == {i: alone[i] for i, _, _ in subset}


def test_control_picks_see_their_own_seed_and_step():
    """The comparison above can fail: a row picked at another step or seed gives other tokens."""
    logits = torch.randn(4, 512, generator=torch.Generator().manual_seed(1))
    seqs = sequences([SamplingParams(temperature=1.0)] * 4)
    at_step = pick_rows(logits, [(i, seq, 0) for i, seq in enumerate(seqs)])
    next_step = pick_rows(logits, [(i, seq, 1) for i, seq in enumerate(seqs)])
    assert at_step != next_step


class KernelLogprobs:
    """The engine runner's logprob entry point: the invariant kernel."""

    @staticmethod
    def logprobs(logits, targets, temperature=1.0):
        return token_logprobs(logits, targets, temperature)


def test_batched_top_logprobs_are_each_rows_own():
    logits = torch.randn(5, 384, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    rows = [(0, 3, 1.0), (1, 3, 1.0), (2, 2, 0.7), (3, 3, 1.0), (4, 2, 0.7)]
    batched = top_logprobs_rows(KernelLogprobs, logits, rows)
    for (row, k, temperature), top in zip(rows, batched):
        ids = torch.topk(logits[row].float(), k).indices
        values = token_logprobs(logits[row][None].expand(k, -1), ids, temperature)[0]
        assert top == dict(zip(ids.tolist(), values.tolist()))
