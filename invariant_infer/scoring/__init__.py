"""Scoring token sequences: ``core`` (``score_sequences`` and the batch planner), ``requests``
(a scoring request's fields), ``pooled`` (a pooled checkpoint's requests and results: embeddings,
scores) and ``job/`` (the ``score`` command's job file, its local, pooled and tensor-parallel
backends, and Ray Data)."""
from .core import DEFAULT_MAX_BATCH_TOKENS, ScoreResult, logprob_digest, score_batch, score_sequences

__all__ = ["score_sequences", "score_batch", "ScoreResult", "logprob_digest", "DEFAULT_MAX_BATCH_TOKENS"]
