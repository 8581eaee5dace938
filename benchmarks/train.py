"""One training step, forward + backward, invariant vs stock on the same weights, and the trainer's
logprob mismatch: a sample's per-token logprobs inside the training batch vs the same sample alone.

Model: the preset's widths and vocabulary with ``TRAIN_LAYERS`` decoder layers (quick: the family's
``tiny`` preset), bf16, ``model.train()``. A step is: zero the gradients, forward, the next-token
logprobs of every scored token, loss = their negative mean, backward; no optimizer step, so both
modes and every repetition see the same weights.
  * stock: no patch, ``attn_implementation="sdpa"``, torch/cuBLAS linear; logprobs as trainers take
    them (TRL's ``selective_log_softmax``): fp32 ``log_softmax`` of the full logits, gather.
  * invariant: ``make_invariant(model)``; ``invariant_infer.training.logprobs.token_logprobs``.
Batches (``LAYOUTS``): ``padded`` = right-padded rows, ``position_ids = cumsum(mask) - 1`` as
``generate`` builds them, so any mismatch comes from reduction order alone; ``packed`` = the same
samples in one row, no attention mask, ``position_ids`` restarting at 0 at each sample (the layout of
transformers' ``DataCollatorWithFlattening``, padding-free trainers). Samples have random
lengths in [seq / 2, seq]; a batch of B takes the first B of one pool, so sample 0 is the same in
every row of the table.
"""
from __future__ import annotations

import time

import torch
from tqdm import tqdm

from invariant_infer import make_invariant, pad_sequences, restore
from invariant_infer.model.padding import positions_from_mask
from invariant_infer.training.logprobs import scored_positions, token_logprobs

from .e2e import build_model, preset_config
from .matmul import DEFAULT_FAMILY, DEFAULT_PRESET
from .timing import Run, free_memory, peak_gb, reset_peak, time_ms

TRAIN_LAYERS = 4  # full suite: the preset's widths, fewer layers (a step's cost per layer is the same)
# (batch, longest sample)
SHAPES, QUICK_SHAPES = ((1, 512), (4, 512), (16, 512), (4, 2048)), ((1, 8), (3, 8))
LAYOUTS = ("padded", "packed")
MODES = ("stock", "invariant")


def samples_for(shapes, vocab: int, seed: int = 5) -> dict:
    """seq -> the pool of samples (1-D token ids) the batches of that length take from."""
    gen = torch.Generator().manual_seed(seed)
    pools = {}
    for seq in dict.fromkeys(s for _, s in shapes):
        count = max(b for b, s in shapes if s == seq)
        lengths = [seq] + torch.randint(max(2, seq // 2), seq + 1, (count - 1,), generator=gen).tolist()
        pools[seq] = [torch.randint(0, vocab, (n,), generator=gen) for n in lengths]
    return pools


def make_batch(layout: str, samples: list, seq: int, device):
    """(input_ids, attention_mask or None, position_ids) of one training batch."""
    if layout == "packed":
        ids = torch.cat(samples)[None]
        positions = torch.cat([torch.arange(len(s)) for s in samples])[None]
        return ids.to(device), None, positions.to(device)
    ids, mask = pad_sequences(samples, side="right", width=seq)
    return ids.to(device), mask.to(device), positions_from_mask(mask, seq).to(device)


def stock_logprobs(model, ids, mask, positions):
    """[B, L-1] fp32 next-token logprobs from the stock forward, 0 where nothing is scored. Without a
    mask, transformers' SDPA path finds packed sequences from the restarting ``position_ids``."""
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
    logps = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return logps * scored_positions(ids, mask, positions)


def batch_logprobs(model, mode: str, ids, mask, positions):
    if mode == "invariant":  # padded rows: positions derived from the mask (the same values)
        return token_logprobs(model, ids, mask, position_ids=None if mask is not None else positions)
    return stock_logprobs(model, ids, mask, positions)


def train_step(model, mode: str, ids, mask, positions) -> torch.Tensor:
    """One forward + backward; returns the batch's logprobs (detached)."""
    model.zero_grad(set_to_none=True)
    logps = batch_logprobs(model, mode, ids, mask, positions)
    scored = scored_positions(ids, mask, positions)
    loss = -(logps * scored).sum() / scored.sum().clamp(min=1)
    loss.backward()
    return logps.detach()


def alone_logprobs(model, mode: str, sample: torch.Tensor) -> torch.Tensor:
    """[len - 1] logprobs of the sample run alone (batch 1, no padding), grad off, train mode."""
    ids = sample[None].to(next(model.parameters()).device)
    with torch.no_grad():
        positions = torch.arange(ids.shape[1], device=ids.device)[None]
        return batch_logprobs(model, mode, ids, torch.ones_like(ids), positions)[0]


def _measure(ctx: Run, model, mode: str, layout: str, seq: int, samples: list, alone: torch.Tensor) -> dict:
    ids, mask, positions = make_batch(layout, samples, seq, ctx.device)
    step = lambda: train_step(model, mode, ids, mask, positions)  # noqa: E731
    reset_peak(ctx.device)
    started = time.perf_counter()
    logps = step()  # warm-up (compiles kernels) and the peak-memory pass
    first_ms = (time.perf_counter() - started) * 1e3
    peak = peak_gb(ctx.device)
    # CPU: the one step's wall time (interpreted kernels; not meaningful); GPU: CUDA-event median.
    ms = time_ms(step, ctx.device, reps=5 if ids.numel() <= 8192 else 3, warmup=0) if ctx.on_gpu else first_ms
    tokens = sum(len(s) for s in samples)
    in_batch = logps[0, :len(samples[0]) - 1].float().cpu()  # sample 0 starts row 0 in both layouts
    return {f"{mode}_ms": ms, f"{mode}_tokens_per_s": tokens / (ms * 1e-3), f"{mode}_peak_gb": peak,
            f"{mode}_logprob_max_abs_diff": (in_batch - alone).abs().max().item(),
            f"{mode}_logprob_bitwise_equal": torch.equal(in_batch, alone), "tokens": tokens}


def run(ctx: Run, config=None, shapes=None, dtype=torch.bfloat16, family: str = DEFAULT_FAMILY,
        preset: str = DEFAULT_PRESET) -> dict:
    overrides = {} if ctx.quick else {"num_hidden_layers": TRAIN_LAYERS}
    config, name = preset_config(family, "tiny" if ctx.quick else preset, config, **overrides)
    shapes = shapes or (QUICK_SHAPES if ctx.quick else SHAPES)
    model = build_model(ctx, config, dtype).train()
    pools = samples_for(shapes, config.vocab_size)
    model_info = {"preset": name, "layers": config.num_hidden_layers, "hidden": config.hidden_size,
                  "intermediate": config.intermediate_size, "vocab": config.vocab_size, "dtype": str(dtype)[6:],
                  "params_m": sum(p.numel() for p in model.parameters()) / 1e6}
    rows = {(layout, b, s): {"layout": layout, "batch": b, "seq": s, **model_info}
            for layout in LAYOUTS for b, s in shapes}
    alone = {}
    try:
        # Shape by shape, each layout, stock then invariant: a budget cut keeps whole rows of the smaller shapes.
        for batch, seq in tqdm(shapes, desc="train", leave=False):
            for layout in LAYOUTS:
                row = rows[layout, batch, seq]
                for mode in MODES:
                    if ctx.out_of_time(f"train {layout} {mode} {batch}x{seq}"):
                        continue
                    try:
                        if mode == "invariant":
                            make_invariant(model).train()
                        sample = pools[seq][0]
                        if (mode, seq) not in alone:
                            alone[mode, seq] = alone_logprobs(model, mode, sample).float().cpu()
                        row.update(_measure(ctx, model, mode, layout, seq, pools[seq][:batch], alone[mode, seq]))
                    except Exception as exc:
                        ctx.failed(f"train {layout} {mode} {batch}x{seq}", exc)
                    finally:
                        restore(model)
    finally:
        del model
        free_memory(ctx.device)
    for row in rows.values():
        for mode in MODES:
            for key in ("ms", "tokens_per_s", "peak_gb", "logprob_max_abs_diff", "logprob_bitwise_equal"):
                row.setdefault(f"{mode}_{key}", None)
        row.setdefault("tokens", None)
        row["ratio"] = (row["invariant_ms"] / row["stock_ms"]
                        if row["stock_ms"] and row["invariant_ms"] else None)
    return {"train": list(rows.values())}
