"""Tensor parallelism at the model level, on CPU with gloo: a model loaded with tp_plan="auto" under
torchrun and patched by make_invariant gives, at TP 2 and TP 4, the single-process patched
model's logits bitwise (every dense family, Gemma 3 with its sliding-window layer, and the dense
hybrid Qwen3.5, whose Gated DeltaNet projections transformers gathers; fp32/bf16/fp16, a
left-padded batch). Negative controls:
stock transformers at TP 2 against stock at TP 1, and the invariant model with the row-parallel
exchange replaced by an all-reduce of each rank's rounded sums (TP-dependent on any machine).
Refusals: TP sizes the heads or the K trees do not divide, a plan layout the trees do not serve,
a mixture-of-experts family (a hybrid one too);
restore gives back transformers' own TP forward.
Each TP size is one torchrun (tests/tp_worker.py) that runs every check of that size."""
from __future__ import annotations

import os
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import triton
from transformers import AutoModelForCausalLM

from helpers.models import FAMILY_NAMES, GEMMA_FAMILY_NAMES, HYBRID_FAMILY_NAMES
from helpers.servers import run_bounded
from tp_worker import HIDDEN_SHARDED_EMBEDDING
from invariant_infer.kernels.configs import row_parallel_config, tree_leaves
from invariant_infer.kernels.fused_linear import silu_mul_linear, silu_mul_linear_partials
from invariant_infer.kernels.linear import combine_partials, linear, linear_partials
from invariant_infer.model.families import FAMILIES
from invariant_infer.model.patch import make_invariant
from invariant_infer.testing.random_checkpoints import random_config, save_random_checkpoint
from invariant_infer.model.tensor_parallel import supported_tp_sizes, tp_size_refusal

WORKER = Path(__file__).resolve().parents[1] / "tp_worker.py"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# 8 query / 4 KV heads of 16, intermediate 256: o_proj's and down_proj's K trees have 8 leaves.
TP_SHAPE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=8, num_key_value_heads=4, head_dim=16)
REFUSED = {"kv2": dict(num_key_value_heads=2), "i160": dict(intermediate_size=160)}  # at TP 4
RUN_TIMEOUT = 300
TP_FAMILIES = FAMILY_NAMES + GEMMA_FAMILY_NAMES + [f for f in HYBRID_FAMILY_NAMES if FAMILIES[f].moe is None]

pytestmark = [pytest.mark.heavy, pytest.mark.file_minutes(1.2)]  # measured on 2 cores: start it early


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp-checkpoints")
    paths = {f: save_random_checkpoint(root / f, random_config(f, "tiny", **TP_SHAPE), seed=3) for f in TP_FAMILIES}
    paths["moe"] = save_random_checkpoint(root / "moe", random_config("qwen3_moe", "tiny"))
    paths["hybrid-moe"] = save_random_checkpoint(root / "hybrid-moe", random_config("qwen3_5_moe_text", "tiny"))
    for name, overrides in REFUSED.items():
        paths[name] = save_random_checkpoint(root / name, random_config("qwen2", "tiny", **{**TP_SHAPE, **overrides}))
    return paths


def torchrun(nproc: int, out: Path, args: list[str]) -> None:
    """One torchrun of the worker on 127.0.0.1 (ephemeral rendezvous port, gloo on loopback);
    the whole process group is killed if it outlives RUN_TIMEOUT or the test is interrupted."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", "127.0.0.1:0", "--nproc-per-node", str(nproc), str(WORKER), "--out", str(out), *args]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    run = run_bounded(command, RUN_TIMEOUT, env)
    assert run.returncode == 0, f"torchrun with {nproc} ranks failed:\n{(run.stdout + run.stderr)[-6000:]}"


def models(checkpoints) -> list[str]:
    return [arg for f in TP_FAMILIES for arg in ("--model", f"{f}={checkpoints[f]}")]


@pytest.fixture(scope="module")
def tp_runs(checkpoints, tmp_path_factory) -> dict[int, Path]:
    dtypes = [arg for d in DTYPES for arg in ("--dtype", d)]
    outs = {size: tmp_path_factory.mktemp(f"tp{size}") for size in (2, 4)}
    torchrun(2, outs[2], [*models(checkpoints), *dtypes, "--variant", "invariant", "--variant", "stock:fp32",
                          "--variant", "restored:fp32",
                          "--variant", "allreduce:bf16", "--refuse-plan", f"plan={checkpoints['qwen2']}",
                          "--refuse", f"moe={checkpoints['moe']}",
                          "--refuse", f"hybrid-moe={checkpoints['hybrid-moe']}"])
    torchrun(4, outs[4], [*models(checkpoints), *dtypes, "--variant", "invariant",
                          *[arg for name in REFUSED for arg in ("--refuse", f"{name}={checkpoints[name]}")]])
    return outs


@pytest.fixture(scope="module")
def single_process(checkpoints):
    """Logits of one process, cached: (family, dtype, patched) -> tensor."""
    sys.path.insert(0, str(WORKER.parent))
    from tp_worker import padded_batch  # the worker's batch, so both sides run the same rows
    cache = {}

    def get(family: str, dtype: str, patched: bool = True) -> torch.Tensor:
        key = (family, dtype, patched)
        if key not in cache:
            model = AutoModelForCausalLM.from_pretrained(checkpoints[family], dtype=DTYPES[dtype]).eval()
            if patched:
                make_invariant(model)
            ids, mask = padded_batch(model.config.vocab_size)
            with torch.no_grad():
                cache[key] = model(input_ids=ids, attention_mask=mask).logits
        return cache[key]
    return get


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("family", TP_FAMILIES)
def test_tp_logits_bitwise_equal_to_single_process(tp_runs, single_process, family, dtype, size):
    got = torch.load(tp_runs[size] / f"{family}-{dtype}-invariant.pt")
    assert torch.equal(got, single_process(family, dtype))


@pytest.mark.parametrize("family", TP_FAMILIES)
def test_negative_control_stock_tp2_differs_from_tp1(tp_runs, single_process, family):
    stock_tp2 = torch.load(tp_runs[2] / f"{family}-fp32-stock.pt")
    stock_tp1 = single_process(family, "fp32", patched=False)
    diff = (stock_tp2 - stock_tp1).abs().max().item()
    assert 0 < diff < 1e-4  # other bits, the same model
    assert not torch.equal(torch.load(tp_runs[2] / f"{family}-fp32-invariant.pt"), stock_tp2)


@pytest.mark.parametrize("family", TP_FAMILIES)
def test_restore_gives_back_transformers_tp(tp_runs, family):
    restored = torch.load(tp_runs[2] / f"{family}-fp32-restored.pt")
    assert torch.equal(restored, torch.load(tp_runs[2] / f"{family}-fp32-stock.pt"))


@pytest.mark.parametrize("family", TP_FAMILIES)
def test_negative_control_allreduce_of_rounded_sums_differs(tp_runs, single_process, family):
    """Each rank adds its own leaves and rounds to bf16, then the ranks all-reduce (stock TP's
    order): the test sees the change of bits that a TP-dependent reduction makes."""
    control = torch.load(tp_runs[2] / f"{family}-bf16-allreduce.pt")
    assert not torch.equal(control, single_process(family, "bf16"))


def test_refusals_name_the_sizes_that_work(tp_runs):
    kv2 = (tp_runs[4] / "refused-kv2.txt").read_text()
    assert kv2.startswith("UnsupportedModelError: tensor-parallel size 4: 8 attention heads / 2 KV heads")
    assert "Sizes that work for this model: [1, 2]" in kv2
    i160 = (tp_runs[4] / "refused-i160.txt").read_text()
    assert "down_proj (intermediate_size)'s K = 160 reduces as a tree of 2 leaves" in i160
    assert "Sizes that work for this model: [1, 2]" in i160
    plan = (tp_runs[2] / "refused-plan.txt").read_text()
    assert plan.startswith(f"UnsupportedModelError: tp_plan shards model.embed_tokens as {HIDDEN_SHARDED_EMBEDDING!r}")
    moe = (tp_runs[2] / "refused-moe.txt").read_text()
    assert moe.startswith("UnsupportedModelError: qwen3_moe: tensor parallelism does not run mixture-of-experts models")
    hybrid_moe = (tp_runs[2] / "refused-hybrid-moe.txt").read_text()
    assert hybrid_moe.startswith("UnsupportedModelError: qwen3_5_moe_text: tensor parallelism does not run "
                                 "mixture-of-experts models")


def test_supported_sizes_of_real_shapes():
    assert supported_tp_sizes(random_config("qwen2", "qwen2.5-1.5b")) == [1, 2]     # 2 KV heads
    assert supported_tp_sizes(random_config("qwen3", "qwen3-8b")) == [1, 2, 4, 8]
    assert supported_tp_sizes(random_config("llama", "llama-3.1-8b")) == [1, 2, 4, 8]
    assert tp_size_refusal(random_config("qwen3", "qwen3-8b"), 8) is None
    assert "Sizes that work for this model: [1, 2, 4, 8]" in tp_size_refusal(random_config("qwen3", "qwen3-8b"), 3)


@pytest.mark.parametrize("dtype, k", [(torch.float32, 256), (torch.bfloat16, 256), (torch.bfloat16, 384)])
def test_kernel_tree_split_across_ranks(dtype, k):
    """The kernel's own check: shards of K computed apart (each rank's leaves) and combined give
    linear's bits for every TP size dividing the leaves; a split that reduces each shard as one
    chunk (a TP-dependent tree) does not. K = 384 has leaves of 48, which the interpreter walks
    in one BLOCK_K step of 64 masked at the leaf's end."""
    n = 64
    x, gate, up = (torch.randn(5, k).to(dtype) for _ in range(3))
    w, b = torch.randn(n, k).to(dtype), torch.randn(n).to(dtype)
    cfg = row_parallel_config("cpu", dtype, n, k)
    assert cfg.k_chunks == tree_leaves(k) == 8 and cfg.chunk_k == k // 8
    assert cfg.block_k == triton.next_power_of_2(k // 8)
    ref, fused_ref = linear(x, w, b, config=cfg), silu_mul_linear(gate, up, w, b, config=cfg)
    exact = x.double() @ w.double().T + b.double()  # the tree is an accurate sum too (bf16 output rounding)
    assert (ref.double() - exact).abs().max() <= 2 ** -7 * exact.abs().max()
    for t in (1, 2, 4, 8):
        rank_cfg, s = replace(cfg, k_chunks=cfg.k_chunks // t), k // t
        shards = [slice(r * s, (r + 1) * s) for r in range(t)]
        parts = torch.cat([linear_partials(x[:, sh], w[:, sh], rank_cfg) for sh in shards])
        assert parts.shape == (8, 5, n) and torch.equal(combine_partials(parts, b, dtype), ref)
        fused = torch.cat([silu_mul_linear_partials(gate[:, sh], up[:, sh], w[:, sh], rank_cfg) for sh in shards])
        assert torch.equal(combine_partials(fused, b, dtype), fused_ref)
    halves = (slice(0, k // 2), slice(k // 2, k))  # compared in fp32, before any rounding to dtype
    tree = combine_partials(linear_partials(x, w, cfg), None, torch.float32)
    one_chunk = torch.cat([linear_partials(x[:, sh], w[:, sh], replace(cfg, k_chunks=1)) for sh in halves])
    assert not torch.equal(combine_partials(one_chunk, None, torch.float32), tree)
