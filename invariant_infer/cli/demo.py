"""``invariant-infer demo``: the same model, stock and invariant, batch vs alone.

By default it builds a random-init model with Qwen2.5-1.5B's layer widths (one layer, small
vocab) that runs on CPU through the Triton interpreter in under a minute; ``--family`` picks
another family's real widths. ``--model PATH`` runs a real checkpoint of any supported family
(on GPU when one is present). Both runs give the batch position_ids = cumsum(mask) - 1, so the
stock figure is reduction order alone. A checkpoint of another architecture or model type is refused by
name before any weight is loaded (exit status 6); another refused model or checkpoint exits 2."""
from __future__ import annotations

import argparse
import sys
import time

import torch
from tqdm import tqdm

from ..testing.drift import batch_drift
from ..model.families import FAMILIES
from ..checkpoints.loading import DEVICES, DTYPES, load_model, resolve_device
from ..errors import InvariantInferError
from ..model.patch import make_invariant, restore
from ..model.quantization import describe_quantization, is_quantized, weight_bytes
from ..testing.random_checkpoints import random_config, random_model
from . import exit_codes
from .help_text import exit_status_epilog, plain

SAMPLE_LENGTHS = (1, 33, 7, 20)
# The real widths each family's built-in random model takes (one layer, small vocab).
DEMO_PRESETS = {"qwen2": "qwen2.5-1.5b", "qwen3": "qwen3-0.6b", "llama": "llama-3.2-1b", "mistral": "mistral-7b-v0.3"}


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="show stock HF logits drifting between batch and alone, and ours not",
                       description=plain(__doc__), epilog=exit_status_epilog(),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a checkpoint directory or hub id of a supported family "
                   f"({', '.join(sorted(FAMILIES))}); default: a built-in random model")
    p.add_argument("--family", choices=sorted(DEMO_PRESETS), default="qwen2",
                   help="the built-in random model's family and widths (ignored with --model)")
    p.add_argument("--dtype", choices=DTYPES, default="bf16")
    p.add_argument("--device", choices=DEVICES, help="default: cuda if available")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(run=run)


def _load(args, device):
    if args.model is None:
        preset = DEMO_PRESETS[args.family]
        config = random_config(args.family, preset, num_hidden_layers=1, vocab_size=2048,
                               max_position_embeddings=1024)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        heads = f"{config.num_attention_heads}/{config.num_key_value_heads} heads of {head_dim}"
        return random_model(config, seed=args.seed, dtype=DTYPES[args.dtype]).to(device), \
            (f"random-init, {preset} widths (hidden {config.hidden_size}, MLP {config.intermediate_size}, "
             f"{heads}), 1 layer, vocab 2048")
    return load_model(args.model, dtype=args.dtype, device=device.type, invariant=False), args.model


def run(args) -> int:
    """The exit statuses of ``check`` and ``score``: 6 for an architecture or model type that is not run,
    2 for another refusal (an unreadable checkpoint, a model make_invariant refuses), each on stderr."""
    subject = args.model or "the built-in model"
    refused = None if args.model is None else exit_codes.architecture_refusal("demo", args.model)
    if refused is not None:
        return refused
    try:
        return _demo(args)
    except (InvariantInferError, OSError, ValueError) as exc:  # what make_invariant refuses; unreadable weights
        print(f"invariant-infer demo: {subject}: {exc}", file=sys.stderr)
        return exit_codes.REFUSED


def _demo(args) -> int:
    device = resolve_device(args.device)
    model, name = _load(args, device)
    # A quantized model's stock forward changes it (compressed-tensors decompresses every layer), or
    # needs a GPU kernel: the stock run gets a copy of its own.
    stock = _load(args, device)[0] if is_quantized(model) else model
    g = torch.Generator().manual_seed(args.seed)
    samples = [torch.randint(0, model.config.vocab_size, (n,), generator=g) for n in SAMPLE_LENGTHS]
    print(f"model:  {name}\n        {args.dtype} on {device}")
    print(f"weights: {weight_bytes(model) / 2**20:.2f} MiB as held in memory, {describe_quantization(model)}")
    print(f"batch:  {len(samples)} rows of {', '.join(map(str, SAMPLE_LENGTHS))} tokens, left-padded; "
          "each row also run alone")
    results = {}
    with tqdm(total=2 * (len(samples) + 1), desc="forward passes", unit="pass") as bar:
        for label, runs in (("stock HF", stock), ("invariant", model)):
            if label == "invariant":
                make_invariant(model)
            start = time.perf_counter()
            try:
                results[label] = (batch_drift(runs, samples, progress=bar), time.perf_counter() - start)
            except Exception as exc:  # e.g. transformers' fp8 kernels without a GPU
                if runs is model:
                    raise
                print(f"\nstock HF cannot run this checkpoint here: {type(exc).__name__}: {str(exc)[:200]}")
    restore(model)
    print(f"\n{'':12}{'max |Δ logit|':>15}{'rows bitwise equal':>22}{'time':>9}")
    for label, (drift, seconds) in results.items():
        print(f"{label:12}{drift.max_abs_diff:>15.6g}{f'{drift.rows - drift.rows_unequal}/{drift.rows}':>22}"
              f"{seconds:>8.1f}s")
    invariant_drift = results["invariant"][0]
    if invariant_drift.rows_unequal:
        print("\nFAIL: invariant logits differ between batch and alone")
        return exit_codes.ROW_ERRORS
    print("\ninvariant: every row bitwise equal to the same sample run alone (torch.equal).")
    if device.type == "cpu":
        print("(CPU runs the Triton kernels through the interpreter: its times say nothing about GPU speed.)")
    return exit_codes.OK
