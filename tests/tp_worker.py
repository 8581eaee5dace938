"""One rank of a tensor-parallel test run, started by ``torchrun`` (gloo on CPU). For every
checkpoint named on the command line it loads the model with ``tp_plan="auto"`` and writes, from
rank 0, the logits of one padded batch to OUT/<name>-<dtype>-<variant>.pt:
  * ``invariant``: ``make_invariant`` on the sharded model;
  * ``stock``: transformers' own tensor parallelism, unpatched (fp32 only);
  * ``restored``: patched, then ``restore``d: stock again;
  * ``allreduce``: the control: invariant, except that each row-parallel layer adds its own leaves
    and all-reduces the result in the model's dtype, as stock TP does (a TP-dependent order).
Refusals: for each REFUSE checkpoint (loaded with tp_plan="auto", or with PLAN_OVERRIDE for a
--refuse-plan one), make_invariant's error goes to OUT/refused-<name>.txt."""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM
from transformers.distributed import DistributedConfig
from transformers.integrations.tensor_parallel import ALL_PARALLEL_STYLES

from invariant_infer.model import tensor_parallel
from invariant_infer.model.patch import make_invariant, restore
from tp_controls import allreduce_exchange

# A layout the trees do not serve: embeddings sharded on the hidden dimension. transformers 5.24
# names it embedding_colwise; 5.17 lacks that name, and its colwise shards an nn.Embedding so.
HIDDEN_SHARDED_EMBEDDING = "embedding_colwise" if "embedding_colwise" in ALL_PARALLEL_STYLES else "colwise"
PLAN_OVERRIDE = {"model.embed_tokens": HIDDEN_SHARDED_EMBEDDING}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def padded_batch(vocab: int):
    """Three left-padded rows of 7, 3 and 5 tokens."""
    generator = torch.Generator().manual_seed(11)
    lengths = (7, 3, 5)
    width = max(lengths)
    ids = torch.zeros((len(lengths), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, width - n:] = torch.randint(1, vocab, (n,), generator=generator)
        mask[row, width - n:] = 1
    return ids, mask


def logits(path: str, dtype: torch.dtype, variant: str) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=dtype).eval()
    if variant != "stock":
        make_invariant(model)
    if variant == "restored":  # transformers' own TP hooks are back
        restore(model)
    ids, mask = padded_batch(model.config.vocab_size)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", action="append", default=[], help="NAME=PATH")
    parser.add_argument("--dtype", action="append", default=[], choices=sorted(DTYPES))
    parser.add_argument("--variant", action="append", default=[], help="invariant, stock, restored or allreduce[:DTYPE]")
    parser.add_argument("--refuse", action="append", default=[], help="NAME=PATH")
    parser.add_argument("--refuse-plan", action="append", default=[], help="NAME=PATH")
    args = parser.parse_args()
    out = Path(args.out)
    exchange = tensor_parallel.exchange_partials
    for spec in args.model:
        name, path = spec.split("=", 1)
        for variant in args.variant:
            variant, _, only = variant.partition(":")
            for dtype_name in ([only] if only else args.dtype):
                tensor_parallel.exchange_partials = allreduce_exchange if variant == "allreduce" else exchange
                result = logits(path, DTYPES[dtype_name], variant)
                if dist.get_rank() == 0:
                    torch.save(result, out / f"{name}-{dtype_name}-{variant}.pt")
    tensor_parallel.exchange_partials = exchange
    for spec in args.refuse + [f"{s}=plan" for s in args.refuse_plan]:
        name, path, *plan = spec.split("=")
        distributed = DistributedConfig(tp_size=int(os.environ["WORLD_SIZE"]), tp_plan=PLAN_OVERRIDE if plan else "auto")
        model = AutoModelForCausalLM.from_pretrained(path, distributed_config=distributed, dtype=torch.float32).eval()
        try:
            make_invariant(model)
            message = "accepted"
        except Exception as error:  # the test checks the type and the text
            message = f"{type(error).__name__}: {error}"
        if dist.get_rank() == 0:
            (out / f"refused-{name}.txt").write_text(message)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
