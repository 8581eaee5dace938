"""``invariant-infer serve`` as users run it: the real server in a subprocess on an ephemeral
localhost port, driven with the official ``openai`` client and raw HTTP. Every comparison of
text, tokens and logprobs is exact ``==`` (logprobs are float32 values written as JSON floats,
which round-trip exactly)."""
from __future__ import annotations

import json
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import fastapi  # noqa: F401  (the serve extra, installed by the test extra: missing fails)
import openai
import prometheus_client  # noqa: F401
import pytest
import requests
import torch
import uvicorn  # noqa: F401

from helpers import CHAT_TEMPLATE, KEY, MODEL, ServerProcess, save_tokenizer
from invariant_infer.testing.random_checkpoints import random_config, save_random_checkpoint

WRITE_TIMEOUT_S = 2  # --stream-write-timeout of the module's server


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    config = random_config("qwen2", "tiny", num_hidden_layers=1)
    path = save_random_checkpoint(tmp_path_factory.mktemp("serve-qwen2"), config, seed=5)
    save_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    s = ServerProcess(["--model", str(checkpoint), "--served-model-name", MODEL, "--dtype", "fp32",
                       "--api-key", KEY, "--max-num-seqs", "4", "--max-waiting", "4", "--max-body-bytes", "65536",
                       "--stream-write-timeout", str(WRITE_TIMEOUT_S)],
                      tmp_path_factory.mktemp("serve-log") / "server.log")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=300)


def post(server, path: str, body=None, *, content=None, key: str | None = KEY, timeout=300, headers=None):
    headers = dict(headers or {})
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    if content is None:
        content = json.dumps(body)
    return requests.post(server.url + path, data=content, headers={"Content-Type": "application/json", **headers},
                         timeout=timeout)


def completion(server, **body) -> dict:
    r = post(server, "/v1/completions", {"model": MODEL, **body})
    assert r.status_code == 200, r.text
    return r.json()


def choices_of(response: dict) -> list[dict]:
    return sorted(response["choices"], key=lambda c: c["index"])


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


# ---- bad input, limits, disconnects ---------------------------------------------------------------------


def assert_error(response, status: int, param: str | None = None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


def test_bad_input_gets_openai_errors_and_the_server_keeps_serving(server):
    good = {"model": MODEL, "prompt": "the cat", "max_tokens": 1}
    assert_error(post(server, "/v1/completions", content="{bad json"), 400)
    assert_error(post(server, "/v1/completions", content="[1, 2]"), 400)
    assert post(server, "/v1/completions", {**good, "model": "gpt-4"}).json()["error"]["code"] == "model_not_found"
    assert_error(post(server, "/v1/completions", {**good, "model": "gpt-4"}), 404, "model")
    assert_error(post(server, "/v1/completions", {**good, "prompt": [1, 2, 512]}), 400, "prompt")
    assert_error(post(server, "/v1/completions", {**good, "prompt": [[3, -1]]}), 400, "prompt")
    error = assert_error(post(server, "/v1/completions", {**good, "prompt": [5] * 500, "max_tokens": 100}), 400)
    assert error["code"] == "context_length_exceeded"
    for field, value in [("max_tokens", "3"), ("max_tokens", -1), ("max_tokens", 1.5), ("temperature", "hot"),
                         ("temperature", -1), ("top_p", 0), ("top_p", 1.5), ("top_k", -2), ("logprobs", 21),
                         ("logprobs", True), ("n", 0), ("n", 100), ("seed", -1), ("seed", 2 ** 64), ("echo", "yes"),
                         ("stop", 3), ("stream", 1), ("prompt", 5), ("prompt", []), ("prompt", [[]]),
                         ("prompt", ["a", 1]), ("best_of", 2), ("logit_bias", {"1": 5}), ("suffix", "x"),
                         ("presence_penalty", 0.5), ("unknown_option", 1)]:
        assert_error(post(server, "/v1/completions", {**good, field: value}), 400, field)
    assert_error(post(server, "/v1/completions", {**good, "max_tokens": 0}), 400, "max_tokens")
    assert_error(post(server, "/v1/completions", {"model": MODEL}), 400, "prompt")
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    assert_error(post(server, "/v1/chat/completions", {**chat, "messages": "hi"}), 400, "messages")
    assert_error(post(server, "/v1/chat/completions", {**chat, "top_logprobs": 2}), 400, "top_logprobs")
    assert_error(post(server, "/v1/chat/completions", {**chat, "tools": [{"type": "function"}]}), 400, "tools")
    nested = {**chat, "messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": 5}]}
    assert_error(post(server, "/v1/chat/completions", nested), 400, "messages[1].content")
    # the codes, and a JSON null meaning the default
    assert assert_error(post(server, "/v1/completions", {**good, "n": "2"}), 400, "n")["code"] == "invalid_type"
    assert assert_error(post(server, "/v1/completions", {**good, "n": 99}), 400, "n")["code"] == "invalid_value"
    assert assert_error(post(server, "/v1/completions", {**good, "x": 1}), 400, "x")["code"] == "unsupported_parameter"
    assert assert_error(post(server, "/v1/completions", {"model": MODEL}), 400, "prompt")["code"] == \
        "missing_required_parameter"
    assert assert_error(post(server, "/v1/completions", content="{bad json"), 400)["code"] == "invalid_json"
    assert completion(server, **good, temperature=None, stop=None)["choices"]
    # authentication, size limit, unknown paths
    assert_error(post(server, "/v1/completions", good, key=None), 401)
    assert_error(post(server, "/v1/completions", {**good, "max_tokens": "3"}, key=None), 401)  # before the fields
    assert_error(post(server, "/v1/completions", good, key="wrong"), 401)
    assert_error(post(server, "/v1/chat/completions", chat, key=None), 401)
    assert requests.get(server.url + "/v1/models", timeout=30).status_code == 401
    assert_error(post(server, "/v1/completions", {**good, "prompt": "x" * 70000}), 413)
    assert_error(requests.get(server.url + "/v1/nothing", timeout=30), 404)
    # still serving
    assert completion(server, **good)["choices"][0]["finish_reason"] in ("length", "stop")
    assert requests.get(server.url + "/health", timeout=30).status_code == 200
    server.wait_idle()


def test_queue_full_429_and_disconnects_free_pages(server):
    """Capacity is 4 running + 4 waiting sequences. A streaming client that goes away, and a
    non-streaming one that times out, both free their sequences and pages."""
    body = {"model": MODEL, "prompt": "the dog", "max_tokens": 200, "temperature": 1.0, "seed": 1, "n": 8,
            "stream": True}
    with requests.Session() as http:
        with http.post(server.url + "/v1/completions", json=body, stream=True, timeout=300,
                       headers={"Authorization": f"Bearer {KEY}"}) as stream:
            assert stream.status_code == 200
            lines = stream.iter_lines(decode_unicode=True)
            assert next(line for line in lines if line.startswith("data: "))  # it is running
            full = post(server, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1})
            error = assert_error(full, 429)
            assert full.headers["retry-after"] and error["type"] == "rate_limit_error"
            assert server.metrics()["invariant_infer_kv_pages_used"] > 0
        # leaving the block closes the connection mid-stream
    server.wait_idle(timeout=60)
    with pytest.raises(requests.Timeout):
        post(server, "/v1/completions", {**body, "stream": False, "n": 2}, timeout=3)
    server.wait_idle(timeout=60)
    assert completion(server, prompt="x", max_tokens=1)["choices"]


def test_tokenizer_endpoints(server, checkpoint):
    from transformers import PreTrainedTokenizerFast
    tokenizer = PreTrainedTokenizerFast.from_pretrained(checkpoint)
    info = requests.get(server.url + "/tokenizer_info", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).json()
    assert info["eos_token"] == tokenizer.eos_token and info["chat_template"] == CHAT_TEMPLATE
    assert {"bos_token", "pad_token"} <= set(info)
    tokens = post(server, "/tokenize", {"prompt": "the cat runs", "add_special_tokens": False}).json()["tokens"]
    assert tokens == tokenizer.encode("the cat runs", add_special_tokens=False)
    assert post(server, "/detokenize", {"tokens": tokens}).json()["prompt"] == "the cat runs"
    assert_error(post(server, "/detokenize", {"tokens": [10 ** 9]}), 400, "tokens")


# ---- stock kernels (negative control) ----------------------------------------------------------------


@pytest.mark.slow
def test_negative_control_stock_server_differs_under_load(tmp_path):
    """The same load through the engine's stock kernels at Qwen2.5-1.5B widths (fp32) changes some
    logprobs between alone and batched."""
    config = random_config("qwen2", "qwen2.5-1.5b", num_hidden_layers=1, vocab_size=2048,
                           max_position_embeddings=1024)
    path = save_random_checkpoint(tmp_path / "m", config, seed=3)
    save_tokenizer(path)
    s = ServerProcess(["--model", str(path), "--dtype", "fp32", "--kernels", "stock", "--served-model-name", MODEL,
                       "--max-num-batched-tokens", "64"], tmp_path / "server.log")
    try:
        rng = random.Random(7)
        prompts = [[rng.randrange(2048) for _ in range(n)] for n in (33, 1, 20, 7)]
        params = {"max_tokens": 3, "temperature": 0, "logprobs": 0, "echo": True}
        r = post(s, "/v1/completions", {"prompt": prompts, **params}, key=None)
        batched = choices_of(r.json())
        alone = [choices_of(completion(s, prompt=p, **params))[0] for p in prompts]
        assert any(a["logprobs"]["token_logprobs"] != b["logprobs"]["token_logprobs"]
                   for a, b in zip(alone, batched)), "stock kernels should drift under load"
    finally:
        s.stop()


def test_cli_help_and_serve_without_the_serve_extra():
    """``invariant-infer --help`` never imports fastapi; ``serve`` without it says which extra to install."""
    script = ("import sys; sys.modules['fastapi'] = None; from invariant_infer.cli import main\n"
              "try:\n    main(['--help'])\nexcept SystemExit as e:\n    print('help exit', e.code)\n"
              "sys.exit(main(['serve', '--model', 'x']))")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert "help exit 0" in run.stdout and "serve" in run.stdout.split("help exit")[0]
    assert run.returncode == 2 and "invariant-infer[serve]" in run.stderr


@pytest.mark.parametrize("value", ["0", "-1", "inf", "nan"])
def test_stream_write_timeout_must_be_positive_and_finite(value, capsys):
    from invariant_infer.cli import main
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--model", "x", "--stream-write-timeout", value])
    assert exit_info.value.code == 2 and "--stream-write-timeout" in capsys.readouterr().err


# ---- faults: a client that stops reading, a soak, SIGTERM (last: it stops the module's server) ----------


def raw_request(path: str, body: dict) -> bytes:
    data = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n").encode() + data


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return value


def stalled_stream(server) -> socket.socket:
    """A raw socket with a small receive buffer that sends a streaming request whose first events
    are large (echo + logprobs 20 on a long prompt) and then reads nothing."""
    rng = random.Random(9)
    body = {"model": MODEL, "prompt": [rng.randrange(512) for _ in range(200)], "max_tokens": 200, "n": 4,
            "echo": True, "logprobs": 20, "stream": True, "temperature": 1.0, "seed": 4, "ignore_eos": True}
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: a small TCP window
    sock.connect(server.address)
    sock.sendall(raw_request("/v1/completions", body))
    return sock


def test_a_stream_client_that_stops_reading_is_dropped_and_its_pages_freed(server):
    """A raw socket with a small receive buffer sends a streaming request whose first events are
    large (echo + logprobs 20 on a long prompt) and reads nothing. After --stream-write-timeout the
    server ends the stream and aborts its requests: /metrics shows every page free and nothing
    running while the socket is still open, and no choice finished (none was counted as
    generated); what the client reads afterwards stops short of ``data: [DONE]``, or the connection
    was reset (the kernel's TCP_USER_TIMEOUT on a client that read nothing for as long)."""
    generated_before = server.metrics()["invariant_infer_generation_tokens_total"]
    sock = stalled_stream(server)
    try:
        wait_for(lambda: server.metrics()["invariant_infer_running_sequences"] > 0, 60, "the request to run")
        idle = server.wait_idle(timeout=60)  # pages free, nothing running, waiting or in flight
        assert idle["invariant_infer_generation_tokens_total"] == generated_before  # aborted, not finished
        sock.settimeout(30)
        received, reset = b"", False
        try:
            while chunk := sock.recv(1 << 16):
                received += chunk
        except ConnectionResetError:
            reset = True
    finally:
        sock.close()
    assert reset or (received.startswith(b"HTTP/1.1 200") and b"data: {" in received)
    assert b"data: [DONE]" not in received
    assert completion(server, prompt="x", max_tokens=1)["choices"]  # still serving


SOAK_REQUESTS, SOAK_THREADS, SOAK_DEADLINE_S = 300, 6, 120
BAD_BODIES = [{"prompt": "a", "max_tokens": "3"}, {"prompt": "a", "temperature": -1}, {"prompt": "a", "n": 99},
              {"prompt": [1, 2, 512]}, {"prompt": [7] * 600}, {"prompt": "a", "unknown": 1},
              {"prompt": "a", "logit_bias": {"1": 2}}, {"model": "gpt-4", "prompt": "a"}, {"prompt": []}]


def soak_one(server, i: int) -> tuple[str, int | None]:
    """Request ``i`` of the soak: (its kind, the HTTP status; None where the client gave up)."""
    rng = random.Random(1000 + i)
    kind = rng.choice(["whole", "whole", "n2", "stream", "stream", "cancel", "cancel", "chat", "chat_stream", "bad",
                       "bad", "malformed", "gave_up"])
    prompt = [rng.randrange(512) for _ in range(rng.randint(1, 20))] if rng.random() < 0.5 else \
        " ".join(rng.choice(["the", "cat", "dog", "runs"]) for _ in range(rng.randint(1, 8)))
    body = {"model": MODEL, "prompt": prompt, "max_tokens": rng.randint(1, 3), "temperature": rng.choice([0, 1.0]),
            "seed": i, "logprobs": rng.choice([None, 0, 2])}
    path = "/v1/completions"
    if kind.startswith("chat"):
        path, body = "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": str(prompt)}],
                                              "max_tokens": body["max_tokens"], "seed": i}
    if kind == "n2":
        body["n"] = 2
    if kind == "bad":
        body = {"model": MODEL, **rng.choice(BAD_BODIES)}
    if kind == "malformed":
        return kind, post(server, path, content='{"prompt": ', timeout=30).status_code
    if kind == "gave_up":  # a whole response the client stops waiting for
        try:
            return kind, post(server, path, {**body, "max_tokens": 60, "ignore_eos": True}, timeout=0.5).status_code
        except requests.Timeout:
            return kind, None
    if kind in ("stream", "cancel", "chat_stream"):
        with requests.post(server.url + path, json={**body, "stream": True}, stream=True, timeout=60,
                           headers={"Authorization": f"Bearer {KEY}"}) as r:
            if r.status_code != 200:
                return kind, r.status_code
            events = []
            for line in r.iter_lines(decode_unicode=True):
                if line.startswith("data: "):
                    events.append(line[6:])
                    if kind == "cancel":
                        break  # leaving the block closes the connection mid-stream
            if kind != "cancel":
                assert events[-1] == "[DONE]" and not any('"error"' in e for e in events), events[-3:]
            return kind, r.status_code
    r = post(server, path, body, timeout=60)
    if r.status_code == 200:
        assert len(r.json()["choices"]) == body.get("n", 1)
    return kind, r.status_code


def test_soak_of_mixed_requests_leaves_nothing_held_and_no_5xx(server):
    """Several hundred mixed requests from concurrent clients (whole and streamed, completions and
    chat, n = 2, streams cancelled after their first event, clients that stop waiting, bad bodies,
    malformed JSON), bounded in count and by a deadline past which no new one starts. Afterwards
    /metrics shows nothing running, waiting or in flight and every KV page free; no response was
    a 5xx, and the server's own count has no 5xx either."""
    deadline = time.monotonic() + SOAK_DEADLINE_S

    def run(i):
        return soak_one(server, i) if time.monotonic() < deadline else ("skipped", None)

    with ThreadPoolExecutor(SOAK_THREADS) as pool:
        results = list(pool.map(run, range(SOAK_REQUESTS)))
    statuses = Counter(status for kind, status in results if kind != "skipped")
    kinds = Counter(kind for kind, _ in results)
    assert sum(statuses.values()) >= 200, (kinds, statuses)
    assert not [s for s in statuses if s is not None and s >= 500], statuses
    assert statuses[200] >= 100 and statuses[400] > 0 and statuses[404] > 0, statuses
    idle = server.wait_idle(timeout=60)
    assert idle["invariant_infer_kv_pages_total"] > 0
    text = server.metrics_text()
    assert 'status="2' in text and not any(f'status="5{d}' in text for d in range(10)), text


def test_sigterm_refuses_new_connections_and_drains_in_flight(server):
    """Last in this file: it stops the module's server. SIGTERM while three requests (two whole,
    one streamed) are in flight and a stalled stream's client still holds its connection open
    without reading: a new connection is refused while they are still running, each of them
    completes equal to the same request sent alone, and the process exits 0 (the stalled
    connection does not keep it waiting)."""
    bodies = [{"model": MODEL, "prompt": p, "max_tokens": 24, "temperature": 1.0, "seed": 20 + k, "logprobs": 1,
               "ignore_eos": True} for k, p in enumerate(["the cat", [5, 9, 200, 3], "a dog runs"])]
    alone = [completion(server, **b) for b in bodies]
    stalled = stalled_stream(server)
    wait_for(lambda: server.metrics()["invariant_infer_running_sequences"] > 0, 60, "the stalled request to run")
    server.wait_idle(timeout=60)  # its stream was ended by the write timeout; the socket stays open
    results = {}

    def whole(k):
        results[k] = post(server, "/v1/completions", bodies[k]).json()

    def streamed(k):
        text, values = "", []
        with requests.post(server.url + "/v1/completions", json={**bodies[k], "stream": True}, stream=True,
                           timeout=300, headers={"Authorization": f"Bearer {KEY}"}) as r:
            events = [line[6:] for line in r.iter_lines(decode_unicode=True) if line.startswith("data: ")]
        for event in events[:-1]:
            piece = json.loads(event)["choices"][0]
            text += piece["text"]
            values += piece["logprobs"]["token_logprobs"]
        results[k] = (events[-1], text, values)

    workers = [threading.Thread(target=whole, args=(0,)), threading.Thread(target=whole, args=(1,)),
               threading.Thread(target=streamed, args=(2,))]
    for w in workers:
        w.start()
    wait_for(lambda: server.metrics()["invariant_infer_running_sequences"] == 3, 60, "three running sequences")
    server.proc.send_signal(signal.SIGTERM)

    def refused() -> bool:
        try:
            socket.create_connection(server.address, timeout=5).close()
            return False
        except ConnectionRefusedError:
            return True
    wait_for(refused, 2, "a new connection to be refused")
    assert any(w.is_alive() for w in workers), "the in-flight requests ended before the refusal was seen"
    for w in workers:
        w.join(120)
    for k in (0, 1):
        assert choices_of(results[k]) == choices_of(alone[k]) and results[k]["usage"] == alone[k]["usage"]
    done, text, values = results[2]
    reference = choices_of(alone[2])[0]
    assert done == "[DONE]" and text == reference["text"] and values == reference["logprobs"]["token_logprobs"]
    try:
        assert server.proc.wait(60) == 0
    finally:
        stalled.close()
