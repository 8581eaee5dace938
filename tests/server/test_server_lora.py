"""LoRA adapters in the server (vLLM's conventions): ``--lora-modules``, the ``model`` field picks an
adapter, ``/v1/models`` lists them with their sha256, ``/v1/load_lora_adapter`` and
``/v1/unload_lora_adapter`` mid-traffic behind the API key, bad bodies refused. Every response is
bitwise what an in-process engine gives the request alone with its adapter."""
from __future__ import annotations

import copy
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import requests
import torch
from peft import LoraConfig, get_peft_model

from helpers.models import load_model
from helpers.servers import KEY, MODEL, ServerProcess, assert_error, post
from invariant_infer.engine import Engine, SamplingParams
from invariant_infer.testing.random_checkpoints import random_config, random_model

pytestmark = pytest.mark.heavy  # crosses a process boundary

ADAPTERS = {"a": LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "down_proj"], init_lora_weights=False),
            "b": LoraConfig(r=8, lora_alpha=8, target_modules=["v_proj", "o_proj", "up_proj"], init_lora_weights=False),
            "too-wide": LoraConfig(r=16, target_modules=["q_proj"], init_lora_weights=False)}
PROMPTS = ["the cat runs", "a model token batch", "score sequence"]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    config = random_config("qwen2", "tiny", num_hidden_layers=1)
    paths = {}
    for seed, (name, lora) in enumerate(ADAPTERS.items()):
        torch.manual_seed(seed)
        paths[name] = tmp_path_factory.mktemp(f"serve-lora-{name}")
        get_peft_model(random_model(config), copy.deepcopy(lora)).save_pretrained(paths[name])
    return paths


@pytest.fixture(scope="module")
def lora_server(checkpoint, adapters, tmp_path_factory):
    s = ServerProcess(["--model", str(checkpoint), "--served-model-name", MODEL, "--dtype", "fp32", "--api-key", KEY,
                       "--lora-modules", f"a={adapters['a']}", "--max-loras", "2", "--max-lora-rank", "8"],
                      tmp_path_factory.mktemp("serve-lora-log") / "server.log")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def truth(checkpoint, adapters):
    """(text, token logprobs) of each (adapter, prompt) alone, from an engine in this process."""
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    engine = Engine(load_model(checkpoint, torch.float32), tokenizer, max_loras=1, max_lora_rank=8)
    for name in ("a", "b"):
        engine.add_lora(name, adapters[name])
    params = SamplingParams(max_tokens=4, logprobs=0, ignore_eos=True)
    found = {(lora, p): engine.generate([p], params, lora=lora)[0] for lora in (None, "a", "b") for p in PROMPTS}
    return {key: (out.text, out.logprobs) for key, out in found.items()}, {a.name: a.sha256 for a in engine.list_loras()}


def ask(client, model, prompt):
    out = client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0, logprobs=0,
                                    extra_body={"ignore_eos": True})
    return out.choices[0].text, out.choices[0].logprobs.token_logprobs


def test_adapters_concurrently_with_load_and_unload_mid_traffic(lora_server, adapters, truth):
    expected, sha = truth
    client = openai.OpenAI(base_url=lora_server.url + "/v1", api_key=KEY, max_retries=0, timeout=300)
    ids = {m.id: m for m in client.models.list().data}
    assert set(ids) == {MODEL, "a"} and ids["a"].to_dict()["sha256"] == sha["a"]
    with ThreadPoolExecutor(6) as pool:
        first = [(key, pool.submit(ask, client, key[0] or MODEL, key[1])) for key in expected if key[0] != "b"]
        loaded = post(lora_server, "/v1/load_lora_adapter", {"lora_name": "b", "lora_path": str(adapters["b"])})
        second = [(key, pool.submit(ask, client, key[0] or MODEL, key[1])) for key in expected]
        results = [(key, f.result()) for key, f in first + second]
    assert loaded.status_code == 200 and loaded.json()["sha256"] == sha["b"], loaded.text
    for key, got in results:
        assert got == expected[key], key
    assert all(expected[(lora, p)] != expected[(None, p)] for lora in ("a", "b") for p in PROMPTS)
    assert {m.id for m in client.models.list().data} == {MODEL, "a", "b"}
    assert post(lora_server, "/v1/unload_lora_adapter", {"lora_name": "b"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        ask(client, "b", PROMPTS[0])
    assert ask(client, "a", PROMPTS[0]) == expected[("a", PROMPTS[0])]


def test_bad_adapter_requests_are_refused_and_change_nothing(lora_server, adapters, tmp_path):
    load = "/v1/load_lora_adapter"
    assert_error(post(lora_server, load, {"lora_name": "c", "lora_path": str(adapters["too-wide"])}), 400, "lora_path")
    assert_error(post(lora_server, load, {"lora_name": "c", "lora_path": str(tmp_path)}), 400, "lora_path")
    assert_error(post(lora_server, load, {"lora_name": "a", "lora_path": str(adapters["a"])}), 400)  # loaded already
    assert_error(post(lora_server, load, {"lora_name": "c"}), 400)
    assert_error(post(lora_server, load, {"lora_name": "c", "lora_path": str(adapters["a"])}, key=None), 401)
    assert_error(post(lora_server, "/v1/unload_lora_adapter", {"lora_name": "nope"}), 404, "lora_name")
    assert_error(post(lora_server, "/v1/completions", {"model": "nope", "prompt": "x", "max_tokens": 1}), 404, "model")
    models = post(lora_server, "/v1/models", None)  # GET only
    assert models.status_code == 405
    listed = [m["id"] for m in requests.get(lora_server.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"},
                                            timeout=30).json()["data"]]
    assert "c" not in listed and "a" in listed
