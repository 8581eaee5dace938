"""Loading a checkpoint and its tokenizer, as the commands, the server and the ranks do; a pooled
checkpoint (an embedder, a classifier, a cross-encoder, a reward model) as a ``PooledModel``
(``pooled_loading``)."""
from .loading import load_model, load_tokenizer
from .pooled_loading import load_pooled_model, pooling_task_of

__all__ = ["load_model", "load_pooled_model", "load_tokenizer", "pooling_task_of"]
