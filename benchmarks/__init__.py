"""Benchmarks: what batch invariance costs (stock vs invariant, side by side) and how far
stock logits drift between batch and alone.

    python -m benchmarks --quick --out DIR     # CPU smoke run through the Triton interpreter
    python -m benchmarks --out DIR             # full suite, on a GPU

See benchmarks/README.md for the output schema and how to read the plots.
"""
SECTIONS = ("matmul", "norm_attention", "e2e", "scoring", "divergence", "engine", "host_overhead", "server", "train", "moe",
            "gdn", "tensor_parallel", "spec", "quant", "lora", "vlm", "embed")
