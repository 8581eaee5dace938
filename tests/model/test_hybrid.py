"""Hybrid models (Qwen3.5's text models, dense and MoE, and Qwen3-Next: Gated DeltaNet layers beside
gated full attention), saved and loaded as users load them: each row's logits bitwise those of the
row alone (left and right padding, inputs_embeds, packed rows; bf16, fp16, fp32), decode == prefill through ``generate`` and
through the cache at any cut (prompts of 3, 60, 64, 65 and 66 tokens, decode across the chunk
boundary at 64), a batched ``generate`` == each prompt alone, accuracy against stock in float64.
Negative controls: stock's recurrent decode differs from its prefill (fp32), chunks anchored at a
left-padded row's position 0 and a chunk size chosen by the batch give other bits. What does not run
yet is refused by name. The fast tier runs the dense Qwen3.5 model (the negative controls run on it
only); the others run in the heavy tier."""
import pytest
import torch
from transformers import AutoModelForCausalLM, DataCollatorWithFlattening

import invariant_infer.model.linear_attention as linear_attention
from helpers.models import BATCHINGS, DTYPES, HYBRID_FAMILY_NAMES, batch_mismatches, load_model
from helpers.models import make_samples
from invariant_infer import NonInvariantInputError, UnsupportedModelError, make_invariant, score_sequences
from invariant_infer.kernels import gated_delta_rule
from invariant_infer.model.families import FAMILIES

pytestmark = pytest.mark.file_minutes(0.6)

PROMPT_LENGTHS = (60, 3, 66)  # 60 + 6 new tokens decode across the boundary at 64
NEW_TOKENS = 6


@pytest.fixture(autouse=True)
def _inference():
    with torch.no_grad():
        yield


# Every dtype on the dense hybrid; bf16 on the MoE ones (their Gated DeltaNet layers are the same; CI time).
HYBRID_DTYPE_CELLS = [pytest.param(f, d, id=f"{f}-{str(d).removeprefix('torch.')}")
                      for f in HYBRID_FAMILY_NAMES for d in DTYPES if f == "qwen3_5_text" or d == torch.bfloat16]


# The negative controls break the Gated DeltaNet path, which every hybrid family shares: one family
# catches them (CI time). Packing, the cache, accuracy and scores run the dense family and Qwen3-Next
# (fused projections, sparse blocks); Qwen3.5-MoE's layers are the one's attention and linear
# attention with the other's kind of sparse block.
NEGATIVE_CONTROL_FAMILIES = ["qwen3_5_text"]
LAYOUT_FAMILIES = ["qwen3_5_text", "qwen3_next"]


def samples_for(model, lengths=(9, 1, 70, 5)):
    """Lengths 1 and 70 (past the 64-token chunk) beside short ones."""
    return make_samples(model.config.vocab_size, lengths)


@pytest.mark.fast_cells(ids=["qwen3_5_text-float16"])
@pytest.mark.parametrize("family, dtype", HYBRID_DTYPE_CELLS)
def test_rows_alone_equal_rows_in_any_batch(family_checkpoints, family, dtype):
    model = make_invariant(load_model(family_checkpoints(family), dtype))
    assert batch_mismatches(model, samples_for(model), BATCHINGS) == []


@pytest.mark.fast_cells(ids=["qwen3_5_text"])
@pytest.mark.parametrize("family", LAYOUT_FAMILIES)
def test_packed_rows_equal_alone(family_checkpoints, family):
    model = make_invariant(load_model(family_checkpoints(family), torch.float32))
    samples = samples_for(model, (5, 1, 70, 3))
    alone = [model(input_ids=s[None]).logits[0] for s in samples]
    for flash_kwargs in (False, True):
        batch = DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)(
            [{"input_ids": s.tolist()} for s in samples])
        del batch["labels"]
        logits = model(**batch).logits[0]
        bounds = torch.tensor([0, *[len(s) for s in samples]]).cumsum(0).tolist()
        assert all(torch.equal(logits[a:b], want) for a, b, want in zip(bounds, bounds[1:], alone)), flash_kwargs


def generate(model, ids, mask):
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                         output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    return out.sequences, torch.stack(out.logits, 1)  # [B, new, V]


def left_padded(prompts):
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):], mask[row, width - len(prompt):] = prompt, 1
    return ids, mask


def decode_equals_prefill(model, prompts) -> tuple[list[bool], list[torch.Tensor]]:
    """Per prompt alone: whether generate's logits at every step equal one forward over the prompt and
    the tokens before that step; and those logits [new, V]."""
    equal, logits_alone = [], []
    for prompt in prompts:
        sequences, logits = generate(model, prompt[None], torch.ones(1, len(prompt), dtype=torch.long))
        prefill = model(input_ids=sequences[:, :-1]).logits[0, len(prompt) - 1:]
        equal.append(torch.equal(logits[0], prefill))
        logits_alone.append(logits[0])
    return equal, logits_alone


@pytest.mark.fast_cells(ids=["qwen3_5_text-float32"])
@pytest.mark.parametrize("family, dtype", [c for c in HYBRID_DTYPE_CELLS if c.values[1] != torch.float16])
def test_generate_decode_equals_prefill_and_a_batch_equals_each_prompt_alone(family_checkpoints, family, dtype):
    model = make_invariant(load_model(family_checkpoints(family), dtype))
    prompts = make_samples(model.config.vocab_size, PROMPT_LENGTHS, seed=3)
    equal, alone = decode_equals_prefill(model, prompts)
    assert equal == [True] * len(prompts)
    _, batched = generate(model, *left_padded(prompts))
    for row in range(len(prompts)):
        assert torch.equal(batched[row], alone[row]), row


@pytest.mark.heavy  # the fast tier keeps to its 10 minutes
@pytest.mark.parametrize("family", LAYOUT_FAMILIES)
def test_a_prefill_cut_anywhere_through_the_cache_equals_one_forward(family_checkpoints, family):
    """The prompt fed through the cache in pieces (before, at and after the chunk boundary), as a
    chunked prefill does: every token's logits equal one forward over the whole prompt."""
    model = make_invariant(load_model(family_checkpoints(family), torch.float32))
    (prompt,) = make_samples(model.config.vocab_size, (130,), seed=5)
    whole = model(input_ids=prompt[None]).logits[0]
    for cuts in ([7, 64, 65, 66, 130], [63, 64, 128, 129, 130]):
        cache, pieces, done = None, [], 0
        for cut in cuts:
            out = model(input_ids=prompt[None, done:cut], past_key_values=cache, use_cache=True)
            cache, done = out.past_key_values, cut
            pieces.append(out.logits[0])
        assert torch.equal(torch.cat(pieces), whole), cuts


@pytest.mark.fast_cells(ids=["qwen3_5_text"])
@pytest.mark.parametrize("family", LAYOUT_FAMILIES)
def test_accuracy_against_stock_in_float64(family_checkpoints, family):
    """fp32 invariant logits within 1e-4 of transformers' own forward in float64 (its torch fallbacks)."""
    stock = load_model(family_checkpoints(family), torch.float64)
    if FAMILIES[family].moe is not None:
        stock.set_experts_implementation("eager")  # torch's grouped_mm has no float64
    model = make_invariant(load_model(family_checkpoints(family), torch.float32))
    for sample in samples_for(model, (70, 3)):
        want = stock(input_ids=sample[None]).logits[0]
        assert (model(input_ids=sample[None]).logits[0].double() - want).abs().max() < 1e-4


@pytest.mark.parametrize("family", NEGATIVE_CONTROL_FAMILIES)
def test_negative_control_stock_decode_differs_from_its_prefill(family_checkpoints, family):
    """transformers' own decode (the recurrent rule, one token at a time) against its chunked prefill."""
    stock = load_model(family_checkpoints(family), torch.float32)
    prompts = make_samples(stock.config.vocab_size, PROMPT_LENGTHS, seed=3)
    assert decode_equals_prefill(stock, prompts)[0] == [False] * len(prompts)


@pytest.mark.parametrize("family", NEGATIVE_CONTROL_FAMILIES)
def test_negative_control_chunks_anchored_at_the_padded_position_0(family_checkpoints, family, monkeypatch):
    """Each row's segment starting at column 0 (pads counted into its chunks, zeroed as stock zeroes
    them) instead of at its first real token: a left-padded row's chunk boundaries move."""
    model = make_invariant(load_model(family_checkpoints(family), torch.float32))
    real_ranges = linear_attention._row_ranges

    def from_column_0(mask, batch, length, device):
        start, end = real_ranges(mask, batch, length, device)
        return torch.zeros_like(start), end
    monkeypatch.setattr(linear_attention, "_row_ranges", from_column_0)
    assert batch_mismatches(model, samples_for(model, (9, 1, 20, 5)), BATCHINGS[:1]) != []


@pytest.mark.parametrize("family", NEGATIVE_CONTROL_FAMILIES)
def test_negative_control_a_chunk_size_chosen_by_the_batch(family_checkpoints, family, monkeypatch):
    model = make_invariant(load_model(family_checkpoints(family), torch.float32))
    scan = gated_delta_rule.chunk_gated_delta_rule

    def batch_chunk(*args, **kwargs):
        return scan(*args, **kwargs, chunk=32 if args[7].shape[0] > 1 else gated_delta_rule.CHUNK)
    monkeypatch.setattr(linear_attention, "chunk_gated_delta_rule", batch_chunk)
    assert batch_mismatches(model, samples_for(model, (9, 1, 40, 5)), BATCHINGS[:1]) != []


@pytest.mark.fast_cells(ids=["qwen3_5_text"])
@pytest.mark.parametrize("family", HYBRID_FAMILY_NAMES)
def test_what_does_not_run_yet_is_refused_by_name(family_checkpoints, family):
    model = make_invariant(load_model(family_checkpoints(family), torch.float32))
    ids, mask = torch.tensor([[5, 6, 7], [8, 9, 0]]), torch.tensor([[1, 1, 1], [1, 1, 0]])
    cache = model(input_ids=ids, attention_mask=mask, use_cache=True).past_key_values  # a right-padded row
    with pytest.raises(NonInvariantInputError, match="right padding"):
        model(input_ids=torch.tensor([[1], [2]]), past_key_values=cache, use_cache=True)
    if FAMILIES[family].moe is not None:  # the dense family trains (tests/training/test_training_hybrid.py)
        with torch.enable_grad(), pytest.raises(UnsupportedModelError, match="MoE training"):
            model.train()(input_ids=torch.tensor([[1, 2, 3]]))
    model.eval()


def test_a_qwen3_5_checkpoint_loads_as_its_text_model(tmp_path):
    """A released Qwen3.5 checkpoint is the multimodal ``qwen3_5`` model; AutoModelForCausalLM loads
    its language model (``qwen3_5_text``), which make_invariant patches."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from invariant_infer.testing.random_checkpoints import random_config
    text = random_config("qwen3_5_text", "tiny").to_dict()
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                  temporal_patch_size=1, spatial_merge_size=1)
    full = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=vision))
    full.save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert model.config.model_type == "qwen3_5_text"
    make_invariant(model)
    assert batch_mismatches(model, samples_for(model, (9, 1, 12, 5)), BATCHINGS[:1]) == []


@pytest.mark.fast_cells(ids=["qwen3_5_text"])
@pytest.mark.parametrize("family", LAYOUT_FAMILIES)
def test_scores_are_each_sequence_alone(family_checkpoints, family):
    model = make_invariant(load_model(family_checkpoints(family), torch.bfloat16))
    sequences = [s.tolist() for s in samples_for(model, (70, 5, 20))]
    together = score_sequences(model, sequences, prompt_lengths=[3, 1, 4])
    for sequence, start, got in zip(sequences, [3, 1, 4], together):
        (alone,) = score_sequences(model, [sequence], prompt_lengths=[start])
        assert torch.equal(got.token_logprobs, alone.token_logprobs) and got.digest == alone.digest
