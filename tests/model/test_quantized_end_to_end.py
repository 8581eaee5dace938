"""Quantized checkpoints through the engine, ``score`` and ``serve``: bits batch-invariant across
engine schedules with prefix-cache hits, and the CLIs reading the format from the checkpoint
(their results are those of the quantized model in process, not of a dense one). Exact comparisons."""
from __future__ import annotations

import json
import types

import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers.controls import per_tensor_scaled_quantized_forward
from helpers.scoring_rows import read_rows
from helpers.servers import MODEL, ServerProcess, choices_of, completion
from helpers.scoring_rows import write_jsonl
from helpers.tokenizer import save_tokenizer
from invariant_infer import make_invariant, score_sequences
from invariant_infer.checkpoints.quantized import quantized_loading
from invariant_infer.cli import demo as demo_cli, score as scoring_cli
from invariant_infer.engine import Engine, SamplingParams
from invariant_infer.model.quantization import quantized_layers
from invariant_infer.testing.quantized_checkpoints import save_fp8_checkpoint, save_quantized_checkpoint
from invariant_infer.testing.random_checkpoints import qwen2_config, random_config

import compressed_tensors  # noqa: E402,F401  (the test extra pins it: a missing install fails, never skips)

CONFIG = dict(hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=2,
              num_hidden_layers=1, vocab_size=512)
# Qwen3-MoE with its experts in fp8 blocks too (every width a multiple of 128).
MOE_CONFIG = dict(hidden_size=128, head_dim=32, num_attention_heads=4, num_key_value_heads=4, moe_intermediate_size=128,
                  num_hidden_layers=1, vocab_size=512)
PARAMS = SamplingParams(max_tokens=3, logprobs=1, ignore_eos=True)  # prompt logprobs would skip the cache


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root, config = tmp_path_factory.mktemp("quantized-e2e"), qwen2_config("tiny", **CONFIG)
    paths = {"W4A16_ASYM": save_quantized_checkpoint(root / "w4a16-asym", config, "W4A16_ASYM", seed=2),
             "fp8": save_fp8_checkpoint(root / "fp8", config, seed=2),
             "fp8-moe": save_fp8_checkpoint(root / "fp8-moe", random_config("qwen3_moe", "tiny", **MOE_CONFIG), seed=2)}
    for path in paths.values():
        save_tokenizer(path)
    return paths


def _model(path):
    with quantized_loading():
        return make_invariant(AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval())


def _prompts(vocab: int, page: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(4)
    shared = torch.randint(1, vocab, (page + 3,), generator=g).tolist()
    return [shared + [7, 8], shared + [9], torch.randint(1, vocab, (6,), generator=g).tolist()]


def _same(a, b) -> bool:
    return a.token_ids == b.token_ids and a.logprobs == b.logprobs and a.top_logprobs == b.top_logprobs


def _schedule_vs_alone(model) -> list[bool]:
    """Prompts sharing a cached prefix, chunked by a 5-token budget with decodes mixed in, against
    each alone on an engine without a prefix cache."""
    engine = Engine(model, max_num_seqs=3, max_num_batched_tokens=5)
    prompts = _prompts(model.config.vocab_size, engine.core.blocks.page_size)
    engine.generate(prompts[:1], PARAMS)  # fills the prefix cache
    hits = engine.core.blocks.prefix_hits
    mixed = engine.generate(prompts, PARAMS)
    assert engine.core.blocks.prefix_hits - hits >= 2 * engine.core.blocks.page_size
    alone = Engine(model, enable_prefix_caching=False)
    return [_same(out, alone.generate([prompt], PARAMS)[0]) for out, prompt in zip(mixed, prompts)]


@pytest.mark.fast_cells(1)
@pytest.mark.parametrize("fmt", ["W4A16_ASYM", "fp8", "fp8-moe"])
def test_engine_schedules_with_prefix_hits_equal_each_request_alone(checkpoints, fmt):
    assert all(_schedule_vs_alone(_model(checkpoints[fmt])))




@pytest.mark.heavy
def test_negative_control_per_tensor_activation_scale_changes_engine_outputs(checkpoints):
    model = _model(checkpoints["fp8"])
    for module in quantized_layers(model):
        module.forward = types.MethodType(per_tensor_scaled_quantized_forward, module)
    assert not all(_schedule_vs_alone(model))


@pytest.mark.heavy
def test_score_cli_reads_the_format_from_the_checkpoint(checkpoints, tmp_path):
    path = checkpoints["fp8"]
    g = torch.Generator().manual_seed(5)
    sequences = [torch.randint(1, 512, (n,), generator=g).tolist() for n in (12, 5, 20)]
    inp = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "input_ids": s} for i, s in enumerate(sequences)])
    digests = []
    for budget in ("8", "64"):
        out = tmp_path / f"out-{budget}.jsonl"
        assert scoring_cli.main(["--model", str(path), "--input", inp, "--output", str(out), "--dtype", "bf16",
                                 "--max-batch-tokens", budget]) == 0
        digests.append({row["id"]: row["digest"] for row in read_rows(out)})
    in_process = score_sequences(_model(path), sequences)
    assert digests[0] == digests[1] == {i: r.digest for i, r in enumerate(in_process)}


@pytest.mark.heavy
@pytest.mark.parametrize("fmt", ["W4A16_ASYM", "fp8-moe"])
def test_serve_reads_the_format_from_the_checkpoint(checkpoints, tmp_path, fmt):
    path = checkpoints[fmt]
    server = ServerProcess(["--model", str(path), "--served-model-name", MODEL, "--dtype", "bf16"],
                           tmp_path / "server.log")
    try:
        prompts = _prompts(512, 64)
        response = completion(server, prompt=prompts, max_tokens=3, temperature=0, logprobs=1)
    finally:
        server.stop()
    expected = Engine(_model(path), enable_prefix_caching=False)
    for choice, prompt in zip(choices_of(response), prompts):
        alone = expected.generate([prompt], SamplingParams(max_tokens=3, logprobs=1))[0]
        assert choice["logprobs"]["token_logprobs"] == alone.logprobs


@pytest.mark.heavy
def test_demo_shows_the_weight_bytes(checkpoints, capsys):
    assert demo_cli.run(demo_cli.argparse.Namespace(model=str(checkpoints["fp8"]), family="qwen2", dtype="bf16",
                                                     device="cpu", seed=0)) == 0
    out = capsys.readouterr().out
    assert "weights:" in out and "fp8" in out and "MiB" in out
