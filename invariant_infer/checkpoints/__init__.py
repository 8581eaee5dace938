"""Loading a checkpoint and its tokenizer, as the commands, the server and the ranks do."""
from .loading import load_model, load_tokenizer

__all__ = ["load_model", "load_tokenizer"]
