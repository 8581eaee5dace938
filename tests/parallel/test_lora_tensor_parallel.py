"""Adapters under tensor parallelism: an ``Engine(max_loras=N)`` on ``TensorParallelRanks`` at TP 2
(CPU, gloo on 127.0.0.1) gives each request bitwise the tokens, logprobs and scores of one process,
with adapters of different ranks and targets beside base rows, and slots evicted and reloaded on
every rank. Column-parallel projections keep their rows of B; row-parallel ones gather their input's
K shards and shrink it whole. Negative control: row-parallel slots that shrink each rank's K shard
and all-reduce the sums (stock LoRA under TP, an order that depends on the TP size) give other bits. ``serve
--tensor-parallel-size 2 --lora-modules`` answers concurrent ``openai`` requests naming adapters, and
one loaded through ``/v1/load_lora_adapter``, as the one-process server does."""
from __future__ import annotations

import copy

import pytest
import requests
import torch
from openai import OpenAI
from peft import LoraConfig, get_peft_model

import tp_controls
from helpers.servers import ServerProcess, run_concurrently
from helpers.tokenizer import save_tokenizer
from invariant_infer.checkpoints.loading import load_model
from invariant_infer.engine import Engine, SamplingParams
from invariant_infer.model import lora as lora_module
from invariant_infer.parallel import TensorParallelRanks
from invariant_infer.testing.random_checkpoints import random_config, save_random_checkpoint

pytestmark = [pytest.mark.heavy,
              pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensor-parallel ranks need a machine "
                                                                   "without CUDA GPUs"),
              pytest.mark.file_minutes(2.1)]  # measured on 2 cores: start it early
# 8 query / 4 KV heads of 16, intermediate 256: TP 2 divides every shard and K tree.
TP_SHAPE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=8, num_key_value_heads=4, head_dim=16,
                num_hidden_layers=2)
ADAPTERS = {  # every projection, a row-parallel pair only, and a column-parallel mix with rsLoRA
    "all": LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                           "up_proj", "down_proj"], init_lora_weights=False),
    "rows": LoraConfig(r=4, lora_alpha=4, target_modules=["o_proj", "down_proj"], init_lora_weights=False),
    "cols": LoraConfig(r=2, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj", "up_proj"],
                       init_lora_weights=False),
}
LORAS = ["all", None, "rows", "cols", "all", "rows"]
PROMPTS = [list(range(5 + i, 12 + 3 * i)) for i in range(len(LORAS))]
PARAMS = [SamplingParams(max_tokens=5, prompt_logprobs=0, logprobs=1, ignore_eos=True),
          SamplingParams(max_tokens=5, temperature=0.8, seed=3, prompt_logprobs=0, ignore_eos=True)] * 3
# Two slots for three adapters: requests wait for a slot, and slots are reloaded on every rank.
ENGINE_OPTIONS = dict(max_num_seqs=4, max_num_batched_tokens=24, max_loras=2, max_lora_rank=8)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(base checkpoint, name -> PEFT adapter folder)."""
    root = tmp_path_factory.mktemp("lora-tp")
    path = save_random_checkpoint(root / "qwen2", random_config("qwen2", "tiny", **TP_SHAPE), seed=5)
    save_tokenizer(path)
    adapters = {}
    for seed, (name, config) in enumerate(ADAPTERS.items()):
        torch.manual_seed(200 + seed)
        peft_model = get_peft_model(load_model(str(path), dtype="fp32", device="cpu"), copy.deepcopy(config))
        adapters[name] = root / f"adapter-{name}"
        peft_model.save_pretrained(adapters[name])
    return str(path), adapters


def outcomes(outputs) -> list:
    return [(o.token_ids, o.logprobs, o.top_logprobs, o.prompt_logprobs) for o in outputs]


def results(model, adapters, executor=None):
    engine = Engine(model, executor=executor, **ENGINE_OPTIONS)
    for name, folder in adapters.items():
        engine.add_lora(name, folder)
    outputs = engine.generate(PROMPTS, PARAMS, lora=LORAS)
    scores = [engine.score(PROMPTS[:2], prompt_lengths=[2, 3], lora=name) for name in ADAPTERS]
    return outcomes(outputs), [[s.token_logprobs for s in group] for group in scores]


def assert_same(expected, got) -> None:
    assert got[0] == expected[0]  # token ids and every logprob as Python floats: exact equality
    assert all(torch.equal(a, b) for one, two in zip(expected[1], got[1]) for a, b in zip(one, two))


@pytest.fixture(scope="module")
def one_process(checkpoint):
    path, adapters = checkpoint
    return results(load_model(path, dtype="fp32", device="cpu"), adapters)


def test_adapters_at_tp2_give_the_bits_of_one_process(checkpoint, one_process):
    path, adapters = checkpoint
    base = outcomes(Engine(load_model(path, dtype="fp32", device="cpu")).generate(PROMPTS, PARAMS))
    assert one_process[0][1] == base[1]  # the base row is the base model's
    assert all(one_process[0][i] != base[i] for i in (0, 2, 3))  # each adapter changes the numbers
    with TensorParallelRanks(path, 2, dtype="fp32", device="cpu") as ranks:
        assert_same(one_process, results(ranks.model, adapters, ranks))


def test_control_sharded_lora_shrink_at_tp2_differs(checkpoint, one_process, monkeypatch):
    """Every rank (this one included) swaps in the sharded shrink; monkeypatch restores it here."""
    path, adapters = checkpoint
    monkeypatch.setattr(lora_module.SlotWeights, "apply", lora_module.SlotWeights.apply)
    with TensorParallelRanks(path, 2, dtype="fp32", device="cpu",
                             rank_init=tp_controls.use_sharded_lora_shrink) as ranks:
        assert lora_module.SlotWeights.apply is tp_controls.sharded_lora_shrink_apply
        control = results(ranks.model, adapters, ranks)
    assert control[0] != one_process[0]


SERVER_REQUESTS = [("all", dict(prompt=[5, 6, 7, 8, 9], max_tokens=5, temperature=0.9, seed=3, logprobs=2)),
                   ("rows", dict(prompt=[40, 41, 42], max_tokens=6, temperature=0.0, seed=1, logprobs=1)),
                   ("base", dict(prompt=[11, 12, 13, 14], max_tokens=4, temperature=0.0, seed=2, logprobs=1)),
                   ("cols", dict(prompt=[7, 8], max_tokens=5, temperature=1.0, seed=9, logprobs=0))]


def served_completions(server: ServerProcess, adapters) -> list[dict]:
    """The requests, concurrently; "cols" is loaded through the endpoint first."""
    loaded = requests.post(server.url + "/v1/load_lora_adapter", timeout=60,
                           json={"lora_name": "cols", "lora_path": str(adapters["cols"])})
    assert loaded.status_code == 200, loaded.text
    client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def one(request):
        model, body = request
        return client.completions.create(model=model, **body).model_dump(include={"choices"})
    return run_concurrently(one, SERVER_REQUESTS)


def test_serve_at_tp2_with_adapters_answers_as_one_process(checkpoint, tmp_path):
    path, adapters = checkpoint
    args = ["--model", path, "--device", "cpu", "--dtype", "fp32", "--served-model-name", "base",
            "--lora-modules", f"all={adapters['all']}", f"rows={adapters['rows']}", "--max-loras", "2",
            "--max-lora-rank", "8"]
    answers = {}
    for size in (1, 2):
        server = ServerProcess([*args, "--tensor-parallel-size", str(size)], tmp_path / f"tp{size}.log")
        try:
            answers[size] = served_completions(server, adapters)
        finally:
            server.stop()
    assert all(answers[1])
    assert answers[2] == answers[1]
