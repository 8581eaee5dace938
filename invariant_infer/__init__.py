"""Bitwise batch-invariant inference for Hugging Face Qwen2 / Qwen2.5 models."""
