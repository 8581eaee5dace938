"""The asyncio front of the engine: the event loop keeps running while the engine holds its lock
(a step in progress), outputs equal the engine's own, and leaving a stream early frees its pages."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from helpers.models import load_model
from invariant_infer.engine import AsyncEngine, Engine, SamplingParams

PROMPT = [5, 9, 3, 7, 11, 2]
PARAMS = SamplingParams(max_tokens=3, logprobs=1, ignore_eos=True)


@pytest.fixture(scope="module")
def async_engine(tiny_checkpoint):
    import torch
    engine = AsyncEngine(Engine(load_model(tiny_checkpoint, torch.float32), max_num_seqs=4))
    yield engine
    engine.shutdown()


async def collect(async_engine, prompt, params):
    return [out async for out in async_engine.generate(prompt, params)][-1]


def test_event_loop_runs_while_a_step_holds_the_engine_lock(async_engine):
    """A step holds the engine's lock for as long as it runs (seconds on CPU). Adding a request
    must wait for it off the event loop, or every other connection stalls meanwhile."""
    held = threading.Event()

    def hold_lock(seconds: float):
        with async_engine._lock:
            held.set()
            time.sleep(seconds)

    async def main():
        holder = threading.Thread(target=hold_lock, args=(1.0,))
        holder.start()
        held.wait()
        ticks_while_held = 0
        request = asyncio.create_task(collect(async_engine, PROMPT, PARAMS))
        while holder.is_alive():
            await asyncio.sleep(0.01)
            ticks_while_held += holder.is_alive()
        holder.join()
        return ticks_while_held, await request

    ticks, out = asyncio.run(main())
    assert ticks > 10, "the event loop was blocked while the engine's lock was held"
    assert out.finished and len(out.token_ids) == PARAMS.max_tokens


def test_outputs_equal_the_engine_alone_and_leaving_early_frees_pages(async_engine, tiny_checkpoint):
    import torch
    reference = Engine(load_model(tiny_checkpoint, torch.float32), max_num_seqs=4)
    rid = reference.add_request(PROMPT, PARAMS)
    expected = None
    while reference.has_unfinished():
        for out in reference.step():
            if out.request_id == rid and out.finished:
                expected = out

    async def main():
        long = SamplingParams(max_tokens=50, ignore_eos=True)
        stream = async_engine.generate(PROMPT * 3, long)
        await anext(stream)          # one output, then the client goes away
        await stream.aclose()
        return await collect(async_engine, PROMPT, PARAMS)

    got = asyncio.run(main())
    assert got.token_ids == expected.token_ids and got.logprobs == expected.logprobs
    deadline = time.monotonic() + 60
    while async_engine.stats()["kv_pages_used"] or async_engine.stats()["running"]:
        assert time.monotonic() < deadline, f"pages still held: {async_engine.stats()}"
        time.sleep(0.05)
