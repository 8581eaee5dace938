"""``invariant-infer serve`` through the official ``openai`` client and raw HTTP, on the app in process
and on the real server (a subprocess on an ephemeral localhost port; tests/server/conftest.py): echo
and logprobs, prompt logprobs equal to ``score_sequences``, ``logprobs_mode``, streaming equal to
whole responses, ``n`` choices equal to their seeds alone, and concurrent load bitwise equal to each
request alone. Every comparison of text, tokens and logprobs is exact ``==`` (logprobs are float32
values written as JSON floats, which round-trip exactly)."""
from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import fastapi  # noqa: F401  (the serve extra, installed by the test extra: missing fails)
import openai
import prometheus_client  # noqa: F401
import pytest
import torch
import uvicorn  # noqa: F401

from helpers.servers import MODEL, choices_of, completion, post


# ---- the openai client ---------------------------------------------------------------------------


def test_openai_client_completion_with_echo_and_logprobs(client):
    out = client.completions.create(model=MODEL, prompt="the cat runs", max_tokens=4, temperature=0, logprobs=2,
                                    echo=True)
    choice = out.choices[0]
    assert choice.text.startswith("the cat runs") and choice.finish_reason in ("length", "stop")
    lp = choice.logprobs
    n_prompt = out.usage.prompt_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) \
        == n_prompt + out.usage.completion_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(isinstance(v, float) and v <= 0 for v in lp.token_logprobs[1:])
    for token, value, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert 2 <= len(top) <= 3 and top[token] >= value  # the chosen token is always there
    # greedy: each generated token is the most likely one
    for value, top in zip(lp.token_logprobs[n_prompt:], lp.top_logprobs[n_prompt:]):
        assert value == max(top.values())
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    assert isinstance(choice.model_extra["seed"], int)
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_echo_max_tokens_0_equals_score_sequences(server, checkpoint):
    """Prompt logprobs over HTTP == score_sequences in process, bitwise; generated tokens' logprobs ==
    the prompt logprobs of the same tokens scored afterwards."""
    from transformers import AutoModelForCausalLM

    from invariant_infer import make_invariant
    from invariant_infer.scoring.core import score_sequences

    rng = random.Random(3)
    prompts = [[rng.randrange(512) for _ in range(n)] for n in (9, 2, 30)]
    scored = completion(server, prompt=prompts, max_tokens=0, echo=True, logprobs=0, temperature=0)
    model = make_invariant(AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval())
    reference = score_sequences(model, prompts)
    for choice, ids, ref in zip(choices_of(scored), prompts, reference):
        values = choice["logprobs"]["token_logprobs"]
        assert values[0] is None and len(values) == len(ids)
        assert torch.equal(torch.tensor(values[1:], dtype=torch.float32), ref.token_logprobs)
        assert all(float(v) == v for v in ref.token_logprobs.tolist())
    generated = completion(server, prompt=prompts[0], max_tokens=3, temperature=0, logprobs=0)
    gen_ids_text = choices_of(generated)[0]
    gen_logprobs = gen_ids_text["logprobs"]["token_logprobs"]
    tokens = post(server, "/tokenize", {"prompt": gen_ids_text["text"], "add_special_tokens": False}).json()["tokens"]
    rescored = completion(server, prompt=prompts[0] + tokens, max_tokens=0, echo=True, logprobs=0, temperature=0)
    if len(tokens) == 3:  # the text re-tokenizes to the same ids
        assert choices_of(rescored)[0]["logprobs"]["token_logprobs"][-3:] == gen_logprobs


def test_logprobs_mode_through_extra_body(client, checkpoint):
    """``logprobs_mode`` as an extra field: processed prompt logprobs are the kernel's at the
    temperature on the ``model(...)`` logits, bitwise; the tokens are the raw request's; bad values
    and filters the processed logprobs would not reflect are refused naming the field."""
    from transformers import AutoModelForCausalLM

    from invariant_infer import make_invariant
    from invariant_infer.kernels import token_logprobs

    processed = {"logprobs_mode": "processed_logprobs"}
    prompt = [random.Random(4).randrange(512) for _ in range(12)]
    echo = dict(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=0, temperature=0.7)
    values = client.completions.create(**echo, extra_body=processed).choices[0].logprobs.token_logprobs
    model = make_invariant(AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval())
    ids = torch.tensor(prompt)
    with torch.no_grad():
        logits = model(input_ids=ids[None]).logits[0, :-1]
    assert torch.equal(torch.tensor(values[1:], dtype=torch.float32), token_logprobs(logits, ids[1:], 0.7)[0])
    raw = client.completions.create(**echo).choices[0].logprobs.token_logprobs
    assert torch.equal(torch.tensor(raw[1:], dtype=torch.float32), token_logprobs(logits, ids[1:])[0])
    chat = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=0.7, seed=3,
                logprobs=True)
    chat_processed = client.chat.completions.create(**chat, extra_body=processed).choices[0]
    chat_raw = client.chat.completions.create(**chat).choices[0]
    assert chat_processed.message.content == chat_raw.message.content
    assert [t.logprob for t in chat_processed.logprobs.content] != [t.logprob for t in chat_raw.logprobs.content]
    for extra, param in (({"logprobs_mode": "processed"}, "logprobs_mode"), ({**processed, "top_k": 5}, "top_k")):
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(**echo, extra_body=extra)
        assert refused.value.param == param, refused.value.body


def test_streaming_equals_non_streaming(client):
    kwargs = dict(model=MODEL, prompt="a dog", max_tokens=5, temperature=0.9, seed=7, logprobs=1, echo=True)
    whole = client.completions.create(**kwargs).choices[0]
    text, tokens, values, finish = "", [], [], None
    for chunk in client.completions.create(stream=True, **kwargs):
        piece = chunk.choices[0]
        text += piece.text
        if piece.logprobs:
            tokens += piece.logprobs.tokens
            values += piece.logprobs.token_logprobs
        finish = piece.finish_reason or finish
    assert text == whole.text and tokens == whole.logprobs.tokens and values == whole.logprobs.token_logprobs
    assert finish == whole.finish_reason

    messages = [{"role": "user", "content": "tell me about cats"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0.8, seed=3,
                                          logprobs=True, top_logprobs=2)
    content = chat.choices[0].message.content
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == \
        len(chat.choices[0].logprobs.content)
    assert chat.choices[0].model_extra["seed"] == 3
    streamed, streamed_lp = "", []
    for chunk in client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0.8,
                                                seed=3, logprobs=True, top_logprobs=2, stream=True):
        delta = chunk.choices[0]
        streamed += delta.delta.content or ""
        if delta.logprobs and delta.logprobs.content:
            streamed_lp += [(t.token, t.logprob) for t in delta.logprobs.content]
    assert streamed == content
    assert streamed_lp == [(t.token, t.logprob) for t in chat.choices[0].logprobs.content]
    # The chat template was applied: the same prompt through /v1/completions gives the same answer.
    prompt = "user: tell me about cats\nassistant:"
    same = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0.8, seed=3)
    assert same.choices[0].text == content


def test_n_choices_each_equal_their_seed_alone(server):
    both = completion(server, prompt="the sun", n=3, seed=11, max_tokens=3, temperature=1.0, logprobs=1)
    choices = choices_of(both)
    assert [c["seed"] for c in choices] == [11, 12, 13]
    for c in choices:
        alone = choices_of(completion(server, prompt="the sun", seed=c["seed"], max_tokens=3, temperature=1.0,
                                      logprobs=1))[0]
        assert {**alone, "index": c["index"]} == c
    drawn = choices_of(completion(server, prompt="the sun", n=2, max_tokens=2, temperature=1.0))
    for c in drawn:  # a drawn seed replays its choice
        again = choices_of(completion(server, prompt="the sun", seed=c["seed"], max_tokens=2, temperature=1.0))[0]
        assert again["text"] == c["text"]


# ---- load: every response is bitwise the request alone -----------------------------------------------


def load_requests(count: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    requests = []
    for i in range(count):
        prompt = (" ".join(rng.choice(["the", "cat", "dog", "runs", "a", "sun"]) for _ in range(rng.randint(1, 12)))
                  if i % 2 else [rng.randrange(512) for _ in range(rng.randint(1, 24))])
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 3, "logprobs": 2, "echo": i % 3 == 0,
                "temperature": 0 if i % 4 == 0 else 1.0, "seed": 100 + i}
        requests.append(body)
    return requests


def test_concurrent_load_is_bitwise_alone(server):
    requests = load_requests(12)
    alone = [completion(server, **body) for body in requests]
    server.wait_idle()
    order = list(range(len(requests)))
    random.Random(1).shuffle(order)

    def send(i):
        r = post(server, "/v1/completions", requests[i])
        return i, r.status_code, r.json()

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(send, order))
    assert len(results) == len(requests) and all(status == 200 for _, status, _ in results), \
        [(i, s, b) for i, s, b in results if s != 200]
    for i, _, body in results:
        assert choices_of(body) == choices_of(alone[i]), f"request {i} differs under load"
        assert body["usage"] == alone[i]["usage"]
    metrics = server.wait_idle()
    assert metrics["invariant_infer_generation_tokens_total"] > 0
