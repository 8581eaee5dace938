"""Tensor parallelism of quantized checkpoints (compressed-tensors FP8_BLOCK and W4A16, written with
its own compressors), on CPU with gloo: loaded with tp_plan="auto" under torchrun (transformers
shards the compressed tensors themselves) and patched by make_invariant, TP 2 gives the single-process
model's logits bitwise. Row-parallel layers reduce K as a tree of leaves of whole scale groups, and
each rank computes its own leaves. Negative control: the exchange replaced by an all-reduce of each
rank's rounded sums. Refusals: a format the shards do not serve, and a size that would split a
128-row block, each naming what works; a quantized hybrid (Gated DeltaNet) checkpoint. One torchrun
(tests/tp_worker.py) runs the model checks; ``invariant-infer score`` and ``serve`` at TP 2 (rank
processes) give the bits of one process, and ``serve`` refuses adapter slots on a quantized
checkpoint at TP 2."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers.servers import MODEL, ServerProcess, choices_of, completion, run_bounded
from helpers.tokenizer import save_tokenizer
from invariant_infer.cli import score as scoring_cli
from invariant_infer.engine import Engine, SamplingParams
from invariant_infer.kernels import dequantize_weight
from invariant_infer.model.patch import make_invariant
from invariant_infer.model.quantization import quantized_layers
from invariant_infer.testing.quantized_checkpoints import save_quantized_checkpoint
from invariant_infer.testing.random_checkpoints import qwen2_config, random_config
from invariant_infer.model.module_state import state_of
from test_tensor_parallel import RUN_TIMEOUT, WORKER, torchrun

import compressed_tensors  # noqa: F401  (the test extra pins it: a missing install fails, never skips)

pytestmark = pytest.mark.file_minutes(0.8)

# 4 heads of 64 (o_proj K = 256: two leaves of two 128-groups), intermediate 512 (down_proj: four
# leaves), every column shard at TP 2 whole 128-row blocks.
SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=4, head_dim=64,
             num_hidden_layers=1, vocab_size=512)
FORMATS = ("FP8_BLOCK", "W4A16")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("quantized-tp")
    paths = {fmt: save_quantized_checkpoint(root / fmt, qwen2_config("tiny", **SHAPE), fmt, seed=3) for fmt in FORMATS}
    paths["per-channel"] = save_quantized_checkpoint(root / "per-channel", qwen2_config("tiny", **SHAPE), "FP8_DYNAMIC")
    paths["kv2"] = save_quantized_checkpoint(root / "kv2", qwen2_config("tiny", **{**SHAPE, "num_key_value_heads": 2}),
                                             "FP8_BLOCK")
    hybrid = random_config("qwen3_5_text", "tiny", hidden_size=128, intermediate_size=256, num_attention_heads=2,
                           num_key_value_heads=2, head_dim=64)
    paths["hybrid"] = save_quantized_checkpoint(root / "hybrid", hybrid, "FP8_BLOCK",
                                                ignore=("lm_head", "re:.*linear_attn.*"))
    return paths


@pytest.fixture(scope="module")
def tp2(checkpoints, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("quantized-tp2")
    torchrun(2, out, [*[a for fmt in FORMATS for a in ("--model", f"{fmt}={checkpoints[fmt]}")],
                      *[a for d in DTYPES for a in ("--dtype", d)], "--variant", "invariant", "--variant", "allreduce:bf16",
                      "--refuse", f"per-channel={checkpoints['per-channel']}", "--refuse", f"kv2={checkpoints['kv2']}",
                      "--refuse", f"hybrid={checkpoints['hybrid']}"])
    return out


def _single_process(path, dtype):
    sys.path.insert(0, str(WORKER.parent))
    from tp_worker import padded_batch  # the worker's batch, so both sides run the same rows
    model = make_invariant(AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval())
    ids, mask = padded_batch(model.config.vocab_size)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


@pytest.mark.heavy
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("fmt", FORMATS)
def test_tp2_logits_bitwise_equal_to_single_process(tp2, checkpoints, fmt, dtype):
    got = torch.load(tp2 / f"{fmt}-{dtype}-invariant.pt")
    assert torch.equal(got, _single_process(checkpoints[fmt], DTYPES[dtype]))


@pytest.mark.heavy
@pytest.mark.parametrize("fmt", FORMATS)
def test_negative_control_allreduce_of_rounded_sums_differs(tp2, checkpoints, fmt):
    control = torch.load(tp2 / f"{fmt}-bf16-allreduce.pt")
    assert not torch.equal(control, _single_process(checkpoints[fmt], torch.bfloat16))


def test_row_parallel_layers_reduce_k_as_a_tree_of_whole_groups(checkpoints):
    model = make_invariant(AutoModelForCausalLM.from_pretrained(checkpoints["W4A16"], dtype=torch.bfloat16))
    layer = model.model.layers[0]
    plans = quantized_layers(model)  # as loaded: the leaves are make_invariant's
    assert state_of(layer.self_attn.o_proj).quantized.k_leaves == 2  # K = 256, groups of 128
    assert state_of(layer.mlp.down_proj).quantized.k_leaves == 4     # K = 512
    assert state_of(layer.self_attn.q_proj).quantized.k_leaves == 1  # column-parallel: K whole
    assert torch.equal(dequantize_weight(plans[layer.mlp.down_proj].weight),
                       dequantize_weight(state_of(layer.mlp.down_proj).quantized.weight))


@pytest.mark.heavy
def test_refusals_name_what_works(tp2):
    per_channel = (tp2 / "refused-per-channel.txt").read_text()
    assert per_channel.startswith("UnsupportedModelError: qwen2: tensor parallelism does not run compressed-tensors "
                                  "FP8 checkpoints with per-channel or per-tensor scales: ")
    assert "activation scale spans the whole row" in per_channel and "FP8_BLOCK" in per_channel
    kv2 = (tp2 / "refused-kv2.txt").read_text()
    assert "k_proj's 128 output rows would split a 128-row weight block" in kv2
    assert "Sizes that work for this model: [1]" in kv2
    hybrid = (tp2 / "refused-hybrid.txt").read_text()
    assert hybrid.startswith("UnsupportedModelError: qwen3_5_text: tensor parallelism does not run quantized "
                             "checkpoints with Gated DeltaNet (linear attention) layers: ")


def _rows(path: Path, count: int = 12) -> Path:
    generator = torch.Generator().manual_seed(4)
    lines = [json.dumps({"id": f"r{i}", "input_ids": torch.randint(1, 512, (int(n),), generator=generator).tolist()})
             for i, n in enumerate(torch.randint(3, 30, (count,), generator=generator))]
    path.write_text("\n".join(lines) + "\n")
    return path


def _score_args(checkpoint: Path, inputs: Path, output: Path, *extra: str) -> list[str]:
    return ["--model", str(checkpoint), "--input", str(inputs), "--output", str(output), "--device", "cpu",
            "--dtype", "bf16", *extra]


def _score(checkpoint: Path, inputs: Path, output: Path, *extra: str) -> None:
    run = run_bounded([sys.executable, "-m", "invariant_infer.cli", "score",
                       *_score_args(checkpoint, inputs, output, *extra)], RUN_TIMEOUT)
    assert run.returncode == 0, run.stderr[-3000:]


@pytest.mark.heavy
def test_score_command_at_tp2_writes_the_bytes_of_tp1(checkpoints, tmp_path, capsys):
    inputs = _rows(tmp_path / "in.jsonl")
    tp1 = _score_args(checkpoints["W4A16"], inputs, tmp_path / "tp1.jsonl")
    assert scoring_cli.main(tp1) == 0, capsys.readouterr().err[-3000:]  # TP 1 in this process; TP 2 as a command
    _score(checkpoints["W4A16"], inputs, tmp_path / "tp2.jsonl", "--tensor-parallel-size", "2", "--max-batch-tokens",
           "32")
    assert (tmp_path / "tp2.jsonl").read_bytes() == (tmp_path / "tp1.jsonl").read_bytes()


@pytest.mark.heavy
def test_serve_at_tp2_answers_as_the_engine_in_one_process(checkpoints, tmp_path):
    path = checkpoints["FP8_BLOCK"]
    save_tokenizer(path)
    generator = torch.Generator().manual_seed(6)
    prompts = [torch.randint(1, 512, (n,), generator=generator).tolist() for n in (9, 4, 13)]
    server = ServerProcess(["--model", str(path), "--served-model-name", MODEL, "--dtype", "bf16",
                            "--tensor-parallel-size", "2"], tmp_path / "server.log")
    try:
        response = completion(server, prompt=prompts, max_tokens=4, temperature=0, logprobs=1)
    finally:
        server.stop()
    engine = Engine(make_invariant(AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()),
                    enable_prefix_caching=False)
    for choice, prompt in zip(choices_of(response), prompts):
        alone = engine.generate([prompt], SamplingParams(max_tokens=4, logprobs=1))[0]
        assert choice["logprobs"]["token_logprobs"] == alone.logprobs


@pytest.mark.heavy
def test_serve_refuses_adapters_on_a_quantized_checkpoint_at_tp2(checkpoints, tmp_path):
    """Adapter slots on quantized layers run at TP 1 only: refused by name at start-up (exit status 2)."""
    from peft import LoraConfig, get_peft_model

    from invariant_infer.model.quantization import prepare_for_peft

    path = checkpoints["W4A16"]
    save_tokenizer(path)
    base = prepare_for_peft(AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16))
    get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "down_proj"])).save_pretrained(tmp_path / "adapter")
    run = run_bounded([sys.executable, "-m", "invariant_infer.cli", "serve", "--model", str(path), "--dtype", "bf16",
                       "--device", "cpu", "--port", "0", "--tensor-parallel-size", "2",
                       "--lora-modules", f"a={tmp_path / 'adapter'}"], RUN_TIMEOUT)
    assert run.returncode == 2
    assert "adapter slots on a quantized checkpoint run at tensor-parallel size 1 only" in run.stderr
