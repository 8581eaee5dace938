"""``invariant-infer serve`` on pooled checkpoints (vLLM's pooling routes): a BERT sentence-transformers
embedder, a BERT cross-encoder, a Qwen3 reward model and a Qwen3 classifier, one layer each, saved
and served as users do. Every value a route answers is compared with exact ``==`` (JSON floats
round-trip float32 and float64 exactly): a request's inputs together == each alone == fired at
once from threads == the model in process (``load_pooled_model``, and sentence-transformers'
``encode`` / ``predict`` after ``make_invariant``). The negative control runs the same together ==
alone check with a linear whose K block follows the batch size and sees it fail. The app runs in
process (Starlette's TestClient, as tests/server/conftest.py's); one heavy test runs the real command."""
from __future__ import annotations

import base64
import math
import threading

import numpy as np
import openai
import pytest
import torch

import invariant_infer.model.layer_forwards
from helpers.controls import m_dependent_linear
from helpers.servers import KEY, MODEL, InProcessServer, ServerProcess, assert_error, get, post, run_concurrently
from helpers.served_pooled_checkpoints import (BERT_MAX_LENGTH, CLASS_LABELS, MATRYOSHKA, save_bert_cross_encoder,
                                               save_bert_embedder, save_qwen3_head)
from invariant_infer.checkpoints.pooled_loading import load_pooled_model
from invariant_infer.engine.pooling_engine import PoolingEngine
from invariant_infer.server import ServerOptions

TEXTS = ["the cat runs fast", "a dog", "model token batch score sequence invariant logits prompt", "the",
         "prompt completion cat dog runs fast the a model token", "dog dog"]
SAVERS = {"embed": save_bert_embedder, "score": save_bert_cross_encoder,
          "reward": lambda path: save_qwen3_head(path, 1), "classify": lambda path: save_qwen3_head(path, 3)}


def options(path, **extra) -> ServerOptions:
    # a small token budget, so a request of several inputs runs in several batches
    return ServerOptions(model=str(path), model_name=MODEL, api_key=KEY, dtype="fp32", device="cpu",
                         max_num_batched_tokens=48, **extra)


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("pooled")
    return {task: save(root / task) for task, save in SAVERS.items()}


@pytest.fixture(scope="module")
def servers(paths):
    started = {}
    try:
        for task, path in paths.items():
            started[task] = InProcessServer(options(path))
        yield started
    finally:
        for server in started.values():
            server.stop()


@pytest.fixture(scope="module")
def models(paths):
    return {task: load_pooled_model(path, dtype="fp32", device="cpu") for task, path in paths.items()}


def ok(server, route, body) -> dict:
    r = post(server, route, {"model": MODEL, **body})
    assert r.status_code == 200, r.text
    return r.json()


def values(response: dict, field: str) -> list:
    assert [d["index"] for d in response["data"]] == list(range(len(response["data"])))
    return [d[field] for d in response["data"]]


def alone_together_concurrent(server, route, field, items, key="input", **extra) -> list:
    """The values of ``items`` sent together; asserted == each sent alone == each fired at once."""
    together = values(ok(server, route, {key: items, **extra}), field)
    alone = [values(ok(server, route, {key: [item], **extra}), field)[0] for item in items]
    at_once = run_concurrently(lambda item: values(ok(server, route, {key: [item], **extra}), field)[0], items)
    assert together == alone == at_once
    return together


# ---- embeddings ------------------------------------------------------------------------------------


def test_embeddings_are_the_rows_alone_and_the_model_in_process(servers, models, paths):
    import sentence_transformers as st

    from invariant_infer import make_invariant

    server, model = servers["embed"], models["embed"]
    got = alone_together_concurrent(server, "/v1/embeddings", "embedding", TEXTS[:4])
    want = [model.embeddings(model.forward_rows([model.tokenize(t)]))[0].tolist() for t in TEXTS[:4]]
    assert got == want and all(len(v) == model.dimensions for v in got)
    st_model = make_invariant(st.SentenceTransformer(str(paths["embed"]), device="cpu"))
    assert [row.tolist() for row in st_model.encode(TEXTS[:4], batch_size=3, convert_to_tensor=True)] == got
    # token ids as given, and base64 of little-endian float32
    ids = [model.tokenize(t).input_ids for t in TEXTS[:2]]
    assert values(ok(server, "/v1/embeddings", {"input": ids}), "embedding") == got[:2]
    assert values(ok(server, "/v1/embeddings", {"input": ids[0]}), "embedding") == got[:1]
    encoded = values(ok(server, "/v1/embeddings", {"input": TEXTS[:4], "encoding_format": "base64"}), "embedding")
    assert [np.frombuffer(base64.b64decode(e), dtype="<f4").tolist() for e in encoded] == got
    body = ok(server, "/v1/embeddings", {"input": TEXTS[:2], "dimensions": MATRYOSHKA[0]})
    short = [model.embeddings(model.forward_rows([model.tokenize(t)]), MATRYOSHKA[0])[0].tolist() for t in TEXTS[:2]]
    assert values(body, "embedding") == short and len(short[0]) == MATRYOSHKA[0]
    tokens = sum(len(model.tokenize(t).input_ids) for t in TEXTS[:2])
    assert body["object"] == "list" and body["model"] == MODEL and body["data"][0]["object"] == "embedding"
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}


def test_the_openai_client_embeddings(servers):
    server = servers["embed"]
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, http_client=server.http)
    as_floats = values(ok(server, "/v1/embeddings", {"input": TEXTS[:3]}), "embedding")
    default = client.embeddings.create(model=MODEL, input=TEXTS[:3])  # base64 on the wire, decoded by the client
    floats = client.embeddings.create(model=MODEL, input=TEXTS[:3], encoding_format="float")
    assert [d.embedding for d in default.data] == [d.embedding for d in floats.data] == as_floats
    assert [m.id for m in client.models.list().data] == [MODEL]
    with pytest.raises(openai.BadRequestError, match="not supported by this model"):
        client.embeddings.create(model=MODEL, input="a dog", dimensions=MATRYOSHKA[0] + 1)


def test_an_embedder_scores_and_reranks_by_cosine(servers, models):
    server, model = servers["embed"], models["embed"]
    rows = {t: model.embeddings(model.forward_rows([model.tokenize(t)]))[0].tolist() for t in TEXTS}

    def cosine(a, b):
        x, y = rows[a], rows[b]
        return math.fsum(p * q for p, q in zip(x, y)) / (math.sqrt(math.fsum(p * p for p in x)) *
                                                         math.sqrt(math.fsum(q * q for q in y)))
    scores = values(ok(server, "/score", {"text_1": TEXTS[0], "text_2": TEXTS[1:]}), "score")
    assert scores == [cosine(TEXTS[0], t) for t in TEXTS[1:]]
    ranked = ok(server, "/v1/rerank", {"query": TEXTS[0], "documents": TEXTS[1:], "top_n": 2})["results"]
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[:2]
    assert [(r["index"], r["relevance_score"], r["document"]["text"]) for r in ranked] == \
        [(i, scores[i], TEXTS[1:][i]) for i in order]


# ---- the heads ---------------------------------------------------------------------------------------


def test_a_cross_encoder_scores_pairs_through_its_head(servers, models, paths):
    from sentence_transformers import CrossEncoder

    from invariant_infer import make_invariant

    server, model = servers["score"], models["score"]
    docs = TEXTS[1:4]
    pairs = [(TEXTS[0], t) for t in docs]
    logits = [model.forward_rows([model.tokenize_pair(a, b)])[0] for a, b in pairs]
    want = [model.activations(row[None])[0, 0].item() for row in logits]
    one_to_n = ok(server, "/v1/score", {"text_1": TEXTS[0], "text_2": docs})
    assert values(one_to_n, "score") == want and one_to_n["data"][0]["object"] == "score"
    pairwise = alone_together_concurrent(server, "/score", "score", docs, key="text_2", text_1=TEXTS[0])
    assert pairwise == want
    n_to_n = values(ok(server, "/score", {"text_1": [a for a, _ in pairs], "text_2": [b for _, b in pairs]}), "score")
    assert n_to_n == want
    # the head's logit is CrossEncoder.predict's (without its float32 sigmoid) after make_invariant
    pooled = values(ok(server, "/pooling", {"input": TEXTS[:1]}), "data")
    cross = make_invariant(CrossEncoder(str(paths["score"]), device="cpu"))
    predicted = cross.predict(pairs, batch_size=3, activation_fn=torch.nn.Identity(), convert_to_tensor=True)
    assert predicted.tolist() == [row[0].item() for row in logits]
    assert pooled == [model.forward_rows([model.tokenize(TEXTS[0])])[0].tolist()]
    for top_n, expect in ((0, 3), (2, 2)):
        result = ok(server, "/rerank", {"query": TEXTS[0], "documents": docs, "top_n": top_n})
        ranked = result["results"]
        assert len(ranked) == expect and [r["relevance_score"] for r in ranked] == sorted(want, reverse=True)[:expect]
        assert all(want[r["index"]] == r["relevance_score"] and r["document"]["text"] == docs[r["index"]]
                   for r in ranked)
        assert result["usage"]["total_tokens"] == sum(len(model.tokenize_pair(a, b).input_ids) for a, b in pairs)


def test_a_reward_model_answers_its_logit_on_pooling(servers, models):
    server, model = servers["reward"], models["reward"]
    got = alone_together_concurrent(server, "/pooling", "data", TEXTS[:3])
    assert got == [model.forward_rows([model.tokenize(t)])[0].tolist() for t in TEXTS[:3]] and len(got[0]) == 1
    body = ok(server, "/pooling", {"input": TEXTS[:2], "encoding_format": "base64"})
    assert [np.frombuffer(base64.b64decode(d["data"]), dtype="<f4").tolist() for d in body["data"]] == got[:2]


def test_a_classifier_answers_labels_and_probabilities(servers, models):
    server, model = servers["classify"], models["classify"]
    probs = alone_together_concurrent(server, "/classify", "probs", TEXTS[:3])
    want = [model.activations(model.forward_rows([model.tokenize(t)]))[0] for t in TEXTS[:3]]
    assert probs == [w.tolist() for w in want]
    body = ok(server, "/classify", {"input": TEXTS[:3]})
    assert [d["label"] for d in body["data"]] == [CLASS_LABELS[int(torch.argmax(w))] for w in want]
    assert {d["num_classes"] for d in body["data"]} == {3} and body["object"] == "list"


# ---- the engine's batches -------------------------------------------------------------------------------


def test_requests_share_batches_and_a_request_spans_batches(models):
    """Held at its first batch, the engine then runs the queued rows of three requests in batches of at
    most 40 padded tokens: rows of different requests share a batch, one request's rows are in two;
    every row is bitwise what it gives alone."""
    model, entered, gate, batches = models["embed"], threading.Event(), threading.Event(), []

    class Gated:
        def __getattr__(self, name):
            return getattr(model, name)

        def forward_rows(self, inputs):
            entered.set()
            gate.wait(60)
            batches.append(len(inputs))
            return model.forward_rows(inputs)

    engine = PoolingEngine(Gated(), max_num_batched_tokens=40)
    try:
        rows = [model.tokenize(t) for t in TEXTS]
        first = engine.submit(rows[:1])
        assert entered.wait(60)
        requests = [engine.submit(rows[1:2]), engine.submit(rows[2:5]), engine.submit(rows[5:])]
        gate.set()
        outs = [f.result(60) for f in first] + [f.result(60) for fs in requests for f in fs]
    finally:
        engine.shutdown()
    assert [torch.equal(out, model.forward_rows([r])[0]) for out, r in zip(outs, rows)] == [True] * len(rows)
    # rows of 4, 10, 3, 12 and 4 tokens queued: [4, 10, 3] fit 40 padded tokens (3 x 10), with 12 they do not
    assert [len(r.input_ids) for r in rows[1:]] == [4, 10, 3, 12, 4] and batches == [1, 3, 2]


# ---- refusals -----------------------------------------------------------------------------------------

LONG = " ".join(["model"] * (BERT_MAX_LENGTH + 5))
BAD = [  # (task, route, body, status, param or None, words the message holds)
    ("embed", "/v1/embeddings", {"input": []}, 400, "input", "empty"),
    ("embed", "/v1/embeddings", {"input": ["a", 3]}, 400, "input", "'input'[1]"),
    ("embed", "/v1/embeddings", {"input": [[]]}, 400, "input", "empty token-id list"),
    ("embed", "/v1/embeddings", {"input": LONG}, 400, "input[0]",
     f"input of {BERT_MAX_LENGTH + 7} tokens is longer than the model's maximum of {BERT_MAX_LENGTH}"),
    ("embed", "/v1/embeddings", {"input": [[1, 10 ** 6]]}, 400, "input[0]", "outside the vocabulary"),
    ("embed", "/v1/embeddings", {"input": "a", "dimensions": 7}, 400, "dimensions", "dimensions=7"),
    ("embed", "/v1/embeddings", {"input": "a", "encoding_format": "int8"}, 400, "encoding_format", None),
    ("embed", "/v1/embeddings", {"input": "a", "truncate_prompt_tokens": 4}, 400, "truncate_prompt_tokens", None),
    ("embed", "/v1/embeddings", {"input": "a", "model": "other"}, 404, "model", "'other' does not exist"),
    ("embed", "/classify", {"input": "a"}, 400, None, "task 'embed'"),
    ("embed", "/v1/completions", {"prompt": "a"}, 400, None, "needs a generation model"),
    ("score", "/v1/embeddings", {"input": "a"}, 400, None, "task 'score'"),
    ("score", "/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, 400, "text_1", "2 texts"),
    ("score", "/rerank", {"query": "a", "documents": []}, 400, "documents", None),
    ("score", "/rerank", {"query": "a", "documents": ["b"], "top_n": -1}, 400, "top_n", None),
    ("score", "/score", {"text_1": "a", "text_2": [LONG]}, 400, "text_2[0]", "longer than"),
    ("reward", "/v1/embeddings", {"input": "a"}, 400, None, "task 'reward'"),
    ("reward", "/classify", {"input": "a"}, 400, None, "task 'reward'"),
    ("reward", "/pooling", {"input": ""}, 400, "input[0]", "no tokens"),
    ("reward", "/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}]}, 400, None, "task 'reward'"),
    ("classify", "/score", {"text_1": "a", "text_2": "b"}, 400, None, "task 'classify'"),
]


@pytest.mark.parametrize("task,route,body,status,param,words", BAD,
                         ids=[f"{b[0]}{b[1]}-{i}" for i, b in enumerate(BAD)])
def test_bad_input_is_a_4xx_naming_the_problem(servers, task, route, body, status, param, words):
    error = assert_error(post(servers[task], route, {"model": MODEL, **body}), status, param)
    assert words is None or words in error["message"], error


def test_without_the_key_and_health_and_metrics(servers):
    server = servers["embed"]
    assert_error(post(server, "/v1/embeddings", {"input": "a"}, key=None), 401)
    assert get(server, "/health").json() == {"status": "ok"}
    assert get(server, "/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()["data"][0]["task"] == "embed"
    text = get(server, "/metrics").text
    assert 'invariant_infer_http_requests_total{endpoint="embeddings",status="200"}' in text


def test_task_override_and_dimensions_on_a_model_that_is_not_matryoshka(paths):
    """--task embed on the cross-encoder pools its encoder (cls, normalised); that model is not Matryoshka."""
    server = InProcessServer(options(paths["score"], task="embed"))
    try:
        model = load_pooled_model(paths["score"], task="embed", dtype="fp32", device="cpu")
        got = values(ok(server, "/v1/embeddings", {"input": TEXTS[:2]}), "embedding")
        assert got == [model.embeddings(model.forward_rows([model.tokenize(t)]))[0].tolist() for t in TEXTS[:2]]
        error = assert_error(post(server, "/v1/embeddings", {"model": MODEL, "input": "a", "dimensions": 8}), 400,
                             "dimensions")
        assert "not a Matryoshka model" in error["message"]
    finally:
        server.stop()


def test_pooling_routes_on_a_generation_server_name_the_task(server):
    for route, body in (("/v1/embeddings", {"input": "a"}), ("/rerank", {"query": "a", "documents": ["b"]})):
        error = assert_error(post(server, route, {"model": MODEL, **body}), 400)
        assert "for task 'generate'" in error["message"] and route in error["message"]


def test_negative_control_a_batch_size_keyed_linear_breaks_together_equals_alone(paths, monkeypatch):
    monkeypatch.setattr(invariant_infer.model.layer_forwards, "linear", m_dependent_linear)
    server = InProcessServer(options(paths["reward"]))
    try:
        together = values(ok(server, "/pooling", {"input": TEXTS[2:4]}), "data")
        alone = [values(ok(server, "/pooling", {"input": [t]}), "data")[0] for t in TEXTS[2:4]]
    finally:
        server.stop()
    assert together != alone


# ---- the real command ------------------------------------------------------------------------------------


@pytest.mark.heavy
def test_the_real_server_serves_an_embedder(paths, models, tmp_path):
    server = ServerProcess(["--model", str(paths["embed"]), "--served-model-name", MODEL, "--dtype", "fp32",
                            "--device", "cpu", "--api-key", KEY, "--max-num-batched-tokens", "48"],
                           tmp_path / "server.log")
    try:
        got = alone_together_concurrent(server, "/v1/embeddings", "embedding", TEXTS)
        model = models["embed"]
        assert got == [model.embeddings(model.forward_rows([model.tokenize(t)]))[0].tolist() for t in TEXTS]
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        assert [d.embedding for d in client.embeddings.create(model=MODEL, input=TEXTS).data] == got
        assert_error(post(server, "/v1/completions", {"model": MODEL, "prompt": "a"}), 400)
    finally:
        server.stop()
    log = (tmp_path / "server.log").read_text()
    assert log.count("check: PASS") == 2, log
