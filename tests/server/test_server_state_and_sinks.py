"""``serve`` on the families whose attention is more than plain causal GQA: a hybrid model (Qwen3.5's
text model: Gated DeltaNet beside gated attention) and gpt-oss (attention sinks, a 24-key sliding
window, experts with biases), the app in process: prompt logprobs equal ``score_sequences``, and
requests sent together (prompts across the scan's chunk boundary at 64 and past the window, greedy
and seeded) are bitwise the same requests sent one at a time."""
from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers.servers import MODEL, choices_of, completion, post, start_in_process_server
from helpers.tokenizer import save_tokenizer
from invariant_infer import make_invariant, score_sequences
from invariant_infer.testing.random_checkpoints import random_config, save_random_checkpoint


@pytest.fixture(scope="module", params=["qwen3_5_text", "gpt_oss"])
def family_checkpoint(request, tmp_path_factory):
    path = save_random_checkpoint(tmp_path_factory.mktemp(f"serve-{request.param}"),
                                  random_config(request.param, "tiny"), seed=5)
    save_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def family_server(family_checkpoint):
    server = start_in_process_server(family_checkpoint)
    yield server
    server.stop()


def test_prompt_logprobs_equal_score_sequences_and_load_equals_alone(family_server, family_checkpoint):
    rng = random.Random(4)
    prompts = [[rng.randrange(1, 512) for _ in range(n)] for n in (70, 5, 30, 66)]
    scored = completion(family_server, prompt=prompts, max_tokens=0, echo=True, logprobs=0, temperature=0)
    model = make_invariant(AutoModelForCausalLM.from_pretrained(family_checkpoint, dtype=torch.float32).eval())
    for choice, reference in zip(choices_of(scored), score_sequences(model, prompts)):
        assert torch.equal(torch.tensor(choice["logprobs"]["token_logprobs"][1:], dtype=torch.float32),
                           reference.token_logprobs)

    bodies = [{"model": MODEL, "prompt": prompt, "max_tokens": 4, "logprobs": 1, "seed": i,
               "temperature": 0 if i % 2 == 0 else 0.9}
              for i, prompt in enumerate(prompts)]
    alone = [completion(family_server, **{k: v for k, v in body.items() if k != "model"}) for body in bodies]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda body: post(family_server, "/v1/completions", body), bodies))
    for i, response in enumerate(together):
        assert response.status_code == 200, response.text
        assert choices_of(response.json()) == choices_of(alone[i]), i
