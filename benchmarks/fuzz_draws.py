"""The padded-batch fuzz's draws: models, sample pools, one batching per (seed, index), and the
batch-variant linear of the negative control. Every draw is a pure function of its arguments."""
from __future__ import annotations

import contextlib
import random
import time
import zlib
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

import invariant_infer.model.layer_forwards as layer_forwards
from invariant_infer import make_invariant
from invariant_infer.model import experts as hf_experts
from invariant_infer.testing.drift import logits_alone
from invariant_infer.kernels import grouped_linear, linear
from invariant_infer.kernels.configs import linear_config
from invariant_infer.checkpoints.loading import DTYPES
from invariant_infer.testing.random_checkpoints import random_config, save_random_checkpoint

from .fuzz_quantized import batch_variant_quantized_layers, family_preset, quant_overrides, split, write_and_load

# Speed: the interpreter pays per kernel launch and per program (attention runs B x heads programs),
# so the fuzz models are each family's "tiny" preset with 1 layer (every kernel still runs and any
# batch dependence reaches the logits), 2 query heads sharing 1 KV head (still GQA) and a 128-token
# vocabulary (one lm_head tile, as with 512): about 2x the batchings/s of 2 layers and 4 heads.
# What makes each family different stays (see the module docstring); qwen3's and qwen3_moe's
# head_dim 16 keeps head_dim != hidden / heads (64 / 2 = 32). With 1 layer every MoE family's one
# layer is a sparse block (qwen3_moe's dense ``mlp_only_layers=[1]`` is gone; glm4_moe's dense first layer
# by first_k_dense_replace=0).
FUZZ_OVERRIDES = dict(num_hidden_layers=1, vocab_size=128, num_attention_heads=2, num_key_value_heads=1)
# The hybrid families keep their two layers: one Gated DeltaNet, one gated full attention; Gemma 3
# and gpt-oss theirs: one sliding-window layer, one global; DeepSeek-V3 its dense layer and its sparse one;
# Gemma 4 three (below).
FAMILY_OVERRIDES = {"qwen3": dict(head_dim=16), "qwen3_moe": dict(head_dim=16),
                    "gemma3_text": dict(num_hidden_layers=2), "gpt_oss": dict(num_hidden_layers=2),
                    "deepseek_v3": dict(num_hidden_layers=2),
                    # Gemma 4: a sliding layer, a global one (its own head_dim, K = V), a global one reading its K/V
                    "gemma4_text": dict(num_hidden_layers=3, num_kv_shared_layers=1, use_double_wide_mlp=False,
                                        layer_types=["sliding_attention", "full_attention", "full_attention"]),
                    "qwen3_5_text": dict(num_hidden_layers=2), "qwen3_5_moe_text": dict(num_hidden_layers=2),
                    "qwen3_next": dict(num_hidden_layers=2), "glm4_moe": dict(first_k_dense_replace=0)}
# Other presets drawn as models of their own (``family@preset``, with the family's overrides): Gemma 4's
# MoE variant, its experts (8, top-2) beside the dense MLP in every layer. After the families, so that
# their draws keep their indices.
PRESET_MODELS = ["gemma4_text@tiny-moe"]
SAMPLES_PER_POOL = 24
MAX_LEN = 40
# One longer sample per pool: on CPU the attention's KV block is 64 keys and blocks start at a
# row's first real key, so only a sample past 64 tokens runs the online softmax across blocks.
LONG_LEN = 72
MAX_BATCH = 8
MAX_EXTRA_PAD = 8
SMALL_M = 32  # negative control: the linear's BLOCK_K is 16 at M <= SMALL_M rows
# ... and the grouped expert GEMM's is 16 when no expert has more than SMALL_EXPERT_ROWS rows: a
# sample alone gives an expert at most one row per token, a batch gives its crowded experts more
SMALL_EXPERT_ROWS = 16


@dataclass(frozen=True)
class Batching:
    index: int
    family: str
    dtype: str
    members: tuple[int, ...]  # pool indices, in batch order (repeats allowed)
    lengths: tuple[int, ...]  # real tokens of each member
    side: str                 # "left" or "right" padding
    extra_pad: int            # columns beyond the longest member
    embeds: bool              # inputs_embeds instead of input_ids
    explicit_positions: bool  # position_ids = cumsum(mask) - 1 passed, else derived by the model

    def options(self) -> dict:
        return dict(side=self.side, extra_pad=self.extra_pad, embeds=self.embeds,
                    explicit_positions=self.explicit_positions)

    def describe(self) -> str:
        return (f"#{self.index} {self.family} {self.dtype} B={len(self.members)} members={list(self.members)} "
                f"lengths={list(self.lengths)} side={self.side} extra_pad={self.extra_pad} "
                f"{'inputs_embeds' if self.embeds else 'input_ids'} "
                f"{'explicit' if self.explicit_positions else 'derived'} positions")


def draw(seed: int, index: int, families: list[str], dtypes: list[str], pool_lengths: dict[str, list[int]],
         max_batch: int = MAX_BATCH, max_extra_pad: int = MAX_EXTRA_PAD) -> Batching:
    """Batching ``index`` of the run seeded ``seed``: independent of every other index."""
    rng = random.Random(f"fuzz/{seed}/{index}")
    family = rng.choice(families)
    dtype = rng.choice(dtypes)
    lengths = pool_lengths[family]
    size = rng.randint(1, max_batch)
    members = tuple(rng.randrange(len(lengths)) for _ in range(size))  # with replacement, in drawn order
    return Batching(index=index, family=family, dtype=dtype, members=members,
                    lengths=tuple(lengths[m] for m in members), side=rng.choice(("left", "right")),
                    extra_pad=rng.randint(0, max_extra_pad), embeds=rng.random() < 0.5,
                    explicit_positions=rng.random() < 0.5)


def pool_lengths(seed: int, family: str, size: int = SAMPLES_PER_POOL, max_len: int = MAX_LEN,
                 long_len: int = LONG_LEN) -> list[int]:
    """1, max_len, long_len (if > 0), then uniform in 1..max_len: ``size`` lengths."""
    g = _generator(seed, family)
    fixed = [1, max_len] + ([long_len] if long_len > 0 else [])
    return (fixed + torch.randint(1, max_len + 1, (size,), generator=g).tolist())[:size]


def pool_samples(seed: int, family: str, vocab: int, size: int = SAMPLES_PER_POOL, max_len: int = MAX_LEN,
                 long_len: int = LONG_LEN) -> list[torch.Tensor]:
    """The family's samples (the same for every dtype): token ids uniform in the vocabulary."""
    g = _generator(seed, family)
    g.manual_seed(g.initial_seed() + 1)
    return [torch.randint(0, vocab, (n,), generator=g) for n in pool_lengths(seed, family, size, max_len, long_len)]


def _generator(seed: int, family: str) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(family.encode()))


def m_dependent_linear(x, weight, bias=None, config=None):
    """Negative control: BLOCK_K 16 for at most SMALL_M rows, the shape's own config above, as
    batch-size-keyed heuristics and autotuners do (tests/kernels/test_linear.py has the same idea)."""
    m = x.reshape(-1, x.shape[-1]).shape[0]
    config = config or linear_config(x.device.type, x.dtype, *weight.shape)
    if m <= SMALL_M:
        config = replace(config, block_k=16)
    return linear(x, weight, bias, config=config)


def m_dependent_grouped_linear(x, weight, expert_offsets, bias=None, offsets_valid=False):
    """Negative control for the MoE experts: BLOCK_K 16 while no expert has more than
    SMALL_EXPERT_ROWS rows, the shape's own config above, as batch-size-keyed grouped GEMMs do."""
    config = linear_config(x.device.type, x.dtype, *weight.shape[1:])
    if int((expert_offsets[1:] - expert_offsets[:-1]).max()) <= SMALL_EXPERT_ROWS:
        config = replace(config, block_k=16)
    return grouped_linear(x, weight, expert_offsets, bias, config=config, offsets_valid=offsets_valid)


@contextlib.contextmanager
def batch_variant_linear():
    """Every patched projection (the MoE routers too) goes through ``m_dependent_linear`` for the
    block, the MoE experts' gate/up projection through ``m_dependent_grouped_linear``, and the
    quantized layers through ``batch_variant_quantized_layers``."""
    originals = layer_forwards.linear, hf_experts.linear, hf_experts.grouped_linear
    layer_forwards.linear = hf_experts.linear = m_dependent_linear
    hf_experts.grouped_linear = m_dependent_grouped_linear
    try:
        with batch_variant_quantized_layers():
            yield
    finally:
        layer_forwards.linear, hf_experts.linear, hf_experts.grouped_linear = originals


def fuzz_overrides(model: str) -> dict:
    """The config overrides of a fuzz model: a family (another preset of it: the family's overrides too),
    or ``family:FORMAT`` at the quantized widths."""
    (family, _), fmt = family_preset(model), split(model)[1]
    return {**FUZZ_OVERRIDES, **FAMILY_OVERRIDES.get(family, {}), **(quant_overrides(family) if fmt else {})}


def fuzz_config(model: str):
    """A fuzz model's config: its family's preset (``tiny`` unless named ``family@preset``) with its overrides."""
    return random_config(*family_preset(model), **fuzz_overrides(model))


class Models:
    """One patched model per (family, dtype), from a random checkpoint saved once per family under
    ``workdir`` and loaded with ``from_pretrained(dtype=...)``, on first use. A ``family:FORMAT``
    model is saved quantized once per dtype (``fuzz_quantized``)."""

    def __init__(self, families, seed: int, device: str, workdir: Path):
        self.seed, self.device, self.workdir = seed, device, workdir
        self.configs = {f: fuzz_config(f) for f in families}
        self.loaded: dict[tuple, torch.nn.Module] = {}

    def __call__(self, family: str, dtype: str):
        key = (family, dtype)
        if key not in self.loaded:
            fmt = split(family)[1]
            if fmt:
                path = self.workdir / f"{family.replace(':', '-')}-{dtype}"
                model = write_and_load(path, self.configs[family], fmt, self.seed, DTYPES[dtype], self.device)
            else:
                path = self.workdir / family
                if not path.exists():
                    save_random_checkpoint(path, self.configs[family], seed=self.seed)
                model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype]).to(self.device).eval()
            self.loaded[key] = make_invariant(model)
        return self.loaded[key]


class Pools:
    """The padded fuzz's models and sample pools; each sample's alone logits cached per model."""

    def __init__(self, families, seed: int, device: str, workdir: Path, pool_size: int, max_len: int,
                 long_len: int):
        self.models = Models(families, seed, device, workdir)
        self.samples = {f: pool_samples(seed, f, c.vocab_size, pool_size, max_len, long_len)
                        for f, c in self.models.configs.items()}
        self.alone: dict[tuple, list] = {}
        self.alone_s = 0.0
        self.alone_forwards = 0

    def lengths(self) -> dict[str, list[int]]:
        return {f: [len(s) for s in samples] for f, samples in self.samples.items()}

    def model(self, family: str, dtype: str):
        self.alone.setdefault((family, dtype), [None] * len(self.samples[family]))
        return self.models(family, dtype)

    def alone_logits(self, family: str, dtype: str, members) -> list[torch.Tensor]:
        model, cache = self.model(family, dtype), self.alone[(family, dtype)]
        for m in members:
            if cache[m] is None:
                t0 = time.perf_counter()
                logits = logits_alone(model, self.samples[family][m])
                if not torch.isfinite(logits).all():  # NaN != NaN would read as a mismatch
                    raise RuntimeError(f"{family} {dtype}: sample {m} alone has non-finite logits")
                cache[m] = logits
                self.alone_s += time.perf_counter() - t0
                self.alone_forwards += 1
        return [cache[m] for m in members]
