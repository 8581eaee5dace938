"""Load a checkpoint and its tokenizer, build the engine and serve it with uvicorn.

The socket is bound before uvicorn starts, so ``--port 0`` picks a free port; once the model is
loaded and the socket listens, one line ``invariant-infer serve: listening on http://HOST:PORT``
goes to stdout. SIGTERM / SIGINT: uvicorn stops accepting, lets in-flight requests finish, then
the engine stops and the process exits 0."""
from __future__ import annotations

import json
import signal
import socket
import sys
from pathlib import Path

DTYPES = ("bf16", "fp16", "fp32")


def load_tokenizer(path: str):
    """The tokenizer saved at ``path``. A ``PreTrainedTokenizerFast`` config is loaded as such:
    ``AutoTokenizer`` would build the model type's own tokenizer class around it."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    config = Path(path) / "tokenizer_config.json"
    if config.exists():
        try:
            if json.loads(config.read_text()).get("tokenizer_class") == "PreTrainedTokenizerFast":
                return PreTrainedTokenizerFast.from_pretrained(path)
        except ValueError:
            pass
    return AutoTokenizer.from_pretrained(path)


def build(args):
    import torch
    from transformers import AutoModelForCausalLM

    from ..engine import AsyncEngine, Engine
    from .app import ServerOptions, create_app

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[
        args.dtype or ("bf16" if device == "cuda" else "fp32")]
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(device).eval()
    tokenizer = load_tokenizer(args.tokenizer or args.model)
    engine = Engine(model, tokenizer, max_num_seqs=args.max_num_seqs,
                    max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_memory=args.kv_cache_memory,
                    enable_prefix_caching=not args.disable_prefix_caching, kernels=args.kernels)
    options = ServerOptions(model_name=args.served_model_name or args.model, api_key=args.api_key,
                            max_waiting=args.max_waiting, max_body_bytes=args.max_body_bytes)
    return create_app(AsyncEngine(engine), tokenizer, options)


def serve(args) -> int:
    import uvicorn

    class GracefulServer(uvicorn.Server):
        """After a graceful shutdown on SIGTERM, exit 0 (uvicorn re-raises the signal, which would
        end the process with -15)."""

        def handle_exit(self, sig, frame) -> None:
            super().handle_exit(sig, frame)
            captured = getattr(self, "_captured_signals", None)
            if sig == signal.SIGTERM and isinstance(captured, list):
                captured[:] = [s for s in captured if s != signal.SIGTERM]

    app = build(args)
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    sock.listen(2048)
    host, port = sock.getsockname()[:2]
    config = uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=None, access_log=False)
    server = GracefulServer(config)
    shown = f"[{host}]" if family == socket.AF_INET6 else host
    print(f"invariant-infer serve: listening on http://{shown}:{port}", flush=True)
    server.run(sockets=[sock])
    return 0


if __name__ == "__main__":
    from ..serve_cli import main
    sys.exit(main())
