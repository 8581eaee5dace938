"""``invariant-infer check``: is this checkpoint batch-invariant here, on this device and these
library versions?

Loads the checkpoint as ``serve`` and ``score`` do (a causal LM, or an image-text-to-text model of a
vision-language family; another architecture or model type is refused by name before any weight is
loaded), prints the device, the library versions and the compile options the kernels pin, then runs
the audit (every reduction of a forward on an invariant kernel) and a probe at the model's real
widths: a few short rows of random token ids alone against the same rows in a left-padded and in a
right-padded batch, and a decode step with the KV cache against the same position of the prefill,
each compared bitwise (torch.equal on the logits). One line per check, PASS or FAIL (with the max
|Δ logit| of a failed comparison); the exit status is 0 only when every check passes.
``invariant-infer serve`` runs the same check before it takes traffic."""
from __future__ import annotations

import argparse
import sys

from ..checkpoints.loading import DEVICES, DTYPES, load_model, resolve_device
from ..errors import InvariantInferError
from ..testing.invariance_check import REFUSALS, check_invariance, environment
from . import exit_codes
from .help_text import exit_status_epilog, plain


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="a checkpoint directory (or hub id) of a supported family")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="default: bf16 on cuda, fp32 on cpu")
    p.add_argument("--device", choices=DEVICES, help="default: cuda if available")
    p.add_argument("--seed", type=int, default=0, help="the probe's random token ids (default: 0)")


def run(args) -> int:
    refused = exit_codes.architecture_refusal("check", args.model)
    if refused is not None:
        return refused
    device = resolve_device(args.device)
    print(f"model:           {args.model}")
    for line in environment(device):
        print(line)
    try:
        model = load_model(args.model, dtype=args.dtype, device=device.type)
    except (InvariantInferError, OSError, ValueError) as exc:  # what make_invariant refuses; unreadable weights
        print(f"invariant-infer check: {args.model}: {exc}", file=sys.stderr)
        return exit_codes.REFUSED
    print(f"dtype:           {str(next(model.parameters()).dtype).removeprefix('torch.')}", flush=True)
    try:
        report = check_invariance(model, seed=args.seed, on_result=lambda result: print(result, flush=True))
    except REFUSALS as exc:  # refused at its first forward (FP8 on a GPU without it)
        print(f"invariant-infer check: {args.model}: {exc}", file=sys.stderr)
        return exit_codes.REFUSED
    if not report.ok:
        print(f"not batch-invariant here: {'; '.join(report.failed)}")
        return exit_codes.NOT_INVARIANT
    print("batch-invariant here: every check passed")
    return exit_codes.OK


def add_parser(sub) -> None:
    p = sub.add_parser("check", help="check that a checkpoint is batch-invariant on this machine",
                       description=plain(__doc__), epilog=exit_status_epilog(),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(run=run)


def main(argv: list[str] | None = None) -> int:
    """``python -m invariant_infer.cli.check ...``: the check command on its own."""
    parser = argparse.ArgumentParser(prog="invariant-infer check", description=plain(__doc__),
                                     epilog=exit_status_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
