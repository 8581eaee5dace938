"""The host-sync counter itself: each call that reads tensor values into Python counts once, an op that
stays on the device counts nothing, ``inside`` counts only during that module's forward, each sync names
the line that made it, and the kernels' interpreted launches (which read arrays on CPU only) count nothing."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from invariant_infer.kernels import rms_norm
from invariant_infer.kernels.interpreter_harness import fp32_to_fp8e4m3_bits
from invariant_infer.testing.host_syncs import count_host_syncs

x = torch.arange(6.0)
mask = torch.tensor([True, False, True, False, True, False])

READS = {  # each reads values (or a size that depends on them) into Python: one sync
    "tolist": lambda: x.tolist(),
    "item": lambda: x[0].item(),
    "cpu": lambda: x.cpu(),
    "numpy": lambda: x.numpy(),
    "bool": lambda: bool(x[1]),
    "if": lambda: 1 if x.any() else 0,
    "int": lambda: int(x[1]),
    "float": lambda: float(x[1]),
    "index": lambda: [1, 2, 3][torch.tensor(1)],
    "format": lambda: f"{x[0]:.1f}",
    "contains": lambda: 2.0 in x,
    "equal": lambda: torch.equal(x, x),
    "allclose": lambda: torch.allclose(x, x),
    "nonzero": lambda: x.nonzero(),
    "argwhere": lambda: torch.argwhere(x),
    "where(condition)": lambda: torch.where(mask),
    "unique": lambda: torch.unique(x),
    "bincount": lambda: torch.bincount(torch.tensor([1, 2])),
    "masked_select": lambda: torch.masked_select(x, mask),
    "boolean mask index": lambda: x[mask],
    "boolean mask index in a tuple": lambda: x[None][:, mask],
    "boolean mask set of many values": lambda: x.clone().__setitem__(mask, torch.tensor([1.0, 2.0, 3.0])),
    "repeat_interleave by a tensor": lambda: x.repeat_interleave(torch.ones(6, dtype=torch.long)),
}
STAYS = {  # sizes known on the host: nothing is read back
    "arithmetic": lambda: (x * 2 + 1).sum(),
    "any without if": lambda: x.any(),
    "long index": lambda: x[torch.tensor([0, 2])],
    "boolean mask set of one value": lambda: x.clone().__setitem__(mask, 0.0),
    "masked_fill": lambda: x.masked_fill(mask, 0.0),
    "where(condition, a, b)": lambda: torch.where(mask, x, 0.0),
    "repeat_interleave with output_size": lambda: x.repeat_interleave(torch.ones(6, dtype=torch.long), output_size=6),
    "repeat_interleave by an int": lambda: x.repeat_interleave(2),
    "shape": lambda: int(x.shape[0]),
    "to the same device": lambda: x.to(x.device),
}


@pytest.mark.parametrize("name", READS)
def test_a_read_counts_once(name):
    with count_host_syncs() as syncs:
        READS[name]()
    assert syncs.count == 1, syncs.summary()
    assert "tests/testing/test_host_sync_counting.py" in syncs.events[0].where[0]


@pytest.mark.parametrize("name", STAYS)
def test_a_device_op_counts_nothing(name):
    with count_host_syncs() as syncs:
        STAYS[name]()
    assert syncs.count == 0, syncs.summary()


class Reader(nn.Module):
    def forward(self, h):
        return h * float(h[0])  # one read inside the forward


def test_inside_counts_only_during_the_modules_forward():
    inner = Reader()
    with count_host_syncs(inside=inner) as inside, count_host_syncs() as whole:
        h = torch.ones(3)
        bool(h.any())  # outside the module: counted by the whole, not by inside
        inner(h)
    assert inside.count == 1 and inside.events[0].call == "__float__"
    assert whole.count == 2
    assert "1 x __float__" in inside.summary()
    assert not inner._forward_pre_hooks and not inner._forward_hooks  # its hooks are removed afterwards


def test_an_interpreted_kernel_launch_counts_nothing():
    """On CPU Triton's interpreter reads each argument as an array; a compiled launch reads nothing."""
    h, w = torch.randn(4, 32), torch.ones(32)
    with count_host_syncs() as syncs:
        rms_norm(h, w, 1e-6)
    assert syncs.count == 0, syncs.summary()


def test_the_interpreters_own_reads_count_nothing():
    """The harness converts fp8 through torch and back to an array (a read, were it not the interpreter's)."""
    values = np.array([0.5, -3.0, 1000.0], dtype=np.float32)
    with count_host_syncs() as syncs:
        fp32_to_fp8e4m3_bits(values)
    assert syncs.count == 0, syncs.summary()
    with count_host_syncs() as control:  # the same read made outside the harness counts
        torch.from_numpy(values).numpy()
    assert control.count == 1
