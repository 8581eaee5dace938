"""The server tests' checkpoint and server, shared by the files that only send requests to it:
session-scoped, so each pytest-xdist worker starts it at most once. Each test that takes ``server``
or ``client`` runs twice: on the app in this process (Starlette's TestClient, the fast tier) and on
``invariant-infer serve`` in a subprocess (uvicorn on a 127.0.0.1 port, the heavy tier). A file whose
tests stop or wear out the server (the faults file) starts its own."""
from __future__ import annotations

import openai
import pytest

from helpers.servers import KEY, start_in_process_server, start_server
from helpers.tokenizer import save_tokenizer
from invariant_infer.testing.random_checkpoints import random_config, save_random_checkpoint


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    config = random_config("qwen2", "tiny", num_hidden_layers=1)
    path = save_random_checkpoint(tmp_path_factory.mktemp("serve-qwen2"), config, seed=5)
    save_tokenizer(path)
    return path


@pytest.fixture(scope="session", params=["in-process", pytest.param("subprocess", marks=pytest.mark.heavy)])
def server(request, checkpoint, tmp_path_factory):
    if request.param == "in-process":
        s = start_in_process_server(checkpoint)
    else:
        s = start_server(checkpoint, tmp_path_factory.mktemp("serve-log") / "server.log")
    yield s
    s.stop()


@pytest.fixture(scope="session")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=300,
                         http_client=getattr(server, "http", None))
