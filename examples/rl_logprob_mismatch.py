"""Rollout logprobs vs trainer logprobs, as an RL loop (GRPO, PPO) sees them: invariant kernels vs stock.

    python examples/rl_logprob_mismatch.py                        # seconds on CPU
    python examples/rl_logprob_mismatch.py --family llama --prompts 16 --max-tokens 12 --temperature 0.7

An RL trainer samples completions with a rollout engine, which reports each sampled token's logprob,
then recomputes those logprobs in its own micro-batches to form the importance ratio
exp(trainer - sampler). Any difference biases the ratio. Here, on one random checkpoint:

  invariant  rollouts: ``invariant_infer.engine.Engine`` (continuous batching, paged KV cache), seeded
             sampling; trainer: ``invariant_infer.training.logprobs.token_logprobs`` on the same model in train
             mode with grad enabled, at two micro-batch sizes, each left-padded, right-padded and packed
             (padding-free: one row, position_ids restarting at each sequence).
  stock      rollouts: transformers ``generate`` (left-padded batch, KV cache, sampling), each sampled
             token's logprob from its raw logits; trainer: the stock forward on the same micro-batches,
             fp32 ``log_softmax(logits / T)`` and gather, as TRL computes them.

Both trainers get position_ids = cumsum(mask) - 1 on padded rows (as ``generate`` builds them), so a
difference comes from reduction order alone. Printed: max |trainer - sampler| over every completion
token, per layout and overall, and each trainer against itself across micro-batch sizes and layouts.
"""
from __future__ import annotations

import argparse
import tempfile

import torch
import transformers
from transformers import AutoModelForCausalLM

from invariant_infer import pad_sequences
from invariant_infer.engine import Engine, SamplingParams
from invariant_infer.model.padding import positions_from_mask
from invariant_infer.testing.random_checkpoints import random_config, save_random_checkpoint
from invariant_infer.training.logprobs import token_logprobs

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", default="qwen2", help="qwen2, qwen3, llama or mistral (a random 'tiny' checkpoint)")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=8, help="new tokens per completion (eos ignored)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.prompts < 2 or args.max_tokens < 1 or not args.temperature > 0:
        p.error("need --prompts >= 2, --max-tokens >= 1 and --temperature > 0")
    return args


def make_prompts(vocab: int, count: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 13, (count,), generator=gen).tolist()
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def engine_rollouts(model, prompts, args):
    """(completions, sampler logprobs) from the invariant engine, one seed per request."""
    mode = "raw_logprobs" if args.temperature == 1.0 else "processed_logprobs"  # logprobs at the temperature
    params = [SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed + i,
                             ignore_eos=True, logprobs=0, logprobs_mode=mode) for i in range(len(prompts))]
    outputs = Engine(model, max_num_seqs=len(prompts)).generate(prompts, params)
    return [o.token_ids for o in outputs], [torch.tensor(o.logprobs, dtype=torch.float32) for o in outputs]


def hf_rollouts(model, prompts, args):
    """(completions, sampler logprobs) from stock ``generate`` on one left-padded batch."""
    ids, mask = pad_sequences([torch.tensor(p) for p in prompts], side="left")
    torch.manual_seed(args.seed)
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=args.temperature,
                         top_k=0, top_p=1.0, max_new_tokens=args.max_tokens, min_new_tokens=args.max_tokens,
                         output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    tokens = out.sequences[:, ids.shape[1]:]
    logits = torch.stack(out.logits, dim=1).float() / args.temperature  # [B, new, V], raw
    logps = torch.log_softmax(logits, dim=-1).gather(-1, tokens[..., None]).squeeze(-1)
    return tokens.tolist(), list(logps)


def micro_batch_inputs(seqs: list, layout: str):
    """(input_ids, attention_mask, position_ids, end of each sequence in its row) for ``layout``: padded
    on the "right" or "left", or "packed" into one row (no mask, positions restarting at each sequence,
    as transformers' DataCollatorWithFlattening builds padding-free batches)."""
    if layout == "packed":
        ends = torch.tensor([len(s) for s in seqs]).cumsum(0).tolist()
        positions = torch.cat([torch.arange(len(s)) for s in seqs])[None]
        return torch.cat(seqs)[None], None, positions, [(0, end) for end in ends]
    ids, mask = pad_sequences(seqs, side=layout)
    width = ids.shape[1]
    ends = [(row, width if layout == "left" else len(s)) for row, s in enumerate(seqs)]
    return ids, mask, positions_from_mask(mask, width), ends


def stock_token_logprobs(model, ids, mask, positions, temperature):
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
    return torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def trainer_logprobs(model, kernels: str, prompts, completions, micro_batch: int, layout: str, temperature: float):
    """Each completion's token logprobs recomputed from prompt + completion, ``micro_batch`` sequences a
    forward in ``layout``: what a trainer's loss sees (train mode, grad enabled)."""
    model.train()
    out = []
    for start in range(0, len(prompts), micro_batch):
        chunk = completions[start:start + micro_batch]
        seqs = [torch.tensor(p + c) for p, c in zip(prompts[start:start + micro_batch], chunk)]
        ids, mask, positions, ends = micro_batch_inputs(seqs, layout)
        if kernels == "invariant":  # padded rows: positions derived from the mask (the same values)
            logps = token_logprobs(model, ids, mask, position_ids=positions if mask is None else None,
                                   temperature=temperature)
        else:
            logps = stock_token_logprobs(model, ids, mask, positions, temperature)
        for (row, end), c in zip(ends, chunk):  # logps[t] scores token t + 1
            out.append(logps[row, end - 1 - len(c):end - 1].detach().float())
    model.eval()
    return out


def max_diff(a: list, b: list) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def measure(model, kernels: str, prompts, completions, sampler, args) -> tuple[dict, list]:
    layouts = {}
    for micro_batch in (2, len(prompts)):
        for layout in ("right", "left", "packed"):
            layouts[micro_batch, layout] = trainer_logprobs(model, kernels, prompts, completions, micro_batch, layout,
                                                            args.temperature)
    return {key: max_diff(logps, sampler) for key, logps in layouts.items()}, list(layouts.values())


def main(argv=None) -> int:
    args = parse(argv)
    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        save_random_checkpoint(tmp, random_config(args.family, "tiny"), seed=args.seed)
        load = lambda: AutoModelForCausalLM.from_pretrained(tmp, dtype=DTYPES[args.dtype])  # noqa: E731
        invariant, stock = load(), load()
    stock.set_attn_implementation("sdpa")
    prompts = make_prompts(invariant.config.vocab_size, args.prompts, args.seed)
    print(f"{args.family} tiny random checkpoint, {args.dtype}; {len(prompts)} prompts of "
          f"{min(map(len, prompts))}-{max(map(len, prompts))} tokens, {args.max_tokens} sampled tokens each, "
          f"temperature {args.temperature}")

    results = {}
    for kernels, model, rollouts in (("invariant", invariant, engine_rollouts), ("stock", stock, hf_rollouts)):
        completions, sampler = rollouts(model, prompts, args)
        with torch.enable_grad():
            results[kernels] = measure(model, kernels, prompts, completions, sampler, args)

    print("\nmax |trainer - sampler| logprob over all completion tokens")
    print(f"{'micro-batch':>12} {'layout':>8} {'invariant':>12} {'stock':>12}")
    for key in results["invariant"][0]:
        print(f"{key[0]:>12} {key[1]:>8} {results['invariant'][0][key]:>12.6g} {results['stock'][0][key]:>12.6g}")
    stock_layouts = results["stock"][1]
    stock_self = max(max_diff(stock_layouts[0], other) for other in stock_layouts[1:])
    inv_layouts = results["invariant"][1]
    inv_self = max(max_diff(inv_layouts[0], other) for other in inv_layouts[1:])
    print(f"\ntrainer vs itself across micro-batch sizes and layouts: invariant {inv_self!r}, stock {stock_self!r}")
    print(f"invariant max |trainer - sampler|: {max(results['invariant'][0].values())!r}")
    print(f"stock max |trainer - sampler|: {max(results['stock'][0].values())!r}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
