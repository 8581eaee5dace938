"""``invariant-infer serve`` as users run it: the real server in a subprocess on an ephemeral
localhost port, driven with the official ``openai`` client and raw HTTP. Every comparison of
text, tokens and logprobs is exact ``==`` (logprobs are float32 values written as JSON floats,
which round-trip exactly)."""
from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
openai = pytest.importorskip("openai")
requests = pytest.importorskip("requests")

from helpers import CHAT_TEMPLATE, KEY, MODEL, ServerProcess, save_tokenizer  # noqa: E402
from invariant_infer.random_checkpoints import random_config, save_random_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    config = random_config("qwen2", "tiny", num_hidden_layers=1)
    path = save_random_checkpoint(tmp_path_factory.mktemp("serve-qwen2"), config, seed=5)
    save_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    s = ServerProcess(["--model", str(checkpoint), "--served-model-name", MODEL, "--dtype", "fp32",
                       "--api-key", KEY, "--max-num-seqs", "4", "--max-waiting", "4", "--max-body-bytes", "65536"],
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
    from invariant_infer.scoring import score_sequences

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
    # authentication, size limit, unknown paths
    assert_error(post(server, "/v1/completions", good, key=None), 401)
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


# ---- stock kernels (negative control) and SIGTERM ------------------------------------------------------


@pytest.mark.slow
def test_negative_control_stock_server_differs_and_sigterm_finishes_in_flight(tmp_path):
    """The same load through the engine's stock kernels at Qwen2.5-1.5B widths (fp32) changes some
    logprobs between alone and batched. Then SIGTERM: the request in flight finishes, exit 0."""
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

        result = {}

        def long_request():
            result["response"] = post(s, "/v1/completions", {"prompt": prompts[0], "max_tokens": 40,
                                                             "temperature": 0, "ignore_eos": True}, key=None)
        worker = threading.Thread(target=long_request)
        worker.start()
        deadline = time.monotonic() + 60
        while s.metrics()["invariant_infer_running_sequences"] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        s.proc.send_signal(signal.SIGTERM)
        worker.join(120)
        response = result["response"]
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 40
        assert s.proc.wait(60) == 0
    finally:
        s.stop()


def test_cli_help_and_serve_without_the_serve_extra():
    """``invariant-infer --help`` never imports fastapi; ``serve`` without it says which extra to install."""
    block = "import sys; sys.modules['fastapi'] = None; from invariant_infer.cli import main; "
    helped = subprocess.run([sys.executable, "-c", block + "main(['--help'])"], capture_output=True, text=True,
                            timeout=120)
    assert helped.returncode == 0 and "serve" in helped.stdout
    served = subprocess.run([sys.executable, "-c", block + "sys.exit(main(['serve', '--model', 'x']))"],
                            capture_output=True, text=True, timeout=120)
    assert served.returncode == 2 and "invariant-infer[serve]" in served.stderr
