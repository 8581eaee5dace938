"""One rank of the tensor-parallel audit, started by ``torchrun`` (gloo on CPU): for every checkpoint
named on the command line (``--model name=path``) it loads the model with ``tp_plan="auto"`` and
audits it stock, patched, and patched with ``make_invariant(strict=True)``; rank 0 writes each
report to OUT/<name>-<stock|invariant|strict>.txt (the strict line: "strict ok" or the error)."""
from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from invariant_infer import audit, make_invariant
from invariant_infer.errors import NonInvariantOpError


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", action="append", default=[])
    args = parser.parse_args()
    out = Path(args.out)
    for spec in args.model:
        name, path = spec.split("=", 1)
        model = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=torch.bfloat16).eval()
        reports = {"stock": str(audit(model))}
        reports["invariant"] = str(audit(make_invariant(model)))
        try:
            make_invariant(model, strict=True)
            reports["strict"] = "strict ok"
        except NonInvariantOpError as error:
            reports["strict"] = f"strict refused: {error}"
        if dist.get_rank() == 0:
            for variant, text in reports.items():
                (out / f"{name}-{variant}.txt").write_text(text)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
