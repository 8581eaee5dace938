"""One context per engine step (``invariant_infer.model.step_context``): built by the model runner
before the forward, frozen, active only while the decoder runs, and the one object that every
attention call, every adapter-slot projection and every Gated DeltaNet layer of the step reads; no
other module sets step state on the layers. Control: the reads of two steps see two contexts."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model

import invariant_infer
from invariant_infer.engine import Engine, SamplingParams
from invariant_infer.engine.model_runner import ModelRunner
from invariant_infer.engine.paged_batch import PagedBatch
from invariant_infer.model import attention, linear_attention, lora, step_context
from invariant_infer.model.step_context import StepContext, current_step
from invariant_infer.testing.random_checkpoints import qwen2_config, random_config, random_model

ROOT = Path(invariant_infer.__file__).parent
PARAMS = SamplingParams(max_tokens=2, ignore_eos=True)


def record_reads(monkeypatch) -> tuple[dict[str, list], list]:
    """({reader: the context each of its reads got}, the context of each forward, in order)."""
    reads = {"attention": [], "lora": [], "linear_attention": []}
    for name, module in (("attention", attention), ("lora", lora), ("linear_attention", linear_attention)):
        def reader(seen=reads[name]):
            seen.append(current_step())
            return seen[-1]
        monkeypatch.setattr(module, "current_step", reader)
    forwards, forward = [], ModelRunner._forward

    def recorded(self, inputs):
        forwards.append(inputs.context)
        return forward(self, inputs)
    monkeypatch.setattr(ModelRunner, "_forward", recorded)
    return reads, forwards


def lora_engine():
    model = random_model(qwen2_config("tiny", num_hidden_layers=2), seed=0, dtype=torch.float32)
    config = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "down_proj"], init_lora_weights=False)
    adapter = get_peft_model(random_model(qwen2_config("tiny", num_hidden_layers=2), seed=0, dtype=torch.float32),
                             config)
    engine = Engine(model, max_num_seqs=4, max_loras=1, max_lora_rank=2)
    engine.add_lora("a", adapter)
    return engine


@pytest.mark.parametrize("kind", ["dense with adapters", "hybrid"])
def test_every_layer_of_a_step_reads_the_steps_one_context(monkeypatch, kind):
    if kind == "hybrid":
        engine = Engine(random_model(random_config("qwen3_5_text", "tiny"), dtype=torch.float32), max_num_seqs=4)
        readers = {"attention": 1, "linear_attention": 1}
    else:
        engine = lora_engine()
        readers = {"attention": 2, "lora": len(engine.core.runner.loras.layers)}  # every projection has slots
    reads, forwards = record_reads(monkeypatch)
    engine.generate([[3, 5, 7], [4, 6]], [PARAMS, PARAMS], **({} if kind == "hybrid" else {"lora": ["a", None]}))
    assert len(forwards) == 2 and all(type(c) is StepContext for c in forwards)
    assert forwards[0] is not forwards[1]  # the control: the reads tell the steps apart
    for reader, per_step in readers.items():  # per forward: one read per layer (or projection)
        assert [id(c) for c in reads[reader]] == [id(c) for c in forwards for _ in range(per_step)], reader
    if kind != "hybrid":  # the adapter's rows (request 0's tokens) reach the projections
        assert [(slot, rows.tolist()) for slot, rows in forwards[0].lora_groups] == [(0, [0, 1, 2])]
    assert current_step() is None  # active only during the forward


def test_the_context_is_frozen_and_reset_after_its_forward_even_when_it_fails():
    context = StepContext(attention=object())
    with pytest.raises(dataclasses.FrozenInstanceError):
        context.lora_groups = ((0, torch.tensor([0])),)
    with pytest.raises(RuntimeError), context.active():
        assert current_step() is context
        raise RuntimeError("a failing forward")
    assert current_step() is None
    for step_type in (step_context.LinearAttentionStep, PagedBatch):
        assert step_type.__dataclass_params__.frozen, step_type


# What builds or activates a step's context, and the side channels it replaced.
CONTEXT_WRITERS = re.compile(r"\bStepContext\(|\.active\(\)|\b_CURRENT\b")
SIDE_CHANNELS = re.compile(r"\bPAGED_BATCH_KWARG\b|\bLoraRows\b|\brows\.groups\b|\b_STATES\b|WeakKeyDictionary|"
                           r"\.linear_attention\s*=[^=]")


def test_only_the_model_runner_builds_and_activates_step_contexts():
    allowed = {ROOT / "model" / "step_context.py", ROOT / "engine" / "model_runner.py"}
    sources = [*ROOT.rglob("*.py"), *(ROOT.parent / "benchmarks").rglob("*.py")]
    writers = [f"{p.relative_to(ROOT.parent)}:{i}" for p in sources if p not in allowed
               for i, line in enumerate(p.read_text().splitlines(), 1) if CONTEXT_WRITERS.search(line)]
    assert not writers, writers
    channels = [f"{p.relative_to(ROOT.parent)}:{i}" for p in sources
                for i, line in enumerate(p.read_text().splitlines(), 1) if SIDE_CHANNELS.search(line)]
    assert not channels, channels
    # The control: each pattern finds what it is for.
    assert all(CONTEXT_WRITERS.search(line) for line in ("StepContext(batch)", "with context.active():"))
    assert all(SIDE_CHANNELS.search(line) for line in ("**{PAGED_BATCH_KWARG: b}", "self.rows.groups = g",
                                                       "batch.linear_attention = step"))
