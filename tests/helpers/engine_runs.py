"""Engine runs the engine and training tests share: a schedule of arrivals and preemptions, and the
trainer's completion logprobs computed in micro-batches."""
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
            engine.scheduler.preempt_latest()
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
