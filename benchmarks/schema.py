"""What every results.json holds: the required fields per section, the run's metadata (device,
commit, versions, model preset) and the schema check. Imported by the report and the plots."""
from __future__ import annotations

import datetime
import os
import platform
import subprocess
from pathlib import Path

import torch

from invariant_infer.model.families import FAMILIES
from invariant_infer.testing.random_checkpoints import random_config

REQUIRED = {
    "top": ("device", "commit", "torch", "triton", "transformers", "matmul", "e2e", "divergence"),
    "matmul": ("shape", "M", "N", "K", "stock_tflops", "invariant_tflops"),
    "e2e": ("batch", "seq", "stock_tokens_per_s", "invariant_tokens_per_s", "stock_peak_gb", "invariant_peak_gb"),
    "divergence": ("case", "stock_max_abs_diff", "invariant_max_abs_diff", "stock_rows_unequal",
                   "invariant_rows_unequal"),
    "scoring_memory": ("tokens", "hidden", "vocab", "chunk_rows", "naive_peak_gb", "ours_peak_gb", "peak_gb_method",
                       "naive_ms", "ours_ms", "max_abs_diff", "is_argmax_agree"),
    "scoring_throughput": ("sequences", "tokens", "max_batch_tokens", "stock_tokens_per_s", "invariant_tokens_per_s",
                           "max_abs_diff", "digests_equal_across_budgets"),
    "engine": ("mode", "concurrency", "requests", "output_tokens", "tokens_per_s", "tpot_ms", "ttft_ms",
               "invariant_to_stock_engine", "invariant_to_hf_generate", "invariant_rows_checked",
               "invariant_rows_equal"),
    "host_overhead": ("kernels", "forward", "running", "context", "steps", "schedule_us", "metadata_us", "sampling_us", "output_us",
                      "forward_us", "logprobs_us", "host_us", "device_us", "host_us_per_seq"),
    "server": ("mode", "concurrency", "requests", "output_tokens", "tokens_per_s", "requests_per_s", "p50_ms",
               "p99_ms", "errors", "invariant_to_stock", "invariant_rows_checked", "invariant_rows_equal"),
    "train": ("layout", "batch", "seq", "tokens", "stock_ms", "invariant_ms", "stock_tokens_per_s",
              "invariant_tokens_per_s", "ratio", "stock_peak_gb", "invariant_peak_gb", "stock_logprob_max_abs_diff",
              "invariant_logprob_max_abs_diff", "stock_logprob_bitwise_equal", "invariant_logprob_bitwise_equal"),
    "moe": ("tokens", "implementation", "hidden", "experts", "top_k", "intermediate", "dtype", "ms", "tokens_per_s",
            "invariant_time_ratio", "alone_checked", "alone_bitwise_equal", "alone_max_abs_diff",
            "max_abs_diff_to_eager", "skipped"),
    "gdn": ("case", "implementation", "sequences", "tokens", "key_heads", "value_heads", "head_dim", "ms",
            "tokens_per_s", "invariant_time_ratio", "max_abs_diff_to_stock", "decode_equals_prefill", "skipped"),
    "tp_exchange": ("preset", "tp", "layer", "N", "K", "leaves", "ours_bytes_per_token", "stock_bf16_bytes_per_token",
                    "ratio"),
    "spec": ("workload", "method", "batch", "k", "speculative", "output_tokens", "target_forwards",
             "forwards_per_token", "acceptance_length", "elapsed_s", "tokens_per_s", "speedup", "bitwise_equal"),
    "quant": ("model", "shape", "format", "M", "N", "K", "stock", "invariant_ms", "stock_ms", "bf16_ms", "ratio",
              "ratio_to_bf16", "weight_bytes", "bf16_weight_bytes", "bytes_ratio", "invariant_max_abs_diff_to_stock",
              "invariant_alone_bitwise_equal", "stock_alone_bitwise_equal"),
    "tp_steps": ("tp", "requests", "prompt_tokens", "decode_tokens", "prefill_step_ms", "decode_step_ms",
                 "prefill_ratio_to_tp1", "decode_ratio_to_tp1", "bitwise_equal_to_tp1"),
}
REQUIRED["gdn_prefill"], REQUIRED["gdn_decode"] = REQUIRED["e2e"], ("batch", "prompt", "new_tokens")
REQUIRED["lora"] = ("mode", "phase", "adapters", "rank", "requests", "tokens", "elapsed_s", "tokens_per_s",
                    "time_ratio_to_base", "bitwise_rows_checked", "bitwise_rows_equal")
REQUIRED["vlm"] = ("case", "images", "batch", "side", "image_tokens", "stock_ms", "invariant_ms", "ratio",
                   "stock_alone_bitwise_equal", "invariant_alone_bitwise_equal", "max_abs_diff_to_stock")
REQUIRED["attention_vs_stock"] = ("case", "batch", "q_len", "kv_len", "heads", "kv_heads", "head_dim", "device",
                                  "invariant", "stock", "invariant_ms", "stock_ms", "ratio", "max_abs_diff",
                                  "bitwise_equal_to_attention", "skipped")
REQUIRED["embed"] = ("model", "pooling", "padding", "batch", "tokens", "stock_ms", "invariant_ms",
                     "stock_sequences_per_s", "invariant_sequences_per_s", "ratio", "throughput_ratio",
                     "max_abs_diff_to_stock")
REQUIRED["embed_divergence"] = ("model", "pooling", "batch", "stock_max_abs_diff", "stock_rows_unequal",
                                "stock_rows_checked", "invariant_max_abs_diff", "invariant_rows_unequal",
                                "invariant_rows_checked")
NOT_MEANINGFUL = "CPU / Triton interpreter: timings NOT meaningful"


def git_commit(repo: Path) -> str:
    """``git rev-parse HEAD`` (+ "-dirty"), else $BENCH_COMMIT, else "unknown"."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                               capture_output=True, text=True, timeout=30).stdout.strip()
        return head + ("-dirty" if dirty else "")
    except Exception:
        return os.environ.get("BENCH_COMMIT", "unknown")


def model_metadata(family: str, preset: str) -> dict:
    """The preset the sections take their shapes from: names and its real (full-suite) widths."""
    config = random_config(family, preset)
    heads = config.num_attention_heads
    return {"name": f"{family}:{preset}", "family": family, "preset": preset, "hidden_size": config.hidden_size,
            "intermediate_size": config.intermediate_size, "num_attention_heads": heads,
            "num_key_value_heads": config.num_key_value_heads or heads,
            "head_dim": getattr(config, "head_dim", None) or config.hidden_size // heads,
            "num_hidden_layers": config.num_hidden_layers, "vocab_size": config.vocab_size,
            "tie_word_embeddings": config.tie_word_embeddings, "rms_norm": FAMILIES[family].rms_norm.__name__}


def model_name(results: dict) -> str:
    """ "family:preset" of a results dict ("qwen2:qwen2.5-1.5b" for results written before the field)."""
    return (results.get("model") or {}).get("name", "qwen2:qwen2.5-1.5b")


def metadata(device: torch.device, quick: bool, family: str = "qwen2", preset: str = "qwen2.5-1.5b") -> dict:
    import transformers
    import triton
    gpu = device.type == "cuda"
    name = torch.cuda.get_device_name(device) if gpu else f"cpu ({platform.processor() or platform.machine()}, " \
                                                           f"{os.cpu_count()} cores)"
    return {
        "device": name, "device_type": device.type, "commit": git_commit(Path(__file__).resolve().parents[1]),
        "torch": torch.__version__, "triton": triton.__version__, "transformers": transformers.__version__,
        "python": platform.python_version(), "created": datetime.datetime.now().isoformat(timespec="seconds"),
        "quick": quick, "timings_meaningful": gpu, "model": model_metadata(family, preset),
        "timing_note": ("CUDA: triton.testing.do_bench medians with L2 flushed (kernels); CUDA-event medians (e2e)"
                        if gpu else NOT_MEANINGFUL + ": invariant kernels run in Python; quick mode checks "
                                                     "correctness and divergence only"),
        "memory_note": ("torch.cuda.max_memory_allocated, weights included" if gpu
                        else "null on CPU: torch's CPU allocator is invisible to tracemalloc and ru_maxrss is a "
                             "process-lifetime high-water mark"),
    }


def validate(results: dict) -> list:
    """Names of required fields that are missing (empty list = schema ok)."""
    missing = [key for key in REQUIRED["top"] if key not in results]
    for section in ("matmul", "e2e", "divergence", "scoring_memory", "scoring_throughput", "engine", "host_overhead",
                    "server", "train", "moe", "gdn", "gdn_prefill", "gdn_decode", "tp_exchange", "tp_steps", "spec",
                    "quant", "lora", "vlm", "attention_vs_stock", "embed", "embed_divergence"):
        for i, row in enumerate(results.get(section) or []):
            missing += [f"{section}[{i}].{key}" for key in REQUIRED[section] if key not in row]
    return missing
