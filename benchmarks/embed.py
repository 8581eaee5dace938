"""Embedding models: encode throughput (forward, pooling, L2 normalisation) invariant vs stock, and how far a
row's embedding moves between alone and inside a batch.

Models, random weights in bf16 (no downloads), each built as its embedders run it:
  * ``bert-base``: BERT-base's widths (hidden 768, 12 layers, 12 heads, MLP 3072), CLS pooling (as
    bge-base-en-v1.5), right padding;
  * ``xlm-roberta-base``: the same widths with XLM-R's 250002-token vocabulary, mean pooling (as
    multilingual-e5-base), right padding;
  * ``qwen3-embedding-0.6b``: Qwen3-0.6B's widths (hidden 1024, 28 layers, 16 query heads of 128 on 8 KV
    heads, MLP 3072) as Qwen3-Embedding-0.6B runs them: the base model, last-token pooling, left padding.
Every embedding is L2-normalised. Stock: transformers' "sdpa" model called as sentence-transformers calls it
(``input_ids`` and ``attention_mask``; so a left-padded Qwen3 row's positions start at the batch's first column),
pooled as its ``Pooling`` pools a padded batch (``stock_pool``, torch ops: fp32 sums for mean), then
``torch.nn.functional.normalize``.
Invariant: the same model after ``make_invariant`` (then ``restore``), ``invariant_infer.model.pooling.pool`` and
``normalize``. Quick: each family's ``tiny`` preset with 1 layer (hidden 64), batches 1 and 8, rows of 4-16 tokens.

Rows of ``embed`` (one per model and batch): sequences/s of each path, ``ratio`` = invariant ms / stock ms
(above 1: invariant slower), ``throughput_ratio`` = invariant sequences/s / stock sequences/s, and the max
|invariant - stock| over the batch's embeddings. Rows of ``embed_divergence`` (one per model and batch): each
checked row encoded alone (unpadded, batch 1) against its embedding in the batch; max |delta| and how many
rows are not bitwise equal (``torch.equal``), for each path. Each model gets an equal share of the section's
time left (what one leaves passes on); stock and invariant of an item run back to back.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AutoModel

from invariant_infer import make_invariant, restore
from invariant_infer.model.pooling import normalize, pool
from invariant_infer.testing.random_checkpoints import random_config, random_model

from .timing import Run, free_memory, time_ms

MODES = ("stock", "invariant")
DTYPE = torch.bfloat16


@dataclass(frozen=True)
class EmbedModel:
    name: str
    family: str
    preset: str
    pooling: str  # a mode of invariant_infer.model.pooling.POOLING_MODES
    side: str     # padding side


MODELS = (EmbedModel("bert-base", "bert", "bert-base", "cls", "right"),
          EmbedModel("xlm-roberta-base", "xlm-roberta", "xlm-roberta-base", "mean", "right"),
          EmbedModel("qwen3-embedding-0.6b", "qwen3", "qwen3-0.6b", "lasttoken", "left"))
BATCHES, QUICK_BATCHES = (1, 32, 256), (1, 8)
DIVERGENCE_BATCHES, QUICK_DIVERGENCE_BATCHES = (32, 256), (4, 8)
LENGTHS, QUICK_LENGTHS = (32, 256), (4, 16)  # real tokens per row, drawn uniformly in [lo, hi]
CHECKED_ROWS, QUICK_CHECKED_ROWS = 16, 2     # rows encoded alone per divergence batch, spread over it
QUICK_OVERRIDES = dict(num_hidden_layers=1)  # the tiny presets, one layer: the interpreter runs every kernel
FIRST_TOKEN_ID = 3                           # random ids from here: never a pad (XLM-R's stock positions read ids)


def stock_pool(hidden: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """sentence-transformers' ``Pooling`` of a padded batch (6.x), in torch: cls = the first real token,
    mean = fp32 sum of the real tokens / their count, lasttoken = the last real token."""
    if mode == "cls":
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), mask.to(torch.int).argmax(dim=1)]
    if mode == "mean":
        expanded = mask.unsqueeze(-1).to(hidden.dtype)
        total = (hidden * expanded).sum(dim=1, dtype=torch.float32)
        return (total / expanded.sum(dim=1, dtype=torch.float32).clamp(min=1e-9)).to(hidden.dtype)
    if mode == "lasttoken":
        values, indices = mask.flip(1).max(1)
        indices = torch.where(values == 0, hidden.shape[1] - 1, indices)
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        return (hidden * mask.unsqueeze(-1).to(hidden.dtype))[rows, hidden.shape[1] - indices - 1]
    raise ValueError(f"stock_pool: no stock pooling {mode!r} in this benchmark (cls, mean, lasttoken)")


def encode(model, spec: EmbedModel, mode: str, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, H] normalised embeddings of the padded batch, on the ``mode`` path (the model patched or not)."""
    hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
    if mode == "invariant":
        return normalize(pool(hidden, mask, spec.pooling))
    return F.normalize(stock_pool(hidden, mask, spec.pooling), p=2, dim=-1)


def random_rows(lengths: tuple, batch: int, vocab: int, gen: torch.Generator) -> list[torch.Tensor]:
    """``batch`` rows of random ids; the first at the longest length, the others of random lengths."""
    lo, hi = lengths
    sizes = [hi] + torch.randint(lo, hi + 1, (batch - 1,), generator=gen).tolist()
    return [torch.randint(FIRST_TOKEN_ID, vocab, (n,), generator=gen) for n in sizes[:batch]]


def pad(rows: list[torch.Tensor], side: str, pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        cols = slice(width - len(row), width) if side == "left" else slice(0, len(row))
        ids[i, cols], mask[i, cols] = row, 1
    return ids.to(device), mask.to(device)


def checked_rows(batch: int, limit: int) -> list[int]:
    """``limit`` rows spread evenly over the batch, first and last included."""
    if limit >= batch:
        return list(range(batch))
    return sorted({round(i * (batch - 1) / (limit - 1)) for i in range(limit)})


@contextlib.contextmanager
def _mode(model, mode: str):
    if mode == "stock":
        yield
        return
    make_invariant(model)
    try:
        yield
    finally:
        restore(model)


def build(ctx: Run, spec: EmbedModel, dtype: torch.dtype = DTYPE):
    config = random_config(spec.family, "tiny", **QUICK_OVERRIDES) if ctx.quick else \
        random_config(spec.family, spec.preset)
    with torch.device(ctx.device):  # random weights made on the device (XLM-R's embeddings alone are 192M)
        model = random_model(config, seed=0, dtype=dtype, auto_class=AutoModel)
    model.set_attn_implementation("sdpa")
    return model, config


def _throughput(ctx: Run, model, spec: EmbedModel, batch: int, ids, mask, row: dict) -> None:
    outs = {}
    for mode in MODES:
        if ctx.out_of_time(f"embed {spec.name} {mode} B={batch}"):
            return
        try:
            with _mode(model, mode):
                fn = lambda: encode(model, spec, mode, ids, mask)  # noqa: E731
                if ctx.on_gpu:
                    outs[mode] = fn().float().cpu()  # warm-up (compiles the kernels) and the output compared
                    ms = time_ms(fn, ctx.device, reps=3 if batch >= 256 else 5, warmup=0)
                else:  # one call through the interpreter: its output, and a time that means nothing
                    started = time.perf_counter()
                    outs[mode] = fn().float()
                    ms = (time.perf_counter() - started) * 1e3
        except Exception as exc:
            ctx.failed(f"embed {spec.name} {mode} B={batch}", exc)
            return
        row.update({f"{mode}_ms": ms, f"{mode}_sequences_per_s": batch / (ms * 1e-3)})
    row["ratio"] = row["invariant_ms"] / row["stock_ms"]
    row["throughput_ratio"] = row["invariant_sequences_per_s"] / row["stock_sequences_per_s"]
    row["max_abs_diff_to_stock"] = (outs["invariant"] - outs["stock"]).abs().max().item()


def _divergence(ctx: Run, model, spec: EmbedModel, rows: list, pad_id: int, checked: list, row: dict) -> None:
    ids, mask = pad(rows, spec.side, pad_id, ctx.device)
    for mode in MODES:
        if ctx.out_of_time(f"embed divergence {spec.name} {mode} B={len(rows)}"):
            return
        try:
            with _mode(model, mode):
                batched = encode(model, spec, mode, ids, mask)
                diffs, unequal = [], 0
                for i in checked:
                    alone_ids = rows[i].to(ctx.device)[None]
                    alone = encode(model, spec, mode, alone_ids, torch.ones_like(alone_ids))[0]
                    diffs.append((alone.float() - batched[i].float()).abs().max().item())
                    unequal += not torch.equal(alone, batched[i])
        except Exception as exc:
            ctx.failed(f"embed divergence {spec.name} {mode} B={len(rows)}", exc)
            continue
        row.update({f"{mode}_max_abs_diff": max(diffs), f"{mode}_rows_unequal": unequal,
                    f"{mode}_rows_checked": len(checked)})


def model_rows(ctx: Run, spec: EmbedModel, batches, divergence_batches,
               dtype: torch.dtype = DTYPE) -> tuple[list, list]:
    """(``embed`` rows, ``embed_divergence`` rows) of one model at these batch sizes."""
    model, config = build(ctx, spec, dtype)
    pad_id = config.pad_token_id if config.pad_token_id is not None else 0
    lengths = QUICK_LENGTHS if ctx.quick else LENGTHS
    gen = torch.Generator().manual_seed(7)
    about = {"model": spec.name, "preset": f"{spec.family}:{'tiny' if ctx.quick else spec.preset}",
             "pooling": spec.pooling, "padding": spec.side, "layers": config.num_hidden_layers,
             "hidden": config.hidden_size, "vocab": config.vocab_size, "dtype": str(dtype)[6:]}
    speed, drift = [], []
    with torch.inference_mode():
        for batch in batches:
            rows = random_rows(lengths, batch, config.vocab_size, gen)
            ids, mask = pad(rows, spec.side, pad_id, ctx.device)
            row = {**about, "batch": batch, "tokens": int(mask.sum()), "padded_length": ids.shape[1]}
            _throughput(ctx, model, spec, batch, ids, mask, row)
            if "stock_ms" in row:  # a row per item that measured something
                speed.append(row)
        for batch in divergence_batches:
            rows = random_rows(lengths, batch, config.vocab_size, gen)
            checked = checked_rows(batch, QUICK_CHECKED_ROWS if ctx.quick else CHECKED_ROWS)
            row = {**about, "batch": batch}
            _divergence(ctx, model, spec, rows, pad_id, checked, row)
            if "stock_rows_checked" in row or "invariant_rows_checked" in row:
                drift.append(row)
    del model
    free_memory(ctx.device)
    return speed, drift


SPEED_FIELDS = ("stock_ms", "invariant_ms", "stock_sequences_per_s", "invariant_sequences_per_s", "ratio",
                "throughput_ratio", "max_abs_diff_to_stock")
DRIFT_FIELDS = tuple(f"{mode}_{key}" for mode in MODES for key in ("max_abs_diff", "rows_unequal", "rows_checked"))


def run(ctx: Run, family: str | None = None, preset: str | None = None) -> dict:
    """The section (the models are fixed: ``family`` and ``preset``, the suite's preset, are not used)."""
    speed, drift = [], []
    batches = ctx.grid(BATCHES, QUICK_BATCHES)
    divergence_batches = ctx.grid(DIVERGENCE_BATCHES, QUICK_DIVERGENCE_BATCHES)
    deadline = ctx.deadline
    try:
        for i, spec in enumerate(MODELS):
            if deadline is not None:  # an equal share of what is left; time one model leaves passes on
                ctx.deadline = time.monotonic() + (deadline - time.monotonic()) / (len(MODELS) - i)
            if not (batches or divergence_batches) or ctx.out_of_time(f"embed {spec.name}"):
                continue
            try:
                rows = model_rows(ctx, spec, batches, divergence_batches)
            except Exception as exc:
                ctx.failed(f"embed {spec.name}", exc)
                continue
            speed += rows[0]
            drift += rows[1]
    finally:
        ctx.deadline = deadline
    for row in speed:
        for key in SPEED_FIELDS:
            row.setdefault(key, None)
    for row in drift:
        for key in DRIFT_FIELDS:
            row.setdefault(key, None)
    return {"embed": speed, "embed_divergence": drift}


def markdown(results: dict, table) -> str:
    """RESULTS.md's tables of this section (``table``: report_markdown's, which calls this)."""
    if not results.get("embed") and not results.get("embed_divergence"):
        return ""
    return "\n".join([
        "\n## Embedding models: encode throughput (forward, pooling, L2 normalisation), invariant vs stock\n\n"
        "ratio = invariant ms / stock ms (above 1 = invariant slower); throughput ratio = invariant sequences/s / "
        "stock sequences/s; max abs Δ to stock over the batch's normalised embeddings.\n",
        table(results.get("embed"), [
            ("model", "model"), ("pooling", "pooling"), ("padding", "padding"), ("batch", "batch"),
            ("tokens", "tokens"), ("stock seq/s", "stock_sequences_per_s"),
            ("invariant seq/s", "invariant_sequences_per_s"), ("ratio", "ratio"),
            ("throughput ratio", "throughput_ratio"), ("max abs Δ to stock", "max_abs_diff_to_stock")]),
        "\n## Embedding models: a row's embedding alone vs in the batch\n\n"
        "max |Δ| over the checked rows' normalised embeddings, each row alone (unpadded) vs in the batch; rows "
        "unequal = not bitwise equal (`torch.equal`), of rows checked.\n",
        table(results.get("embed_divergence"), [
            ("model", "model"), ("batch", "batch"), ("stock max abs Δ", "stock_max_abs_diff"),
            ("stock rows unequal", "stock_rows_unequal"), ("invariant max abs Δ", "invariant_max_abs_diff"),
            ("invariant rows unequal", "invariant_rows_unequal"), ("rows checked", "invariant_rows_checked")])])
