"""TRL GRPO on the invariant kernels: TRL's own ``sampling/sampling_logp_difference/max`` is exactly 0.0
at every step when the engine samples and ``token_logprobs`` trains, with a generation batch (4) that
differs from the training micro-batch (2); stock TRL with its rollout logprobs from a batch-variant
sampler logs a nonzero difference; unsupported options and unknown TRL versions are refused."""
from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
import trl
from datasets import Dataset
from transformers import PreTrainedTokenizerFast
from trl import GRPOConfig, GRPOTrainer

from helpers.controls import m_dependent_linear
from helpers.models import DEVICES, load_model
from helpers.tokenizer import save_tokenizer
from invariant_infer.training.integrations.trl import (ALLOW_UNTESTED_TRL_ENV, TESTED_TRL_VERSIONS, InvariantGRPOTrainer,
                                              UnsupportedTRLError, check_trl_version)
from invariant_infer.model.patch import is_invariant
from invariant_infer.testing.random_checkpoints import qwen2_config, save_random_checkpoint

METRIC = "sampling/sampling_logp_difference/max"
WORDS = "the a model token batch score sequence invariant logits prompt completion cat dog runs fast".split()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The tiny random Qwen2 (2 layers, hidden 64), with a byte-level BPE and a chat template next to it."""
    path = save_random_checkpoint(tmp_path_factory.mktemp("grpo-qwen2"), qwen2_config("tiny"), seed=0)
    save_tokenizer(path)
    return path


def prompts(count: int = 8) -> Dataset:
    rows = [[{"role": "user", "content": " ".join(WORDS[(3 * i + j) % len(WORDS)] for j in range(2 + i % 3))}]
            for i in range(count)]
    return Dataset.from_dict({"prompt": rows})


def token_sum_reward(completion_ids, **kwargs):
    """Differs between the completions of a prompt, so the advantages (and the gradients) are nonzero."""
    return [float(sum(ids) % 13) for ids in completion_ids]


def config(tmp_path, **overrides) -> GRPOConfig:
    # Generation batch 4 (2 prompts x 2 generations) scored by the trainer in micro-batches of 2;
    # each optimizer step is one generation, so the second step samples from updated weights.
    options = dict(output_dir=str(tmp_path), use_cpu=True, bf16=False, num_generations=2,
                   per_device_train_batch_size=2, gradient_accumulation_steps=2, generation_batch_size=4,
                   per_device_eval_batch_size=2,
                   max_completion_length=5, temperature=0.7, max_steps=2, learning_rate=3e-2, logging_steps=1,
                   report_to=[], save_strategy="no", seed=0)
    return GRPOConfig(**{**options, **overrides})


# End-of-turn ids besides the tokenizer's EOS, as chat models declare in generation_config: about one
# sampled token in eight of the random model ends its completion, so completions have several lengths.
STOP_IDS = list(range(448, 512))


def trainer_for(cls, checkpoint, args, device="cpu", **kwargs):
    tokenizer = PreTrainedTokenizerFast.from_pretrained(checkpoint)
    model = load_model(checkpoint, torch.float32, device)
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, *STOP_IDS]
    return cls(model=model, reward_funcs=token_sum_reward, args=args, train_dataset=prompts(),
               processing_class=tokenizer, **kwargs)


def logged(trainer, name: str) -> list[float]:
    return [float(entry[name]) for entry in trainer.state.log_history if name in entry]


@pytest.mark.fast_cells(1)
@pytest.mark.parametrize("device", DEVICES)
def test_sampler_and_trainer_logprobs_are_bitwise_equal(checkpoint, tmp_path, device):
    trainer = trainer_for(InvariantGRPOTrainer, checkpoint, config(tmp_path, use_cpu=device == "cpu"), device)
    assert is_invariant(trainer.model)
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    trainer.train()
    differences = logged(trainer, METRIC)
    assert differences == [0.0, 0.0], differences  # one generation per optimizer step, both compared by TRL
    assert logged(trainer, "sampling/importance_sampling_ratio/min") == [1.0, 1.0]
    # Some completions ended at a stop id before max_completion_length: right padding in the training batch.
    assert min(logged(trainer, "completions/min_length")) < 5 and min(logged(trainer, "completions/clipped_ratio")) < 1
    changed = [name for name, p in trainer.model.named_parameters() if not torch.equal(p, before[name])]
    assert len(changed) == len(before), f"unchanged: {sorted(set(before) - set(changed))}"
    assert trainer.engine.model is trainer.model  # the sampler ran on the trained weights, no copy
    evaluation = trainer.evaluate(prompts(4))  # eval mode: rollouts and TRL's comparison run there too
    assert float(evaluation[f"eval_{METRIC}"]) == 0.0
    with pytest.raises(RuntimeError, match="invariant engine"):
        trainer.vllm_generation.sync_weights()


@pytest.mark.heavy
def test_rollouts_replay_from_the_seed(checkpoint, tmp_path):
    """Each rollout's sampling seed is a function of (args.seed, step, call): the same run samples the same
    completions, another seed others."""
    prompt_ids = [[5, 9, 17], [5, 9, 17], [40, 2]]

    def rollouts(seed):
        trainer = trainer_for(InvariantGRPOTrainer, checkpoint, config(tmp_path, seed=seed))
        return trainer._generate_single_turn(prompt_ids, None, {}, 2)

    first, again, other = rollouts(0), rollouts(0), rollouts(1)
    assert first == again
    assert first[0][0] != first[0][1]  # the two generations of one prompt have their own seeds
    assert first[0] != other[0]


def trl_layout_batch(vocab: int):
    """Four rows as TRL lays them out: left-padded prompts of 3-6 tokens, right-padded completions of 2-5."""
    g = torch.Generator().manual_seed(1)
    prompt_lengths, completion_lengths = [3, 6, 4, 5], [5, 2, 4, 3]
    ids = torch.randint(1, vocab, (4, 11), generator=g)
    mask = torch.zeros(4, 11, dtype=torch.long)
    for row, (p, c) in enumerate(zip(prompt_lengths, completion_lengths)):
        mask[row, 6 - p:6 + c] = 1
    return ids.masked_fill(mask == 0, 0), mask, 5


def test_training_logprobs_match_trl_and_do_not_depend_on_the_chunking(checkpoint, tmp_path):
    trainer = trainer_for(InvariantGRPOTrainer, checkpoint, config(tmp_path))
    ids, mask, keep = trl_layout_batch(trainer.model.config.vocab_size)
    with torch.no_grad():
        ours, ours_entropy, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, keep,
                                                                           compute_entropy=True)
        rows, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, keep, batch_size=1)
        # TRL's own computation (its fused lm_head over the same backbone) agrees within fp32 rounding.
        theirs, theirs_entropy, _ = GRPOTrainer._get_per_token_logps_and_entropies(
            trainer, trainer.model, ids, mask, keep, compute_entropy=True)
    assert torch.equal(rows, ours)  # micro-batch 1 or 4: the same bits
    scored = mask[:, -keep:].bool()
    assert torch.equal(ours[~scored], torch.zeros_like(ours[~scored]))
    # fp32, logprobs about -6 and entropies about 6: measured 4.8e-7 and 1.9e-6 (10x margins).
    assert (ours - theirs)[scored].abs().max().item() < 5e-6
    assert (ours_entropy - theirs_entropy)[scored].abs().max().item() < 2e-5


# ---- negative control ---------------------------------------------------------------------------------

@contextmanager
def m_dependent_projections(model):
    """The decoder's projections on a linear whose K tile depends on the row count, as batch-size-keyed
    kernel heuristics pick tiles (decode steps of 4 rows get another reduction order than prefill)."""
    linears = [m for m in model.model.layers.modules() if type(m) is torch.nn.Linear]
    for module in linears:
        module.forward = lambda x, m=module: m_dependent_linear(x, m.weight, m.bias)
    try:
        yield
    finally:
        for module in linears:
            del module.forward


class SeparateSamplerGRPOTrainer(GRPOTrainer):
    """Stock TRL as it runs with a separate sampler (vLLM): the sampler reports the logprobs of the tokens it
    samples (here transformers ``generate`` over the whole generation batch, on an M-dependent linear, its
    logits / temperature as ``processed_logprobs``), and TRL's vLLM branch recomputes them with the stock
    model in its micro-batches and logs the difference."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.use_vllm, self.vllm_generation = True, None

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        pad, width = self._tokenizer.pad_token_id, max(map(len, prompt_ids))
        ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompt_ids])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids])
        with torch.no_grad(), m_dependent_projections(self.model):
            out = self.model.generate(input_ids=ids, attention_mask=mask, generation_config=self.generation_config,
                                      output_logits=True, return_dict_in_generate=True)
        completions = out.sequences[:, width:]
        logps = torch.log_softmax(torch.stack(out.logits, 1).float() / self.temperature, -1)
        logps = logps.gather(-1, completions[..., None])[..., 0]
        completion_ids, logprobs = [], []
        for row, row_logps in zip(completions.tolist(), logps.tolist()):
            ends = [i for i, t in enumerate(row) if t in self.eos_token_ids]
            keep = ends[0] + 1 if ends else len(row)
            completion_ids.append(row[:keep])
            logprobs.append(row_logps[:keep])
        return completion_ids, logprobs


def test_control_separate_batch_variant_sampler_differs(checkpoint, tmp_path):
    trainer = trainer_for(SeparateSamplerGRPOTrainer, checkpoint, config(tmp_path, max_steps=1))
    trainer.train()
    differences = logged(trainer, METRIC)
    assert len(differences) == 1 and differences[0] > 0, differences
    print(f"control {METRIC}: {differences[0]:.3g}")


# ---- refusals -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("option, value, needle", [
    ("use_vllm", True, "use_vllm"),
    ("top_k", 5, "top_k"),
    ("top_p", 0.9, "top_p"),
    ("min_p", 0.1, "min_p"),
    ("repetition_penalty", 1.2, "repetition_penalty"),
    ("use_liger_kernel", True, "use_liger_kernel"),
    ("cast_lm_head_to_fp32", True, "cast_lm_head_to_fp32"),
    ("vllm_importance_sampling_correction", False, "vllm_importance_sampling_correction"),
    ("entropy_coef", 0.01, "entropy"),
    ("top_entropy_quantile", 0.5, "top_entropy_quantile"),
    ("generation_kwargs", {"top_k": 3}, "generation_kwargs"),
    ("use_transformers_continuous_batching", True, "continuous_batching"),
])
def test_unsupported_options_are_refused(checkpoint, tmp_path, option, value, needle):
    with pytest.raises(UnsupportedTRLError, match=needle):
        trainer_for(InvariantGRPOTrainer, checkpoint, config(tmp_path, **{option: value}))


def test_rollouts_from_elsewhere_are_refused(checkpoint, tmp_path):
    with pytest.raises(UnsupportedTRLError, match="rollout_func"):
        trainer_for(InvariantGRPOTrainer, checkpoint, config(tmp_path), rollout_func=lambda prompts, trainer: {})


def test_unknown_trl_version_is_refused(checkpoint, tmp_path, monkeypatch):
    assert trl.__version__ in TESTED_TRL_VERSIONS  # the installed TRL is a tested one
    monkeypatch.setattr(trl, "__version__", "99.0.0")
    monkeypatch.delenv(ALLOW_UNTESTED_TRL_ENV, raising=False)
    expected = rf"tested with trl {TESTED_TRL_VERSIONS[0]}.*{ALLOW_UNTESTED_TRL_ENV}"
    with pytest.raises(UnsupportedTRLError, match=expected):
        trainer_for(InvariantGRPOTrainer, checkpoint, config(tmp_path))
    monkeypatch.setenv(ALLOW_UNTESTED_TRL_ENV, "1")
    check_trl_version()  # the explicit opt-in


@pytest.mark.heavy
def test_kl_to_a_reference_model(checkpoint, tmp_path):
    trainer = trainer_for(InvariantGRPOTrainer, checkpoint, config(tmp_path, beta=0.04, max_steps=1))
    assert trainer.ref_model is not None and is_invariant(trainer.ref_model)
    trainer.train()
    assert logged(trainer, METRIC) == [0.0]
    # Before the first optimizer step the policy has the reference's weights: TRL's KL is exactly 0.
    assert logged(trainer, "kl") == [0.0]
