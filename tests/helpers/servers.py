"""The real server in a subprocess (started on an ephemeral 127.0.0.1 port, posted to, stopped), bounded
subprocess runs, and concurrent calls."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests


KEY = "test-key"


MODEL = "tiny"


START_TIMEOUT = 240


def run_bounded(command: list[str], timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``command`` in its own session; its whole process group is killed if it outlives
    ``timeout`` or the test is interrupted."""
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def run_concurrently(function, items, timeout: float = 120) -> list:
    """``function(item)`` for every item at once, each on its own thread; the results in order (an
    exception, or a call still running after ``timeout`` seconds, raises here)."""
    with ThreadPoolExecutor(max(1, len(items))) as pool:
        return list(pool.map(function, items, timeout=timeout))


class ServerProcess:
    def __init__(self, args: list[str], log: Path):
        self.log = open(log, "w")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen([sys.executable, "-m", "invariant_infer.cli", "serve", "--port", "0", *args],
                                     stdout=subprocess.PIPE, stderr=self.log, text=True, env=env)
        self.log_path = log
        line = self._first_line()
        match = re.search(r"listening on (http://\S+)", line or "")
        if not match:
            self.stop()
            raise RuntimeError(f"server did not start: {line!r}\n{log.read_text()[-3000:]}")
        self.url = match.group(1)
        deadline = time.monotonic() + 60
        while True:
            try:
                if requests.get(self.url + "/health", timeout=5).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("server never answered /health")
            time.sleep(0.2)

    def _first_line(self) -> str | None:
        result = []
        reader = threading.Thread(target=lambda: result.append(self.proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(START_TIMEOUT)
        return result[0] if result else None

    @property
    def address(self) -> tuple[str, int]:
        """(host, port), for raw sockets."""
        host, port = self.url.removeprefix("http://").rsplit(":", 1)
        return host.strip("[]"), int(port)

    def metrics_text(self) -> str:
        return requests.get(self.url + "/metrics", timeout=30).text

    def metrics(self) -> dict[str, float]:
        """The unlabelled metrics by name."""
        return {m.group(1): float(m.group(2))
                for m in re.finditer(r"^(invariant_infer_\w+) (\S+)$", self.metrics_text(), re.M)}

    def wait_idle(self, timeout: float = 60) -> dict[str, float]:
        """Metrics once no sequence holds a KV page (fails after ``timeout``)."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if m["invariant_infer_kv_pages_used"] == 0 and m["invariant_infer_running_sequences"] == 0 and \
                    m["invariant_infer_queue_length"] == 0 and m["invariant_infer_requests_in_flight"] == 0:
                return m
            assert time.monotonic() < deadline, f"pages still held: {m}"
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        self.proc.stdout.close()
        self.log.close()


class InProcessServer(ServerProcess):
    """The same app (``server.main.build``: engine, middleware, handlers) in this process, behind
    Starlette's TestClient instead of uvicorn and a socket; ``http`` is that client (an httpx
    client, which the ``openai`` client also takes). Requests from several threads run concurrently
    on the client's event loop."""

    url = "http://testserver"

    def __init__(self, options):
        from starlette.testclient import TestClient

        from invariant_infer.server.main import build

        self.http = TestClient(build(options), raise_server_exceptions=False)
        self.http.__enter__()  # runs the app's lifespan: startup now, shutdown in stop()

    @property
    def address(self):
        raise AssertionError("an in-process server has no socket: use ServerProcess")

    def metrics_text(self) -> str:
        return self.http.get("/metrics").text

    def stop(self) -> None:
        self.http.__exit__(None, None, None)


# The server tests' server: an API key, 4 running + 4 waiting sequences, a 64 KiB body limit and a
# 2 s stream write timeout.
SERVER_OPTIONS = dict(model_name=MODEL, api_key=KEY, max_num_seqs=4, max_waiting=4, max_body_bytes=65536,
                      stream_write_timeout=2.0, dtype="fp32", device="cpu")


def start_server(checkpoint, log: Path) -> ServerProcess:
    """The server tests' server, as ``invariant-infer serve`` in a subprocess."""
    return ServerProcess(["--model", str(checkpoint), "--served-model-name", MODEL, "--dtype", "fp32", "--api-key",
                          KEY, "--max-num-seqs", "4", "--max-waiting", "4", "--max-body-bytes", "65536",
                          "--stream-write-timeout", "2"], log)


def start_in_process_server(checkpoint) -> InProcessServer:
    """The server tests' server, in this process."""
    from invariant_infer.server import ServerOptions

    return InProcessServer(ServerOptions(model=str(checkpoint), **SERVER_OPTIONS))


def post(server, path: str, body=None, *, content=None, key: str | None = KEY, timeout=300, headers=None):
    """A POST with the API key; ``content`` (raw text) instead of ``body`` for bodies JSON cannot dump."""
    headers = {"Content-Type": "application/json", **(headers or {})}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = json.dumps(body) if content is None else content
    if isinstance(server, InProcessServer):
        return server.http.post(path, content=data, headers=headers)  # runs to completion in process
    return requests.post(server.url + path, data=data, headers=headers, timeout=timeout)


def get(server, path: str, *, headers=None):
    """A GET (no API key unless ``headers`` has one)."""
    if isinstance(server, InProcessServer):
        return server.http.get(path, headers=headers)
    return requests.get(server.url + path, headers=headers, timeout=30)


# For a test of what only a socket shows (a client that disconnects or times out): the shared
# ``server`` fixture's subprocess server alone, in the heavy tier.
subprocess_server_only = pytest.mark.parametrize("server", [pytest.param("subprocess", marks=pytest.mark.heavy)],
                                                 indirect=True)


def completion(server, **body) -> dict:
    r = post(server, "/v1/completions", {"model": MODEL, **body})
    assert r.status_code == 200, r.text
    return r.json()


def choices_of(response: dict) -> list[dict]:
    return sorted(response["choices"], key=lambda c: c["index"])


def assert_error(response, status: int, param: str | None = None) -> dict:
    """OpenAI's error body with ``status`` (and ``param``); returns the error."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error
