"""``Engine`` holds an ``EngineCore`` (it does not subclass it) and ``AsyncEngine`` drives the same core
through the same ``Frontend``: both frontends build each request's output processor from that one object,
and nothing outside the core calls its private methods."""
from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest
import torch

import invariant_infer
from helpers.models import load_model
from invariant_infer.engine import AsyncEngine, Engine, SamplingParams
from invariant_infer.engine.core import EngineCore
from invariant_infer.engine.frontend import Frontend

ROOT = Path(invariant_infer.__file__).parent
PARAMS = SamplingParams(max_tokens=1, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    return Engine(load_model(tiny_checkpoint, torch.float32), max_num_seqs=2)


def test_engine_holds_a_core(engine):
    assert not issubclass(Engine, EngineCore) and isinstance(engine.core, EngineCore)
    assert type(engine.frontend) is Frontend and engine.frontend.core is engine.core
    # The core's values an engine shows are the core's own, read-only.
    assert (engine.model, engine.max_positions, engine.page_bytes) == (engine.core.model, engine.core.max_positions,
                                                                        engine.core.page_bytes)
    with pytest.raises(AttributeError):
        engine.max_positions = 1


def test_async_engine_shares_the_engine_frontend(engine, monkeypatch):
    """Each request's output processor comes from the one frontend, whichever front queued it."""
    made = []
    original = engine.frontend.output_processor
    monkeypatch.setattr(engine.frontend, "output_processor", lambda *args: made.append(args[0]) or original(*args))
    engine.generate([[5, 6, 7]], PARAMS)
    async_engine = AsyncEngine(engine)
    try:
        assert async_engine.core is engine.core and async_engine.frontend is engine.frontend

        async def run():
            return [out async for out in async_engine.generate([8, 9], PARAMS, request_id="async")]
        outputs = asyncio.run(run())
    finally:
        async_engine.shutdown()
    assert len(made) == 2 and made[1] == "async" and outputs[-1].finished


def test_no_module_reaches_into_the_core():
    """Outside ``engine/core.py``, the core is used through its public methods only."""
    private = re.compile(r"\b(?:core|engine)\._(?:add|finish|lora_fields|delta|forward|process|pick|append|"
                         r"release_draft|slots|arrivals)\b")
    sources = [p for p in (*ROOT.rglob("*.py"), *(ROOT.parent / "benchmarks").rglob("*.py"))
               if p != ROOT / "engine" / "core.py"]
    found = [f"{p.relative_to(ROOT.parent)}:{i}" for p in sources
             for i, line in enumerate(p.read_text().splitlines(), 1) if private.search(line)]
    assert not found, found
