"""A fusion into the linear kernel's prologue, bitwise equal to the unfused pair.

``silu_mul_linear`` computes silu(gate) * up as the down projection loads its input. The
prologue computes exactly the values the standalone kernel would write, so fusing saves the
[tokens x intermediate] round trip through memory without changing a bit, and stays
batch-invariant. Fusing is therefore a schedule choice (``prologue_pays``): every N tile of the
output recomputes the prologue over its rows' whole K, which pays at small M (one row tile: a
launch and a round trip saved, the weight's bytes dominate) and not at large M, where the down
projection's N tiles (12 at N = 1536) would each redo it; there silu_mul runs once, then linear.
"""
from __future__ import annotations

import torch

from .configs import linear_config, tile_device
from .linear import PROLOGUE_SILU_MUL, LinearConfig, _check_operands, launch_linear
from .silu_mul import silu_mul
from .errors import InvalidArgumentError


def prologue_pays(device: torch.device, m: int, config: LinearConfig) -> bool:
    """The schedule (never the arithmetic): fuse silu_mul into the projection's prologue when M is
    one row tile, run it once beforehand otherwise. The interpreter always fuses (fewer launches)."""
    return tile_device(device.type) == "cpu" or m <= config.block_m


def _rows(t: torch.Tensor) -> torch.Tensor:
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _gate_up_rows(gate, up, weight, bias):
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise InvalidArgumentError(f"silu_mul_linear: gate {tuple(gate.shape)} {gate.dtype} vs up {tuple(up.shape)} "
                                   f"{up.dtype}")
    _check_operands(gate, weight, bias)
    g2, u2 = _rows(gate), _rows(up)
    if g2.stride() != u2.stride():
        u2 = u2.contiguous()
        g2 = g2.contiguous()
    return g2, u2


def silu_mul_linear(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                    config: LinearConfig | None = None, parallel_chunks: bool | None = None,
                    fused: bool | None = None) -> torch.Tensor:
    """linear(silu_mul(gate, up), weight, bias), bitwise; fused (without writing silu_mul's output)
    where ``prologue_pays``. ``fused`` and ``parallel_chunks`` force a schedule (tests)."""
    g2, u2 = _gate_up_rows(gate, up, weight, bias)
    config = config or linear_config(g2.device.type, g2.dtype, *weight.shape)
    if fused is None:
        fused = prologue_pays(g2.device, g2.shape[0], config)
    if fused:
        y = launch_linear(g2, weight, bias, config, PROLOGUE_SILU_MUL, up=u2, parallel_chunks=parallel_chunks)
    else:
        y = launch_linear(silu_mul(g2, u2), weight, bias, config, parallel_chunks=parallel_chunks)
    return y.reshape(*gate.shape[:-1], weight.shape[0])


def silu_mul_linear_partials(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor,
                             config: LinearConfig) -> torch.Tensor:
    """``linear_partials(silu_mul(gate, up), weight, config)``, bitwise, with the fused prologue."""
    g2, u2 = _gate_up_rows(gate, up, weight, None)
    return launch_linear(g2, weight, None, config, PROLOGUE_SILU_MUL, up=u2, partials=True)
