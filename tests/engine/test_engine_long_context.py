"""The engine past many KV chunks: a prompt of 1280 tokens on a model whose attention has head_dim
128 (CPU chunks of 128 keys: 10 of them). Alone or chunked next to other requests, and with
the KV chunks in sequence or in parallel, a request's tokens, logprobs and prompt logprobs are the
same bits, and its decode logprobs are the padded prefill's (``score_sequences``). Comparisons are
exact."""
from __future__ import annotations

import importlib

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from helpers.engine_runs import run_schedule
from invariant_infer import make_invariant, score_sequences
from invariant_infer.engine import Engine, SamplingParams

PROMPT = 1280
PARAMS = SamplingParams(max_tokens=3, logprobs=1, prompt_logprobs=1, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=256, hidden_size=256, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096)
    return make_invariant(Qwen2ForCausalLM(config).eval())  # fp32: a reordered sum shows


@pytest.mark.heavy
def test_a_long_prompt_alone_equals_it_chunked_in_a_busy_batch_and_prefill(model, monkeypatch):
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 256, (n,), generator=g).tolist() for n in (PROMPT, 40, 7)]
    alone = Engine(model, max_num_batched_tokens=4096).generate([prompts[0]], PARAMS)[0]
    # The busy engine runs the KV chunks in parallel, as a GPU would, from the step's max_seq_len.
    paged = importlib.import_module("invariant_infer.kernels.paged_attention")
    combines = []
    combine = paged.combine_chunks
    monkeypatch.setattr(paged, "parallel_chunks_pay", lambda device, programs, chunks, nbytes: chunks > 1)
    monkeypatch.setattr(paged, "combine_chunks", lambda *a: (combines.append(1), combine(*a)))
    # A 450-token budget chunks the long prefill into three pieces next to the others' prefill and decode.
    busy = run_schedule(Engine(model, max_num_seqs=3, max_num_batched_tokens=450), prompts, lambda i: PARAMS,
                        arrivals=(0, 0, 2))[0]
    assert combines
    assert busy.token_ids == alone.token_ids and busy.logprobs == alone.logprobs
    assert busy.prompt_logprobs == alone.prompt_logprobs
    scored = score_sequences(model, [prompts[0] + alone.token_ids])[0]
    assert torch.equal(torch.tensor(alone.prompt_logprobs + alone.logprobs, dtype=torch.float32),
                       scored.token_logprobs)
