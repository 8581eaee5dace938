"""A continuous-batching engine over packed, unpadded batches and a paged KV cache, whose every
result is bitwise what the same request gives alone, and what ``model.generate`` /
``score_sequences`` give on the wrapped model.

Files: ``sequence`` (a request's state), ``sampling_params``, ``kv_cache_layout`` (KV cache
groups of layers by spec), ``page_pool``, ``kv_cache_managers`` (one per spec kind),
``kv_cache_manager`` (them combined: pages per spec, prefix cache), ``linear_state`` and
``linear_state_slots`` (linear-attention states), ``scheduler`` (continuous batching, chunked
prefill, preemption), ``model_runner`` (one packed forward over the paged cache),
``logprob_rows``, ``speculative`` and ``proposers`` (speculative decoding, bitwise lossless),
``output`` (each step's deltas, and the outputs built from them: text, stop strings, output
kinds), ``core`` (the engine core, on token ids), ``frontend`` (prompts and images in, output
processors out, shared by both fronts), ``engine`` (the API: a core and a frontend, with text and
offline jobs) and ``async_engine`` (for servers: the same core and frontend).
"""
from .async_engine import AsyncEngine
from ..errors import EngineBusyError, RequestError
from .engine import Engine, RequestOutput
from .sampling_params import RequestOutputKind, SamplingParams

__all__ = ["Engine", "AsyncEngine", "EngineBusyError", "RequestOutput", "RequestOutputKind", "RequestError",
           "SamplingParams"]
