"""RoPE under autograd: the patched rotary embedding is a lookup in a constant cos/sin table, and the
family's own apply_rotary_pos_emb is elementwise, so torch's autograd gives each token's q/k gradient
from that token alone. Checked: gradients against float64, the same bits twice, a token's gradient the
same at any batch position, and the table carrying no gradient."""
import pytest
import torch
from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

from helpers.models import load_model
from invariant_infer import make_invariant

TOLERANCE = {torch.bfloat16: 8e-3, torch.float32: 1e-6}


def rope_grads(rotary, q, k, positions, dq, dk):
    q, k = q.detach().requires_grad_(), k.detach().requires_grad_()
    cos, sin = rotary(q, positions)
    q_rot, k_rot = apply_rotary_pos_emb(q, k, cos, sin)
    torch.autograd.backward((q_rot, k_rot), (dq, dk))
    return q_rot.detach(), k_rot.detach(), q.grad, k.grad, cos


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_rope_gradients(tiny_checkpoint, dtype):
    model = make_invariant(load_model(tiny_checkpoint, dtype))
    rotary, d = model.model.rotary_emb, model.config.hidden_size // model.config.num_attention_heads
    g = torch.Generator().manual_seed(0)
    q, k, dq, dk = (torch.randn(3, 2, 9, d, generator=g).to(dtype) for _ in range(4))
    positions = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 8], [0, 0, 0, 0, 1, 2, 3, 4, 5], [4, 5, 6, 7, 8, 9, 10, 11, 12]])
    first = rope_grads(rotary, q, k, positions, dq, dk)
    second = rope_grads(rotary, q, k, positions, dq, dk)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    assert not first[4].requires_grad, "the cos/sin table is a constant"
    # float64 reference: the same rotation, from HF's frequencies in float64
    inv_freq = rotary.inv_freq.double()
    angles = positions[..., None].double() * inv_freq
    cos64, sin64 = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    q64, k64 = q.double().requires_grad_(), k.double().requires_grad_()
    torch.autograd.backward(apply_rotary_pos_emb(q64, k64, cos64, sin64), (dq.double(), dk.double()))
    for got, want in ((first[2], q64.grad), (first[3], k64.grad)):
        assert ((got.double() - want).abs().max() / want.abs().max()).item() < TOLERANCE[dtype]
    # a token's gradient does not depend on the batch around it: row 2 alone, and at another batch index
    alone = rope_grads(rotary, q[2:], k[2:], positions[2:], dq[2:], dk[2:])
    swapped = rope_grads(rotary, q.flip(0), k.flip(0), positions.flip(0), dq.flip(0), dk.flip(0))
    for i in range(4):
        assert torch.equal(alone[i][0], first[i][2]) and torch.equal(swapped[i][0], first[i][2])


def test_negative_control_batch_shaped_positions_are_caught(tiny_checkpoint):
    """The classic batch-variant path: positions arange(width) for a left-padded row instead of its own
    (cumsum of the mask - 1). The comparison above sees it."""
    model = make_invariant(load_model(tiny_checkpoint, torch.float32))
    rotary, d = model.model.rotary_emb, model.config.hidden_size // model.config.num_attention_heads
    q, k, dq, dk = (torch.randn(1, 2, 6, d) for _ in range(4))
    own = rope_grads(rotary, q, k, torch.arange(6)[None], dq, dk)
    batch_shaped = rope_grads(rotary, q, k, torch.arange(3, 9)[None], dq, dk)  # 3 pads to its left
    assert not torch.equal(own[2], batch_shaped[2])
