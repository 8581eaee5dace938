"""Models and checkpoints for the tests: the dtypes, devices and families to parametrize over (and the
family x dtype cells), loading a saved checkpoint, and the model-level batchings compared bitwise
with each sample alone (through ``invariant_infer.testing.drift``)."""
from __future__ import annotations

from dataclasses import dataclass
from itertools import product

import pytest
import torch
from transformers import AutoModelForCausalLM

from invariant_infer.testing.drift import batch_drift, logits_alone, logits_in_batch
from invariant_infer.model.families import FAMILIES


DTYPES = [torch.bfloat16, torch.float16, torch.float32]


# Dense families of the Llama layout: the FAMILY-driven tests run over these. The MoE, hybrid (Gated
# DeltaNet), Gemma, gpt-oss, GLM-4.5, latent-attention and vision-language families have their own tests
# (tests/model/test_moe.py, test_hybrid.py, test_gemma3.py, test_gpt_oss.py, test_glm4_moe.py,
# test_deepseek_v3.py), so CI time does not multiply.
GEMMA_FAMILY_NAMES = ["gemma3_text"]
GEMMA4_FAMILY_NAMES = ["gemma4_text", "gemma4"]  # tests/model/test_gemma4.py, test_gemma4_multimodal.py (not TP)
GPT_OSS_FAMILY_NAMES = ["gpt_oss"]
GLM4_MOE_FAMILY_NAMES = ["glm4_moe"]  # its own tests (test_glm4_moe.py)
# own tests (test_deepseek_v3.py)
LATENT_ATTENTION_FAMILY_NAMES = sorted(name for name, adapter in FAMILIES.items() if adapter.latent_attention)
VISION_FAMILY_NAMES = sorted(name for name, adapter in FAMILIES.items() if adapter.vision is not None)  # own tests
FAMILY_NAMES = sorted(name for name, adapter in FAMILIES.items()
                      if adapter.moe is None and adapter.linear_attention is None and adapter.vision is None
                      and name not in GEMMA_FAMILY_NAMES + GEMMA4_FAMILY_NAMES + LATENT_ATTENTION_FAMILY_NAMES)
MOE_FAMILY_NAMES = sorted(name for name, adapter in FAMILIES.items()
                          if adapter.moe is not None and adapter.linear_attention is None
                          and name not in GPT_OSS_FAMILY_NAMES + GLM4_MOE_FAMILY_NAMES + LATENT_ATTENTION_FAMILY_NAMES)
HYBRID_FAMILY_NAMES = sorted(name for name, adapter in FAMILIES.items() if adapter.linear_attention is not None)
# Families with their own model tests whose engine schedule, score CLI and server run in the generic
# tests as heavy cells (tests/engine/test_engine.py, tests/generation/test_family_workflows.py,
# tests/server/test_server_families.py).
OWN_TEST_FAMILY_NAMES = sorted(GLM4_MOE_FAMILY_NAMES + LATENT_ATTENTION_FAMILY_NAMES + GEMMA4_FAMILY_NAMES)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


# The family x dtype matrix. The fast tier runs a cover of it: every family once, the dtypes in turn,
# so every dtype meets a family; the families meet every dtype in the tests that run them all in bf16
# or fp32 (engine, speculation, training, digests). The other cells are marked heavy: the heavy tier
# (pytest -m heavy) runs them.
def family_dtype_cells(families: list[str], dtypes: list[torch.dtype]) -> list:
    """Every (family, dtype) parameter; those outside the cover above are marked heavy."""
    cover = {(families[i % len(families)], dtypes[i % len(dtypes)]) for i in range(max(len(families), len(dtypes)))}
    return [pytest.param(f, d, id=f"{f}-{str(d).removeprefix('torch.')}",
                         marks=() if (f, d) in cover else pytest.mark.heavy) for f, d in product(families, dtypes)]


def load_model(path, dtype: torch.dtype, device: str = "cpu"):
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()


# Model-level batchings

@dataclass(frozen=True)
class Batching:
    members: tuple[int, ...]      # which samples, in which order
    left_pad: bool = True
    extra_pad: int = 0            # padding beyond the longest member
    embeds: bool = False          # inputs_embeds instead of input_ids
    pass_positions: bool = False  # pass position_ids (cumsum - 1) instead of letting them be derived

    def options(self) -> dict:
        return dict(side="left" if self.left_pad else "right", extra_pad=self.extra_pad, embeds=self.embeds,
                    explicit_positions=self.pass_positions)


BATCHINGS = [
    Batching((0, 1, 2, 3)),
    Batching((3, 2, 1, 0), extra_pad=5),
    Batching((2, 0), left_pad=False),
    Batching((1, 3, 2), left_pad=False, extra_pad=3, embeds=True),
    Batching((0, 3), embeds=True, pass_positions=True),
    Batching((3, 0, 1, 2), left_pad=False, pass_positions=True),
]


def make_samples(vocab_size: int, lengths=(9, 1, 14, 5), seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=g) for n in lengths]


def logits_batched(model, samples, batching: Batching) -> list[torch.Tensor]:
    return logits_in_batch(model, [samples[i] for i in batching.members], **batching.options())


def batch_mismatches(model, samples, batchings=BATCHINGS):
    """Every (batching, sample) whose real-token logits differ from the sample run alone,
    with the max |difference|. Empty means bitwise invariant."""
    alone = [logits_alone(model, s) for s in samples]
    mismatches = []
    for batching in batchings:
        drift = batch_drift(model, [samples[i] for i in batching.members], **batching.options(),
                            alone=[alone[i] for i in batching.members])
        mismatches += [(batching, batching.members[row], diff) for row, diff in drift.mismatches]
    return mismatches


def logits_and_chosen_experts(model, ids, layer: int = 1):
    """(float64 logits [L, V] of ``ids`` [1, L], each token's experts in sparse layer ``layer``, sorted [L, k]),
    for the routers that return (logits, weights, experts) (GLM-4.5's and DeepSeek-V3's ``mlp.gate``)."""
    chosen = []
    hook = model.model.layers[layer].mlp.gate.register_forward_hook(
        lambda module, args, out: chosen.append(out[2].sort(-1).values))
    try:
        logits = model(ids).logits[0].double()
    finally:
        hook.remove()
    return logits, chosen[0]
