"""``invariant-infer serve``'s refusals on the real server (a subprocess on an ephemeral localhost
port): OpenAI's error bodies for bad input, authentication, the body limit, unknown paths and a full
queue; the tokenizer endpoints; the command line's own checks; and the stock kernels' server
drifting under load (the negative control of the invariance tests)."""
from __future__ import annotations

import random
import subprocess
import sys

import pytest
import requests

from helpers.servers import (KEY, MODEL, ServerProcess, assert_error, choices_of, completion, get, post,
                             subprocess_server_only)
from helpers.tokenizer import CHAT_TEMPLATE, save_tokenizer
from invariant_infer.testing.random_checkpoints import random_config, save_random_checkpoint


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
    assert get(server, "/v1/models").status_code == 401
    assert_error(post(server, "/v1/completions", {**good, "prompt": "x" * 70000}), 413)
    assert_error(get(server, "/v1/nothing"), 404)
    # still serving
    assert completion(server, **good)["choices"][0]["finish_reason"] in ("length", "stop")
    assert get(server, "/health").status_code == 200
    server.wait_idle()


@subprocess_server_only
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
    info = get(server, "/tokenizer_info", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert info["eos_token"] == tokenizer.eos_token and info["chat_template"] == CHAT_TEMPLATE
    assert {"bos_token", "pad_token"} <= set(info)
    tokens = post(server, "/tokenize", {"prompt": "the cat runs", "add_special_tokens": False}).json()["tokens"]
    assert tokens == tokenizer.encode("the cat runs", add_special_tokens=False)
    assert post(server, "/detokenize", {"tokens": tokens}).json()["prompt"] == "the cat runs"
    assert_error(post(server, "/detokenize", {"tokens": [10 ** 9]}), 400, "tokens")


# ---- stock kernels (negative control) ----------------------------------------------------------------


@pytest.mark.heavy
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


@pytest.mark.heavy
def test_cli_help_and_serve_without_the_serve_extra():
    """``invariant-infer --help`` never imports fastapi; ``serve`` without it says which extra to install."""
    script = ("import sys; sys.modules['fastapi'] = None; from invariant_infer.cli import main\n"
              "try:\n    main(['--help'])\nexcept SystemExit as e:\n    print('help exit', e.code)\n"
              "sys.exit(main(['serve', '--model', 'x']))")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert "help exit 0" in run.stdout and "serve" in run.stdout.split("help exit")[0]
    assert run.returncode == 2 and 'pip install -e ".[serve]"' in run.stderr


@pytest.mark.parametrize("value", ["0", "-1", "inf", "nan"])
def test_stream_write_timeout_must_be_positive_and_finite(value, capsys):
    from invariant_infer.cli import main
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--model", "x", "--stream-write-timeout", value])
    assert exit_info.value.code == 2 and "--stream-write-timeout" in capsys.readouterr().err
