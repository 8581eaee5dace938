"""lm-evaluation-harness's ``local-completions`` against the real server (a subprocess on an
ephemeral localhost port), on local JSON tasks: a multiple-choice task (loglikelihood: ``echo``,
``max_tokens: 1``, ``logprobs: 1``) and a generate_until task (stop strings). Its per-sample results
are bitwise identical with tokenized requests or strings, one request at a time or several
concurrent, one prompt a request or batches of them; the tokenizer comes from the server's
``/tokenizer_info`` and ``/tokenize``."""
from __future__ import annotations

import random

import fastapi  # noqa: F401  (the serve extra, installed by the test extra: missing fails)
import lm_eval
import pytest
import uvicorn  # noqa: F401

from helpers.lm_eval_tasks import write_local_tasks
from helpers.servers import KEY, MODEL, ServerProcess
from helpers.tokenizer import save_tokenizer
from invariant_infer.testing.random_checkpoints import random_config, save_random_checkpoint

pytestmark = pytest.mark.heavy  # crosses a process boundary

MC_TASK, GEN_TASK = "serve_mc", "serve_gen"
DOCS, CHOICES, MAX_GEN_TOKS, STOP = 4, 3, 4, "a"


@pytest.fixture(scope="module")
def task_manager(tmp_path_factory):
    manager, _ = write_local_tasks(tmp_path_factory.mktemp("serve_lm_eval_tasks"), random.Random(2), mc_task=MC_TASK,
                                   gen_task=GEN_TASK, docs=DOCS, choices=CHOICES, max_words=6, max_choice_words=2,
                                   max_gen_toks=MAX_GEN_TOKS, stop=STOP)
    return manager


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    config = random_config("qwen2", "tiny", num_hidden_layers=1)
    path = save_random_checkpoint(tmp_path_factory.mktemp("serve-lm-eval"), config, seed=6)
    save_tokenizer(path)
    s = ServerProcess(["--model", str(path), "--served-model-name", MODEL, "--dtype", "fp32", "--api-key", KEY],
                      tmp_path_factory.mktemp("serve-lm-eval-log") / "server.log")
    yield s
    s.stop()


def evaluate(server, task_manager, **model_args) -> dict:
    out = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=dict(base_url=server.url + "/v1/completions", model=MODEL, tokenizer_backend="auto",
                        auth_token=KEY, max_retries=1, timeout=600, **model_args),
        tasks=[MC_TASK, GEN_TASK], task_manager=task_manager, log_samples=True, bootstrap_iters=0,
        random_seed=0, numpy_random_seed=0, torch_random_seed=0)
    return {task: {s["doc_id"]: (s["resps"], s["filtered_resps"]) for s in out["samples"][task]}
            for task in (MC_TASK, GEN_TASK)}


def test_lm_eval_local_completions_same_results_for_every_setting(server, task_manager, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    reference = evaluate(server, task_manager, tokenized_requests=True, num_concurrent=1, batch_size=1)
    mc, gen = reference[MC_TASK], reference[GEN_TASK]
    assert sorted(mc) == sorted(gen) == list(range(DOCS))
    for resps, _ in mc.values():
        assert len(resps) == CHOICES
        for (logprob, greedy), in resps:
            assert isinstance(logprob, float) and logprob < 0 and isinstance(greedy, bool)
    assert all(isinstance(filtered[0], str) for _, filtered in gen.values())
    assert any(filtered[0] for _, filtered in gen.values()), "every generation is empty"
    for settings in (dict(tokenized_requests=False, num_concurrent=4, batch_size=1),
                     dict(tokenized_requests=True, num_concurrent=2, batch_size=4)):
        other = evaluate(server, task_manager, **settings)
        for task in (MC_TASK, GEN_TASK):
            for doc in range(DOCS):
                assert other[task][doc] == reference[task][doc], f"{task} doc {doc} differs with {settings}"
    server.wait_idle()
