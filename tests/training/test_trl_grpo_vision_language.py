"""TRL GRPO on Qwen2.5-VL (Qwen3-VL in the heavy tier): prompts with images of several sizes sampled by the
invariant engine, trained on ``token_logprobs`` in micro-batches of another size, and TRL's own
``sampling/sampling_logp_difference/max`` is exactly 0.0 at every step; the vision tower stays frozen
(training it is refused by name at construction). The model favours its image placeholder, which the
engine never samples. Negative controls: the same run whose rollout logprobs come from an M-dependent
GEMM logs a nonzero difference; with nothing suppressed the training step fails on sampled placeholders."""
from __future__ import annotations

import functools

import pytest
import torch
from datasets import Dataset
from PIL import Image
from transformers import AutoModelForImageTextToText
from trl import GRPOConfig

import invariant_infer.model.layer_forwards
from helpers.controls import m_dependent_linear
from helpers.vision import VISION_TOKENS, image_processor_only, random_images, save_vision_checkpoint
from invariant_infer.training.integrations.trl import InvariantGRPOTrainer, UnsupportedTRLError

METRIC = "sampling/sampling_logp_difference/max"
STOP_IDS = list(range(448, 512))  # end-of-turn ids besides EOS: completions of several lengths


@pytest.fixture(scope="module", params=["qwen2_5_vl", pytest.param("qwen3_vl", marks=pytest.mark.heavy)])
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"grpo-{request.param}")
    config = save_vision_checkpoint(path, request.param, seed=6)
    return path, random_images(config, ((4, 6), (6, 4), (2, 8)), seed=7)


def dataset(images) -> Dataset:
    """Four prompts, each with an image of one of three sizes (the trainer puts it in the first user message;
    TRL's processor call takes no batch that mixes rows with and without images)."""
    texts = ["the cat runs", "a dog", "the model scores", "batch of tokens"]
    pictures = [Image.fromarray(images[i]) for i in (0, 1, 2, 0)]
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": t}] for t in texts], "image": pictures})


def token_sum_reward(completion_ids, **kwargs):
    return [float(sum(ids) % 13) for ids in completion_ids]


def trainer_for(path, images, tmp_path, *, freeze: bool = True, favoured: float = 5.0, **overrides):
    processor = image_processor_only(path)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    if freeze:
        model.model.visual.requires_grad_(False)
    # The image placeholder is favoured (``favoured`` added to its logit): the engine never samples it. The
    # vision start and end tokens, which a trained model does not sample either, are pushed to -inf.
    start, image, end = processor.tokenizer.convert_tokens_to_ids(VISION_TOKENS)
    bias = torch.zeros(model.lm_head.out_features)
    bias[[start, end]], bias[image] = -1e4, favoured
    model.lm_head.bias = torch.nn.Parameter(bias, requires_grad=False)
    model.generation_config.eos_token_id = [processor.tokenizer.eos_token_id, *STOP_IDS]
    options = dict(output_dir=str(tmp_path), use_cpu=True, bf16=False, num_generations=2,
                   per_device_train_batch_size=2, gradient_accumulation_steps=2, generation_batch_size=4,
                   max_completion_length=5, temperature=0.7, max_steps=2, learning_rate=3e-2, logging_steps=1,
                   report_to=[], save_strategy="no", seed=0)
    return InvariantGRPOTrainer(model=model, reward_funcs=token_sum_reward, args=GRPOConfig(**{**options, **overrides}),
                                train_dataset=dataset(images), processing_class=processor)


def test_sampler_and_trainer_logprobs_are_bitwise_equal_with_images(checkpoint, tmp_path):
    trainer = trainer_for(*checkpoint, tmp_path)
    model = trainer.model
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    trainer.train()
    assert logged(trainer, METRIC) == [0.0, 0.0]
    changed = {name for name, p in model.named_parameters() if not torch.equal(p, before[name])}
    tower = {name for name in before if name.startswith("model.visual.")}
    assert tower and not changed & tower  # frozen
    assert changed == {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainer.engine.frontend.images is not None  # the engine took the processor: rollouts saw the images


@pytest.mark.heavy
@pytest.mark.parametrize("checkpoint", ["qwen2_5_vl"], indirect=True)
def test_negative_control_sampled_placeholders(checkpoint, tmp_path):
    """With nothing suppressed the rollouts sample the favoured image placeholder, and TRL's training step
    fails on it (transformers counts more image tokens than image features)."""
    trainer = trainer_for(*checkpoint, tmp_path, max_steps=1)
    trainer.engine.core.suppressed_token_ids = ()
    with pytest.raises(ValueError, match="Image features and image tokens do not match"):
        trainer.train()


@pytest.mark.heavy  # the fast tier keeps to its 10 minutes
@pytest.mark.parametrize("checkpoint", ["qwen2_5_vl"], indirect=True)  # one family is enough here
def test_negative_control_m_dependent_rollouts(checkpoint, tmp_path, monkeypatch):
    """Rollout logprobs from a GEMM whose K tile depends on the row count (the engine's decode steps of a
    few rows against the trainer's micro-batches of whole sequences): TRL logs the difference."""
    trainer = trainer_for(*checkpoint, tmp_path, max_steps=1)
    generate = trainer._generate_single_turn

    def m_dependent_rollouts(*args, **kwargs):
        with monkeypatch.context() as patched:
            patched.setattr(invariant_infer.model.layer_forwards, "linear",
                            functools.partial(m_dependent_linear, small_m=4))
            return generate(*args, **kwargs)
    trainer._generate_single_turn = m_dependent_rollouts
    trainer.train()
    differences = logged(trainer, METRIC)
    assert len(differences) == 1 and differences[0] > 0, differences


@pytest.mark.parametrize("checkpoint", ["qwen2_5_vl"], indirect=True)  # one family is enough here
def test_a_trainable_vision_tower_is_refused(checkpoint, tmp_path):
    with pytest.raises(UnsupportedTRLError, match="vision tower"):
        trainer_for(*checkpoint, tmp_path, freeze=False)


def logged(trainer, name: str) -> list[float]:
    return [float(entry[name]) for entry in trainer.state.log_history if name in entry]
