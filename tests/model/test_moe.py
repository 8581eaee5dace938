"""Mixture-of-experts families (Qwen3-MoE, Mixtral, Qwen2-MoE with its shared expert): logits alone
equal, bitwise, their rows in any batch, also when the routing crowds every token onto a few experts
and leaves others empty; routing ties go to the lowest expert index; each token's expert output and
combine are bitwise the token alone; accuracy against float64; the refusals. The negative control
makes the expert GEMM's tile depend on how many rows an expert got."""
import pytest
import requests
import torch
from torch import nn

import invariant_infer.model.experts as hf_experts
from helpers.models import (BATCHINGS, DEVICES, DTYPES, MOE_FAMILY_NAMES, Batching, batch_mismatches, load_model,
                            logits_batched)
from helpers.controls import m_dependent_grouped_linear
from helpers.models import family_dtype_cells, make_samples
from helpers.servers import MODEL, ServerProcess
from helpers.tokenizer import save_tokenizer
from invariant_infer import NonInvariantInputError, UnsupportedModelError, make_invariant, restore
from invariant_infer.testing.drift import logits_alone
from invariant_infer.kernels import linear
from invariant_infer.kernels.fused_linear import silu_mul_linear
from invariant_infer.testing.random_checkpoints import random_config, random_model, save_random_checkpoint

pytestmark = pytest.mark.file_minutes(1.5)  # measured on 2 cores: start it early

# Router rows kept random; the others are zeroed, so their logits tie exactly at 0: every token
# routes among HOT and the lowest-index cold experts, and the highest-index experts get no token.
HOT = (2, 5)
CROWDED_BATCHINGS = [Batching((0, 1, 2, 3)), Batching((3, 2, 1, 0), left_pad=False, extra_pad=2)]


@pytest.fixture(params=MOE_FAMILY_NAMES)
def family(request):
    return request.param


def sparse_blocks(model):
    return [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "experts")]


def crowd(model):
    with torch.no_grad():
        for block in sparse_blocks(model):
            cold = [e for e in range(block.gate.weight.shape[0]) if e not in HOT]
            block.gate.weight[cold] = 0
    return model


def expert_loads(model, run) -> list[torch.Tensor]:
    """Rows each expert got, per sparse layer, during ``run()``."""
    loads = []
    hooks = [block.experts.register_forward_hook(
        lambda module, args, out: loads.append(torch.bincount(args[1].reshape(-1), minlength=module.num_experts)))
        for block in sparse_blocks(model)]
    try:
        run()
    finally:
        for hook in hooks:
            hook.remove()
    return loads


@pytest.mark.fast_cells(1)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family, dtype", family_dtype_cells(MOE_FAMILY_NAMES, DTYPES))
def test_logits_alone_equal_logits_in_any_batch(family_checkpoints, family, dtype, device):
    model = make_invariant(load_model(family_checkpoints(family), dtype, device))
    assert batch_mismatches(model, make_samples(model.config.vocab_size)) == []


REAL_PRESETS = {"qwen3_moe": "qwen3-30b-a3b", "mixtral": "mixtral-8x7b", "qwen2_moe": "qwen1.5-moe-a2.7b"}


@pytest.mark.gpu
def test_invariant_at_real_widths_and_control(family, monkeypatch):
    """One layer at the real models' widths (Qwen3-30B-A3B: 128 experts, top-8), bf16 on the GPU;
    the control (expert GEMM tiles picked by an expert's row count) fails there too."""
    config = random_config(family, REAL_PRESETS[family], num_hidden_layers=1, vocab_size=2048,
                           max_position_embeddings=1024)
    model = make_invariant(random_model(config, dtype=torch.bfloat16).to("cuda"))
    samples = make_samples(config.vocab_size, (1, 33, 7, 20))
    batchings = [Batching((0, 1, 2, 3)), Batching((3, 1, 0), left_pad=False, extra_pad=2)]
    assert batch_mismatches(model, samples, batchings) == []
    monkeypatch.setattr(hf_experts, "grouped_linear", m_dependent_grouped_linear)
    assert batch_mismatches(model, samples, batchings) != []


@pytest.mark.heavy
@pytest.mark.parametrize("family, dtype", family_dtype_cells(MOE_FAMILY_NAMES, DTYPES))
def test_crowded_and_empty_experts(family_checkpoints, family, dtype):
    """Every token on a few experts (many rows each), the last experts with none."""
    model = crowd(make_invariant(load_model(family_checkpoints(family), dtype)))
    samples = make_samples(model.config.vocab_size)
    loads = expert_loads(model, lambda: logits_batched(model, samples, CROWDED_BATCHINGS[0]))
    top_k, tokens = model.config.num_experts_per_tok, sum(len(s) for s in samples)
    cold = [e for e in range(len(loads[0])) if e not in HOT]
    never = cold[top_k:]  # a tie among cold experts always goes to the lowest indices
    for load in loads:
        assert len(never) >= 2 and load[never].sum() == 0  # empty experts
        assert load.max() >= tokens // 2  # a crowded one
    assert batch_mismatches(model, samples, CROWDED_BATCHINGS) == []


@pytest.mark.fast_cells(1)
def test_m_dependent_expert_gemm_is_caught(family_checkpoints, family, monkeypatch):
    """Negative control: the expert GEMM picks its tile by the rows its expert got."""
    model = make_invariant(load_model(family_checkpoints(family), torch.float32))
    samples = make_samples(model.config.vocab_size)
    assert batch_mismatches(model, samples, BATCHINGS[:2]) == []
    monkeypatch.setattr(hf_experts, "grouped_linear", m_dependent_grouped_linear)
    assert batch_mismatches(model, samples, BATCHINGS[:2]) != []


def test_routing_ties_go_to_the_lowest_index_alone_and_in_a_batch():
    tied = torch.tensor([[0.5, 2.0, 2.0, -1.0, 2.0, 0.0, 2.0, 1.0]])  # a 4-way tie at ranks 1..4
    others = torch.randn(5, 8)
    weights, experts = hf_experts.route(tied, 3, normalize=True)
    assert experts.tolist() == [[1, 2, 4]] and weights.dtype == torch.float32
    assert weights[0, 0] == weights[0, 1] == weights[0, 2]
    for position in range(others.shape[0] + 1):
        batch = torch.cat([others[:position], tied, others[position:]])
        batch_weights, batch_experts = hf_experts.route(batch, 3, normalize=True)
        assert torch.equal(batch_experts[position], experts[0]) and torch.equal(batch_weights[position], weights[0])
    all_tied_weights, all_tied = hf_experts.route(torch.zeros(4, 8), 2, normalize=False)
    assert all_tied.tolist() == [[0, 1]] * 4 and torch.equal(all_tied_weights, torch.full((4, 2), 1 / 8))


def test_routing_matches_stock_softmax_top_k():
    """Qwen3-MoE's stock routing (softmax in fp32, torch.topk, norm_topk_prob) on logits without ties."""
    logits = torch.randn(64, 128)
    weights, experts = hf_experts.route(logits, 8, normalize=True)
    top, index = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float), 8, dim=-1)
    assert torch.equal(experts, index)
    assert ((weights.double() - top / top.sum(-1, keepdim=True)).abs() / weights).max() < 1e-6


def _experts_inputs(dtype, tokens=12, experts=8, top_k=3, hidden=64, intermediate=32):
    module = random_model(random_config("mixtral", "tiny", num_experts_per_tok=top_k), dtype=dtype)
    block = module.model.layers[0].mlp
    x = torch.randn(tokens, hidden, dtype=dtype)
    index = torch.stack([torch.randperm(experts)[:top_k] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, top_k), -1)
    return block.experts, x, index, weights


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_each_token_equals_its_per_expert_loop_alone(dtype):
    """Each row: its k experts run on that token alone (one row per GEMM), combined in rank order in
    fp32, cast once -- bitwise the batched experts forward."""
    experts, x, index, weights = _experts_inputs(dtype)
    with torch.no_grad():
        batched = hf_experts.invariant_experts_forward(experts, x, index, weights)
        inter = experts.down_proj.shape[2]
        for t in range(x.shape[0]):
            total = torch.zeros(x.shape[1], dtype=torch.float32)
            for rank, e in enumerate(index[t].tolist()):
                gate_up = linear(x[t:t + 1], experts.gate_up_proj[e])
                out = silu_mul_linear(gate_up[:, :inter], gate_up[:, inter:], experts.down_proj[e])[0]
                total = total + out.float() * weights[t, rank].float()
            assert torch.equal(batched[t], total.to(dtype)), t


def test_combine_in_rank_order_fp32():
    pair = torch.randn(32, 8, 64, dtype=torch.bfloat16)
    weights = torch.softmax(torch.randn(32, 8), -1)
    got = hf_experts.combine(pair, weights)
    manual = torch.zeros(32, 64)
    for rank in range(8):
        manual = manual + pair[:, rank].float() * weights[:, rank, None]
    assert got.dtype == torch.float32 and torch.equal(got, manual)
    terms = pair.double() * weights.double()[..., None]
    # fp32 summation of 8 terms: within 8 ulps of the sum of their magnitudes
    assert ((got.double() - terms.sum(1)).abs() / terms.abs().sum(1)).max() < 8 * 2.0 ** -24
    reversed_order = torch.zeros(32, 64)
    for rank in reversed(range(8)):
        reversed_order = reversed_order + pair[:, rank].float() * weights[:, rank, None]
    assert not torch.equal(got, reversed_order)  # the order is visible in the bits: the test can fail


def _relative_error(got, ref):
    got, ref = torch.cat([g.double() for g in got]), torch.cat([r.double() for r in ref])
    return ((got - ref).norm() / ref.norm()).item()


# Relative Frobenius error of the real-token logits against stock float64 (eager experts): at most
# twice stock's own error in the dtype, and under these bounds (measured on the tiny presets, worst
# family: 7.5e-3 / 9.3e-4 / 3.2e-7 for bf16 / fp16 / fp32; stock 7.6e-3 / 9.5e-4 / 3.1e-7).
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 3e-3, torch.float32: 1e-6}


@pytest.mark.fast_cells(1)
@pytest.mark.parametrize("family, dtype", family_dtype_cells(MOE_FAMILY_NAMES, DTYPES))
def test_accuracy_against_float64(family_checkpoints, family, dtype):
    path, batching = family_checkpoints(family), Batching((0, 1, 2, 3), extra_pad=2)
    samples = make_samples(512)
    stock64 = load_model(path, torch.float64)
    stock64.set_experts_implementation("eager")
    reference = logits_batched(stock64, samples, batching)
    stock_error = _relative_error(logits_batched(load_model(path, dtype), samples, batching), reference)
    error = _relative_error(logits_batched(make_invariant(load_model(path, dtype)), samples, batching), reference)
    assert 0 < error <= 2 * stock_error and error < TOLERANCE[dtype], (error, stock_error)


def test_qwen3_moe_dense_layers_use_the_dense_mlp(family_checkpoints):
    model = make_invariant(load_model(family_checkpoints("qwen3_moe"), torch.float32))
    sparse, dense = model.model.layers[0].mlp, model.model.layers[1].mlp  # the tiny preset: mlp_only_layers=[1]
    assert type(dense).__name__ == "Qwen3MoeMLP" and "forward" in vars(dense)
    assert "forward" in vars(sparse.gate) and model.config._experts_implementation == "invariant"


def test_restore_returns_stock_behaviour(family_checkpoints, family):
    model = load_model(family_checkpoints(family), torch.float32)
    sample = make_samples(model.config.vocab_size)[0]
    stock = logits_alone(model, sample)
    implementation = model.config._experts_implementation
    restore(make_invariant(model))
    assert model.config._experts_implementation == implementation
    assert all("forward" not in vars(block.gate) for block in sparse_blocks(model))
    assert torch.equal(logits_alone(model, sample), stock)


def test_random_checkpoints_randomise_experts_and_router(family):
    model = random_model(random_config(family, "tiny"))
    for block in sparse_blocks(model):
        for weight in (block.gate.weight, block.experts.gate_up_proj, block.experts.down_proj):
            assert weight.std() > 0.01
        assert not torch.equal(block.experts.gate_up_proj[0], block.experts.gate_up_proj[1])


@pytest.mark.heavy
def test_server_batched_completions_equal_alone(tmp_path):
    """``invariant-infer serve`` on a MoE checkpoint: a batch of prompts gets exactly the tokens and
    logprobs each prompt gets alone."""
    path = save_random_checkpoint(tmp_path / "m", random_config("mixtral", "tiny", num_hidden_layers=1), seed=2)
    save_tokenizer(path)
    server = ServerProcess(["--model", str(path), "--served-model-name", MODEL, "--dtype", "bf16"], tmp_path / "log")
    try:
        prompts = [[int(t) for t in s] for s in make_samples(512, (9, 1, 14))]
        params = {"model": MODEL, "max_tokens": 3, "temperature": 0, "logprobs": 1, "echo": True}

        def complete(prompt):
            response = requests.post(server.url + "/v1/completions", json={"prompt": prompt, **params}, timeout=300)
            assert response.status_code == 200, response.text
            return [(c["text"], c["logprobs"]["token_logprobs"])
                    for c in sorted(response.json()["choices"], key=lambda c: c["index"])]
        assert complete(prompts) == [complete(p)[0] for p in prompts]
    finally:
        server.stop()


# ---- refusals ----------------------------------------------------------------------------------

def test_refuses_grad_recording_forwards(family_checkpoints, family):
    model = make_invariant(load_model(family_checkpoints(family), torch.float32))
    ids = make_samples(model.config.vocab_size)[0][None]
    with pytest.raises(UnsupportedModelError, match="MoE training is not supported"):
        model(input_ids=ids)
    model.requires_grad_(False)
    model(input_ids=ids)  # frozen parameters, nothing to record


def test_refuses_router_jitter_in_train_mode():
    model = make_invariant(random_model(random_config("mixtral", "tiny", router_jitter_noise=0.1)))
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        model(input_ids=ids)  # eval mode: no jitter
        model.train()
        with pytest.raises(NonInvariantInputError, match="router_jitter_noise"):
            model(input_ids=ids)


class _OtherExperts(nn.Module):
    pass


@pytest.mark.parametrize("change, message", [
    (lambda block: setattr(block.experts, "_is_expert_parallel", True), "expert parallelism"),
    (lambda block: setattr(block, "experts", _OtherExperts()), "replaced experts"),
    (lambda block: setattr(block, "gate", _OtherExperts()), "router"),
    (lambda block: setattr(block.experts, "has_bias", True), "has_bias"),
    (lambda block: setattr(block.experts, "down_proj", nn.Parameter(torch.zeros(8, 32))), "3-D parameter"),
])
def test_refuses_unsupported_expert_layouts(family, change, message):
    model = random_model(random_config(family, "tiny"))
    change(sparse_blocks(model)[-1])
    with pytest.raises(UnsupportedModelError, match=message):
        make_invariant(model)


@pytest.mark.parametrize("change, message", [
    (lambda block: setattr(block, "shared_expert_gate", _OtherExperts()), "shared_expert_gate"),
    (lambda block: setattr(block.shared_expert, "up_proj", _OtherExperts()), "shared_expert.up_proj"),
    (lambda block: setattr(block, "shared_expert", _OtherExperts()), "shared_expert is"),
])
def test_refuses_unsupported_shared_experts(change, message):
    model = random_model(random_config("qwen2_moe", "tiny"))
    change(sparse_blocks(model)[0])
    with pytest.raises(UnsupportedModelError, match=message):
        make_invariant(model)


def test_qwen2_moe_shared_expert_is_patched(family_checkpoints):
    block = sparse_blocks(make_invariant(load_model(family_checkpoints("qwen2_moe"), torch.float32)))[0]
    assert vars(block)["forward"].__func__ is hf_experts.shared_expert_block_forward
    assert "forward" in vars(block.shared_expert) and "forward" in vars(block.shared_expert_gate)


def test_refuses_compressed_tensors_models(family):
    """transformers decompresses compressed-tensors experts at load (tests/model/test_quantized_moe.py
    runs transformers' fp8 format, whose experts stay quantized)."""
    model = random_model(random_config(family, "tiny"))
    model.config.quantization_config = {"quant_method": "compressed-tensors"}
    with pytest.raises(UnsupportedModelError, match="compressed-tensors mixture-of-experts"):
        make_invariant(model)
