"""``invariant-infer demo``: the same model, stock and invariant, batch vs alone.

By default it builds a random-init model with Qwen2.5-1.5B's layer widths (one layer, small
vocab) that runs on CPU through the Triton interpreter in under a minute. ``--model PATH``
runs a real checkpoint (on GPU when one is present)."""
from __future__ import annotations

import argparse
import time

import torch
from tqdm import tqdm

from .drift import batch_drift
from .models import qwen2_config, random_qwen2
from .patch import make_invariant, restore

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
SAMPLE_LENGTHS = (1, 33, 7, 20)


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="show stock HF logits drifting between batch and alone, and ours not",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a Qwen2/Qwen2.5 checkpoint directory or hub id (default: built-in random model)")
    p.add_argument("--dtype", choices=DTYPES, default="bf16")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(run=run)


def _load(args, device):
    dtype = DTYPES[args.dtype]
    if args.model is None:
        config = qwen2_config("qwen2.5-1.5b", num_hidden_layers=1, vocab_size=2048, max_position_embeddings=1024)
        return random_qwen2(config, seed=args.seed, dtype=dtype).to(device), \
            "random-init, Qwen2.5-1.5B widths (hidden 1536, MLP 8960, 12/2 heads), 1 layer, vocab 2048"
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(device).eval()
    return model, args.model


def run(args) -> int:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model, name = _load(args, device)
    g = torch.Generator().manual_seed(args.seed)
    samples = [torch.randint(0, model.config.vocab_size, (n,), generator=g) for n in SAMPLE_LENGTHS]
    print(f"model:  {name}\n        {args.dtype} on {device}")
    print(f"batch:  {len(samples)} rows of {', '.join(map(str, SAMPLE_LENGTHS))} tokens, left-padded; "
          "each row also run alone")
    results = {}
    with tqdm(total=2 * (len(samples) + 1), desc="forward passes", unit="pass") as bar:
        for label in ("stock HF", "invariant"):
            if label == "invariant":
                make_invariant(model)
            start = time.perf_counter()
            results[label] = (batch_drift(model, samples, progress=bar), time.perf_counter() - start)
    restore(model)
    print(f"\n{'':12}{'max |Δ logit|':>15}{'rows bitwise equal':>22}{'time':>9}")
    for label, (drift, seconds) in results.items():
        print(f"{label:12}{drift.max_abs_diff:>15.6g}{f'{drift.rows - drift.rows_unequal}/{drift.rows}':>22}"
              f"{seconds:>8.1f}s")
    invariant_drift = results["invariant"][0]
    if invariant_drift.rows_unequal:
        print("\nFAIL: invariant logits differ between batch and alone")
        return 1
    print("\ninvariant: every row bitwise equal to the same sample run alone (torch.equal).")
    if device.type == "cpu":
        print("(CPU runs the Triton kernels through the interpreter: its times say nothing about GPU speed.)")
    return 0
