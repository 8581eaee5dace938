"""``invariant-infer serve``: an OpenAI-compatible server (completions, chat completions, models,
health, metrics, tokenize) over the continuous-batching engine; each response is bitwise a
function of its own request, whatever else is in flight. Needs ``pip install -e ".[serve]"``.

Before it takes traffic it runs the check of ``invariant-infer check`` on the loaded model (one line
per check on stderr); a failing check stops the start (``--skip-check`` serves without it). A
checkpoint that is not a causal LM or an image-text-to-text model of a supported family is refused
by name before it is loaded.

A pooled checkpoint (a sentence-transformers embedder or cross-encoder, an encoder, a sequence-
classification or reward head) is served on vLLM's pooling routes instead: /v1/embeddings, /score,
/rerank, /classify and /pooling, whichever its task serves (--task overrides the inferred task)."""
from __future__ import annotations

import argparse
import json
import math
import sys

from ..checkpoints.loading import DEVICES, DTYPES
from ..errors import InvariantInferError, UnsupportedModelError
from . import exit_codes
from .help_text import exit_status_epilog, plain


def positive_seconds(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds > 0, got {text!r}")
    return value


def json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="a checkpoint directory (or hub id) of a supported family")
    p.add_argument("--tokenizer", help="default: the --model directory")
    p.add_argument("--task", choices=["generate", "embed", "classify", "score", "reward"],
                   help="what to serve (default: the checkpoint's: a sentence-transformers folder or an encoder "
                        "embeds; a sequence-classification head classifies, or scores pairs / rewards with one "
                        "label; a causal LM generates). docs/server.md")
    p.add_argument("--host", default="127.0.0.1", help="default: 127.0.0.1 (localhost only)")
    p.add_argument("--port", type=int, default=8000, help="0: any free port (printed on stdout)")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="default: bf16 on cuda, fp32 on cpu")
    p.add_argument("--device", choices=DEVICES, help="default: cuda if available")
    p.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="ranks (processes, one GPU each on cuda) the model is sharded over; results are bitwise "
                        "those of 1 (default: 1)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="sequences in one step at most")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="tokens in one step at most")
    p.add_argument("--kv-cache-memory", type=int, help="bytes of KV cache (default: 256 MiB on cpu, half "
                   "the free memory on cuda)")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on the API endpoints")
    p.add_argument("--served-model-name", help="the model name clients send (default: --model)")
    p.add_argument("--max-waiting", type=int, default=256,
                   help="sequences queued beyond --max-num-seqs; more get 429 with Retry-After")
    p.add_argument("--max-body-bytes", type=int, default=16 << 20, help="request body limit (413 past it)")
    p.add_argument("--stream-write-timeout", type=positive_seconds, default=30.0, metavar="SECONDS",
                   help="a streaming client that reads nothing for this long is dropped and its requests "
                        "aborted, freeing their KV pages (default: 30)")
    p.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                   help="PEFT LoRA adapters to serve, run unmerged; a request's 'model' field names one")
    p.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters (implied by --lora-modules); /v1/load_lora_adapter adds more")
    p.add_argument("--max-loras", type=int, default=1, metavar="N",
                   help="adapters on the device at once (default: 1); a request waits for a slot")
    p.add_argument("--max-lora-rank", type=int, default=16, metavar="R", help="the largest adapter rank (default: 16)")
    p.add_argument("--disable-prefix-caching", action="store_true")
    p.add_argument("--enforce-eager", action="store_true",
                   help="run decode steps eager: no CUDA graphs (default: captured per batch-size bucket on cuda "
                        "where the engine can; the bits are the same)")
    p.add_argument("--speculative-config", type=json_object, metavar="JSON",
                   help='speculative decoding, bitwise lossless: {"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_max": 3} or {"method": "draft_model", "model": PATH, '
                        '"num_speculative_tokens": 4} (docs/speculative.md)')
    p.add_argument("--skip-check", action="store_true",
                   help="serve without first checking that the model is batch-invariant here (invariant-infer check)")
    p.add_argument("--kernels", choices=["invariant", "stock"], default="invariant",
                   help=argparse.SUPPRESS)  # stock: the negative control and benchmark baseline
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])


def run(args) -> int:
    try:  # here, not at the top: --help and the other commands run without the serve extra
        from ..server.main import serve
        from ..server.state import ServerOptions
    except ImportError as exc:
        print(f'invariant-infer serve needs the serve extra (pip install -e ".[serve]"): {exc}',
              file=sys.stderr)
        return exit_codes.REFUSED
    loras = {}
    for value in args.lora_modules:
        name, sep, path = value.partition("=")
        if not (sep and name and path) or name in loras:
            print(f"invariant-infer serve: --lora-modules takes distinct NAME=PATH, got {value!r}", file=sys.stderr)
            return exit_codes.REFUSED
        if name == (args.served_model_name or args.model):
            print(f"invariant-infer serve: --lora-modules: {name!r} is the base model's name; name the adapter "
                  "otherwise", file=sys.stderr)
            return exit_codes.REFUSED
        loras[name] = path
    task = args.task
    if task is None:
        from ..checkpoints.pooled_loading import check_pooled_architecture, pooled_layout
        try:
            layout = pooled_layout(args.model)
            if layout.task is None and layout.encoder:  # an encoder head no route serves (a masked LM ...)
                check_pooled_architecture(args.model)
            task = layout.task or "generate"
        except UnsupportedModelError as exc:
            print(f"invariant-infer serve: {exc}", file=sys.stderr)
            return exit_codes.UNSUPPORTED_MODEL
        except InvariantInferError:  # an unreadable config: the architecture check below names it
            task = "generate"
    if task == "generate":  # a pooled checkpoint's architecture is checked by its loader
        refused = exit_codes.architecture_refusal("serve", args.model)  # before minutes of loading
        if refused is not None:
            return refused
    options = ServerOptions(
        task=task, model_name=args.served_model_name or args.model, api_key=args.api_key, max_waiting=args.max_waiting,
        max_body_bytes=args.max_body_bytes, stream_write_timeout=args.stream_write_timeout, model=args.model,
        tokenizer=args.tokenizer, dtype=args.dtype, device=args.device, tensor_parallel_size=args.tensor_parallel_size,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory=args.kv_cache_memory, enable_prefix_caching=not args.disable_prefix_caching,
        kernels=args.kernels, speculative_config=args.speculative_config, host=args.host, port=args.port,
        log_level=args.log_level, lora_modules=loras, enable_lora=args.enable_lora, max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank, enforce_eager=args.enforce_eager)
    try:
        stopped = serve(options, rank_failed_status=exit_codes.RANK_FAILED, check=not args.skip_check)
    except InvariantInferError as exc:  # settings, a model, an adapter or a TP size the engine refuses
        print(f"invariant-infer serve: {exc}", file=sys.stderr)
        if task != "generate" and isinstance(exc, UnsupportedModelError):  # a pooled checkpoint's loader refused it
            return exit_codes.UNSUPPORTED_MODEL
        return exit_codes.REFUSED
    return {"rank failed": exit_codes.RANK_FAILED, "check failed": exit_codes.NOT_INVARIANT}.get(stopped, exit_codes.OK)


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server over the engine", description=plain(__doc__),
                       epilog=exit_status_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(run=run)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="invariant-infer serve", description=plain(__doc__),
                                     epilog=exit_status_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args(argv)
    return int(run(args) or 0)
