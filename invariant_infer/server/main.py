"""Load a checkpoint and its tokenizer, build the engine and serve it with uvicorn. A pooled checkpoint
(``resolve_task``: an embedder, a cross-encoder, a classifier, a reward model) gets the pooling app
over its batching engine instead (``pooling_app``).

The socket is bound before uvicorn starts, so ``--port 0`` picks a free port; once the model is
loaded and the socket listens, one line ``invariant-infer serve: listening on http://HOST:PORT``
goes to stdout.

SIGTERM / SIGINT close the listening socket in the signal handler itself, so from then on a new
connection is refused; uvicorn then lets in-flight requests finish, the engine stops and the
process exits 0. (uvicorn alone closes it only on its main loop's next tick, and a tick can wait
behind the engine's lock; until then the kernel keeps completing new connections.)

Before the socket listens, the model runs the check of ``invariant-infer check`` (the audit, rows
alone against padded batches, a decode step against its prefill; ``testing.invariance_check``), one
line per check on stderr; a failing check stops the start (``--skip-check`` serves without it). At
``--tensor-parallel-size`` above 1 it runs through the engine and its ranks (``testing.engine_check``:
rank 0's sharded model runs only through them); with the stock kernels (the batch-variant baseline) it
is not run.

With ``--tensor-parallel-size N`` the server is rank 0 of ``TensorParallelRanks``: it starts the
other ranks, and stops them when it exits. A rank that dies stops the server within seconds, with
the rank named on stderr (the CLI's exit status ``RANK_FAILED``); requests in flight get an error."""
from __future__ import annotations

import signal
import socket
import sys

import uvicorn

from ..engine import AsyncEngine, Engine
from ..checkpoints.loading import is_vision_language_checkpoint, load_model, load_processor, load_tokenizer
from ..errors import CheckpointLoadError, InvalidArgumentError, InvariantInferError, LoraAdapterError
from ..parallel import TensorParallelRanks
from ..parallel.forced_exit import FORCED_EXIT_AFTER_S, exit_later
from ..testing.engine_check import check_engine_invariance
from ..testing.invariance_check import check_invariance
from ..engine.pooling_engine import PoolingEngine
from .app import create_app
from .pooling_app import create_pooling_app, passes_pooling_check
from .state import ServerOptions

# Each connection's kernel send buffer. Bounded so that a client that stops reading stalls its
# stream (and --stream-write-timeout starts counting) after a few hundred KiB, not after the
# megabytes Linux's autotuning would buffer; ample for event streams and ordinary responses.
SEND_BUFFER_BYTES = 64 << 10


class RankFailure:
    """What a rank's failure does to the server: stop it, and end the process with ``exit_status``
    if the drain has not ended FORCED_EXIT_AFTER_S later."""

    def __init__(self, exit_status: int):
        self.server: uvicorn.Server | None = None
        self.message: str | None = None
        self.exit_status = exit_status

    def __call__(self, message: str) -> None:
        self.message = message
        print(f"invariant-infer serve: {message}; shutting down", file=sys.stderr, flush=True)
        if self.server is not None:
            self.server.should_exit = True  # uvicorn's main loop polls it, closes the listener and drains
        exit_later(self.exit_status, after_s=FORCED_EXIT_AFTER_S)


def resolve_task(options: ServerOptions) -> str:
    """``options.task``, else the checkpoint's: a pooling task (``checkpoints.pooled_loading.pooling_task_of``)
    or "generate"."""
    if options.task is not None:
        return options.task
    from ..checkpoints.pooled_loading import pooling_task_of
    try:
        return pooling_task_of(options.model) or "generate"
    except CheckpointLoadError:  # no config to read here (a hub id): the generation loader reads it
        return "generate"


def build_pooling_engine(options: ServerOptions, task: str) -> PoolingEngine:
    """The batching engine of a pooled checkpoint; the generation engine's options are refused by name."""
    from ..checkpoints.pooled_loading import load_pooled_model
    generation_only = {"--tensor-parallel-size": options.tensor_parallel_size != 1, "--tokenizer": options.tokenizer,
                       "--lora-modules": options.lora_modules, "--enable-lora": options.enable_lora,
                       "--speculative-config": options.speculative_config}
    for flag, given in generation_only.items():
        if given:
            raise InvalidArgumentError(f"{flag} applies to generation models; task {task!r} does not take it")
    model = load_pooled_model(options.model, task=task, dtype=options.dtype, device=options.device,
                              invariant=options.kernels == "invariant")
    return PoolingEngine(model, max_num_batched_tokens=options.max_num_batched_tokens,
                         max_num_seqs=options.max_num_seqs)


def build(options: ServerOptions, ranks: TensorParallelRanks | None = None):
    """The app for the checkpoint ``options.model`` (or for ``ranks.model``, the sharded one, run
    through the ranks): the engine wraps the model itself. A pooled checkpoint (or ``options.task``)
    gets the pooling app over its batching engine."""
    task = resolve_task(options) if ranks is None else "generate"
    if task != "generate":
        return create_pooling_app(build_pooling_engine(options, task), options)
    engine, tokenizer = build_engine(options, ranks)
    return create_app(AsyncEngine(engine), tokenizer, options)


def build_engine(options: ServerOptions, ranks: TensorParallelRanks | None = None):
    """The engine and the tokenizer ``build`` serves."""
    if ranks is not None:
        model = ranks.model
    else:
        model = load_model(options.model, dtype=options.dtype, device=options.device, invariant=False)
    tokenizer = load_tokenizer(options.tokenizer or options.model)
    serves_loras = options.enable_lora or bool(options.lora_modules)
    # A vision-language checkpoint's engine takes its image processor beside the tokenizer (image_url parts).
    vision = ranks is None and is_vision_language_checkpoint(options.model)
    processing = load_processor(options.model, tokenizer) if vision else tokenizer
    engine = Engine(model, processing, max_num_seqs=options.max_num_seqs,
                    max_num_batched_tokens=options.max_num_batched_tokens, kv_cache_memory=options.kv_cache_memory,
                    enable_prefix_caching=options.enable_prefix_caching, kernels=options.kernels, executor=ranks,
                    speculative=options.speculative_config,
                    max_loras=options.max_loras if serves_loras else 0, max_lora_rank=options.max_lora_rank,
                    cuda_graphs=False if options.enforce_eager else None)
    for name, path in options.lora_modules.items():
        engine.add_lora(name, path)  # a bad adapter stops the start (serve reports it)
    return engine, tokenizer


def passes_check(engine, options: ServerOptions) -> bool:
    """Run the check on the engine's model, its lines on stderr; True when it passes or does not apply.
    At --tensor-parallel-size 1 it is ``invariant-infer check``'s; above, rank 0's model runs only
    through its ranks, so the probes run through the engine (``testing.engine_check``)."""
    if options.kernels != "invariant":
        print("invariant-infer serve: check: not run on the stock kernels (the batch-variant baseline)",
              file=sys.stderr, flush=True)
        return True

    def show(result) -> None:
        print(f"invariant-infer serve: check: {result}", file=sys.stderr, flush=True)
    if options.tensor_parallel_size == 1:
        report = check_invariance(engine.model, on_result=show)
    else:
        report = check_engine_invariance(engine, on_result=show)
    if not report.ok:
        print(f"invariant-infer serve: not batch-invariant here ({'; '.join(report.failed)}): not serving "
              "(--skip-check serves without the check)", file=sys.stderr, flush=True)
    return report.ok


class DrainingServer(uvicorn.Server):
    """On SIGTERM / SIGINT: stop listening at once, drain, and exit 0 after a graceful SIGTERM
    (uvicorn re-raises the captured signal, which would end the process with -15)."""

    def handle_exit(self, sig, frame) -> None:
        super().handle_exit(sig, frame)
        for server in getattr(self, "servers", []):
            server.close()  # the listening socket; connections already accepted go on
        captured = getattr(self, "_captured_signals", None)
        if sig == signal.SIGTERM and isinstance(captured, list):
            captured[:] = [s for s in captured if s != signal.SIGTERM]


def serve(options: ServerOptions, *, rank_failed_status: int, check: bool = True) -> str:
    """Serve ``options.model`` until SIGTERM / SIGINT (or a rank's failure). Returns "stopped",
    "rank failed" (the process ends with ``rank_failed_status`` if the drain does not), or "check
    failed" (``check``: the check before serving found the model batch-variant; nothing listened).
    What cannot start raises an ``InvariantInferError`` before the listener opens."""
    if options.model is None:
        raise InvalidArgumentError("ServerOptions.model: the checkpoint to serve")
    size = options.tensor_parallel_size
    if size == 1 or resolve_task(options) != "generate":  # a pooled model refuses size > 1 by name
        return _serve(options, None, None, check)
    if options.kernels != "invariant":
        raise InvalidArgumentError("--tensor-parallel-size runs the invariant kernels only")
    failure = RankFailure(rank_failed_status)
    try:
        ranks = TensorParallelRanks(options.model, size, dtype=options.dtype, device=options.device,
                                    on_failure=failure)
    except InvariantInferError:  # a refused size, a rank that failed loading
        raise
    except Exception as exc:  # noqa: BLE001  (a checkpoint a rank could not read)
        raise CheckpointLoadError(f"{options.model}: {type(exc).__name__}: {exc}") from exc
    try:
        stopped = _serve(options, ranks, failure, check)
    finally:
        ranks.close()
    return "rank failed" if failure.message else stopped


def _build_checked(options: ServerOptions, ranks: TensorParallelRanks | None, check: bool):
    """The app, or None when the check before serving fails."""
    task = resolve_task(options) if ranks is None else "generate"
    try:
        if task != "generate":
            pooling = build_pooling_engine(options, task)
        else:
            engine, tokenizer = build_engine(options, ranks)
    except LoraAdapterError as exc:  # a --lora-modules adapter that does not fit
        raise LoraAdapterError(f"--lora-modules: {exc}") from exc
    except InvariantInferError:  # settings or a model the engine refuses
        raise
    except ValueError as exc:  # settings transformers refuses
        raise InvalidArgumentError(str(exc)) from exc
    if task != "generate":
        if check and not passes_pooling_check(pooling.model, options):
            pooling.shutdown()
            return None
        return create_pooling_app(pooling, options)
    if check and not passes_check(engine, options):
        return None
    return create_app(AsyncEngine(engine), tokenizer, options)


def _serve(options: ServerOptions, ranks: TensorParallelRanks | None, failure: RankFailure | None,
           check: bool) -> str:
    app = _build_checked(options, ranks, check)
    if app is None:
        return "check failed"
    family = socket.AF_INET6 if ":" in options.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)  # inherited by each connection
    if hasattr(socket, "TCP_USER_TIMEOUT"):  # Linux
        # A connection whose client reads nothing for this long is reset by the kernel. The app's
        # write timeout ends a stalled stream, but closing its connection waits for the unread
        # bytes to drain, which would keep a graceful shutdown waiting forever.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, max(1, int(options.stream_write_timeout * 1000)))
    sock.bind((options.host, options.port))
    sock.listen(2048)
    host, port = sock.getsockname()[:2]
    config = uvicorn.Config(app, log_level=options.log_level, timeout_graceful_shutdown=None, access_log=False)
    server = DrainingServer(config)
    if failure is not None:
        failure.server = server
        if failure.message:  # a rank failed while the app was built
            return "rank failed"
    shown = f"[{host}]" if family == socket.AF_INET6 else host
    print(f"invariant-infer serve: listening on http://{shown}:{port}", flush=True)
    server.run(sockets=[sock])
    return "stopped"
