"""The causal depthwise conv1d with SiLU: against torch's conv1d in float64; a segment alone equals it
packed with others; a sequence continued from its last K - 1 inputs (one token at a time, or in
chunks) equals one pass over it, bitwise."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from invariant_infer.kernels.causal_conv1d import causal_conv1d_silu

CHANNELS, KERNEL = 48, 4


def inputs(length: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(length, CHANNELS, generator=torch.Generator().manual_seed(seed)).to(dtype)


WEIGHT = torch.randn(CHANNELS, KERNEL, generator=torch.Generator().manual_seed(99)) * 0.5


def run(segments: list[torch.Tensor], dtype, out_from=None) -> list[torch.Tensor]:
    lengths = [s.shape[0] for s in segments]
    starts = torch.tensor([sum(lengths[:i]) for i in range(len(lengths))], dtype=torch.int32)
    ends = starts + torch.tensor(lengths, dtype=torch.int32)
    frm = None if out_from is None else starts + torch.tensor(out_from, dtype=torch.int32)
    out = causal_conv1d_silu(torch.cat(segments), WEIGHT.to(dtype), starts, ends, out_from=frm)
    return [out[s:e] for s, e in zip(starts.tolist(), ends.tolist())]


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
def test_matches_torch_conv1d_in_float64(dtype, tolerance):
    x = inputs(37, dtype, seed=1)
    (out,) = run([x], dtype)
    conv = F.conv1d(x.double().T[None], WEIGHT.to(dtype).double()[:, None, :], padding=KERNEL - 1,
                    groups=CHANNELS)[0, :, :37].T
    expected = F.silu(conv)
    assert (out.double() - expected).abs().max() <= tolerance * expected.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_alone_packed_and_continued_are_bitwise_one_pass(dtype):
    seqs = [inputs(n, dtype, seed=n) for n in (1, 3, 70, 9)]
    alone = [run([s], dtype)[0] for s in seqs]
    for i, out in zip([2, 0, 3, 1], run([seqs[i] for i in (2, 0, 3, 1)], dtype)):
        assert torch.equal(out, alone[i])
    x = seqs[2]
    for cuts in ([1, 2, 3, 4, 5, 40, 70], [33, 34, 70]):
        done, pieces = 0, []
        for cut in cuts:
            history = max(0, done - (KERNEL - 1))  # the last K - 1 inputs before the new ones
            (out,) = run([x[history:cut]], dtype, out_from=[done - history])
            pieces.append(out[done - history:])
            done = cut
        assert torch.equal(torch.cat(pieces), alone[2])
