"""Golden digests: SHA-256 of the logits and engine outputs of fixed models, so that any change of
bits shows, whatever caused it.

Each family gets a one-layer model whose weights, and every input, come from a counter-based
integer formula (splitmix64 of a name and an index, in numpy integer arithmetic: ``golden_formula.py``),
scaled to values that bf16 and fp32 hold exactly. Nothing depends on transformers' initialisation or on a
library's random stream. The model is written with ``save_pretrained`` and read back with
``from_pretrained``, as users load checkpoints. Digests are kept per backend in
``tests/golden/digests.json``: the CPU interpreter's (checked by CI) and one entry per GPU and
toolchain (recorded by ``benchmarks/gpu_check.sh``).

    python -m benchmarks.golden_digests                  # compare this backend with the committed digests
    python -m benchmarks.golden_digests --write          # record them (with an entry in BITS.md)
    python -m benchmarks.golden_digests --device cuda --out FILE   # write this backend's entry to FILE
    python -m benchmarks.golden_digests --merge FILE     # add an entry written by --out
    python -m benchmarks.golden_digests --families qwen2,llama --dtypes bf16   # compare those parts only

Parts (a family in one dtype, or one quantized format) are computed one at a time: one that raises
is recorded (``errors`` in the ``--out`` entry; exit status 1) and the others still run.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import platform
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import transformers
import triton
from transformers import AutoModelForCausalLM

from benchmarks.golden_formula import digest, integers, parameter_values
from benchmarks.golden_pooled import POOLED_CONFIGS, pooled_digests
from benchmarks.golden_vision import VISION_CONFIGS, vision_digests
from invariant_infer.testing.drift import logits_alone, logits_in_batch
from invariant_infer.engine import Engine, SamplingParams
from invariant_infer.model.families import FAMILIES
from invariant_infer.checkpoints.loading import DTYPES as LOADING_DTYPES
from invariant_infer.checkpoints.quantized import quantized_loading
from invariant_infer.model.patch import make_invariant

GOLDEN_PATH = Path(__file__).resolve().parent.parent / "tests" / "golden" / "digests.json"
REGENERATE = "python -m benchmarks.golden_digests --write"
DTYPES = {name: LOADING_DTYPES[name] for name in ("bf16", "fp32")}
ENGINE_FAMILY = "qwen2"

_COMMON = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
               num_hidden_layers=1, vocab_size=256, max_position_embeddings=128)
# Every field that shapes the arithmetic is written out, so a preset or a default moving elsewhere
# cannot move these models.
CONFIGS = {
    "qwen2": dict(_COMMON, rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  use_sliding_window=False),
    "qwen3": dict(_COMMON, head_dim=32, rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
                  attention_bias=False),
    "llama": dict(_COMMON, rms_norm_eps=1e-5, tie_word_embeddings=True, attention_bias=True, mlp_bias=True,
                  rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                                       high_freq_factor=4.0, original_max_position_embeddings=32)),
    "mistral": dict(_COMMON, num_key_value_heads=1, rope_theta=10000.0, rms_norm_eps=1e-5,
                    tie_word_embeddings=False, sliding_window=None),
    "qwen3_moe": dict(_COMMON, head_dim=32, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=4,
                      norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], rope_theta=10000.0,
                      rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False, use_sliding_window=False),
    "mixtral": dict(_COMMON, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
                    num_key_value_heads=1, rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                    sliding_window=None, router_jitter_noise=0.0),
    # Two layers, one of each kind: a Gated DeltaNet layer and a gated full attention layer.
    "qwen3_5_text": dict(_COMMON, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                         head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                         linear_value_head_dim=16, linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
                         tie_word_embeddings=False, attention_bias=False,
                         rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25)),
    "qwen3_5_moe_text": dict(_COMMON, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                             head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                             linear_value_head_dim=16, linear_conv_kernel_dim=4, moe_intermediate_size=32,
                             shared_expert_intermediate_size=64, num_experts=8, num_experts_per_tok=2,
                             rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False,
                             rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25)),
    "qwen3_next": dict(_COMMON, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                       head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                       linear_value_head_dim=16, linear_conv_kernel_dim=4, moe_intermediate_size=32,
                       shared_expert_intermediate_size=64, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                       decoder_sparse_step=1, mlp_only_layers=[], rms_norm_eps=1e-6, tie_word_embeddings=False,
                       attention_bias=False,
                       rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25)),
    # A sliding layer (a window of 4 keys, shorter than the samples) and a global one, as released.
    "gemma3_text": dict(_COMMON, num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"],
                        sliding_window=4, head_dim=32, query_pre_attn_scalar=32, rms_norm_eps=1e-6,
                        tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh",
                        attn_logit_softcapping=None, final_logit_softcapping=None,
                        rope_parameters={"sliding_attention": dict(rope_type="default", rope_theta=10000.0),
                                         "full_attention": dict(rope_type="default", rope_theta=1000000.0)}),
    # Gemma 4: a sliding layer (4 keys, 2 KV heads of 16) and a global one (1 KV head of 32, K = V,
    # proportional RoPE), then a global layer reading the second's K/V; per-layer inputs of 8; the final
    # logits softcapped at 2 (so the cap bends them).
    "gemma4_text": dict(_COMMON, num_hidden_layers=3, layer_types=["sliding_attention", "full_attention",
                                                                   "full_attention"],
                        sliding_window=4, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
                        attention_k_eq_v=True, num_kv_shared_layers=1, use_double_wide_mlp=False,
                        vocab_size_per_layer_input=256, hidden_size_per_layer_input=8, final_logit_softcapping=2.0,
                        rms_norm_eps=1e-6, tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh",
                        enable_moe_block=False, use_bidirectional_attention=None,
                        rope_parameters={"sliding_attention": dict(rope_type="default", rope_theta=10000.0),
                                         "full_attention": dict(rope_type="proportional", partial_rotary_factor=0.25,
                                                                rope_theta=1000000.0)}),
    # Sinks in both layers, one sliding (4 keys) and one full; yarn RoPE; experts with biases.
    "gpt_oss": dict(_COMMON, num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"],
                    sliding_window=4, head_dim=32, intermediate_size=32, num_local_experts=8, num_experts_per_tok=4,
                    rms_norm_eps=1e-5, tie_word_embeddings=False, attention_bias=True, swiglu_alpha=1.702,
                    swiglu_limit=7.0, rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=4.0,
                                                           beta_fast=32.0, beta_slow=1.0, truncate=False,
                                                           original_max_position_embeddings=32)),
    # Multi-head latent attention (absorbed; latent 32 + rope 16), interleaved yarn RoPE; a dense layer and a
    # sparse one (8 experts in 2 groups, one group kept, top-2, scaled by 2.5, a shared expert).
    "deepseek_v3": dict(_COMMON, num_hidden_layers=2, num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=32,
                        qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=24, moe_intermediate_size=32,
                        n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
                        first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True, rms_norm_eps=1e-6,
                        tie_word_embeddings=False, attention_bias=False, rope_interleave=True,
                        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, beta_fast=32.0,
                                             beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0,
                                             original_max_position_embeddings=32)),
    # A dense layer and a sparse one: 2 groups of 4 experts, one kept, top-2 by sigmoid score + selection
    # bias (drawn from the formula, as a bias), scaled by 2.5; an ungated shared MLP; q/k norms; half-head RoPE.
    "glm4_moe": dict(_COMMON, num_hidden_layers=2, first_k_dense_replace=1, head_dim=32, moe_intermediate_size=32,
                     n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1,
                     routed_scaling_factor=2.5, norm_topk_prob=True, use_qk_norm=True, attention_bias=True,
                     rms_norm_eps=1e-5, tie_word_embeddings=False,
                     rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5)),
}
# the vision-language families': benchmarks/golden_vision.py; the pooled kinds': benchmarks/golden_pooled.py
FAMILY_NAMES = (*CONFIGS, *VISION_CONFIGS, *POOLED_CONFIGS)
SAMPLE_LENGTHS = (6, 1, 11, 3)
# name -> (members in batch order, padding side, extra padding, inputs_embeds)
BATCHINGS = {
    "left_pad": ((0, 1, 2, 3), "left", 2, False),
    "right_pad": ((3, 2, 1, 0), "right", 1, False),
    "embeds_left_pad": ((2, 0, 3, 1), "left", 0, True),
}
# One row longer than several of the CPU interpreter's KV chunks (128 keys), alone and left-padded beside
# a short one, in ENGINE_FAMILY's model with room for its positions: the digests then cover attention's
# chunk tree (split-KV), not only a first chunk.
LONG_CONTEXT, LONG_MAX_POSITIONS = 300, 512
ENGINE_REQUESTS = [  # (prompt length, sampling parameters): greedy and seeded, with logprobs
    (7, dict(max_tokens=5, temperature=0.0, logprobs=2, prompt_logprobs=1)),
    (4, dict(max_tokens=6, temperature=0.8, top_p=0.9, seed=7, logprobs=1)),
    (10, dict(max_tokens=4, temperature=1.2, top_k=20, seed=11, logprobs=0)),
    (2, dict(max_tokens=7, temperature=0.0, repetition_penalty=1.3, logprobs=0)),
]


def write_checkpoint(family: str, dtype: torch.dtype, path: Path, **overrides) -> Path:
    config = FAMILIES[family].config_class(**{**CONFIGS[family], **overrides})
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, param in model.named_parameters():  # tied weights appear once
            param.copy_(parameter_values(name, tuple(param.shape)))
        for name, buffer in model.named_buffers():  # a sigmoid router's selection bias is a buffer
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(parameter_values(name, tuple(buffer.shape)))
    model.to(dtype).save_pretrained(path)
    return path


def samples(family: str) -> list[torch.Tensor]:
    vocab = CONFIGS[family]["vocab_size"]
    return [torch.from_numpy(integers(f"{family}/sample{i}", n, 0, vocab)) for i, n in enumerate(SAMPLE_LENGTHS)]


# ---- digests ----------------------------------------------------------------------------------------

def model_digests(model, family: str, prefix: str) -> dict[str, str]:
    seqs = samples(family)
    out = {f"{prefix}/alone": digest(logits_alone(model, s) for s in seqs)}
    for name, (members, side, extra, embeds) in BATCHINGS.items():
        rows = logits_in_batch(model, [seqs[i] for i in members], side=side, extra_pad=extra, embeds=embeds)
        by_sample = dict(zip(members, rows))
        out[f"{prefix}/{name}"] = digest(by_sample[i] for i in sorted(by_sample))
    return out


def long_context_digests(family: str, dtype: torch.dtype, device: str, path: Path, prefix: str) -> dict[str, str]:
    """The LONG_CONTEXT row's logits alone and left-padded beside the first sample (equal by design)."""
    write_checkpoint(family, dtype, path, max_position_embeddings=LONG_MAX_POSITIONS)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    make_invariant(model)
    long = torch.from_numpy(integers(f"{family}/long", LONG_CONTEXT, 0, CONFIGS[family]["vocab_size"]))
    beside = logits_in_batch(model, [samples(family)[0], long], side="left")[1]
    return {f"{prefix}/long_alone": digest([logits_alone(model, long)]), f"{prefix}/long_left_pad": digest([beside])}


def engine_digest(model, family: str) -> str:
    """Tokens, logprobs and top logprobs of a few greedy and seeded requests, run together in
    chunked steps (a small token budget), without a tokenizer; once as they come and once with
    decode steps padded to a bucket, which must give the same record (else this raises)."""
    vocab = CONFIGS[family]["vocab_size"]
    prompts = [integers(f"{family}/engine{i}", n, 0, vocab).tolist() for i, (n, _) in enumerate(ENGINE_REQUESTS)]
    params = [SamplingParams(ignore_eos=True, **p) for _, p in ENGINE_REQUESTS]
    records = []
    for buckets in ((), (4,)):
        engine = Engine(model, max_num_seqs=4, max_num_batched_tokens=8, kv_cache_memory=1 << 22,
                        decode_buckets=buckets)
        records.append([{"tokens": out.token_ids, "logprobs": [float(x).hex() for x in out.logprobs],
                         "top": [sorted((t, float(x).hex()) for t, x in d.items()) for d in out.top_logprobs or []],
                         "prompt_logprobs": [float(x).hex() for x in out.prompt_logprobs or []]}
                        for out in engine.generate(prompts, params)])
    if records[0] != records[1]:
        raise AssertionError("decode steps padded to a bucket changed the engine's outputs")
    return hashlib.sha256(json.dumps(records[0], sort_keys=True).encode()).hexdigest()


def parts(device: str = "cpu", families=None, dtypes=None, engine: bool = True, quantized: bool | None = None):
    """The digests of this device one part at a time: yields (part, thunk), where calling the thunk
    computes {family/dtype/case: sha256 hex} of that part ("family/dtype", or "quant/FORMAT" for
    the quantized formats, when compressed-tensors is installed). ``families`` default: all;
    ``quantized`` default: when ``families`` is all. One part raising leaves the others computable."""
    if quantized is None:
        quantized = families is None
    with tempfile.TemporaryDirectory() as tmp:
        if quantized and importlib.util.find_spec("compressed_tensors") is not None:
            for fmt in QUANT_FORMATS:
                yield f"quant/{fmt}", lambda fmt=fmt: quantized_digests(device, Path(tmp), formats=(fmt,))
        for family in FAMILY_NAMES if families is None else families:
            for dtype_name in dtypes or DTYPES:
                yield f"{family}/{dtype_name}", lambda family=family, dtype_name=dtype_name: _family_digests(
                    family, dtype_name, device, Path(tmp) / f"{family}-{dtype_name}", engine)


def _family_digests(family: str, dtype_name: str, device: str, path: Path, engine: bool) -> dict[str, str]:
    dtype = DTYPES[dtype_name]
    if family in VISION_CONFIGS:
        return vision_digests(family, dtype_name, dtype, device, path)
    if family in POOLED_CONFIGS:
        return pooled_digests(family, dtype_name, dtype, device, path)
    write_checkpoint(family, dtype, path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    make_invariant(model)
    out = model_digests(model, family, f"{family}/{dtype_name}")
    if engine and family == ENGINE_FAMILY:
        out[f"{family}/{dtype_name}/engine"] = engine_digest(model, family)
    if family == ENGINE_FAMILY:
        out.update(long_context_digests(family, dtype, device, path.with_name(path.name + "-long"),
                                        f"{family}/{dtype_name}"))
    return out


def compute(device: str = "cpu", families=None, dtypes=None, engine: bool = True, progress=None,
            quantized: bool | None = None) -> dict[str, str]:
    """Every digest for this device: {family/dtype/case: sha256 hex} of ``families`` (default: all),
    and with ``quantized`` (default: when ``families`` is all) those of the quantized formats
    (``quantized_digests``, when compressed-tensors is installed). A part that raises raises here."""
    out = {}
    for part, thunk in parts(device, families, dtypes, engine, quantized):
        out.update(thunk())
        if progress:
            progress(part)
    return out


def part_of(key: str) -> str:
    """The part a digest key belongs to: "family/dtype" or "quant/FORMAT"."""
    return "/".join(key.split("/")[:2])


# ---- quantized formats --------------------------------------------------------------------------------
# One fixed qwen2 model per format: its weights from the formula, quantized by compressed-tensors' own
# compressors (min/max qparams, no calibration data) or written in transformers' fp8 format, loaded with
# from_pretrained and digested like the dense models. Every K is a multiple of 128 (group and block
# formats); activations are bf16 (weight-only formats need 16-bit activations). Keys: quant/<format>/bf16/<case>.

QUANT_FAMILY = "qwen2"
QUANT_FORMATS = ("FP8_DYNAMIC", "FP8_BLOCK", "W8A8", "W4A16", "W4A16_ASYM", "fp8", "fp8-moe")
QUANT_WIDTHS = dict(hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=2)
# fp8-moe: qwen3_moe in transformers' fp8 format, experts included (128x128 blocks need widths of 128).
QUANT_MOE_WIDTHS = dict(hidden_size=128, moe_intermediate_size=128, num_attention_heads=4, num_key_value_heads=4)


def quant_family(fmt: str) -> str:
    return "qwen3_moe" if fmt == "fp8-moe" else QUANT_FAMILY


def write_quantized_checkpoint(fmt: str, path: Path) -> Path:
    from invariant_infer.testing.quantized_checkpoints import save_fp8_model, save_quantized_model

    family = quant_family(fmt)
    widths = QUANT_MOE_WIDTHS if fmt == "fp8-moe" else QUANT_WIDTHS
    config = FAMILIES[family].config_class(**{**CONFIGS[family], **widths})
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(parameter_values(name, tuple(param.shape)))
    model = model.to(torch.bfloat16).eval()
    return save_fp8_model(model, path) if fmt.startswith("fp8") else save_quantized_model(model, path, fmt)


def quantized_digests(device: str, tmp: Path, formats=QUANT_FORMATS, progress=None) -> dict[str, str]:
    out = {}
    for fmt in formats:
        path = write_quantized_checkpoint(fmt, tmp / f"quant-{fmt}")
        with quantized_loading():
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device).eval()
        out.update(model_digests(make_invariant(model), quant_family(fmt), f"quant/{fmt}/bf16"))
        if progress:
            progress(f"quant/{fmt}")
    return out


# ---- backends and the committed file ------------------------------------------------------------------

def backend_key(device: str = "cpu") -> str:
    """Digests are comparable within one backend: the CPU interpreter (whose arithmetic the
    interpreter harness defines), or one GPU model with one toolchain."""
    if device == "cpu":
        return "cpu-interpreter"
    name = torch.cuda.get_device_name(0)
    return f"cuda/{name}/torch-{torch.__version__}/triton-{triton.__version__}/cuda-{torch.version.cuda}"


def environment(device: str = "cpu") -> dict[str, str]:
    env = {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
           "transformers": transformers.__version__, "numpy": np.__version__, "machine": platform.machine()}
    if importlib.util.find_spec("compressed_tensors") is not None:  # it computes the quantized models' qparams
        import compressed_tensors
        env["compressed_tensors"] = compressed_tensors.__version__
    if device != "cpu":
        env.update(gpu=torch.cuda.get_device_name(0), cuda=str(torch.version.cuda))
    return env


def load(path: Path = GOLDEN_PATH) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def save(entries: dict, path: Path = GOLDEN_PATH) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(entries, indent=1, sort_keys=True) + "\n")


def differences(recorded: dict[str, str], current: dict[str, str]) -> list[str]:
    """One line per digest that moved, is missing or is new."""
    lines = [f"moved:   {k}" for k in sorted(recorded.keys() & current.keys()) if recorded[k] != current[k]]
    lines += [f"missing: {k}" for k in sorted(recorded.keys() - current.keys())]
    lines += [f"new:     {k}" for k in sorted(current.keys() - recorded.keys())]
    return lines


def explain(key: str, entry: dict | None, current: dict[str, str], env: dict[str, str]) -> str | None:
    """None when ``current`` equals the committed entry; otherwise what moved and how to regenerate."""
    if entry is None:
        return (f"no golden digests recorded for backend {key!r} in {GOLDEN_PATH}.\n"
                f"Record them with `{REGENERATE}`{' --device cuda' if key != 'cpu-interpreter' else ''} "
                "and an entry in BITS.md.")
    lines = differences(entry["digests"], current)
    if not lines:
        return None
    moved_env = {k: (entry.get("environment", {}).get(k), v) for k, v in env.items()
                 if entry.get("environment", {}).get(k) != v}
    return (f"{len(lines)} golden digest(s) of backend {key!r} changed:\n  " + "\n  ".join(lines) +
            (f"\nenvironment (recorded, now): {moved_env}" if moved_env else "\nenvironment: as recorded") +
            f"\nIf the change of bits is intended, regenerate with `{REGENERATE}` and add an entry to BITS.md "
            "saying what changed them and why.")


def compute_into(device: str, out: Path | None, families=None, dtypes=None) -> tuple[dict, dict, set]:
    """(digests, errors {part: "Type: message"}, parts attempted), computed part by part; a part that
    raises is recorded and the next one runs. With ``out``, this backend's entry (``errors`` added
    while any) is rewritten there after every part, so a run stopped midway keeps what it computed."""
    key, env = backend_key(device), environment(device)
    current, errors, attempted = {}, {}, set()
    for part, thunk in parts(device, families, dtypes):
        attempted.add(part)
        try:
            current.update(thunk())
            print(f"  {part}", file=sys.stderr)
        except Exception as exc:  # keep the other parts' digests
            errors[part] = f"{type(exc).__name__}: {exc}"[:500]
            print(f"  {part}: FAILED {errors[part]}", file=sys.stderr)
        if out:
            save({key: {"environment": env, "digests": current, **({"errors": errors} if errors else {})}}, out)
    return current, errors, attempted


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.golden_digests", description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--write", action="store_true", help=f"record this backend's digests in {GOLDEN_PATH}")
    parser.add_argument("--out", type=Path, help="also write this backend's entry to this file (after every part)")
    parser.add_argument("--merge", type=Path, help="add the entries of a file written by --out, then exit")
    parser.add_argument("--families", help=f"comma list of families to compute (default: all, and the quantized "
                                           f"formats): {','.join(FAMILY_NAMES)}")
    parser.add_argument("--dtypes", help=f"comma list of dtypes (default: all): {','.join(DTYPES)}")
    parser.add_argument("--new-backend-ok", action="store_true",
                        help="exit 0 when no digests are recorded for this backend yet (the --out file has them)")
    args = parser.parse_args(argv)
    entries = load()
    if args.merge:
        incoming = load(args.merge)
        partial = sorted(k for k, entry in incoming.items() if entry.get("errors"))
        if partial:
            parser.error(f"--merge: {args.merge} has parts that failed for {partial}; its digests are incomplete")
        entries.update(incoming)
        save(entries)
        print(f"merged {sorted(incoming)} into {GOLDEN_PATH}")
        return 0
    families = [f for f in args.families.split(",") if f] if args.families else None
    dtypes = [d for d in args.dtypes.split(",") if d] if args.dtypes else None
    unknown = sorted(set(families or ()) - set(FAMILY_NAMES)) + sorted(set(dtypes or ()) - set(DTYPES))
    if unknown:
        parser.error(f"unknown families or dtypes {unknown}; families: {', '.join(FAMILY_NAMES)}; dtypes: "
                     f"{', '.join(DTYPES)}")
    if args.write and (families or dtypes):
        parser.error("--write records every digest: leave out --families and --dtypes")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    key = backend_key(args.device)
    current, errors, attempted = compute_into(args.device, args.out, families, dtypes)
    if errors:
        print(f"{len(errors)} part(s) failed: " + "; ".join(f"{part}: {err}" for part, err in errors.items()))
    entry = {"environment": environment(args.device), "digests": current}
    if args.write:
        if errors:
            return 1
        entries[key] = entry
        save(entries)
        print(f"wrote {len(current)} digests for {key!r} to {GOLDEN_PATH}")
        return 0
    recorded = entries.get(key)
    if recorded is not None and (families or dtypes):  # compare the parts computed, no others
        recorded = {**recorded, "digests": {k: v for k, v in recorded["digests"].items() if part_of(k) in attempted}}
    if recorded is None and args.new_backend_ok:
        print(f"no golden digests recorded for backend {key!r} yet: {len(current)} computed"
              + (f", in {args.out}; add them with `python -m benchmarks.golden_digests --merge {args.out}` "
                 "and an entry in BITS.md" if args.out else ""))
        return 1 if errors else 0
    problem = explain(key, recorded, current, entry["environment"])
    print(problem or f"{len(current)} digests of {key!r} equal the committed ones")
    return 1 if problem or errors else 0


if __name__ == "__main__":
    sys.exit(main())
