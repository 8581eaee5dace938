"""Helpers shared by the test files: dtypes, devices and families to parametrize over, model
loading, the model-level batchings and bitwise comparison (through ``invariant_infer.testing.drift``), the
M-dependent negative-control linear, a locally trained tokenizer, scoring request files, local
lm-eval tasks and the real server in a subprocess (started, and posted to)."""
from __future__ import annotations

import inspect
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from itertools import product
from pathlib import Path

import numpy as np
import pytest
import requests
import torch
import triton
from transformers import AutoModelForCausalLM
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from invariant_infer.testing.drift import batch_drift, logits_alone, logits_in_batch
from invariant_infer.model.families import FAMILIES
from invariant_infer.kernels import LinearConfig, grouped_linear, linear, linear_config, quantized_linear
from invariant_infer.kernels import launch as launch_mod

DTYPES = [torch.bfloat16, torch.float16, torch.float32]

# Dense families: the FAMILY-driven tests run over these. The MoE families have their own short
# tests (tests/model/test_moe.py), so CI time does not multiply.
FAMILY_NAMES = sorted(name for name, adapter in FAMILIES.items() if adapter.moe is None)
MOE_FAMILY_NAMES = sorted(name for name, adapter in FAMILIES.items() if adapter.moe is not None)

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]

# The family x dtype matrix. Through Triton's interpreter (2 CPU cores in CI) a test runs a cover of
# it: every family once, the dtypes in turn, so every dtype meets a family; the families meet every
# dtype in the tests that run them all in bf16 or fp32 (engine, speculation, training, digests).
# INVARIANT_FULL_MATRIX=1, or a CUDA machine, runs every cell.
FULL_MATRIX = os.environ.get("INVARIANT_FULL_MATRIX") == "1" or torch.cuda.is_available()


def family_dtype_cells(families: list[str], dtypes: list[torch.dtype]) -> list:
    """(family, dtype) parameters: the whole product under FULL_MATRIX, else the cover above."""
    if FULL_MATRIX:
        cells = list(product(families, dtypes))
    else:
        cells = [(families[i % len(families)], dtypes[i % len(dtypes)])
                 for i in range(max(len(families), len(dtypes)))]
    return [pytest.param(f, d, id=f"{f}-{str(d).removeprefix('torch.')}") for f, d in cells]

def load_model(path, dtype: torch.dtype, device: str = "cpu"):
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()


# Model-level batchings

@dataclass(frozen=True)
class Batching:
    members: tuple[int, ...]      # which samples, in which order
    left_pad: bool = True
    extra_pad: int = 0            # padding beyond the longest member
    embeds: bool = False          # inputs_embeds instead of input_ids
    pass_positions: bool = False  # pass position_ids (cumsum - 1) instead of letting them be derived

    def options(self) -> dict:
        return dict(side="left" if self.left_pad else "right", extra_pad=self.extra_pad, embeds=self.embeds,
                    explicit_positions=self.pass_positions)


BATCHINGS = [
    Batching((0, 1, 2, 3)),
    Batching((3, 2, 1, 0), extra_pad=5),
    Batching((2, 0), left_pad=False),
    Batching((1, 3, 2), left_pad=False, extra_pad=3, embeds=True),
    Batching((0, 3), embeds=True, pass_positions=True),
    Batching((3, 0, 1, 2), left_pad=False, pass_positions=True),
]


def make_samples(vocab_size: int, lengths=(9, 1, 14, 5), seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=g) for n in lengths]


def logits_batched(model, samples, batching: Batching) -> list[torch.Tensor]:
    return logits_in_batch(model, [samples[i] for i in batching.members], **batching.options())


def batch_mismatches(model, samples, batchings=BATCHINGS):
    """Every (batching, sample) whose real-token logits differ from the sample run alone,
    with the max |difference|. Empty means bitwise invariant."""
    alone = [logits_alone(model, s) for s in samples]
    mismatches = []
    for batching in batchings:
        drift = batch_drift(model, [samples[i] for i in batching.members], **batching.options(),
                            alone=[alone[i] for i in batching.members])
        mismatches += [(batching, batching.members[row], diff) for row, diff in drift.mismatches]
    return mismatches


def m_dependent_linear(x, weight, bias=None, config=None):
    """Negative control: picks BLOCK_K by M, as batch-size-keyed heuristics and autotuners do
    (whatever ``config`` the caller asks for, e.g. a row-parallel layer's K tree)."""
    m = x.reshape(-1, x.shape[-1]).shape[0]
    base = linear_config(x.device.type, x.dtype, *weight.shape)
    cfg = LinearConfig(base.block_m, base.block_n, 16 if m <= 4 else 64)
    return linear(x, weight, bias, config=cfg)


def m_dependent_grouped_linear(x, weight, expert_offsets, bias=None):
    """Negative control for the grouped expert GEMM: picks BLOCK_K by the largest expert's row
    count, as batch-size-keyed grouped GEMMs do."""
    base = linear_config(x.device.type, x.dtype, *weight.shape[1:])
    most = int((expert_offsets[1:] - expert_offsets[:-1]).max())
    cfg = LinearConfig(base.block_m, base.block_n, 16 if most <= 4 else 64)
    return grouped_linear(x, weight, expert_offsets, bias, config=cfg)


def per_tensor_scaled_quantized_forward(self, x):
    """Negative control for a patched fp8 layer: a dynamic per-tensor activation scale, the max over
    every token of the call (the batch), on the layer's own quantized GEMM."""
    x2 = x.reshape(-1, x.shape[-1])
    scale = (x2.float().abs().amax() / 448).clamp(min=1e-12)
    q = (x2.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    scales = scale.reshape(1, 1).expand(x2.shape[0], x2.shape[1] // 128).contiguous()
    y = quantized_linear(q, self._invariant_quantized.weight, self.bias, x_scale=scales, out_dtype=x.dtype)
    return y.reshape(*x.shape[:-1], y.shape[-1])


BPE_WORDS = "the a model token batch score sequence invariant logits prompt completion cat dog runs fast".split()

def train_tokenizer(model_dir):
    """A byte-level BPE trained here and saved next to the model, as a real checkpoint ships one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    rng = np.random.default_rng(0)
    corpus = [" ".join(rng.choice(BPE_WORDS, size=12)) for _ in range(200)]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(corpus, trainer)
    PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>").save_pretrained(model_dir)

def score_requests(count: int, seed: int = 0) -> list[dict]:
    """A mix of all four request shapes."""
    rng = np.random.default_rng(seed)
    text = lambda n: " ".join(rng.choice(BPE_WORDS, size=n))  # noqa: E731
    ids = lambda n: rng.integers(0, 512, size=n).tolist()  # noqa: E731
    rows = []
    for i in range(count):
        n = int(rng.integers(3, 24))
        kind = i % 4
        row = ({"input_ids": ids(n)} if kind == 0 else {"text": text(n)} if kind == 1
               else {"prompt": text(n), "completion": " " + text(3)} if kind == 2
               else {"prompt_ids": ids(n), "completion_ids": ids(4)})
        rows.append({"id": i if i % 2 else f"r{i}", **row})
    return rows

def write_jsonl(path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)

def read_rows(path) -> list[dict]:
    return [json.loads(line) for line in open(path, encoding="utf-8")]

BAD_LINES = [
    ('{"id": "ok1", "input_ids": [1, 2, 3]}', None),
    ('{"id": "bad json", ', "malformed JSON"),
    ('[1, 2, 3]', "expected a JSON object"),
    ('{"input_ids": [1, 2]}', "missing field 'id'"),
    ('{"id": "unknown", "input_ids": [1, 2], "extra": 1}', "unknown field"),
    ('{"id": "missing", "prompt": "the cat"}', "missing field(s) ['completion']"),
    ('{"id": "neither"}', "need exactly one of"),
    ('{"id": "conflict", "text": "the cat", "input_ids": [1, 2]}', "need exactly one of"),
    ('{"id": "empty", "input_ids": []}', "empty sequence"),
    ('{"id": "one token", "input_ids": [5]}', "nothing to score"),
    ('{"id": "empty prompt", "prompt_ids": [], "completion_ids": [1, 2]}', "empty prompt"),
    ('{"id": "empty completion", "prompt": "the cat", "completion": ""}', "nothing to score"),
    ('{"id": "vocab", "input_ids": [1, 512]}', "outside the vocabulary"),
    ('{"id": "negative", "input_ids": [1, -1]}', "outside the vocabulary"),
    ('{"id": "float", "input_ids": [1, 2.5]}', "list of integers"),
    ('{"id": "long", "input_ids": [%s]}' % ", ".join(["1"] * 513), "longer than the model's 512 positions"),
    ('{"id": [1], "input_ids": [1, 2]}', "id must be"),
    ('{"id": null, "input_ids": [1, 2]}', "id must be"),
    ('{"id": NaN, "input_ids": [1, 2]}', "malformed JSON"),
    ('{"id": "ok1", "input_ids": [4, 5]}', "duplicate id"),
    ("", None),  # blank lines are skipped
    ('{"id": 7, "text": "the cat runs fast"}', None),
    ('{"id": "ok2", "prompt": "the dog", "completion": " runs"}', None),
]


def _lm_eval_words(count: int) -> list[str]:
    words = ["".join(w) for w in product("bdfgklmnprstvz", "aeiou", "bdgklmnprstxz")]
    random.Random(0).shuffle(words)
    return words[:count]

LM_EVAL_WORDS = _lm_eval_words(512 - 3)  # with the three special tokens, exactly the tiny models' vocab_size

def _text(rng: random.Random, low: int, high: int) -> str:
    return " ".join(rng.choice(LM_EVAL_WORDS) for _ in range(rng.randint(low, high)))

def write_local_tasks(root, rng: random.Random, *, mc_task: str, gen_task: str, docs: int, choices: int,
                      max_words: int, max_choice_words: int, max_gen_toks: int, stop: str):
    """A multiple-choice and a generate_until task over local JSON lines in ``root`` (no hub):
    (TaskManager, the multiple-choice docs)."""
    import yaml
    from lm_eval.tasks import TaskManager

    mc = [{"question": _text(rng, 1, max_words),
           "choices": [" " + _text(rng, 1, max_choice_words) for _ in range(choices)],
           "answer": rng.randrange(choices)} for _ in range(docs)]
    gen = [{"prompt": _text(rng, 1, max_words), "target": rng.choice(LM_EVAL_WORDS)} for _ in range(docs)]
    configs = {
        "mc": dict(task=mc_task, output_type="multiple_choice", doc_to_text="{{question}}",
                   doc_to_choice="{{choices}}", doc_to_target="answer", docs=mc, metric="acc"),
        "gen": dict(task=gen_task, output_type="generate_until", doc_to_text="{{prompt}}",
                    doc_to_target="{{target}}", docs=gen, metric="exact_match",
                    generation_kwargs=dict(until=[stop], max_gen_toks=max_gen_toks, do_sample=False)),
    }
    for name, config in configs.items():
        data = root / f"{name}.jsonl"
        data.write_text("".join(json.dumps(doc) + "\n" for doc in config.pop("docs")))
        metric = config.pop("metric")
        config.update(dataset_path="json", test_split="test",
                      dataset_kwargs=dict(data_files=dict(test=str(data)), cache_dir=str(root / "datasets_cache")),
                      metric_list=[dict(metric=metric, aggregation="mean", higher_is_better=True)])
        (root / f"{name}.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return TaskManager(include_path=str(root), include_defaults=False), mc


KEY = "test-key"

MODEL = "tiny"

CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")

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

def save_tokenizer(path) -> None:
    """The scoring tests' byte-level BPE, saved as a PreTrainedTokenizerFast with a chat template."""
    from transformers import PreTrainedTokenizerFast

    train_tokenizer(path)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)

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


def start_server(checkpoint, log: Path) -> ServerProcess:
    """The server tests' server: an API key, 4 running + 4 waiting sequences, a 64 KiB body limit
    and a 2 s stream write timeout."""
    return ServerProcess(["--model", str(checkpoint), "--served-model-name", MODEL, "--dtype", "fp32", "--api-key",
                          KEY, "--max-num-seqs", "4", "--max-waiting", "4", "--max-body-bytes", "65536",
                          "--stream-write-timeout", "2"], log)


def post(server, path: str, body=None, *, content=None, key: str | None = KEY, timeout=300, headers=None):
    """A POST with the API key; ``content`` (raw text) instead of ``body`` for bodies JSON cannot dump."""
    headers = {"Content-Type": "application/json", **(headers or {})}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    return requests.post(server.url + path, data=json.dumps(body) if content is None else content, headers=headers,
                         timeout=timeout)


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


# Offline compiles for CUDA targets (no GPU needed)


def compile_for(kernel, arch, types, constexprs, num_warps=4, num_stages=3, options=None, aligned=None):
    """Compile ``kernel`` for sm_<arch> with the launches' pinned options (``options`` replaces
    them). ``types`` maps argument names to Triton types (default: pointers from the 'ptr'
    entry, everything else i32). ``aligned``: the arguments specialised as divisible by 16
    (default: the pointers, 16-byte aligned as torch allocates them)."""
    signature, attrs = {}, {}
    for index, name in enumerate(inspect.signature(kernel.fn).parameters):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in types:
            signature[name] = types[name]
        else:
            signature[name] = types["ptr"] if name.endswith("_ptr") else "i32"
        if (signature[name].startswith("*") if aligned is None else name in aligned):
            attrs[(index,)] = [["tt.divisibility", 16]]
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    pinned = launch_mod.PINNED_OPTIONS if options is None else options
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages, **pinned})
    assert compiled.asm["cubin"]
    return compiled


def reduction_layouts(compiled) -> list[str]:
    """The operand and result types, layouts spelled out, of every dot and reduction in the TTGIR:
    the layouts fix which thread sums which elements, so equal layouts mean equal summation trees."""
    ttgir = compiled.asm["ttgir"]
    aliases = dict(re.findall(r"^(#\w+) = (.*)$", ttgir, re.M))
    spell = lambda text: re.sub(r"#\w+", lambda m: aliases.get(m.group(0), m.group(0)), text)  # noqa: E731
    ops = [line for line in ttgir.splitlines() if re.search(r"\b(tt\.dot|warp_group_dot) ", line)
           or line.strip().startswith("}) : ")]
    assert ops, "no dot or reduction found"
    return [spell(re.sub(r" loc\(.*$", "", line.rsplit(" : ", 1)[-1])) for line in ops]
