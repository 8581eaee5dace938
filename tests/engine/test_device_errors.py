"""Out of memory and device errors are no one request's fault: the engine and scoring end the step
with a ``DeviceError`` naming the failure, and retry nothing request by request or row by row.
An ordinary exception is still retried alone, so that only its request fails (the control)."""
from __future__ import annotations

import pytest
import torch

import invariant_infer.engine.sampler as sampler_module
from helpers.models import load_model
from invariant_infer import make_invariant
from invariant_infer.engine import Engine, SamplingParams
from invariant_infer.errors import DeviceError
from invariant_infer.scoring.core import score_group

DEVICE_FAILURES = [
    pytest.param(lambda: torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
                 "out of memory", id="torch.OutOfMemoryError"),
    pytest.param(lambda: torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
                 "out of memory", id="torch.cuda.OutOfMemoryError"),
    pytest.param(lambda: RuntimeError("CUDA error: device-side assert triggered"), "device error",
                 id="device-side-assert"),
    pytest.param(lambda: RuntimeError("CUDA error: an illegal memory access was encountered"), "device error",
                 id="cuda-error"),
]
if hasattr(torch, "AcceleratorError"):
    DEVICE_FAILURES.append(pytest.param(lambda: torch.AcceleratorError("CUDA error: unspecified launch failure"),
                                        "device error", id="torch.AcceleratorError"))


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return make_invariant(load_model(tiny_checkpoint, torch.float32))


def failing_forward(model, monkeypatch, make_error):
    """Make the base model's forward raise ``make_error()``; returns the list of its calls."""
    calls = []

    def forward(*args, **kwargs):
        calls.append(kwargs.get("input_ids", args[0] if args else None).shape)
        raise make_error()
    monkeypatch.setattr(model.model, "forward", forward)
    return calls


PROMPTS = [[3, 4, 5, 6], [7, 8, 9], [10, 11, 12, 13, 14]]


@pytest.mark.parametrize("make_error,kind", DEVICE_FAILURES)
def test_engine_step_ends_on_a_device_failure_without_retrying_each_request(model, monkeypatch, make_error, kind):
    engine = Engine(model)
    for prompt in PROMPTS:
        engine.add_request(prompt, SamplingParams(max_tokens=2))
    calls = failing_forward(model, monkeypatch, make_error)
    with pytest.raises(DeviceError, match=f"{kind}.*{type(make_error()).__name__}") as raised:
        engine.step()
    assert len(calls) == 1  # the whole step's forward only: no request ran alone
    assert type(raised.value.__cause__) is type(make_error())


@pytest.mark.parametrize("make_error,kind", DEVICE_FAILURES)
def test_engine_sampling_device_failure_is_not_one_requests_error(model, monkeypatch, make_error, kind):
    def sample(*args, **kwargs):
        raise make_error()
    monkeypatch.setattr(sampler_module, "seeded_scores_rows", sample)
    engine = Engine(model)
    engine.add_request(PROMPTS[0], SamplingParams(max_tokens=2, temperature=1.0, seed=1))
    with pytest.raises(DeviceError, match=kind):
        engine.step()


def test_control_an_ordinary_error_is_retried_request_by_request(model, monkeypatch):
    engine = Engine(model)
    ids = [engine.add_request(prompt, SamplingParams(max_tokens=2)) for prompt in PROMPTS]
    calls = failing_forward(model, monkeypatch, lambda: RuntimeError("a bad request"))
    outputs = {out.request_id: out for out in engine.step()}
    assert len(calls) == 1 + len(PROMPTS)  # the step, then each request alone
    assert all(outputs[i].finish_reason == "error" and "a bad request" in outputs[i].error for i in ids)


@pytest.mark.parametrize("make_error,kind", DEVICE_FAILURES)
def test_score_group_raises_a_device_failure_without_retrying_each_row(model, monkeypatch, make_error, kind):
    calls = failing_forward(model, monkeypatch, make_error)
    with pytest.raises(DeviceError, match=f"{kind}.*{type(make_error()).__name__}"):
        score_group(model, PROMPTS, [1] * len(PROMPTS))
    assert len(calls) == 1


def test_control_score_group_retries_an_ordinary_error_row_by_row(model, monkeypatch):
    calls = failing_forward(model, monkeypatch, lambda: RuntimeError("a bad row"))
    results = score_group(model, PROMPTS, [1] * len(PROMPTS))
    assert len(calls) == 1 + len(PROMPTS)
    assert all(isinstance(r, str) and "a bad row" in r for r in results)
