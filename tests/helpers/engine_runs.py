"""Engine runs the engine and training tests share: a schedule of arrivals and preemptions, the
trainer's completion logprobs computed in micro-batches, and a two-step TRL GRPO run."""
from __future__ import annotations

from invariant_infer import pad_sequences
from invariant_infer.training.logprobs import token_logprobs


def run_schedule(engine, prompts, params_for, arrivals, preempt_at=()) -> dict[int, object]:
    """Add prompt i (with ``params_for(i)``) at step arrivals[i]; preempt the latest sequence before
    the steps in ``preempt_at``. Returns each prompt's finished output by index."""
    outputs, step, ids = {}, 0, {}
    while len(outputs) < len(prompts):
        for i, arrival in enumerate(arrivals):
            if arrival == step:
                ids[engine.add_request(prompts[i], params_for(i))] = i
        if step in preempt_at:
            engine.core.scheduler.preempt_latest()
        for out in engine.step():
            if out.finished:
                outputs[ids[out.request_id]] = out
        step += 1
        assert step < 500, "the engine stopped making progress"
    return outputs


def trainer_logprobs(model, sequences, prompt_lengths, micro_batch: int, side: str, temperature: float):
    """Completion-token logprobs per sequence, from ``token_logprobs`` in micro-batches of
    ``micro_batch`` rows padded on ``side``."""
    found = []
    for first in range(0, len(sequences), micro_batch):
        chunk = sequences[first:first + micro_batch]
        ids, mask = pad_sequences(chunk, side=side, width=max(map(len, chunk)) + 1)
        logps = token_logprobs(model, ids, mask, temperature=temperature)
        for row, seq in enumerate(chunk):
            start = int(mask[row].argmax())
            found.append(logps[row, start:start + len(seq) - 1])
    return [values[p - 1:].tolist() for values, p in zip(found, prompt_lengths)]


def grpo_run(model, checkpoint, output_dir, temperature: float):
    """Two TRL GRPO steps on ``model`` (CPU, 2 generations per prompt, its tokenizer at ``checkpoint``):
    (the logged max sampler-trainer logprob differences, whether every parameter changed)."""
    import torch  # noqa: PLC0415
    from datasets import Dataset  # noqa: PLC0415
    from transformers import PreTrainedTokenizerFast  # noqa: PLC0415
    from trl import GRPOConfig  # noqa: PLC0415

    from invariant_infer.training.integrations.trl import InvariantGRPOTrainer  # noqa: PLC0415

    words = "the a model token batch score sequence invariant logits prompt".split()
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": " ".join(words[i:i + 3])}] for i in range(8)]})
    args = GRPOConfig(output_dir=str(output_dir), use_cpu=True, bf16=False, num_generations=2,
                      per_device_train_batch_size=2, gradient_accumulation_steps=2, generation_batch_size=4,
                      max_completion_length=5, temperature=temperature, max_steps=2, learning_rate=3e-2,
                      logging_steps=1, report_to=[], save_strategy="no", seed=0)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    trainer = InvariantGRPOTrainer(model=model, args=args, train_dataset=dataset,
                                   reward_funcs=lambda completion_ids, **kw: [float(sum(ids) % 13) for ids in
                                                                              completion_ids],
                                   processing_class=PreTrainedTokenizerFast.from_pretrained(checkpoint))
    trainer.train()
    differences = [float(e["sampling/sampling_logp_difference/max"]) for e in trainer.state.log_history
                   if "sampling/sampling_logp_difference/max" in e]
    changed = all(not torch.equal(p, before[name]) for name, p in trainer.model.named_parameters())
    return differences, changed
