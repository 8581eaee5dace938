"""``invariant-infer serve`` on the families with their own model tests (GLM-4.5's MoE, DeepSeek-V3's
latent attention, Gemma 4's text model and its multimodal checkpoint given text): a tiny random
checkpoint with a tokenizer, served in a subprocess on a 127.0.0.1 port. A completion's tokens and
logprobs are bitwise the same request run alone by the library's engine in this process, and so are
concurrent requests' (greedy and seeded). One server per family for the module, always stopped."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from helpers.models import OWN_TEST_FAMILY_NAMES, load_model, make_samples
from helpers.servers import choices_of, completion, run_concurrently, start_server
from helpers.tokenizer import save_tokenizer
from invariant_infer import make_invariant
from invariant_infer.engine import Engine, SamplingParams
from invariant_infer.testing.random_checkpoints import random_config, save_random_checkpoint

pytestmark = pytest.mark.heavy  # a server subprocess per family

TOKENIZER_VOCAB = 320  # helpers.tokenizer's BPE: prompts stay inside it


@pytest.fixture(scope="module", params=OWN_TEST_FAMILY_NAMES)
def served(request, tmp_path_factory):
    """(the checkpoint, its server: fp32 on CPU, as helpers.servers.start_server runs it)."""
    path = save_random_checkpoint(tmp_path_factory.mktemp(f"serve-{request.param}"),
                                  random_config(request.param, "tiny"), seed=5)
    save_tokenizer(path)
    server = start_server(path, tmp_path_factory.mktemp(f"serve-{request.param}-log") / "server.log")
    yield path, server
    server.stop()


@pytest.fixture(scope="module")
def alone(served):
    """A request's (token strings, logprobs) alone in the library's engine, the server's dtype."""
    path, _ = served
    engine = Engine(make_invariant(load_model(path, torch.float32)))
    tokenizer = AutoTokenizer.from_pretrained(path)

    def run(body: dict) -> tuple[list[str], list[float]]:
        params = SamplingParams(max_tokens=body["max_tokens"], temperature=body["temperature"],
                                top_k=body.get("top_k", 0), seed=body.get("seed"), logprobs=0, ignore_eos=True)
        out = engine.generate([body["prompt"]], params)[0]
        return [tokenizer.decode([t]) for t in out.token_ids], out.logprobs
    return run


def request(prompt, **sampling) -> dict:
    return {"prompt": prompt, "max_tokens": 4, "logprobs": 0, "ignore_eos": True, **sampling}


def tokens_and_logprobs(response: dict) -> tuple[list[str], list[float]]:
    logprobs = choices_of(response)[0]["logprobs"]
    return logprobs["tokens"], logprobs["token_logprobs"]


def prompts(lengths, seed: int) -> list[list[int]]:
    return [s.tolist() for s in make_samples(TOKENIZER_VOCAB, lengths, seed=seed)]


def test_a_completion_equals_the_library_alone(served, alone):
    """A greedy completion of a prompt past Gemma 4's 16-key window."""
    _, server = served
    body = request(prompts((21,), seed=1)[0], temperature=0)
    got = tokens_and_logprobs(completion(server, **body))
    assert len(got[1]) == 4 and got == alone(body)


def test_concurrent_requests_equal_each_alone(served, alone):
    _, server = served
    first, second, third = prompts((18, 3, 9), seed=2)
    bodies = [request(first, temperature=0), request(second, temperature=1.0, seed=7),
              request(third, temperature=0.8, top_k=20, seed=8)]
    responses = run_concurrently(lambda body: completion(server, **body), bodies)
    for body, response in zip(bodies, responses):
        assert tokens_and_logprobs(response) == alone(body)
    server.wait_idle()
