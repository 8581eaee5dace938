"""HTTP server: throughput (output tokens/s, requests/s) and p50 / p99 request latency at several
concurrencies against the real ``invariant-infer serve`` process, invariant kernels vs the engine's
stock kernels (``--kernels stock``), side by side on the same checkpoint and prompts.

A random checkpoint of the preset (``random_config`` + random weights, ``save_pretrained``) and a
word-level tokenizer covering its whole vocabulary (``t0`` … ``t{V-1}``) go to a temporary folder;
both servers start from it at once, each a subprocess on 127.0.0.1 with ``--port 0`` (the port is
read from its ``listening on`` line, then ``/health`` is polled). The levels then run one server at a
time, alternating modes (invariant c=1, stock c=1, invariant c=8, …), so a budget that ends early
still leaves both modes at the lower concurrencies.

Load: a closed loop of ``concurrency`` client threads (``requests``), each sending the next prompt
(random token ids) as soon as its last response arrived, until ``requests`` are done. Every request is
``/v1/completions``, greedy, ``max_tokens`` fixed, ``ignore_eos`` (all produce the same count),
``logprobs: 0``, ``seed`` = the prompt's index. Latency = send to full response (non-streaming);
tokens/s = sum of ``usage.completion_tokens`` / (last response - first send); errors = responses that
are not 200 (or raised). On GPU each server first gets one unmeasured wave at the top concurrency.

Invariance under load: at each invariant level above concurrency 1 a few responses
(``engine.check_indices``) are compared with ``==`` (the whole choice: text, logprobs, finish reason,
seed; and usage) with the same request alone: its response at concurrency 1 when that level ran,
else the request sent again alone on the idle server.

Both servers are always stopped at the end: SIGTERM (graceful), then kill after a timeout."""
from __future__ import annotations

import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from .e2e import build_model, preset_config
from .engine import check_indices, kv_cache_bytes, random_prompts
from .matmul import DEFAULT_FAMILY, DEFAULT_PRESET
from .timing import Run, free_memory

MODES = ("invariant", "stock")
# Full suite: concurrency 1, 8, 32 with 8, 32, 96 requests, prompts of 96-160 tokens, 32 new tokens.
CONCURRENCY, REQUESTS = (1, 8, 32), (8, 32, 96)
PROMPT_LENS, MAX_TOKENS, MAX_BATCHED_TOKENS = (96, 160), 32, 8192
QUICK_CONCURRENCY, QUICK_REQUESTS = (1, 4), (4, 4)
QUICK_PROMPT_LENS, QUICK_MAX_TOKENS, QUICK_MAX_BATCHED_TOKENS = (6, 10), 3, 256
PROMPT_SEED, WARMUP_SEED = 3, 4
START_TIMEOUT_S, STOP_TIMEOUT_S = 300, 30
MODEL_NAME = "bench"


def save_tokenizer(path: Path, vocab_size: int) -> None:
    """A word-level tokenizer whose ids are the whole model vocabulary (``t{i}`` = id i), so any
    generated id decodes."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0").save_pretrained(path)


def save_checkpoint(ctx: Run, config, dtype: torch.dtype, path: Path) -> None:
    model = build_model(ctx, config, dtype)  # random weights made on the device
    model.save_pretrained(path)
    del model
    free_memory(ctx.device)
    save_tokenizer(path, config.vocab_size)


class Server:
    """``invariant-infer serve`` in a subprocess on 127.0.0.1, any free port."""

    def __init__(self, checkpoint: Path, kernels: str, args: list[str], log: Path):
        import requests
        self.kernels, self.log_path, self.url = kernels, log, None
        self._terminated = False
        self.session = requests.Session()
        self._log = open(log, "w")
        env = dict(os.environ, PYTHONUNBUFFERED="1", TQDM_DISABLE="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "invariant_infer.cli", "serve", "--model", str(checkpoint), "--host", "127.0.0.1",
             "--port", "0", "--kernels", kernels, "--served-model-name", MODEL_NAME, *args],
            stdout=subprocess.PIPE, stderr=self._log, text=True, env=env)
        self._line: list[str] = []
        self._reader = threading.Thread(target=lambda: self._line.append(self.proc.stdout.readline()), daemon=True)
        self._reader.start()

    def wait_ready(self, deadline: float) -> None:
        """The ``listening on http://HOST:PORT`` line, then ``/health`` 200, before ``deadline``."""
        import requests
        self._reader.join(max(0.0, deadline - time.monotonic()))
        match = re.search(r"listening on (http://\S+)", self._line[0] if self._line else "")
        if not match:
            raise RuntimeError(f"{self.kernels} server did not start: {self._line[:1]!r}; log: {self.log_tail()}")
        self.url = match.group(1)
        while True:
            try:
                if self.session.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except requests.RequestException:
                pass
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError(f"{self.kernels} server never answered /health; log: {self.log_tail()}")
            time.sleep(0.1)

    def log_tail(self) -> str:
        try:
            self._log.flush()
            return self.log_path.read_text()[-600:]
        except OSError:
            return ""

    def terminate(self) -> None:
        """One SIGTERM only: a second one that lands after the server restored the default handlers
        (while its interpreter exits) would kill it with -15."""
        if self.proc.poll() is None and not self._terminated:
            self._terminated = True
            self.proc.send_signal(signal.SIGTERM)

    def stop(self) -> int | None:
        """SIGTERM (in-flight requests finish), kill after STOP_TIMEOUT_S; the exit code."""
        if self.proc.poll() is None:
            self.terminate()
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        self.session.close()
        self._log.close()
        if self.proc.stdout:
            self.proc.stdout.close()
        return self.proc.returncode


def body(prompt: list[int], index: int, max_tokens: int) -> dict:
    return {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "logprobs": 0, "seed": index}


def closed_loop(url: str, prompts: list[list[int]], max_tokens: int, concurrency: int, timeout_s: float):
    """``concurrency`` threads, each sending the next prompt when its last response arrived.
    Returns ({index: response json}, row dict)."""
    import requests
    lock = threading.Lock()
    pending = list(range(len(prompts)))[::-1]
    responses, latencies, errors, tokens = {}, [], [], [0]
    stamps = []

    def worker():
        with requests.Session() as session:
            while True:
                with lock:
                    if not pending:
                        return
                    i = pending.pop()
                sent = time.perf_counter()
                try:
                    r = session.post(url + "/v1/completions", json=body(prompts[i], i, max_tokens), timeout=timeout_s)
                    status, payload = r.status_code, (r.json() if r.status_code == 200 else r.text[:200])
                except Exception as exc:  # a timeout or a dropped connection: an error, not a crash
                    status, payload = None, f"{type(exc).__name__}: {exc}"[:200]
                done = time.perf_counter()
                with lock:
                    stamps.append((sent, done))
                    if status == 200:
                        responses[i] = payload
                        latencies.append(done - sent)
                        tokens[0] += payload["usage"]["completion_tokens"]
                    else:
                        errors.append((i, status, payload))

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = max(d for _, d in stamps) - min(s for s, _ in stamps) if stamps else 0.0
    ok = len(latencies)
    row = {"requests": len(prompts), "completed": ok, "output_tokens": tokens[0], "elapsed_s": elapsed,
           "tokens_per_s": tokens[0] / elapsed if elapsed > 0 and ok else None,
           "requests_per_s": ok / elapsed if elapsed > 0 and ok else None,
           "p50_ms": 1e3 * statistics.median(latencies) if latencies else None,
           "p99_ms": 1e3 * _percentile(latencies, 99) if latencies else None,
           "mean_ms": 1e3 * statistics.fmean(latencies) if latencies else None,
           "errors": len(errors), "error_examples": [f"{i}: {s} {p}" for i, s, p in errors[:3]]}
    return responses, row


def _percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def alone(server: Server, prompt: list[int], index: int, max_tokens: int, timeout_s: float) -> dict:
    r = server.session.post(server.url + "/v1/completions", json=body(prompt, index, max_tokens), timeout=timeout_s)
    r.raise_for_status()
    return r.json()


def same(a: dict, b: dict) -> bool:
    return a["choices"] == b["choices"] and a["usage"] == b["usage"]


def run(ctx: Run, config=None, concurrency=None, requests=None, prompt_lens=None, max_tokens=None,
        dtype=torch.bfloat16, family: str = DEFAULT_FAMILY, preset: str = DEFAULT_PRESET) -> dict:
    config, name = preset_config(family, "tiny" if ctx.quick else preset, config)
    concurrency = concurrency or (QUICK_CONCURRENCY if ctx.quick else CONCURRENCY)
    requests = requests or (QUICK_REQUESTS if ctx.quick else REQUESTS)
    prompt_lens = prompt_lens or (QUICK_PROMPT_LENS if ctx.quick else PROMPT_LENS)
    max_tokens = max_tokens or (QUICK_MAX_TOKENS if ctx.quick else MAX_TOKENS)
    batched_tokens = QUICK_MAX_BATCHED_TOKENS if ctx.quick else MAX_BATCHED_TOKENS
    if not ctx.on_gpu:
        dtype = torch.float32  # the server's own default on CPU
    dtype_arg = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]
    top = max(concurrency)
    kv_bytes = kv_cache_bytes(config, ctx.device, dtype, top, prompt_lens[1] + max_tokens)
    args = ["--device", ctx.device.type, "--dtype", dtype_arg, "--max-num-seqs", str(top),
            "--max-num-batched-tokens", str(max(batched_tokens, prompt_lens[1] + max_tokens)),
            "--kv-cache-memory", str(kv_bytes), "--max-waiting", str(4 * top), "--log-level", "warning"]
    pool = random_prompts(max(requests), prompt_lens, config.vocab_size, PROMPT_SEED)
    model_info = {"preset": name, "layers": config.num_hidden_layers, "hidden": config.hidden_size,
                  "vocab": config.vocab_size, "dtype": str(dtype)[6:], "min_prompt": prompt_lens[0],
                  "max_prompt": prompt_lens[1], "max_tokens": max_tokens, "kv_cache_bytes": kv_bytes}
    # A request never outlives the section's budget by much (or 10 min without one).
    timeout_s = lambda: max(30.0, ctx.deadline - time.monotonic() + 30) if ctx.deadline else 600.0  # noqa: E731
    rows, servers = [], {}
    with tempfile.TemporaryDirectory(prefix="bench-server-") as tmp:
        tmp = Path(tmp)
        try:
            if ctx.out_of_time("server checkpoint"):
                return {"server": []}
            save_checkpoint(ctx, config, dtype, tmp / "model")
            for mode in MODES:  # both load at once
                servers[mode] = Server(tmp / "model", mode, args, tmp / f"{mode}.log")
            start_s = START_TIMEOUT_S if ctx.deadline is None else min(
                START_TIMEOUT_S, max(60.0, ctx.deadline - time.monotonic()))
            start_deadline = time.monotonic() + start_s
            for mode in MODES:
                try:
                    servers[mode].wait_ready(start_deadline)
                    if ctx.on_gpu:  # one unmeasured wave at the top concurrency: kernels compile
                        warm = random_prompts(top, prompt_lens, config.vocab_size, WARMUP_SEED)
                        closed_loop(servers[mode].url, warm, 2, top, timeout_s())
                except Exception as exc:
                    ctx.failed(f"server {mode} start", exc)
                    servers.pop(mode).stop()
            first: dict[int, dict] = {}  # prompt index -> invariant response at concurrency 1 (alone)
            for conc, count in zip(concurrency, requests):
                by_mode = {}
                for mode in MODES:
                    item = f"server {mode} c={conc}"
                    if mode not in servers or ctx.out_of_time(item):
                        continue
                    server = servers[mode]
                    try:
                        responses, row = closed_loop(server.url, pool[:count], max_tokens, conc, timeout_s())
                        row = {"mode": mode, "concurrency": conc, **row, "invariant_to_stock": None,
                               "invariant_rows_checked": None, "invariant_rows_equal": None}
                        if mode == "invariant" and conc == 1:
                            first.update(responses)
                        elif mode == "invariant":
                            checked = [i for i in check_indices(count, ctx.quick) if i in responses]
                            for i in checked:
                                if i not in first:
                                    first[i] = alone(server, pool[i], i, max_tokens, timeout_s())
                            row["invariant_rows_checked"] = len(checked)
                            row["invariant_rows_equal"] = sum(same(responses[i], first[i]) for i in checked)
                    except Exception as exc:
                        ctx.failed(item, exc)
                        continue
                    row.update(model_info)
                    by_mode[mode] = row
                inv, ref = by_mode.get("invariant"), by_mode.get("stock")
                if inv and ref and inv["tokens_per_s"] and ref["tokens_per_s"]:
                    inv["invariant_to_stock"] = inv["tokens_per_s"] / ref["tokens_per_s"]
                rows += [by_mode[m] for m in MODES if m in by_mode]
        except Exception as exc:
            ctx.failed("server", exc)
        finally:
            for server in servers.values():  # both shut down at once
                server.terminate()
            for mode, server in servers.items():
                try:
                    code = server.stop()
                    for row in rows:
                        if row["mode"] == mode:
                            row["server_exit_code"] = code
                except Exception as exc:
                    ctx.failed(f"server {mode} stop", exc)
    return {"server": rows}
