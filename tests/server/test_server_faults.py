"""``invariant-infer serve`` under faults, on a real server of this file's own (a subprocess on an
ephemeral localhost port; the last test stops it): a client that stops reading, a soak of mixed
requests, and SIGTERM with requests in flight."""
from __future__ import annotations

import json
import random
import signal
import socket
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from helpers.servers import KEY, MODEL, choices_of, completion, post, start_server

pytestmark = pytest.mark.heavy  # crosses a process boundary


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    """This file's own: its last test stops it."""
    s = start_server(checkpoint, tmp_path_factory.mktemp("serve-faults-log") / "server.log")
    yield s
    s.stop()


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
        except (ConnectionRefusedError, ConnectionResetError):  # reset: the listener closed with it in its backlog
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
