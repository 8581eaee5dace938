"""A reward model in ``InvariantGRPOTrainer``: TRL scores a generation batch's completions in one forward of
the reward model (right-padded, read at the last non-pad token); each completion's reward there is bitwise the
reward TRL's own path gives it scored alone (batch of 1), and in another order and batch size. The reward
model is a tiny Qwen3ForSequenceClassification (one label) saved and loaded back, passed as a model and as a
path; a BERT cross-encoder as reward model; a family make_invariant does not patch is refused by name, leaving no model patched.
Negative control: the reward model's linears on a linear whose K tile follows the row count moves rewards."""
from __future__ import annotations

import random

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForSequenceClassification, GPT2Config, GPT2ForSequenceClassification
from transformers import PreTrainedTokenizerFast
from trl import GRPOConfig
from trl.data_utils import apply_chat_template

from helpers.controls import m_dependent_linear
from helpers.models import load_model
from helpers.tokenizer import save_tokenizer
from invariant_infer.errors import UnsupportedModelError
from invariant_infer.model.patch import is_invariant
from invariant_infer.testing.random_checkpoints import qwen2_config, random_config, save_random_checkpoint
from invariant_infer.training.integrations.trl import InvariantGRPOTrainer

WORDS = "the a model token batch score sequence invariant logits prompt completion cat dog runs fast".split()
ONE_LAYER = {"num_hidden_layers": 1}
VOCAB = 320  # the byte-level BPE's: every sampled token decodes to text the reward model reads
STOP_IDS = list(range(256, VOCAB))  # about one sampled token in five ends a completion: several lengths


def prompts(count: int = 4) -> Dataset:
    rows = [[{"role": "user", "content": " ".join(WORDS[(3 * i + j) % len(WORDS)] for j in range(2 + i % 3))}]
            for i in range(count)]
    return Dataset.from_dict({"prompt": rows})


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    """{"policy": a 1-layer Qwen2 causal LM, "qwen3" / "bert": 1-layer one-label reward models}, each saved
    with the byte-level BPE (and chat template) beside it, as checkpoints ship."""
    root = tmp_path_factory.mktemp("grpo-reward")
    out = {"policy": save_random_checkpoint(root / "policy", qwen2_config("tiny", vocab_size=VOCAB, **ONE_LAYER),
                                            seed=0)}
    for family in ("qwen3", "bert"):
        config = random_config(family, "tiny", num_labels=1, vocab_size=VOCAB, **ONE_LAYER)
        out[family] = save_random_checkpoint(root / family, config, seed=1, auto_class=AutoModelForSequenceClassification)
    for path in out.values():
        save_tokenizer(path)
    return out


def trainer_for(paths, tmp_path, reward, cls=InvariantGRPOTrainer, model=None, **kwargs):
    tokenizer = PreTrainedTokenizerFast.from_pretrained(paths["policy"])
    model = model if model is not None else load_model(paths["policy"], torch.float32)
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, *STOP_IDS]
    # One generation of 4 (2 prompts x 2) per step, trained in micro-batches of 2.
    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, num_generations=2,
                      per_device_train_batch_size=2, gradient_accumulation_steps=2, generation_batch_size=4,
                      max_completion_length=6, temperature=1.0, max_steps=1, learning_rate=1e-2, logging_steps=1,
                      report_to=[], save_strategy="no", seed=0)
    return cls(model=model, reward_funcs=reward, args=args, train_dataset=prompts(), processing_class=tokenizer,
               **kwargs)


def load_reward(path):
    return AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32)


class RecordingTrainer(InvariantGRPOTrainer):
    """Keeps each call's (inputs, prompts, completions, completion ids) and the rewards TRL computed."""

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self.scored = getattr(self, "scored", []) + [((inputs, prompts, completions, completion_ids_list), rewards)]
        return rewards


def rewards_of(trainer, batch, rows) -> torch.Tensor:
    """TRL's reward path (tokenize, one forward of the reward model, logits[:, 0]) on ``rows`` of ``batch``."""
    return InvariantGRPOTrainer._calculate_rewards(trainer, *([part[i] for i in rows] for part in batch))


def mismatches(trainer, batch, rewards) -> int:
    """How many rows' ``rewards`` (as the trainer computed them for the whole ``batch``) differ from the row
    scored alone; and, against alone too, each row in the batch shuffled and in batches of 3."""
    count = len(batch[0])
    alone = [rewards_of(trainer, batch, [i])[0] for i in range(count)]
    order = list(range(count))
    random.Random(0).shuffle(order)
    shuffled = rewards_of(trainer, batch, order)
    threes = torch.cat([rewards_of(trainer, batch, range(s, min(s + 3, count))) for s in range(0, count, 3)])
    return (sum(not torch.equal(rewards[i], alone[i]) for i in range(count))
            + sum(not torch.equal(threes[i], alone[i]) for i in range(count))
            + sum(not torch.equal(shuffled[slot], alone[i]) for slot, i in enumerate(order)))


@pytest.fixture(scope="module")
def trained(paths, tmp_path_factory):
    """One GRPO step with the Qwen3 reward model, TRL's scored batches recorded."""
    reward = load_reward(paths["qwen3"])
    trainer = trainer_for(paths, tmp_path_factory.mktemp("run"), reward, RecordingTrainer,
                          reward_processing_classes=PreTrainedTokenizerFast.from_pretrained(paths["qwen3"]))
    trainer.train()
    return trainer, reward


def test_trained_rewards_are_each_completion_scored_alone(trained):
    trainer, reward = trained
    assert trainer.reward_funcs[0] is reward and is_invariant(reward)
    assert trainer.scored
    for batch, rewards in trainer.scored:
        texts = [c[0]["content"] for c in batch[2]]
        assert len(set(map(len, batch[3]))) > 1, texts  # completions of several lengths: right padding
        assert rewards[:, 0].unique().numel() == len(texts)  # a reward per completion, not a constant
        assert mismatches(trainer, batch, rewards) == 0


def test_control_a_batch_size_keyed_linear_moves_the_rewards(trained):
    """The same check on the reward model's linears with BLOCK_K chosen by the row count (up to the longest
    text alone, or more: any batch of them) must fail."""
    trainer, reward = trained
    batch, _ = trainer.scored[0]
    tokenizer = trainer.reward_processing_classes[0]
    texts = [apply_chat_template({"messages": p + c}, tokenizer)["text"] for p, c in zip(batch[1], batch[2])]
    longest = max(len(tokenizer(t, add_special_tokens=False).input_ids) for t in texts)
    linears = [m for m in reward.modules() if type(m) is torch.nn.Linear]
    for module in linears:
        module.forward = lambda x, m=module: m_dependent_linear(x, m.weight, m.bias, small_m=longest)
    try:
        assert mismatches(trainer, batch, rewards_of(trainer, batch, range(len(batch[0])))) > 0
    finally:
        for module in linears:
            del module.forward


def fixed_batch(count: int = 5):
    """Conversational prompts and completions of several lengths, as TRL hands them to the reward functions."""
    prompt_rows = prompts(count)["prompt"]
    completions = [[{"role": "assistant", "content": " ".join(WORDS[(5 * i + j) % len(WORDS)] for j in range(1 + i))}]
                   for i in range(count)]
    return ([{"prompt": p} for p in prompt_rows], prompt_rows, completions, [[1] * (1 + i) for i in range(count)])


@pytest.mark.parametrize("family", [pytest.param("qwen3", marks=pytest.mark.heavy), "bert"])
def test_reward_model_given_by_path_or_encoder_is_invariant(paths, tmp_path, family):
    """A path string (TRL loads AutoModelForSequenceClassification and the tokenizer beside it, then the trainer
    patches it); a BERT cross-encoder as the reward model."""
    trainer = trainer_for(paths, tmp_path, str(paths[family]))
    assert is_invariant(trainer.reward_funcs[0])
    assert type(trainer.reward_funcs[0]).__name__ == {"qwen3": "Qwen3", "bert": "Bert"}[family] + \
        "ForSequenceClassification"
    batch = fixed_batch()
    rewards = rewards_of(trainer, batch, range(len(batch[0])))
    assert rewards[:, 0].unique().numel() == len(batch[0])
    assert mismatches(trainer, batch, rewards) == 0


def test_reward_model_of_an_unpatched_family_is_refused_by_name(paths, tmp_path):
    config = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=320, num_labels=1)
    reward = GPT2ForSequenceClassification(config)
    supported = load_reward(paths["qwen3"])
    policy = load_model(paths["policy"], torch.float32)
    with pytest.raises(UnsupportedModelError, match=r"reward_funcs\[1\] .*GPT2ForSequenceClassification.*'gpt2'"):
        trainer_for(paths, tmp_path, [supported, reward], model=policy,
                    reward_processing_classes=[PreTrainedTokenizerFast.from_pretrained(paths["qwen3"])] * 2)
    # Nothing stays patched: the reward model before the refused one is restored, the policy never patched.
    assert not is_invariant(supported) and not is_invariant(policy)
