"""``POST /update_weights_from_disk`` on the real server (a subprocess on an ephemeral localhost
port, raw HTTP): after an update, completions equal, bitwise, those of a server started on the new
checkpoint, prefix-cached prompts included; bad checkpoints get a 400 naming the problem and the
old weights keep serving; the API key is enforced; a request in flight finishes on the old
weights while new ones get 503, and a drain past its timeout changes nothing; after a copy that
fails halfway, generation stays refused until an update succeeds."""
from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
import requests
from safetensors.torch import load_file, save_file

from helpers.servers import KEY, MODEL, ServerProcess
from helpers.tokenizer import save_tokenizer
from invariant_infer.engine import AsyncEngine, Engine
from invariant_infer.checkpoints.loading import load_model, load_tokenizer
from invariant_infer.testing.random_checkpoints import random_config, save_random_checkpoint
from invariant_infer.server.app import create_app
from invariant_infer.server.errors import APIError
from invariant_infer.training.weight_update import WeightUpdate

CONFIG = dict(family="qwen2", preset="tiny", num_hidden_layers=1)
PROMPT = list(range(3, 73))   # 70 tokens: a full KV page (64 on CPU) is cached and hit
LONG = 60                    # tokens of the request kept in flight (seconds through the interpreter)


def checkpoint_at(path, seed):
    save_random_checkpoint(path, random_config(**CONFIG), seed=seed)
    save_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def old(tmp_path_factory):
    return checkpoint_at(tmp_path_factory.mktemp("old"), seed=5)


@pytest.fixture(scope="module")
def new(tmp_path_factory):
    return checkpoint_at(tmp_path_factory.mktemp("new"), seed=6)


def start(path, log) -> ServerProcess:
    return ServerProcess(["--model", str(path), "--served-model-name", MODEL, "--dtype", "fp32", "--api-key", KEY,
                          "--max-num-seqs", "4"], log)


@pytest.fixture(scope="module")
def server(old, tmp_path_factory):
    s = start(old, tmp_path_factory.mktemp("log") / "server.log")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def truth(server, new, tmp_path_factory):
    """What a server started on each checkpoint answers, for each request the tests send: for the old
    one, the module's server before any update; for the new one, a server started on it."""
    answers = {"old": {kind: generated(server, **body) for kind, body in REQUESTS.items()}}
    s = start(new, tmp_path_factory.mktemp("log") / "new.log")
    try:
        answers["new"] = {kind: generated(s, **body) for kind, body in REQUESTS.items()}
    finally:
        s.stop()
    assert answers["old"] != answers["new"]
    return answers


REQUESTS = {"greedy": dict(prompt=PROMPT, max_tokens=4, temperature=0, logprobs=1),
            "seeded": dict(prompt=PROMPT[:9], max_tokens=4, temperature=0.8, seed=3, logprobs=1),
            "long": dict(prompt=PROMPT[:5], max_tokens=LONG, temperature=0, logprobs=0, ignore_eos=True)}


def post(server, path, body, key=KEY, timeout=300):
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    return requests.post(server.url + path, json=body, headers=headers, timeout=timeout)


def generated(server, **body):
    r = post(server, "/v1/completions", {"model": MODEL, **body})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["text"], choice["logprobs"]["tokens"], choice["logprobs"]["token_logprobs"], \
        choice["logprobs"]["top_logprobs"]


def answers(server) -> dict:
    return {kind: generated(server, **body) for kind, body in REQUESTS.items() if kind != "long"}


def update(server, path, **extra):
    return post(server, "/update_weights_from_disk", {"model_path": str(path), **extra})


def load(server, path) -> dict:
    r = update(server, path)
    assert r.status_code == 200, r.text
    return r.json()


def short(truth, name) -> dict:
    return {k: v for k, v in truth[name].items() if k != "long"}


@pytest.mark.heavy
def test_update_serves_the_new_checkpoint_bitwise(server, truth, old, new):
    load(server, old)
    assert answers(server) == short(truth, "old")   # the greedy prompt's first page is now cached
    body = load(server, new)
    assert body["success"] is True and "prefix cache reset" in body["message"]
    assert answers(server) == short(truth, "new")
    assert answers(server) == short(truth, "new")   # served from the cache refilled under the new weights
    load(server, old)
    assert answers(server) == short(truth, "old")   # and back, bitwise
    assert server.metrics()["invariant_infer_weight_update_in_progress"] == 0
    assert 'invariant_infer_weight_updates_total{result="success"}' in server.metrics_text()


def wrong_shape_checkpoint(new, folder):
    tensors = load_file(str(new / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.weight"
    tensors[name] = tensors[name][:, :-1].contiguous()
    folder.mkdir()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


@pytest.mark.heavy
def test_bad_checkpoints_get_400_and_the_old_weights_keep_serving(server, truth, old, new, tmp_path):
    load(server, old)
    index = tmp_path / "index"
    index.mkdir()
    (index / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"lm_head.weight": "gone.safetensors"}}))
    for path, named in ((tmp_path / "nowhere", "does not exist"),
                        (wrong_shape_checkpoint(new, tmp_path / "shape"),
                         "wrong shapes: model.layers.0.mlp.down_proj.weight [64, 159] (the model's is [64, 160])"),
                        (index, "gone.safetensors is missing")):
        r = update(server, path)
        assert r.status_code == 400, r.text
        body = r.json()
        assert body["success"] is False and named in body["message"] and "old weights keep serving" in body["message"]
        assert body["error"]["code"] == "invalid_checkpoint" and body["error"]["message"] == body["message"]
        assert answers(server) == short(truth, "old")
    for bad, code in (({}, "missing_required_parameter"), ({"model_path": str(new), "timeout": -1}, "invalid_value"),
                      ({"model_path": str(new), "load_format": "pt"}, "unsupported_parameter")):
        r = post(server, "/update_weights_from_disk", bad)
        assert r.status_code == 400 and r.json()["error"]["code"] == code, r.text
    assert answers(server) == short(truth, "old")


@pytest.mark.heavy
def test_api_key_is_enforced(server, truth, old, new):
    load(server, old)
    for key in (None, "wrong"):
        r = post(server, "/update_weights_from_disk", {"model_path": str(new)}, key=key)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert answers(server) == short(truth, "old")


class InFlight:
    """The long request, sent from a thread; ``started`` once the server counts it in flight."""

    def __init__(self, server):
        self.result = None
        self.thread = threading.Thread(target=self._run, args=(server,), daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while server.metrics()["invariant_infer_requests_in_flight"] < 1:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the long request never started"
            time.sleep(0.05)

    def _run(self, server):
        self.result = generated(server, **REQUESTS["long"])

    def join(self):
        self.thread.join(300)
        assert not self.thread.is_alive()
        return self.result


def refused_503(server) -> dict:
    """Send short completions until one is refused (the drain has begun); its body."""
    deadline = time.monotonic() + 30
    while True:
        r = post(server, "/v1/completions", {"model": MODEL, **REQUESTS["seeded"]})
        if r.status_code == 503:
            assert r.headers["Retry-After"] == "1"
            return r.json()
        assert r.status_code == 200 and time.monotonic() < deadline, r.text
        time.sleep(0.05)


@pytest.mark.heavy
def test_a_request_in_flight_finishes_on_the_old_weights(server, truth, old, new):
    load(server, old)
    long = InFlight(server)
    updating = {}
    updater = threading.Thread(target=lambda: updating.update(r=update(server, new)), daemon=True)
    updater.start()
    refusal = refused_503(server)
    assert refusal["error"]["code"] == "weights_updating" and "loading new weights" in refusal["error"]["message"]
    second = update(server, old)
    assert second.status_code == 409 and second.json()["error"]["code"] == "update_in_progress"
    assert updater.is_alive()                       # still waiting for the long request
    assert long.join() == truth["old"]["long"]      # all of it on the old weights
    updater.join(300)
    assert updating["r"].status_code == 200 and updating["r"].json()["success"] is True
    assert answers(server) == short(truth, "new")
    assert generated(server, **REQUESTS["long"]) == truth["new"]["long"]


@pytest.mark.heavy
def test_a_drain_past_its_timeout_changes_nothing(server, truth, old, new):
    load(server, old)
    long = InFlight(server)
    r = update(server, new, timeout=0.5)
    assert r.status_code == 503, r.text
    body = r.json()
    assert body["success"] is False and body["error"]["code"] == "drain_timeout"
    assert "still in flight after 0.5 s; the weights were not changed" in body["message"]
    assert long.join() == truth["old"]["long"]
    assert answers(server) == short(truth, "old")   # admitting again, on the old weights
    assert 'invariant_infer_weight_updates_total{result="timeout"} 1.0' in server.metrics_text()


def test_a_copy_that_fails_halfway_keeps_generation_refused(old, new, monkeypatch):
    """In process (the fault cannot be caused from outside): the copy raises after the check; the
    weights are mixed, so admission answers 503 until an update succeeds."""
    async_engine = AsyncEngine(Engine(load_model(str(old), dtype="fp32", device="cpu")))
    try:
        state = create_app(async_engine, load_tokenizer(str(old))).state.server
        real = WeightUpdate.apply

        def halfway(self):
            self.copies = self.copies[:3]
            real(self)
            raise OSError("read error")
        monkeypatch.setattr(WeightUpdate, "apply", halfway)
        with pytest.raises(APIError) as failed:
            asyncio.run(state.weights.update_from_disk(str(new), 5))
        assert failed.value.status == 500 and failed.value.code == "update_failed"
        assert "OSError: read error" in failed.value.message and "weights are mixed" in failed.value.message
        with pytest.raises(APIError) as refused:
            state.runner.admit(1)
        assert refused.value.status == 503 and refused.value.message == failed.value.message
        monkeypatch.setattr(WeightUpdate, "apply", real)
        assert asyncio.run(state.weights.update_from_disk(str(new), 5))["success"] is True
        state.runner.admit(1)  # admitted again
    finally:
        async_engine.shutdown()
