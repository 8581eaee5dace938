"""Every malformed request to ``invariant-infer serve`` gets a 4xx with OpenAI's error body, never
a 5xx: malformed text (lone surrogates, which JSON's ``\\udcff`` escape can spell), malformed token
ids, malformed values of every option, at /v1/completions, /v1/chat/completions, /tokenize and
/detokenize; hand-written cases, then a bounded seeded random mutation of valid bodies. The bulk runs
in process through Starlette's TestClient on ``create_app`` (the same app, middleware and handlers
uvicorn serves); a few cases go through the real server and the ``openai`` client."""
from __future__ import annotations

import json
import random
import time

import openai
import pytest
from starlette.testclient import TestClient

from helpers.servers import KEY, MODEL, assert_error, post
from helpers.tokenizer import save_tokenizer
from invariant_infer.checkpoints.loading import load_model, load_tokenizer
from invariant_infer.engine import AsyncEngine, Engine
from invariant_infer.server import ServerOptions, create_app
from invariant_infer.testing.random_checkpoints import random_config, save_random_checkpoint

POSITIONS = 64  # a short context: a body without max_tokens cannot generate for long
BODY_LIMIT = 65536
VOCAB = 512
MUTATIONS, MUTATION_DEADLINE_S = 300, 150


class Raw(str):
    """JSON text put into a body as it is (``1e999``, ``NaN``): ``dumps`` cannot write these."""


def dumps(body) -> str:
    """``body`` as JSON, each ``Raw`` value spliced in as written."""
    raws: list[str] = []

    def mark(value):
        if isinstance(value, Raw):
            raws.append(value)
            return f"@@raw{len(raws) - 1}@@"
        if isinstance(value, dict):
            return {k: mark(v) for k, v in value.items()}
        if isinstance(value, list):
            return [mark(v) for v in value]
        return value
    text = json.dumps(mark(body))  # lone surrogates are written as \\udcff escapes
    for i, raw in enumerate(raws):
        text = text.replace(f'"@@raw{i}@@"', raw)
    return text


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    """The server's app in process on a checkpoint with POSITIONS positions; stopped afterwards."""
    path = tmp_path_factory.mktemp("serve-bad-input")
    save_random_checkpoint(path, random_config("qwen2", "tiny", num_hidden_layers=1,
                                               max_position_embeddings=POSITIONS), seed=5)
    save_tokenizer(path)
    tokenizer = load_tokenizer(str(path))
    engine = AsyncEngine(Engine(load_model(str(path), dtype="fp32", device="cpu"), tokenizer, max_num_seqs=4))
    options = ServerOptions(model_name=MODEL, api_key=KEY, max_waiting=64, max_body_bytes=BODY_LIMIT)
    with TestClient(create_app(engine, tokenizer, options), raise_server_exceptions=False,
                    headers={"Authorization": f"Bearer {KEY}"}) as client:
        client.engine = engine.engine
        yield client


def send(app, path: str, body):
    return app.post(path, content=dumps(body).encode(), headers={"Content-Type": "application/json"})


def refused(app, path: str, body, param: str | None = None) -> dict:
    """A 4xx (400 unless the body names a model that is not served) with OpenAI's error body."""
    r = send(app, path, body)
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:500], dumps(body)[:300])
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    if param is not None:
        assert error["param"] is not None and error["param"].split("[")[0].split(".")[0] == param, (error, body)
    return error


def not_5xx(app, path: str, body):
    r = send(app, path, body)
    assert r.status_code < 500, (r.status_code, r.text[:500], dumps(body)[:300])
    if r.status_code >= 400:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text
    elif body.get("stream") is True:
        assert r.text.endswith("data: [DONE]\n\n") and '"error"' not in r.text, r.text[-500:]
    else:
        r.json()
    return r


GOOD = {"/v1/completions": {"model": MODEL, "prompt": "the cat", "max_tokens": 2, "seed": 1},
        "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                 "seed": 1},
        "/tokenize": {"prompt": "the cat"},
        "/detokenize": {"tokens": [5, 6]}}
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"

LONE_SURROGATES = ["\udcff", "\ud800", "a\ud800b", "\udfff\ud800", "ok" * 100 + "\udbff"]
NOT_FINITE = [Raw("1e999"), Raw("-1e999"), Raw("NaN"), Raw("Infinity"), Raw("-Infinity")]
WRONG_TYPES = ["3", True, [1], {"a": 1}, [[1]]]


def test_lone_surrogates_get_400_naming_the_field(app):
    for s in LONE_SURROGATES:
        refused(app, COMPLETIONS, {**GOOD[COMPLETIONS], "prompt": s}, "prompt")
        refused(app, COMPLETIONS, {**GOOD[COMPLETIONS], "prompt": ["fine", s]}, "prompt")
        refused(app, COMPLETIONS, {**GOOD[COMPLETIONS], "stop": s}, "stop")
        refused(app, COMPLETIONS, {**GOOD[COMPLETIONS], "stop": ["x", s]}, "stop")
        assert refused(app, COMPLETIONS, {**GOOD[COMPLETIONS], "model": s}, "model")["code"] == "invalid_value"
        refused(app, COMPLETIONS, {**GOOD[COMPLETIONS], s: 1})
        for message in ({"role": "user", "content": s}, {"role": s, "content": "hi"},
                        {"role": "user", "content": [{"type": "text", "text": s}]}):
            refused(app, CHAT, {**GOOD[CHAT], "messages": [message]}, "messages")
            refused(app, "/tokenize", {"messages": [message]}, "messages")
        refused(app, CHAT, {**GOOD[CHAT], "stop": s}, "stop")
        refused(app, "/tokenize", {"prompt": s}, "prompt")
    # a surrogate pair is one character, and NUL is text too: both are served
    for text in ("\U0001f600 cat", "a\x00b"):
        assert send(app, COMPLETIONS, {**GOOD[COMPLETIONS], "prompt": text}).status_code == 200
        assert send(app, "/tokenize", {"prompt": text}).status_code == 200


def test_malformed_text_and_huge_strings(app):
    for prompt in (5, 1.5, True, {}, {"text": "a"}, [], [[]], [["a"]], [[["a"]]], ["a", 1], ["a", ["b"]], [None],
                   ["a", None], Raw("NaN")):
        refused(app, COMPLETIONS, {**GOOD[COMPLETIONS], "prompt": prompt}, "prompt")
    huge = "cat " * ((BODY_LIMIT - 200) // 4)  # just within the body limit: far past the context
    error = refused(app, COMPLETIONS, {**GOOD[COMPLETIONS], "prompt": huge})
    assert error["code"] in ("context_length_exceeded", "invalid_value")
    assert send(app, "/tokenize", {"prompt": huge}).status_code == 200
    refused(app, CHAT, {**GOOD[CHAT], "messages": [{"role": "user", "content": huge}]}, "max_tokens")
    assert send(app, COMPLETIONS, {**GOOD[COMPLETIONS], "prompt": "x" * (BODY_LIMIT + 1)}).status_code == 413
    refused(app, COMPLETIONS, {**GOOD[COMPLETIONS], "prompt": ""}, "prompt")  # no tokens
    refused(app, COMPLETIONS, {**GOOD[COMPLETIONS], "prompt": ["a", ""]}, "prompt")


def test_malformed_token_ids(app):
    for prompt in ([-1], [VOCAB], [1, VOCAB + 7], [10 ** 30], [-(10 ** 30)], [1.0], [1, 2.5], [True], [1, False],
                   [1, "1"], [[1], [2, -1]], [[1], []], [[1], [[2]]], [[[1]]], [[1], "a"], [1, [2]], [Raw("1e999")]):
        refused(app, COMPLETIONS, {**GOOD[COMPLETIONS], "prompt": prompt}, "prompt")
    for tokens in ([-1], [10 ** 9], [10 ** 30], [1.5], [True], ["1"], [[1]], "abc", 5, [None], None, {"a": 1}):
        refused(app, "/detokenize", {"tokens": tokens}, "tokens")
    refused(app, "/detokenize", {})
    assert send(app, "/detokenize", {"tokens": []}).json() == {"prompt": ""}


SHARED_OPTIONS = {
    "model": [5, True, ["tiny"], "gpt-4"],
    "n": [0, -1, 17, 10 ** 30, 1.0, 2.5, "2", True],
    "best_of": [2, 0, "1", 1.5],
    "seed": [-1, 2 ** 63, 2 ** 64, 10 ** 40, 1.5, "1", True, [1]],
    "temperature": [-0.1, 2.01, 1e308, "hot", True, [1.0], *NOT_FINITE],
    "top_p": [0, -1, 1.01, "1", False, *NOT_FINITE],
    "top_k": [-2, -(10 ** 30), 1.5, "5", True],
    "repetition_penalty": [0, -1, "1", True, *NOT_FINITE],
    "stop": [3, True, [3], [["a"]], {"a": 1}, ["a"] * 17, [None]],
    "stream": [1, "true", [True], 0],
    "ignore_eos": [1, "yes"],
    "logprobs_mode": ["processed", 1, True],
    "logit_bias": [{"1": 5}, [1]],
    "presence_penalty": [0.5, "0", Raw("NaN")],
    "frequency_penalty": [-0.5, Raw("1e999")],
    "min_p": [0.1],
    "tools": [[{"type": "function"}], "x"],
    "tool_choice": ["auto"],
    "functions": [[]],
    "response_format": [{"type": "json_object"}],
    "unknown_option": [1, "x"],
}
COMPLETION_OPTIONS = {
    **SHARED_OPTIONS,
    "max_tokens": [-1, 0, 1.5, "3", True, 10 ** 30, POSITIONS, [2], *NOT_FINITE],
    "logprobs": [-1, 21, 10 ** 30, 1.5, True, "1", [1]],
    "echo": ["yes", 1, [True]],
    "suffix": ["x", 5],
    "messages": [[{"role": "user", "content": "hi"}]],
}
CHAT_OPTIONS = {
    **SHARED_OPTIONS,
    "max_tokens": [0, -1, 1.5, "3", True, 10 ** 30, POSITIONS, *NOT_FINITE],
    "max_completion_tokens": [0, -1, 1.5, "3"],
    "logprobs": [1, "yes", [True], 5],
    "top_logprobs": [2, -1, 1.5, "2"],
    "prompt": ["hi"],
    "echo": [True],
    "messages": ["hi", [], {}, {"role": "user", "content": "hi"}, [5], [[]], [{}], [{"role": "user"}],
                 [{"content": "hi"}], [{"role": 5, "content": "hi"}], [{"role": None, "content": "hi"}],
                 [{"role": "user", "content": 5}], [{"role": "user", "content": None}],
                 [{"role": "user", "content": {"text": "hi"}}], [{"role": "user", "content": [5]}],
                 [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
                 [{"role": "user", "content": [{"type": "text"}]}], [{"role": "user", "content": [{"type": "text",
                                                                                                     "text": 5}]}],
                 [[{"role": "user", "content": "hi"}]], [{"role": "user", "content": "hi"}, 5]],
}


@pytest.mark.parametrize("path, options", [(COMPLETIONS, COMPLETION_OPTIONS), (CHAT, CHAT_OPTIONS)],
                         ids=["completions", "chat"])
def test_every_option_refuses_bad_values_naming_it(app, path, options):
    """Each bad value gets a 4xx naming its field (``best_of`` and ``seed`` are checked against ``n``,
    ``max_tokens`` against the context: those name themselves too)."""
    for field, values in options.items():
        for value in values:
            body = {**GOOD[path], field: value}
            if field == "top_logprobs":
                body = {**body, "logprobs": value != 2}  # 2 without logprobs; the rest with them
            refused(app, path, body, "model" if field == "model" else field)
    refused(app, path, {k: v for k, v in GOOD[path].items() if k not in ("prompt", "messages")},
            "prompt" if path == COMPLETIONS else "messages")
    refused(app, COMPLETIONS, {**GOOD[COMPLETIONS], "n": 16, "seed": 2 ** 63 - 3}, "seed")
    refused(app, CHAT, {**GOOD[CHAT], "max_completion_tokens": 10 ** 30}, "max_tokens")  # the context's param


def test_tokenize_options_and_bodies_that_are_not_objects(app):
    for body in ({}, {"prompt": 5}, {"prompt": ["a"]}, {"prompt": "a", "add_special_tokens": "yes"},
                 {"messages": "hi"}, {"messages": [{"role": "user", "content": 5}]},
                 {"messages": [{"role": "user", "content": "a"}], "add_generation_prompt": 1}):
        refused(app, "/tokenize", body)
    for path in GOOD:
        for raw in (b"", b"{", b"[1, 2]", b"null", b"5", b'"text"', b'{"prompt": "a",}', b"\xff\xfe",
                    b'{"prompt": "\xff"}', b'{"a": 1e999999}'):
            r = app.post(path, content=raw, headers={"Content-Type": "application/json"})
            assert 400 <= r.status_code < 500 and set(r.json()["error"]) == {"message", "type", "param", "code"}, \
                (path, raw, r.status_code, r.text)


WEIRD = ["\udcff", "", "a\x00b", "x" * 2000, -1, 0, 1, 2, 3, VOCAB, 2 ** 31, 2 ** 63, 10 ** 30, -(10 ** 30), 0.5,
         -0.5, 1.0, 2.5, 1e308, True, False, None, [], [[]], [1], [-1], [VOCAB], [1.5], ["a"], [["a"]], [[1, 2]],
         [[[1]]], {}, {"a": 1}, {"role": "user"}, [{"role": "user", "content": "\ud800"}],
         [{"role": 1, "content": []}], *NOT_FINITE]
FIELDS = {COMPLETIONS: ["prompt", "n", "best_of", "seed", "temperature", "top_p", "top_k", "stop", "stream",
                        "echo", "logprobs", "max_tokens", "repetition_penalty", "ignore_eos", "logprobs_mode", "user",
                        "suffix", "model", "logit_bias", "extra_field"],
          CHAT: ["messages", "n", "seed", "temperature", "top_p", "top_k", "stop", "stream", "logprobs",
                 "top_logprobs", "max_tokens", "max_completion_tokens", "model", "tools", "user", "extra_field"],
          "/tokenize": ["prompt", "messages", "add_special_tokens", "add_generation_prompt", "extra_field"],
          "/detokenize": ["tokens", "extra_field"]}


def mutate(rng: random.Random, path: str, body: dict) -> dict:
    """One to three edits: a field set to a weird value, removed, or wrapped in a list, or a
    message's or a prompt's innards replaced."""
    body = json.loads(json.dumps(body))
    for _ in range(rng.randint(1, 3)):
        field = rng.choice(FIELDS[path])
        edit = rng.random()
        if edit < 0.6:
            body[field] = rng.choice(WEIRD)
        elif edit < 0.7:
            body.pop(field, None)
        elif edit < 0.8 and field in body:
            body[field] = [body[field]]
        elif path == CHAT and isinstance(body.get("messages"), list) and body["messages"] and \
                isinstance(body["messages"][0], dict):
            body["messages"][0][rng.choice(["role", "content", "name"])] = rng.choice(WEIRD)
        elif path == COMPLETIONS:
            body["prompt"] = rng.choice([[rng.choice(WEIRD)], [rng.randrange(VOCAB), rng.choice(WEIRD)],
                                         "the " + rng.choice(["\udcff", "\x00", "cat"])])
    return body


def test_random_mutations_of_valid_bodies_never_get_a_5xx(app):
    """A few hundred seeded mutations (bounded by a deadline); afterwards the engine holds nothing and
    a valid request gets the same response as before them."""
    probe = {**GOOD[COMPLETIONS], "temperature": 1.0, "logprobs": 2}
    before = send(app, COMPLETIONS, probe).json()
    rng = random.Random(0)
    deadline = time.monotonic() + MUTATION_DEADLINE_S
    statuses: dict[int, int] = {}
    for i in range(MUTATIONS):
        if time.monotonic() > deadline:
            break
        path = rng.choice(list(GOOD))
        body = mutate(rng, path, GOOD[path])
        status = not_5xx(app, path, body).status_code
        statuses[status] = statuses.get(status, 0) + 1
    assert sum(statuses.values()) >= 100 and statuses.get(400, 0) >= 50 and statuses.get(200, 0) > 0, statuses
    after = send(app, COMPLETIONS, probe).json()
    assert after["choices"] == before["choices"] and after["usage"] == before["usage"]
    deadline = time.monotonic() + 30
    while app.engine.has_unfinished():
        assert time.monotonic() < deadline, "requests still in the engine"
        time.sleep(0.05)
    assert app.engine.core.blocks.num_used == 0


def test_the_real_server_and_the_openai_client_refuse_bad_input(server, client):
    """The same refusals from the real server: raw bodies with lone surrogates and 1e999, and the
    ``openai`` client's requests with bad values (it refuses to send NaN itself); then it still serves."""
    good = {"model": MODEL, "prompt": "the cat", "max_tokens": 1}
    for path, body, param in ((COMPLETIONS, {**good, "prompt": "\udcff"}, "prompt"),
                              (COMPLETIONS, {**good, "temperature": Raw("1e999")}, "temperature"),
                              (COMPLETIONS, {**good, "prompt": [[1, -1]]}, "prompt"),
                              (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "\ud800"}]},
                               "messages[0].content"),
                              ("/tokenize", {"prompt": "a\udcffb"}, "prompt")):
        assert_error(post(server, path, content=dumps(body)), 400, param)
    for call, param in ((lambda: client.completions.create(model=MODEL, prompt="a", max_tokens=-1), "max_tokens"),
                        (lambda: client.completions.create(model=MODEL, prompt=[VOCAB], max_tokens=1), "prompt"),
                        (lambda: client.completions.create(model=MODEL, prompt="a", max_tokens=1,
                                                           temperature=3), "temperature"),
                        (lambda: client.chat.completions.create(model=MODEL, max_tokens=1, top_logprobs=2,
                                                                messages=[{"role": "user", "content": "hi"}]),
                         "top_logprobs"),
                        (lambda: client.chat.completions.create(model=MODEL, max_tokens=1,
                                                                messages=[{"role": 5, "content": "hi"}]),
                         "messages[0].role")):
        with pytest.raises(openai.BadRequestError) as error:
            call()
        assert error.value.status_code == 400 and error.value.param == param, error.value.body
    assert client.completions.create(**good).choices[0].finish_reason in ("length", "stop")
