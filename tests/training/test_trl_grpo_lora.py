"""LoRA GRPO: ``InvariantGRPOTrainer(..., peft_config=LoraConfig(...))`` samples with the adapter unmerged
on the engine and trains only the adapter; TRL's own ``sampling/sampling_logp_difference/max`` is exactly
0.0 at every step. Control: merging the trained adapter into the base for a separate sampler (the
merge-and-sync path) gives other logprobs."""
from __future__ import annotations

import torch
from datasets import Dataset
from peft import LoraConfig, PeftModel, get_peft_model_state_dict, set_peft_model_state_dict
from transformers import PreTrainedTokenizerFast
from trl import GRPOConfig

import pytest
from helpers.models import load_model
from helpers.tokenizer import save_tokenizer
from invariant_infer import make_invariant, pad_sequences
from invariant_infer.model.lora import is_peft_model
from invariant_infer.model.patch import is_invariant
from invariant_infer.testing.random_checkpoints import qwen2_config, save_random_checkpoint
from invariant_infer.training import token_logprobs
from invariant_infer.training.integrations.trl import InvariantGRPOTrainer, UnsupportedTRLError

METRIC = "sampling/sampling_logp_difference/max"
WORDS = "the a model token batch score sequence invariant logits prompt completion cat dog runs fast".split()
LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                 "down_proj"])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = save_random_checkpoint(tmp_path_factory.mktemp("grpo-lora"), qwen2_config("tiny", num_hidden_layers=1),
                                  seed=0)
    save_tokenizer(path)
    return path


def trainer_for(checkpoint, tmp_path, peft_config):
    rows = [[{"role": "user", "content": " ".join(WORDS[(3 * i + j) % len(WORDS)] for j in range(2 + i % 3))}]
            for i in range(8)]
    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, num_generations=2,
                      per_device_train_batch_size=2, gradient_accumulation_steps=2, generation_batch_size=4,
                      max_completion_length=5, temperature=0.7, max_steps=2, learning_rate=3e-2, logging_steps=1,
                      report_to=[], save_strategy="no", seed=0)
    return InvariantGRPOTrainer(model=load_model(checkpoint, torch.float32),
                                reward_funcs=lambda completion_ids, **kw: [float(sum(i) % 13) for i in completion_ids],
                                args=args, train_dataset=Dataset.from_dict({"prompt": rows}),
                                processing_class=PreTrainedTokenizerFast.from_pretrained(checkpoint),
                                peft_config=peft_config)


@pytest.mark.heavy
def test_lora_grpo_rollout_and_training_logprobs_are_bitwise_equal(checkpoint, tmp_path):
    trainer = trainer_for(checkpoint, tmp_path, LoraConfig(**LORA))
    assert is_peft_model(trainer.model) and is_invariant(trainer.model)
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    trainer.train()
    differences = [float(e[METRIC]) for e in trainer.state.log_history if METRIC in e]
    assert differences == [0.0, 0.0], differences
    changed = {name for name, p in trainer.model.named_parameters() if not torch.equal(p, before[name])}
    assert changed and all("lora_" in name for name in changed)  # the adapter trained, the base did not
    assert any("lora_B" in name for name in changed)  # B starts at zero: the second step sampled a live adapter
    assert trainer.engine.model is trainer.model.get_base_model()  # unmerged, no copy, nothing synced

    # Control: the merge-and-sync path, the trained adapter merged into a separate sampler's weights.
    sampler = PeftModel(load_model(checkpoint, torch.float32), LoraConfig(**LORA))
    set_peft_model_state_dict(sampler, get_peft_model_state_dict(trainer.model))
    merged = make_invariant(sampler.merge_and_unload())
    g = torch.Generator().manual_seed(0)
    ids, mask = pad_sequences([torch.randint(1, 256, (n,), generator=g) for n in (9, 6)], side="left")
    with torch.no_grad():
        unmerged_logps = token_logprobs(trainer.model, ids, mask, temperature=0.7)
        merged_logps = token_logprobs(merged, ids, mask, temperature=0.7)
    assert not torch.equal(unmerged_logps, merged_logps)
    assert (unmerged_logps - merged_logps).abs().max().item() < 1e-4  # the same adapter, rounded otherwise


def test_lora_dropout_is_refused_up_front(checkpoint, tmp_path):
    with pytest.raises(UnsupportedTRLError, match="lora_dropout"):
        trainer_for(checkpoint, tmp_path, LoraConfig(**LORA, lora_dropout=0.05))
