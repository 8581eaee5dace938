"""TRL's GRPO with the sampler and the trainer agreeing to the bit.

    from invariant_infer.training.integrations.trl import InvariantGRPOTrainer
    trainer = InvariantGRPOTrainer(model=model, reward_funcs=reward, args=GRPOConfig(..., bf16=False),
                                   train_dataset=dataset, processing_class=tokenizer)
    trainer.train()   # logs sampling/sampling_logp_difference/max == 0.0 at every step

``InvariantGRPOTrainer`` takes ``GRPOTrainer``'s arguments. It patches the model with ``make_invariant``,
samples the rollouts with the continuous-batching ``Engine`` running on that very model (no copy: the
optimizer's in-place updates are what it samples from; its prefix cache is reset before each
generation), hands the engine's logprobs of the sampled tokens (``logprobs_mode="processed_logprobs"``
at ``args.temperature``) to TRL as the rollout logprobs, and computes every training logprob with
``invariant_infer.training.logprobs.token_logprobs``. TRL compares rollout and training logprobs only on its
vLLM path, so the trainer takes that path with the engine in vLLM's place (anything that would reach
vLLM raises instead): the comparison, the importance-sampling ratio (exactly 1) and the logged
``sampling/*`` metrics are TRL's own code, unmodified.

A vision-language model (Qwen2.5-VL, Qwen3-VL) takes its processor as ``processing_class`` and a frozen vision
tower: the engine processes each rollout's images alone, and the training logprobs take TRL's pixel values.

With a ``peft_config`` (LoRA), TRL wraps the model in a ``PeftModel`` and the engine runs the model
inside it with the adapter unmerged (``invariant_infer.model.lora``): the optimizer updates only the
adapter, in place, and the next rollouts read it there; nothing is merged or copied.

A reward model in ``reward_funcs`` (a ``...ForSequenceClassification`` of a decoder family or an encoder
family, or its id / path, which TRL loads first) is patched with ``make_invariant`` too: TRL scores the
generation batch in one forward (right-padded, the reward read at the last token that is not the pad
token, ``logits[:, 0]``), and each completion gets the bits it gets scored alone. A reward model
``make_invariant`` cannot patch is refused by name.
"""
from __future__ import annotations

import inspect
import os
from contextlib import contextmanager

import numpy as np
import torch
import trl
from trl import GRPOConfig, GRPOTrainer

from ...engine import Engine, SamplingParams
from ...errors import (InternalError, RequestFailedError, UnsupportedModelError, UnsupportedOperationError,
                       UnsupportedTRLError)
from ...model.kinds import model_kinds
from ...model.lora import unwrap_peft
from ...model.patch import make_invariant, restore
from ...model.support import require
from ..logprobs import scored_positions, token_logprobs

# TRL versions whose GRPOTrainer internals this subclass was tested against (it overrides
# ``_generate_single_turn`` and ``_get_per_token_logps_and_entropies`` and relies on the vLLM branch
# of ``_generate_and_score_completions``).
TESTED_TRL_VERSIONS = ("1.16.0",)
ALLOW_UNTESTED_TRL_ENV = "INVARIANT_INFER_ALLOW_UNTESTED_TRL"


def check_trl_version(version: str | None = None) -> None:
    """Raise ``UnsupportedTRLError`` unless ``version`` (default: the installed TRL) is one of
    ``TESTED_TRL_VERSIONS`` or ``INVARIANT_INFER_ALLOW_UNTESTED_TRL=1`` is set."""
    version = trl.__version__ if version is None else version
    if version in TESTED_TRL_VERSIONS or os.environ.get(ALLOW_UNTESTED_TRL_ENV) == "1":
        return
    raise UnsupportedTRLError(
        f"InvariantGRPOTrainer is tested with trl {', '.join(TESTED_TRL_VERSIONS)}; trl {version} is installed. "
        f"Install a tested version (pip install 'trl=={TESTED_TRL_VERSIONS[-1]}'), or set "
        f"{ALLOW_UNTESTED_TRL_ENV}=1 to run on an untested one and check that "
        "sampling/sampling_logp_difference/max stays 0.0.")


def unsupported_options(args: GRPOConfig, *, peft_config=None, tools=None, rollout_func=None,
                        environment_factory=None, **_) -> list[str]:
    """Why the integration cannot run with these ``GRPOTrainer`` arguments (empty: it can)."""
    problems = []

    def refuse(condition: bool, message: str) -> None:
        if condition:
            problems.append(message)

    rollout_only = "the engine's processed logprobs are those of softmax(logits / temperature), with no other filter"
    refuse(args.use_vllm, "use_vllm=True: the invariant engine generates the rollouts in vLLM's place; "
           "set use_vllm=False")
    refuse(args.use_transformers_continuous_batching,
           "use_transformers_continuous_batching=True: the invariant engine generates the rollouts")
    refuse(args.top_p != 1.0, f"top_p={args.top_p}: {rollout_only} (use top_p=1.0)")
    refuse(bool(args.top_k), f"top_k={args.top_k}: {rollout_only} (use top_k=0)")
    refuse(bool(args.min_p), f"min_p={args.min_p}: {rollout_only} (use min_p=None)")
    refuse(args.repetition_penalty != 1.0, f"repetition_penalty={args.repetition_penalty}: {rollout_only}")
    refuse(not args.temperature > 0, f"temperature={args.temperature}: GRPO samples, the temperature must be > 0")
    refuse(args.generation_kwargs is not None, "generation_kwargs: they configure transformers/vLLM generation, "
           "which the engine replaces")
    refuse(args.use_liger_kernel, "use_liger_kernel=True: Liger's kernels replace the invariant ones")
    refuse(args.cast_lm_head_to_fp32, "cast_lm_head_to_fp32=True: the lm_head runs on the invariant kernel in the "
           "model's dtype, as the engine runs it")
    refuse(not args.vllm_importance_sampling_correction, "vllm_importance_sampling_correction=False: it is TRL's "
           "comparison of rollout and training logprobs (with them equal the ratio is exactly 1)")
    refuse(args.loss_type == "vespo" and args.vllm_importance_sampling_mode not in ("token_truncate", "token_mask"),
           "loss_type='vespo' needs vllm_importance_sampling_mode 'token_truncate' or 'token_mask'")
    refuse(args.entropy_coef != 0.0 or args.use_adaptive_entropy, "an entropy bonus (entropy_coef, "
           "use_adaptive_entropy): entropies are reported as a metric, without gradient")
    refuse(args.top_entropy_quantile < 1.0, "top_entropy_quantile < 1: entropies are a metric here, not a mask")
    refuse(bool(args.deepspeed) or bool(args.fsdp), "DeepSpeed / FSDP: the engine samples from the unsharded model")
    refuse(args.world_size > 1, f"{args.world_size} processes: the integration is tested in one process")
    tuner = getattr(getattr(peft_config, "peft_type", None), "value", None)
    refuse(peft_config is not None and tuner != "LORA", f"peft_config: a PEFT {tuner} adapter (LoRA only)")
    refuse(bool(getattr(peft_config, "lora_dropout", 0.0)), "peft_config.lora_dropout > 0: its random mask is "
           "drawn for the whole batch (use lora_dropout=0.0)")
    for name, value in (("tools", tools), ("rollout_func", rollout_func), ("environment_factory", environment_factory)):
        refuse(bool(value), f"{name}: rollouts come from the engine alone")
    return problems


def check_trainable(model) -> None:
    """Refuse, by the support table, a model GRPO does not train: its kinds, or a vision tower that
    requires grad."""
    require(model_kinds(model), "trl", getattr(unwrap_peft(model).config, "model_type", None))
    tower = getattr(getattr(unwrap_peft(model), "model", None), "visual", None)
    if tower is not None and any(p.requires_grad for p in tower.parameters()):
        require("trainable_vision_tower", "trl")


def make_reward_models_invariant(reward_funcs: list, names: list[str]) -> None:
    """``make_invariant`` on every model among ``reward_funcs`` (TRL has loaded the ids and paths by now); a
    model it cannot patch is refused with its index and name (``UnsupportedModelError``), the models patched
    before it restored."""
    patched = []
    for index, (reward, name) in enumerate(zip(reward_funcs, names)):
        if not isinstance(reward, torch.nn.Module):  # a Python function: its own business
            continue
        try:
            make_invariant(reward)
        except UnsupportedModelError as error:
            for model in patched:
                restore(model)
            raise UnsupportedModelError(
                f"reward_funcs[{index}] ({name}, {type(reward).__name__}): InvariantGRPOTrainer scores with "
                f"reward models make_invariant patches; {error}") from error
        patched.append(reward)


class _NoVLLM:
    """Stands where TRL keeps its vLLM client: the trainer takes TRL's vLLM branch for the comparison of
    logprobs, and anything that would then call vLLM fails loudly instead."""

    def __getattr__(self, name):
        if name.startswith("__"):  # copy / pickle probes: plainly absent
            raise AttributeError(name)
        raise UnsupportedOperationError("InvariantGRPOTrainer samples with the invariant engine; TRL tried to use "
                                        f"vLLM (vllm_generation.{name}), which this TRL version must not do (see "
                                        "TESTED_TRL_VERSIONS)")


class _ImageRows:
    """The images of a batch's rows as TRL hands them to the logprob pass (Qwen-VL's ``pixel_values`` over all
    images' patches, ``image_grid_thw`` and ``num_images`` per row), cut to a micro-batch. TRL's
    ``mm_token_type_ids`` are dropped: it builds them from the processor's padding, which lines up with the
    left-padded prompts only when the processor pads on the left; the model derives them from the image
    token instead, for any processor."""

    def __init__(self, rows: int, *, pixel_values=None, image_grid_thw=None, num_images=None, mm_token_type_ids=None,
                 **others):
        given = sorted(name for name, value in others.items() if value is not None)
        if given:
            raise UnsupportedTRLError(f"multimodal inputs {given}: the supported vision-language models are Qwen2.5-VL "
                                      "and Qwen3-VL, with images (pixel_values and image_grid_thw)")
        if (pixel_values is None) != (image_grid_thw is None):
            raise UnsupportedTRLError("pixel_values without image_grid_thw (or the reverse)")
        self.pixel_values, self.image_grid_thw = pixel_values, image_grid_thw
        images = [0] * rows if pixel_values is None else list(num_images)
        self.first_image = np.cumsum([0] + images).tolist()
        patches = [] if image_grid_thw is None else image_grid_thw.prod(-1).tolist()
        self.first_patch = np.cumsum([0] + patches).tolist()

    def rows(self, start: int, end: int) -> dict:
        end = min(end, len(self.first_image) - 1)
        first, last = self.first_image[start], self.first_image[end]
        if self.pixel_values is None or first == last:
            return {}
        return {"pixel_values": self.pixel_values[self.first_patch[first]:self.first_patch[last]],
                "image_grid_thw": self.image_grid_thw[first:last]}


class _EntropyProbe:
    """Entropies of softmax(logits / T) of the logits the lm_head produces inside one ``token_logprobs``
    call (a metric: no gradient), in the order the head sees its rows."""

    def __init__(self, head: torch.nn.Module, temperature: float):
        self.temperature, self.pieces = temperature, []
        self.handle = head.register_forward_hook(self._record)

    def _record(self, module, inputs, logits):
        with torch.no_grad():
            logp = torch.log_softmax(logits.detach().float() / self.temperature, dim=-1)
            self.pieces.append(-(logp.exp() * logp).sum(-1))

    def scatter(self, valid: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(valid.shape, dtype=torch.float32, device=valid.device)
        values = torch.cat(self.pieces).to(valid.device) if self.pieces else out.new_zeros(0)
        if values.numel() != int(valid.sum()):
            raise InternalError(f"the lm_head scored {values.numel()} rows, token_logprobs {int(valid.sum())}")
        return out.masked_scatter(valid, values)


@contextmanager
def _entropy_probe(head, temperature, enabled: bool):
    probe = _EntropyProbe(head, temperature) if enabled else None
    try:
        yield probe
    finally:
        if probe is not None:
            probe.handle.remove()  # before the backward recomputes the head under checkpointing


class InvariantGRPOTrainer(GRPOTrainer):
    """``trl.GRPOTrainer`` (same arguments) whose rollout logprobs and training logprobs are bitwise
    equal. ``engine_kwargs`` go to ``Engine``: ``max_num_seqs`` defaults to the generation batch and,
    on CUDA, ``kv_cache_memory`` to ``args.vllm_gpu_memory_utilization`` of the free memory when the
    engine starts (at the first generation). The model runs in its own dtype: mixed-precision autocast
    (``bf16=True`` on an fp32 model) does not apply to it, as it does not in the engine; load the model
    in the dtype to train in."""

    def __init__(self, *args, engine_kwargs: dict | None = None, **kwargs):
        check_trl_version()
        arguments = inspect.signature(GRPOTrainer.__init__).bind(self, *args, **kwargs).arguments
        if arguments.get("args") is None:
            raise UnsupportedTRLError("pass args=GRPOConfig(...): the integration checks its options")
        problems = unsupported_options(**{k: v for k, v in arguments.items() if k != "self"})
        if problems:
            raise UnsupportedTRLError("InvariantGRPOTrainer does not support: " + "; ".join(problems))
        super().__init__(*args, **kwargs)
        check_trainable(self.model)
        # The reward models first: a refused one leaves the caller's policy and reference models unpatched.
        # TRL scores all the generation batch's completions in one forward of each reward model.
        make_reward_models_invariant([self.accelerator.unwrap_model(r) if isinstance(r, torch.nn.Module) else r
                                      for r in self.reward_funcs], self.reward_func_names)
        make_invariant(self.model)
        if self.ref_model is not None:
            make_invariant(self.accelerator.unwrap_model(self.ref_model))
        # TRL compares rollout and training logprobs on its vLLM branch only: take it, with the engine
        # (``_generate_single_turn`` below) doing vLLM's part.
        self.use_vllm, self.vllm_mode = True, "invariant-engine"
        self.vllm_generation = _NoVLLM()
        self._engine_kwargs = dict(engine_kwargs or {})
        self._engine: Engine | None = None
        self._rollout_calls = 0

    # ---- rollouts ---------------------------------------------------------------------------------

    @property
    def engine(self) -> Engine:
        """The rollout engine, on ``self.model`` itself (built on first use; a ``PeftModel``'s inner model,
        its adapter unmerged)."""
        if self._engine is None:
            training = self.model.training
            kwargs = {"max_num_seqs": self.args.generation_batch_size, **self._engine_kwargs}
            if self.model.device.type == "cuda" and "kv_cache_memory" not in kwargs:
                # The share TRL gives a colocated vLLM, of the memory free before the optimizer allocates.
                free = torch.cuda.mem_get_info(self.model.device)[0]
                kwargs["kv_cache_memory"] = int(free * self.args.vllm_gpu_memory_utilization)
            # A vision-language model's processor: the engine processes each rollout's images alone with it.
            self._engine = Engine(unwrap_peft(self.model), self.processing_class if self._is_vlm else self._tokenizer,
                                  **kwargs)
            self.model.train(training)  # the engine puts the model in eval mode
        return self._engine

    def _rollout_seeds(self, count: int) -> list[int]:
        """One sampling seed per rollout, a function of (args.seed, process, step, call): a run replays."""
        entropy = [self.args.seed, self.accelerator.process_index, self.state.global_step, self._rollout_calls]
        self._rollout_calls += 1
        state = np.random.SeedSequence(entropy).generate_state(count, np.uint64)
        return [int(s) >> 1 for s in state]

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if has_tool_images:
            raise UnsupportedTRLError("images from tool responses: rollouts with images take the dataset's images")
        engine = self.engine
        engine.reset_prefix_cache()  # KV cached under the weights before the last optimizer step is stale
        params = [SamplingParams(max_tokens=self.max_completion_length, temperature=self.temperature, seed=seed,
                                 stop_token_ids=list(self.eos_token_ids), logprobs_mode="processed_logprobs")
                  for seed in self._rollout_seeds(len(prompt_ids))]
        # The processor expanded each image's tokens in prompt_ids; the engine takes them so, with the images.
        prompts = [list(ids) if not row_images else
                   {"prompt_token_ids": list(ids), "multi_modal_data": {"image": list(row_images)}}
                   for ids, row_images in zip(prompt_ids, images or [None] * len(prompt_ids))]
        with torch.no_grad():
            outputs = engine.generate(prompts, params)
        failed = [out for out in outputs if out.error]
        if failed:
            raise RequestFailedError(f"{len(failed)} rollouts failed, the first: {failed[0].error}")
        return [out.token_ids for out in outputs], [out.logprobs for out in outputs]

    # ---- training logprobs ------------------------------------------------------------------------

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **multimodal):
        """TRL's method on ``token_logprobs``: [B, logits_to_keep] logprobs of the completion tokens at
        ``args.temperature`` (0 at padding), chunked by ``batch_size`` as TRL chunks (the values do
        not depend on it), in the model's dtype with autocast off (the engine does not autocast)."""
        if compute_aux_loss:  # the MoE load-balancing loss
            require("moe", "trl")
        model = self.accelerator.unwrap_model(model)
        images = _ImageRows(input_ids.size(0), **multimodal)
        batch_size = batch_size or input_ids.size(0)
        logps, entropies = [], []
        for start in range(0, input_ids.size(0), batch_size):
            end = start + batch_size
            ids, mask = input_ids[start:end], attention_mask[start:end]
            with torch.autocast(ids.device.type, enabled=False), \
                    _entropy_probe(model.get_output_embeddings(), self.temperature, compute_entropy) as probe:
                logps.append(token_logprobs(model, ids, mask, temperature=self.temperature,
                                            **images.rows(start, end))[:, -logits_to_keep:])
            if probe is not None:
                entropies.append(probe.scatter(scored_positions(ids, mask, None))[:, -logits_to_keep:])
        return torch.cat(logps), (torch.cat(entropies) if compute_entropy else None), None
