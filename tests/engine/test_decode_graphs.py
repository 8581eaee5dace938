"""CUDA-graph decode (``invariant_infer.engine.decode_graphs``): a decode step replayed from its
bucket's captured forward gives every request the bits of the eager engine and of the request
alone, for dense, hybrid (Gated DeltaNet) and sliding-window models (and MoE on a GPU), with requests joining and
leaving (buckets 1, 2 and 4 as they fit) and a preemption.

On CPU the capture is ``rerun_capture``: a replay runs the closure captured at the bucket's first
step again, over the objects it captured, as a graph replays its kernels over the captured
addresses; anything a later step set outside the runner's persistent buffers would be stale there
and change the bits. Negative control: a capture that keeps its first output (what a graph that
read no persistent buffer would replay) fails the same checks. On a GPU (``gpu``-marked), the
engine captures real graphs by default and the same checks hold against ``cuda_graphs=False``.
Comparisons are exact (==, torch.equal)."""
from __future__ import annotations

import time

import pytest
import torch

from helpers.engine_runs import run_schedule
from helpers.models import load_model
from invariant_infer import make_invariant
from invariant_infer.engine import Engine, SamplingParams
from invariant_infer.engine.decode_graphs import DecodeGraphs, default_decode_buckets, rerun_capture
from invariant_infer.errors import InvalidArgumentError
from invariant_infer.testing.random_checkpoints import random_config, save_random_checkpoint

NEW_TOKENS = 5
BUCKETS = (1, 2, 4)


def prompts_for(vocab: int, lengths, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lengths]


def params_for(i: int) -> SamplingParams:
    if i % 2 == 0:
        return SamplingParams(max_tokens=NEW_TOKENS, logprobs=2, ignore_eos=True)
    return SamplingParams(max_tokens=NEW_TOKENS, temperature=0.8, top_k=40, seed=100 + i, logprobs=2,
                          ignore_eos=True)


def results(outputs: dict) -> list:
    return [(o.token_ids, o.logprobs, o.top_logprobs) for _, o in sorted(outputs.items())]


def replayed_run(model, prompts, capture=rerun_capture, **engine_options):
    """Three requests, the third arriving mid-decode and the latest preempted once, so that decode
    steps of 1, 2 and 4 rows replay their buckets' captures; returns (outputs, the runner's graphs)."""
    engine = Engine(model, max_num_seqs=4, max_num_batched_tokens=64, decode_buckets=BUCKETS, **engine_options)
    runner = engine.core.runner
    if capture is not None:
        runner.decode_graphs = DecodeGraphs(capture)
    outputs = run_schedule(engine, prompts, params_for, arrivals=(0, 0, 3), preempt_at=(5,))
    assert engine.core.scheduler.num_preemptions > 0
    return outputs, runner.decode_graphs


def eager_and_alone(model, prompts, **engine_options) -> tuple[list, list]:
    eager = run_schedule(Engine(model, max_num_seqs=4, max_num_batched_tokens=64, **engine_options), prompts,
                         params_for, arrivals=(0, 0, 3), preempt_at=(5,))
    alone = {i: Engine(model, **engine_options).generate([p], params_for(i))[0] for i, p in enumerate(prompts)}
    return results(eager), results(alone)


@pytest.fixture(scope="module")
def models(family_checkpoints, tmp_path_factory):
    cache = {}

    def get(family):
        if family not in cache:
            if family == "mistral_windowed":  # a window of one page (64 keys on CPU) on every layer
                config = random_config("mistral", "tiny", sliding_window=64, max_position_embeddings=512)
                path = save_random_checkpoint(tmp_path_factory.mktemp("windowed"), config)
            else:
                path = family_checkpoints(family)
            cache[family] = make_invariant(load_model(path, torch.float32))
        return cache[family]
    return get


LENGTHS = {"qwen2": (9, 3, 14), "qwen3_moe": (9, 3, 14), "qwen3_5_text": (66, 3, 20),
           "mistral_windowed": (150, 3, 70)}
# On CPU: the dense, hybrid and windowed forwards (the MoE one holds no step state of its own; it
# replays on a GPU below).
CPU_FAMILIES = ["qwen2", "qwen3_5_text", "mistral_windowed"]


@pytest.fixture(scope="module")
def references(models):
    """family -> (model, prompts, the eager engine's results, each request alone's)."""
    cache = {}

    def get(family):
        if family not in cache:
            model = models(family)
            prompts = prompts_for(model.config.vocab_size, LENGTHS[family], seed=3)
            cache[family] = (model, prompts, *eager_and_alone(model, prompts))
        return cache[family]
    return get


@pytest.mark.fast_cells(ids=["qwen2"])
@pytest.mark.parametrize("family", CPU_FAMILIES)
def test_replayed_decode_equals_eager_and_alone(references, family):
    model, prompts, eager, alone = references(family)
    replayed, graphs = replayed_run(model, prompts)
    assert len(graphs.buckets) >= 2 and graphs.num_replays > len(graphs.buckets)
    assert results(replayed) == eager == alone


def test_negative_control_a_replay_that_reads_no_buffer_changes_the_results(references):
    """A capture that replays its first output (the padding step it warmed up on) whatever the
    buffers hold: the replayed steps' tokens and logprobs differ from the eager engine's."""
    model, prompts, eager, _ = references("qwen2")

    def keep_first_output(forward):
        out = forward().clone()
        return lambda: out
    replayed, _ = replayed_run(model, prompts, capture=keep_first_output)
    assert results(replayed) != eager


def test_a_capture_that_fails_turns_graphs_off_with_the_same_bits(references):
    model, prompts, eager, _ = references("qwen2")

    def failing(forward):
        raise RuntimeError("capture refused")
    with pytest.warns(UserWarning, match="CUDA graphs turned off: capturing the decode bucket .* capture refused"):
        replayed, graphs = replayed_run(model, prompts, capture=failing)
    assert graphs is None and results(replayed) == eager


def test_graphs_are_off_on_cpu_and_refused_by_name(models):
    model = models("qwen2")
    engine = Engine(model, max_num_seqs=4)
    assert engine.core.cuda_graphs is False and engine.core.runner.decode_graphs is None
    assert engine.core.runner.decode_buckets == []  # no padding without graphs unless asked
    with pytest.raises(InvalidArgumentError, match="cuda_graphs=True: CUDA graphs need a CUDA device"):
        Engine(model, cuda_graphs=True)


def test_default_buckets_follow_vllm_capture_sizes():
    assert default_decode_buckets(1) == (1,)
    assert default_decode_buckets(3) == (1, 2, 3)
    assert default_decode_buckets(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert default_decode_buckets(20) == (1, 2, 4, 8, 16, 20)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen2", "qwen3_moe", "qwen3_5_text", "mistral_windowed"])
def test_cuda_graph_decode_equals_eager_on_cuda(family_checkpoints, tmp_path, family):
    """Real graphs (the engine's default on CUDA) against the same engine eager and each request alone,
    in bf16; then the host time of a replayed decode step beside an eager one (reported, not asserted)."""
    if family == "mistral_windowed":
        config = random_config("mistral", "tiny", sliding_window=64, max_position_embeddings=512)
        path = save_random_checkpoint(tmp_path, config)
    else:
        path = family_checkpoints(family)
    model = make_invariant(load_model(path, torch.bfloat16, "cuda"))
    prompts = prompts_for(model.config.vocab_size, LENGTHS[family], seed=3)
    replayed, graphs = replayed_run(model, prompts, capture=None)
    assert graphs is not None and len(graphs.buckets) >= 2
    eager, alone = eager_and_alone(model, prompts, cuda_graphs=False)
    assert results(replayed) == eager == alone
    step_us = {}
    for graphs_on in (True, False):
        engine = Engine(model, max_num_seqs=4, decode_buckets=BUCKETS, cuda_graphs=graphs_on)
        for prompt in prompts:
            engine.add_request(prompt, SamplingParams(max_tokens=40, ignore_eos=True))
        for _ in range(8):  # prefill, then decode steps that capture the bucket
            engine.step()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(20):
            engine.step()
        torch.cuda.synchronize()
        step_us[graphs_on] = (time.perf_counter() - start) / 20 * 1e6
    print(f"decode step of 3 sequences ({family}): {step_us[True]:.0f} us with graphs, {step_us[False]:.0f} us eager")
