"""LoRA adapters on DeepSeek-V3's multi-head latent attention. The absorbed attention reads
``kv_b_proj``'s weight and never calls the layer, so an unmerged adapter there would be dropped
without a word: a PeftModel and the engine's adapter slots refuse it by name. Adapters on the
projections the forward does call (q_a_proj, q_b_proj, kv_a_proj_with_mqa, o_proj) change the logits,
keep each row bitwise alone in any batch, and the engine's adapter rows equal the PeftModel's scoring."""
from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model

from helpers.models import batch_mismatches, make_samples
from invariant_infer import UnsupportedModelError, make_invariant, score_sequences
from invariant_infer.engine import Engine
from invariant_infer.engine.lora_slots import LoraAdapterError
from invariant_infer.testing.random_checkpoints import random_config, random_model

CALLED = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj"]


def base_model():
    return random_model(random_config("deepseek_v3", "tiny"), seed=3, dtype=torch.float32)


def adapter(targets) -> LoraConfig:
    return LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory):
    """"called" -> an adapter on the called projections; "kv_b" -> one that also targets kv_b_proj."""
    dirs = {}
    for seed, (name, targets) in enumerate((("called", CALLED), ("kv_b", CALLED + ["kv_b_proj"])), start=1):
        torch.manual_seed(seed)
        dirs[name] = tmp_path_factory.mktemp(f"lora-{name}")
        get_peft_model(base_model(), adapter(targets)).save_pretrained(dirs[name])
    return dirs


def test_lora_on_kv_b_proj_is_refused_by_name(adapter_dirs):
    peft_model = PeftModel.from_pretrained(base_model(), adapter_dirs["kv_b"])
    with pytest.raises(UnsupportedModelError, match="kv_b_proj: LoRA on kv_b_proj is not supported"):
        make_invariant(peft_model)
    engine = Engine(base_model(), max_num_seqs=2, max_loras=1, max_lora_rank=4)
    with pytest.raises(LoraAdapterError, match="kv_b_proj: LoRA on kv_b_proj is not supported"):
        engine.add_lora("kv_b", adapter_dirs["kv_b"])


def test_lora_on_the_called_projections_changes_logits_and_rows_equal_alone(adapter_dirs):
    base = make_invariant(base_model())
    peft_model = make_invariant(PeftModel.from_pretrained(base_model(), adapter_dirs["called"]))
    samples = make_samples(base.config.vocab_size, (9, 1, 20, 5))
    with torch.no_grad():
        plain, adapted = base(samples[0][None]).logits, peft_model(samples[0][None]).logits
        assert not torch.equal(plain, adapted)  # the adapter acts
        assert batch_mismatches(peft_model, samples) == []


def test_engine_adapter_rows_equal_the_peft_models_scoring(adapter_dirs):
    engine = Engine(base_model(), max_num_seqs=4, max_loras=1, max_lora_rank=4)
    engine.add_lora("called", adapter_dirs["called"])
    sequences = [t.tolist() for t in make_samples(512, (7, 12, 4), seed=5)]
    want = score_sequences(make_invariant(PeftModel.from_pretrained(base_model(), adapter_dirs["called"])),
                           copy.deepcopy(sequences))
    got = engine.score(sequences, lora="called")
    assert all(torch.equal(g.token_logprobs, w.token_logprobs) for g, w in zip(got, want))
