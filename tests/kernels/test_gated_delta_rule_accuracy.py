"""The tensor-core gated delta rule against a float64 token-by-token recurrence, beside transformers'
chunked torch fallback (``torch_chunk_gated_delta_rule``, the algorithm fla runs; given q, k, v in
the input dtype and the gates in fp32, the most it can be given) at a real head size (Dk = Dv =
128, two value heads per key head) over 300 tokens (four complete chunks and a partial one).

Asserted, for fp32 and bf16 inputs, on the max abs error of the output and of the state after the
last complete chunk: the kernel's error is at most the fallback's plus one fp32 ulp of the largest
reference value. Both compute in fp32, so both errors are an ulp or so; the kernel's fp32 sums run
over k in one order, the fallback's BLAS blocks them, and either may win by a fraction of an ulp.
A product with bf16x3's 2^-16 (rather than bf16x6's fp32 accuracy) in the state's path exceeds
the bound by several ulps."""
from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen3_5

from invariant_infer.kernels.gated_delta_rule import CHUNK, chunk_gated_delta_rule

HK, HV, D, TOKENS = 1, 2, 128, 300


def make_inputs(dtype: torch.dtype, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    x = {"q": torch.randn(TOKENS, HK, D, generator=g), "k": torch.randn(TOKENS, HK, D, generator=g),
         "v": torch.randn(TOKENS, HV, D, generator=g), "a": torch.randn(TOKENS, HV, generator=g),
         "b": torch.randn(TOKENS, HV, generator=g)}
    x = {name: t.to(dtype) for name, t in x.items()}
    x["a_log"] = torch.log(torch.empty(HV).uniform_(1, 16, generator=g))
    x["dt_bias"] = torch.rand(HV, generator=g)
    return x


def gates(x: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 (g, beta) [T, Hv], as the Gated DeltaNet layer computes them."""
    g = -x["a_log"].double().exp() * F.softplus(x["a"].double() + x["dt_bias"].double())
    return g, torch.sigmoid(x["b"].double())


def float64_recurrence(x: dict) -> tuple[torch.Tensor, dict]:
    """Outputs [T, Hv, D] and the state after each token count."""
    g, beta = gates(x)
    q = F.normalize(x["q"].double(), dim=-1).repeat_interleave(HV // HK, 1) * D ** -0.5
    k = F.normalize(x["k"].double(), dim=-1).repeat_interleave(HV // HK, 1)
    v = x["v"].double()
    state = torch.zeros(HV, D, D, dtype=torch.float64)
    outs, states = [], {}
    for t in range(TOKENS):
        state = state * g[t].exp()[:, None, None]
        delta = (v[t] - torch.einsum("hkv,hk->hv", state, k[t])) * beta[t, :, None]
        state = state + k[t][:, :, None] * delta[:, None, :]
        outs.append(torch.einsum("hkv,hk->hv", state, q[t]))
        states[t + 1] = state.clone()
    return torch.stack(outs), states


def fallback(x: dict, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    g, beta = gates(x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "falling back to its reference PyTorch implementation"
        out, state = qwen3_5.torch_chunk_gated_delta_rule(
            x["q"][None, :tokens], x["k"][None, :tokens], x["v"][None, :tokens], g[None, :tokens].float(),
            beta[None, :tokens].float(), chunk_size=CHUNK, output_final_state=True, use_qk_l2norm_in_kernel=True)
    return out[0], state[0]


def kernel(x: dict) -> tuple[torch.Tensor, torch.Tensor]:
    state = torch.zeros(1, HV, D, D)
    out = chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["a"], x["b"], x["a_log"], x["dt_bias"],
                                 torch.tensor([0], dtype=torch.int32), torch.tensor([TOKENS], dtype=torch.int32), state)
    return out, state[0]


def fp32_ulp(reference: torch.Tensor) -> float:
    return 2.0 ** (math.floor(math.log2(reference.abs().max().item())) - 23)


def max_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    return (value.double() - reference).abs().max().item()


@pytest.mark.parametrize("dtype, seed", [(torch.float32, 0), (torch.float32, 1), (torch.bfloat16, 2)],
                         ids=["fp32-0", "fp32-1", "bf16-2"])
def test_as_accurate_as_transformers_chunked_fallback(dtype, seed):
    x = make_inputs(dtype, seed)
    complete = TOKENS // CHUNK * CHUNK
    expected_out, expected_states = float64_recurrence(x)
    expected_state = expected_states[complete]
    fallback_out, _ = fallback(x, TOKENS)
    _, fallback_state = fallback(x, complete)  # its state after the complete chunks, as the kernel keeps
    out, state = kernel(x)
    assert out.dtype == dtype
    assert max_error(out, expected_out) <= max_error(fallback_out, expected_out) + fp32_ulp(expected_out)
    assert max_error(state, expected_state) <= max_error(fallback_state, expected_state) + fp32_ulp(expected_state)
