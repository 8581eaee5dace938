"""The chunked gated delta rule: accuracy against a float64 token-by-token recurrence; a segment's
outputs and state bitwise the same alone and packed with others in any order; decode == prefill
(the rows since the boundary state run again with new ones appended, at any cut: one token at a
time, or prefill budgets that cut chunks anywhere), with sequences of 1, 63, 64, 65 and 200 tokens.
Negative controls: chunks anchored before the sequence's first token (as at a padded row's position
0), and a chunk size that depends on the batch, change the bits."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from invariant_infer.kernels.gated_delta_rule import CHUNK, chunk_gated_delta_rule

HK, HV, DK, DV = 2, 4, 16, 32
LENGTHS = (1, 63, 64, 65, 200)


def make_inputs(length: int, dtype: torch.dtype, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"q": torch.randn(length, HK, DK, generator=g).to(dtype),
            "k": torch.randn(length, HK, DK, generator=g).to(dtype),
            "v": torch.randn(length, HV, DV, generator=g).to(dtype),
            "a": torch.randn(length, HV, generator=g).to(dtype),
            "b": torch.randn(length, HV, generator=g).to(dtype)}


PARAMS_SEED = 7


def head_params(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(PARAMS_SEED)
    a_log = torch.log(torch.empty(HV).uniform_(1, 16, generator=g))
    return a_log.to(dtype), torch.rand(HV, generator=g).to(dtype)


def run_packed(sequences: list[dict], dtype, states=None, out_from=None, chunk=CHUNK):
    """Pack the sequences as segments; returns (per-sequence outputs, final states)."""
    lengths = [s["q"].shape[0] for s in sequences]
    starts = torch.tensor([sum(lengths[:i]) for i in range(len(lengths))], dtype=torch.int32)
    ends = starts + torch.tensor(lengths, dtype=torch.int32)
    packed = {name: torch.cat([s[name] for s in sequences]) for name in sequences[0]}
    state = (torch.zeros(len(sequences), HV, DK, DV) if states is None else torch.stack(states)).contiguous()
    a_log, dt_bias = head_params(dtype)
    frm = None if out_from is None else starts + torch.tensor(out_from, dtype=torch.int32)
    out = chunk_gated_delta_rule(packed["q"], packed["k"], packed["v"], packed["a"], packed["b"], a_log, dt_bias,
                                 starts, ends, state, out_from=frm, chunk=chunk)
    return [out[s:e] for s, e in zip(starts.tolist(), ends.tolist())], list(state)


def reference(seq: dict, dtype, state0=None):
    """float64, token by token: outputs [T, Hv, Dv] and the state after every token."""
    a_log, dt_bias = (t.double() for t in head_params(dtype))
    group = HV // HK
    q = F.normalize(seq["q"].double(), dim=-1, eps=0).repeat_interleave(group, 1) * DK ** -0.5
    k = F.normalize(seq["k"].double(), dim=-1, eps=0).repeat_interleave(group, 1)
    v, a, b = seq["v"].double(), seq["a"].double(), seq["b"].double()
    decay = torch.exp(-a_log.exp() * F.softplus(a + dt_bias))            # [T, Hv]
    beta = torch.sigmoid(b)
    state = torch.zeros(HV, DK, DV, dtype=torch.float64) if state0 is None else state0.double().clone()
    outs, states = [], []
    for t in range(q.shape[0]):
        state = state * decay[t, :, None, None]
        delta = (v[t] - torch.einsum("hkv,hk->hv", state, k[t])) * beta[t, :, None]
        state = state + k[t][:, :, None] * delta[:, None, :]
        outs.append(torch.einsum("hkv,hk->hv", state, q[t]))
        states.append(state.clone())
    return torch.stack(outs), states


# fp32 inputs: the scan's own error; bf16/fp16: plus the output's rounding (relative 2^-8 / 2^-11).
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_accuracy_against_a_float64_recurrence(dtype):
    sequences = [make_inputs(n, dtype, seed=n) for n in LENGTHS]
    outs, states = run_packed(sequences, dtype)
    for seq, out, state in zip(sequences, outs, states):
        expected, expected_states = reference(seq, dtype)
        scale = expected.abs().max()
        assert (out.double() - expected).abs().max() <= TOLERANCE[dtype] * scale
        n = seq["q"].shape[0]
        boundary = n // CHUNK * CHUNK  # the state after the last complete chunk
        if boundary:
            want = expected_states[boundary - 1]
            assert (state.double() - want).abs().max() <= 2e-5 * want.abs().max()
        else:
            assert torch.equal(state, torch.zeros_like(state))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_segment_alone_equals_it_packed_with_others_in_any_order(dtype):
    sequences = [make_inputs(n, dtype, seed=10 + n) for n in LENGTHS]
    alone = [run_packed([seq], dtype) for seq in sequences]
    for order in ([4, 0, 3, 1, 2], [2, 2, 0]):
        outs, states = run_packed([sequences[i] for i in order], dtype)
        for i, out, state in zip(order, outs, states):
            assert torch.equal(out, alone[i][0][0]) and torch.equal(state, alone[i][1][0])


def continue_from_boundary(seq: dict, cuts: list[int], dtype):
    """Run ``seq`` in steps ending at ``cuts``: each step runs the rows since the boundary state again
    with the new rows appended (outputs written from the new rows only). Returns outputs, state."""
    out_rows, state, boundary, done = [], torch.zeros(HV, DK, DV), 0, 0
    for cut in cuts:
        rows = {name: t[boundary:cut] for name, t in seq.items()}
        outs, states = run_packed([rows], dtype, states=[state], out_from=[done - boundary])
        out_rows.append(outs[0][done - boundary:])
        state, done = states[0], cut
        boundary = cut // CHUNK * CHUNK
    return torch.cat(out_rows), state


@pytest.mark.fast_cells(1)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decode_and_prefill_cut_anywhere_equal_one_prefill(dtype):
    seq = make_inputs(200, dtype, seed=3)
    (whole,), (state,) = run_packed([seq], dtype)
    # Prefill budgets that cut chunks anywhere (before, at and after boundaries), then decode one
    # token at a time across the boundary at 192.
    for cuts in ([7, 64, 70, 71, 128, 129, 200], [63, 65, 191, 192, 193, 200], list(range(184, 201))):
        out, last = continue_from_boundary(seq, cuts, dtype)
        assert torch.equal(out, whole) and torch.equal(last, state)


def test_negative_control_chunks_anchored_before_the_first_token():
    """Three zero rows before the sequence in its segment (pads counted into its chunks, as when
    chunks start at a left-padded row's position 0): the zero rows leave the state at zero, yet the
    sequence's chunk boundaries move, and its outputs' bits with them."""
    dtype = torch.float32
    seq = make_inputs(100, dtype, seed=4)
    alone, _ = run_packed([seq], dtype)
    padded = {name: torch.cat([torch.zeros_like(t[:3]), t]) for name, t in seq.items()}
    padded["b"][:3] = -30.0  # beta ~ 0: the pad rows write nothing into the state
    shifted, _ = run_packed([padded], dtype)
    assert (shifted[0][3:] - alone[0]).abs().max() < 1e-4  # the same numbers...
    assert not torch.equal(shifted[0][3:], alone[0])          # ...in other bits


def test_negative_control_a_chunk_size_that_depends_on_the_batch():
    dtype = torch.float32
    sequences = [make_inputs(n, dtype, seed=20 + n) for n in (100, 30)]
    alone, _ = run_packed(sequences[:1], dtype)
    batched, _ = run_packed(sequences, dtype, chunk=32)  # as if the batch of two chose 32
    assert (batched[0] - alone[0]).abs().max() < 1e-4
    assert not torch.equal(batched[0], alone[0])
