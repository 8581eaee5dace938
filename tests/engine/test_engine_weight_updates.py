"""Weight updates reach the engine: after an in-place update (``add_``, an optimizer step,
``load_state_dict``, ``load_weights_from_disk``) and ``reset_prefix_cache()``, an engine's tokens and
logprobs equal, bitwise, those of an engine freshly built on a freshly loaded model holding the
new weights, and differ from the old ones; without the reset a prefix hit reuses stale KV (the
negative control). A checkpoint that does not fit is refused before anything is copied."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from helpers.models import DEVICES, load_model
from invariant_infer.engine import AsyncEngine, Engine, EngineBusyError, SamplingParams
from invariant_infer.testing.random_checkpoints import qwen2_config, random_model
from invariant_infer.training.weight_update import CheckpointError, load_weights_from_disk

PARAMS = SamplingParams(max_tokens=3, logprobs=1, ignore_eos=True)


@pytest.fixture()
def checkpoint(family_checkpoints):
    return family_checkpoints("qwen2")


def fp32(path, device="cpu"):
    return load_model(path, torch.float32, device)


def prompt(length: int, seed: int = 0) -> list[int]:
    return torch.randint(1, 512, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def reference(path, state: dict, prompts) -> list:
    """What an engine built on a fresh model holding ``state`` gives (no prefix cache)."""
    model = fp32(path)
    model.load_state_dict(state)
    return Engine(model, enable_prefix_caching=False).generate(prompts, PARAMS)


def same(a, b) -> bool:
    return (a.token_ids, a.logprobs, a.top_logprobs) == (b.token_ids, b.logprobs, b.top_logprobs)


def add_delta(model) -> None:
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=g) * 1e-2)


def optimizer_step(model) -> None:
    g = torch.Generator().manual_seed(2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for param in model.parameters():
        param.grad = torch.randn(param.shape, generator=g)
    optimizer.step()


def load_other_state(model) -> None:
    model.load_state_dict(random_model(model.config, seed=9).state_dict())


@pytest.mark.fast_cells(1)
@pytest.mark.parametrize("update", [add_delta, optimizer_step, load_other_state])
def test_in_place_update_reaches_the_engine(checkpoint, update):
    model = fp32(checkpoint)
    engine = Engine(model)
    prompts = [prompt(9), prompt(4, seed=1)]
    before = engine.generate(prompts, PARAMS)
    update(model)
    engine.reset_prefix_cache()
    after = engine.generate(prompts, PARAMS)
    for a, b, old in zip(after, reference(checkpoint, model.state_dict(), prompts), before):
        assert same(a, b) and a.logprobs != old.logprobs


def test_reset_prefix_cache_drops_kv_of_the_old_weights(checkpoint):
    model = fp32(checkpoint)
    engine = Engine(model, max_num_batched_tokens=256)
    page = engine.core.blocks.page_size
    long = prompt(2 * page + 5, seed=3)
    old = engine.generate([long], PARAMS)[0]
    add_delta(model)
    truth = reference(checkpoint, model.state_dict(), [long])[0]
    assert old.logprobs != truth.logprobs

    hits = engine.core.blocks.prefix_hits
    stale = engine.generate([long], PARAMS)[0]        # without the reset: two pages of old KV
    assert engine.core.blocks.prefix_hits - hits == 2 * page and not same(stale, truth)

    assert engine.reset_prefix_cache() >= 2
    hits = engine.core.blocks.prefix_hits
    fresh = engine.generate([long], PARAMS)[0]
    assert engine.core.blocks.prefix_hits == hits and same(fresh, truth)
    cached = engine.generate([long], PARAMS)[0]      # the cache fills again, under the new weights
    assert engine.core.blocks.prefix_hits - hits == 2 * page and same(cached, truth)


def test_reset_prefix_cache_refuses_a_busy_engine(checkpoint):
    engine = Engine(fp32(checkpoint))
    engine.generate([prompt(2 * engine.core.blocks.page_size + 1)], PARAMS)
    cached = dict(engine.core.blocks.page_of_hash)
    rid = engine.add_request(prompt(5), PARAMS)
    with pytest.raises(EngineBusyError, match="idle engine; 0 requests are running and 1 waiting"):
        engine.reset_prefix_cache()
    engine.step()
    with pytest.raises(EngineBusyError, match="1 requests are running"):
        engine.reset_prefix_cache()
    assert engine.core.blocks.page_of_hash == cached  # nothing dropped
    engine.abort(rid)
    assert engine.reset_prefix_cache() == 2 and not engine.core.blocks.page_of_hash


def test_async_engine_update_weights_runs_between_steps_and_resets(checkpoint):
    model = fp32(checkpoint)
    async_engine = AsyncEngine(Engine(model))
    try:
        engine = async_engine.engine
        with async_engine._lock:  # queued without waking the engine thread: it stays in flight
            rid = engine.add_request(prompt(5), PARAMS)
        with pytest.raises(EngineBusyError, match="1 requests"):
            async_engine.update_weights(add_delta)
        assert engine.has_unfinished()
        with async_engine._lock:
            engine.abort(rid)
        engine.generate([prompt(engine.core.blocks.page_size + 1)], PARAMS)
        assert engine.core.blocks.page_of_hash
        snapshot = {k: v.clone() for k, v in model.state_dict().items()}

        def failing(model):
            add_delta(model)
            raise RuntimeError("stopped halfway")
        with pytest.raises(RuntimeError, match="halfway"):
            async_engine.update_weights(failing)
        assert not engine.core.blocks.page_of_hash  # reset also after a failed update
        assert any(not torch.equal(v, snapshot[k]) for k, v in model.state_dict().items())
    finally:
        async_engine.shutdown()


# ---- load_weights_from_disk ---------------------------------------------------------------------------


def assert_state_equal(model, other) -> None:
    a, b = model.state_dict(), other.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.heavy
@pytest.mark.parametrize("device", DEVICES)
def test_load_weights_from_disk_sharded_and_cast(checkpoint, tmp_path, device):
    """A sharded bf16 checkpoint into an fp32 model: bitwise what from_pretrained(dtype=fp32) loads,
    and the engine on it equals an engine on that model."""
    new = random_model(qwen2_config("tiny"), seed=4).to(torch.bfloat16)
    new.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(set(json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"].values())) > 1
    model = fp32(checkpoint, device)
    engine = Engine(model)
    before = engine.generate([prompt(6)], PARAMS)[0]
    assert load_weights_from_disk(model, tmp_path) == len(model.state_dict())
    engine.reset_prefix_cache()
    loaded = fp32(tmp_path, device)
    assert_state_equal(model, loaded)
    after = engine.generate([prompt(6)], PARAMS)[0]
    assert same(after, Engine(loaded).generate([prompt(6)], PARAMS)[0]) and after.logprobs != before.logprobs


def test_tied_checkpoint_loads_into_a_tied_model(tied_checkpoint, tmp_path):
    config = qwen2_config("tiny", tie_word_embeddings=True, num_hidden_layers=1)
    random_model(config, seed=7).save_pretrained(tmp_path)
    model = fp32(tied_checkpoint)
    load_weights_from_disk(model, tmp_path)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert_state_equal(model, fp32(tmp_path))


def write(folder, tensors) -> str:
    folder.mkdir()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return str(folder)


def bad_checkpoints(checkpoint, root) -> list[tuple[str, str]]:
    """(path, what the error names): other weights than the checkpoint's, with a faulty tensor that
    sorts last, after every tensor a copy that did not check first would already have written."""
    tensors = {k: v.clone() for k, v in random_model(fp32(checkpoint).config, seed=9).state_dict().items()}
    last = "model.layers.1.mlp.down_proj.weight"
    wrong_shape = dict(tensors, **{last: tensors[last][:, :-1].contiguous()})
    missing = {k: v for k, v in tensors.items() if k != last}
    extra = dict(tensors, **{"model.layers.2.mlp.down_proj.weight": tensors[last].clone()})
    integer = dict(tensors, **{last: tensors[last].to(torch.int32)})
    (root / "pickle").mkdir()
    (root / "pickle" / "pytorch_model.bin").write_bytes(b"")
    (root / "corrupt").mkdir()
    (root / "corrupt" / "model.safetensors").write_bytes(b"\x08" + b"\x00" * 7 + b"garbage!")
    (root / "index").mkdir()
    (root / "index" / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: "model-00001-of-00002.safetensors" for k in tensors}}))
    return [
        (str(root / "nowhere"), "does not exist"),
        (str(checkpoint / "config.json"), "is not a directory"),
        (str(root / "pickle"), "no model.safetensors or model.safetensors.index.json"),
        (str(root / "corrupt"), "cannot read"),
        (str(root / "index"), "model-00001-of-00002.safetensors is missing"),
        (write(root / "shape", wrong_shape), rf"wrong shapes: {last} \[64, 159\] \(the model's is \[64, 160\]\)"),
        (write(root / "missing", missing), f"missing tensors: {last}"),
        (write(root / "extra", extra), "unexpected tensors: model.layers.2.mlp.down_proj.weight"),
        (write(root / "integer", integer), f"dtypes that cannot be cast: {last} torch.int32"),
    ]


def test_bad_checkpoints_are_refused_before_any_copy(checkpoint, tmp_path):
    model = fp32(checkpoint)
    snapshot = {k: v.clone() for k, v in model.state_dict().items()}
    for path, message in bad_checkpoints(checkpoint, tmp_path):
        with pytest.raises(CheckpointError, match=message):
            load_weights_from_disk(model, path)
        assert all(torch.equal(v, snapshot[k]) for k, v in model.state_dict().items()), path


def test_negative_control_a_copy_without_the_check_changes_weights(checkpoint, tmp_path):
    """The wrong-shape checkpoint copied tensor by tensor, unchecked: the tensors before the bad
    one are written when it raises, so the test above would see a changed model."""
    model = fp32(checkpoint)
    snapshot = {k: v.clone() for k, v in model.state_dict().items()}
    path, _ = bad_checkpoints(checkpoint, tmp_path)[5]
    entries = model.state_dict(keep_vars=True)
    with safe_open(f"{path}/model.safetensors", framework="pt") as handle, torch.no_grad():
        with pytest.raises(RuntimeError):
            for name in sorted(handle.keys()):
                entries[name].copy_(handle.get_tensor(name))
    assert any(not torch.equal(v, snapshot[k]) for k, v in model.state_dict().items())
