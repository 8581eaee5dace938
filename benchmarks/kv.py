"""The KV memory report: the cache bytes one request holds when every attention layer keeps its whole
context (before) and when a sliding-window layer keeps only the pages its window spans (after), and
the most requests a fixed KV budget holds at once, for real presets at long contexts.

    python -m benchmarks kv                                   # Gemma-3-27B, gpt-oss-20b, Mistral-7B-v0.1
    python -m benchmarks kv --contexts 8192,131072 --budget-gib 60
    python -m benchmarks kv --write-doc                       # and replace the table in docs/benchmarks.md

Analytic, from each layer's cache spec (``invariant_infer.model.cache_specs``) of the presets in
``invariant_infer.model.families``: no weights, no GPU. The accounting (``request_cache_bytes``, over
the engine's own pages per spec, ``invariant_infer.engine.kv_cache_layout.pages_held``), at a decode step:
  * the engine stores K/V in pages of the CUDA attention kernel's KV block (``attention_config("cuda",
    dtype, head_dim).block_n``: 64 tokens at head_dim 64 and 128), so a layer holds whole pages;
  * a full-attention layer holds the pages of every token of the context, before and after;
  * a sliding-window layer of window w: before, the same as a full layer; after, at most
    (w - 1) // page + 2 pages, i.e. ceil(w / page) + 1: its window rounded up to whole pages, plus one
    because a window starts anywhere in a page (and the step's token, the chunk in flight, ends it);
  * a linear-attention layer holds its fixed state (``LinearStateSpec.state_bytes`` with a chunk's
    unfinished rows), the same before and after;
  * one rank (no tensor parallelism), bf16.
Requests at a budget: the budget's bytes over one request's, rounded down.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import torch

from invariant_infer.engine.kv_cache_layout import pages_held
from invariant_infer.kernels import attention_config
from invariant_infer.kernels.gated_delta_rule import CHUNK
from invariant_infer.model.cache_specs import (AttentionSpec, FullAttentionSpec, LayerCacheSpec, LinearStateSpec,
                                               SlidingWindowSpec, cache_specs)
from invariant_infer.testing.random_checkpoints import random_config

from .doc_sections import DOC, replace_section

BEGIN, END = "<!-- kv-report:begin -->", "<!-- kv-report:end -->"
DTYPE = torch.bfloat16
CONTEXTS = (8192, 32768)
BUDGET_GIB = 40.0
# Report name -> (family, preset).
MODELS = {"gemma-3-27b": ("gemma3_text", "gemma-3-27b"), "gpt-oss-20b": ("gpt_oss", "gpt-oss-20b"),
          "mistral-7b-v0.1": ("mistral", "mistral-7b-v0.1")}
GIB = 1 << 30


def cuda_page_size(specs: tuple[LayerCacheSpec, ...], dtype: torch.dtype) -> int:
    """Tokens per page of the engine's cache on CUDA: the attention kernel's KV block at the layers' head_dim."""
    head_dim = next(spec.head_dim for spec in specs if isinstance(spec, AttentionSpec))
    return attention_config("cuda", dtype, head_dim).block_n


def request_cache_bytes(specs: tuple[LayerCacheSpec, ...], context: int, dtype: torch.dtype, page_size: int,
                        windows: bool = True) -> int:
    """Bytes of cache one request of ``context`` tokens holds over every layer at a decode step, by the
    engine's own page accounting (``pages_held``); ``windows=False``: every attention layer keeps the
    whole context, as a full-attention layer does."""
    total = 0
    for spec in specs:
        if isinstance(spec, LinearStateSpec):
            total += spec.state_bytes(dtype, CHUNK - 1)
        else:
            held = spec if windows else FullAttentionSpec(spec.num_kv_heads, spec.head_dim)
            total += pages_held(held, context, page_size) * page_size * spec.kv_bytes_per_token(dtype)
    return total


@dataclass(frozen=True)
class KvRow:
    model: str
    context: int
    layers: str          # the layers by kind: "10 full + 52 sliding (w 1024)"
    page_size: int
    before: int          # bytes per request, every layer holding the whole context
    after: int           # bytes per request, sliding layers holding their windows
    budget: int          # bytes

    @property
    def ratio(self) -> float:
        return self.before / self.after

    @property
    def requests_before(self) -> int:
        return self.budget // self.before

    @property
    def requests_after(self) -> int:
        return self.budget // self.after


def layer_kinds(specs: tuple[LayerCacheSpec, ...]) -> str:
    full = sum(isinstance(spec, FullAttentionSpec) for spec in specs)
    windows = sorted({spec.window for spec in specs if isinstance(spec, SlidingWindowSpec)})
    sliding = sum(isinstance(spec, SlidingWindowSpec) for spec in specs)
    linear = sum(isinstance(spec, LinearStateSpec) for spec in specs)
    parts = [f"{full} full"] if full else []
    if sliding:
        parts.append(f"{sliding} sliding (w {', '.join(map(str, windows))})")
    if linear:
        parts.append(f"{linear} linear")
    return " + ".join(parts)


def kv_rows(models: dict[str, tuple[str, str]] = MODELS, contexts=CONTEXTS, budget_gib: float = BUDGET_GIB,
            dtype: torch.dtype = DTYPE) -> list[KvRow]:
    rows = []
    for name, (family, preset) in models.items():
        specs = cache_specs(random_config(family, preset))  # the preset's config (no weights)
        page = cuda_page_size(specs, dtype)
        for context in contexts:
            rows.append(KvRow(name, context, layer_kinds(specs), page,
                              request_cache_bytes(specs, context, dtype, page, windows=False),
                              request_cache_bytes(specs, context, dtype, page), int(budget_gib * GIB)))
    return rows


def table(rows: list[KvRow]) -> str:
    """The markdown table, ending with a newline."""
    budget = f"{rows[0].budget / GIB:g} GiB" if rows else ""
    lines = [f"`python -m benchmarks kv --write-doc`. KV bytes per request (bf16, one rank), pages of the CUDA "
             f"attention kernel's KV block; requests: how many fit in {budget} of KV at once.", "",
             "| model | layers | context | page | before MiB | after MiB | before / after | "
             "requests before | requests after |", "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row.model} | {row.layers} | {row.context:,} | {row.page_size} | {row.before / 2**20:,.1f} | "
                     f"{row.after / 2**20:,.1f} | {row.ratio:.2f} | {row.requests_before} | {row.requests_after} |")
    return "\n".join(lines) + "\n"


def write_doc(text: str, doc=None) -> None:
    replace_section(text, BEGIN, END, doc or DOC)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks kv", description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", help=f"comma-separated, of: {', '.join(MODELS)} (default: all)")
    parser.add_argument("--contexts", default=",".join(map(str, CONTEXTS)), help="comma-separated token counts")
    parser.add_argument("--budget-gib", type=float, default=BUDGET_GIB, help="the KV budget the request counts fill")
    parser.add_argument("--write-doc", action="store_true", help=f"replace the table in {DOC.name}")
    args = parser.parse_args(argv)
    names = args.models.split(",") if args.models else list(MODELS)
    unknown = [name for name in names if name not in MODELS]
    if unknown:
        parser.error(f"unknown models {unknown}; choose from {', '.join(MODELS)}")
    contexts = tuple(int(c) for c in args.contexts.split(","))
    text = table(kv_rows({name: MODELS[name] for name in names}, contexts, args.budget_gib))
    print(text, end="")
    if args.write_doc:
        write_doc(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
