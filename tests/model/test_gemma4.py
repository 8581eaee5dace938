"""Gemma 4's text model (``gemma4_text``, dense), the tiny preset with every feature at once: sliding
(16 keys) and global layers, the global ones with their own head_dim and KV heads and K = V, two
layers reading the first two's K/V, per-layer inputs, the per-layer scalar and softcapped logits.
Each row is bitwise itself alone in any padded batch and packed (ids and embeddings); fp32 logits are
within tolerance of stock float64, which references with full rotary on the global layers, with the
global layers' attention at the local head_dim, without the window, without KV sharing or without
softcapping all miss; bf16 errs no more than stock bf16;
``generate`` past the window gives each row's bits alone and each step one forward's; the engine's
requests equal alone with prefix hits. Negative control: an M-dependent linear. The MoE variant:
tests/model/test_gemma4_moe.py."""
from __future__ import annotations

import copy
import functools

import pytest
import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask
from transformers.models.gemma4 import modeling_gemma4 as gemma4_modeling

from helpers.controls import m_dependent_linear
from helpers.models import BATCHINGS, batch_mismatches, load_model, make_samples
from invariant_infer import make_invariant
from invariant_infer.model.logits import softcap_logits
from invariant_infer.testing.random_checkpoints import random_config, random_model, save_random_checkpoint
from test_sliding_window import (assert_engine_requests_equal_alone_with_prefix_hits,
                                 assert_generate_past_the_window_equals_prefill_and_alone,
                                 assert_rows_equal_alone_in_any_batch_and_packed)

FAMILY = "gemma4_text"
LENGTHS = (9, 1, 26, 5)  # past the 16-key window
RELATIVE_TOLERANCE = 2e-4  # of the logits' scale (their largest magnitude), fp32 against stock float64


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_random_checkpoint(tmp_path_factory.mktemp("gemma4"), random_config(FAMILY, "tiny"), seed=1)


@pytest.mark.fast_cells(ids=["bfloat16"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
def test_rows_equal_alone_in_a_padded_batch_and_packed(checkpoint, dtype):
    """A left-padded batch of ids, a right-padded one of embeddings, and packed rows (the fast tier: bf16;
    fp32: the negative control's test)."""
    model = make_invariant(load_model(checkpoint, dtype))
    samples = make_samples(model.config.vocab_size, LENGTHS)
    with torch.no_grad():
        assert batch_mismatches(model, samples, [BATCHINGS[0], BATCHINGS[3]]) == []
        assert packed_rows_equal_alone(model, samples)


def packed_rows_equal_alone(model, samples) -> bool:
    """The samples packed in one row (positions restarting) give each its logits alone."""
    packed = model(input_ids=torch.cat(samples)[None],
                   position_ids=torch.cat([torch.arange(len(s)) for s in samples])[None]).logits[0]
    starts = torch.tensor([0, *map(len, samples)]).cumsum(0).tolist()
    return all(torch.equal(packed[a:b], model(input_ids=s[None]).logits[0])
               for s, a, b in zip(samples, starts, starts[1:]))


@pytest.mark.heavy
def test_rows_equal_alone_in_any_batch_and_packed(checkpoint):
    """Every batching of helpers.models (left and right padding, extra padding, ids and embeddings,
    positions passed or derived) and packed rows."""
    assert_rows_equal_alone_in_any_batch_and_packed(make_invariant(load_model(checkpoint, torch.bfloat16)), LENGTHS)


@pytest.mark.heavy
def test_embedding_rows_equal_id_rows(checkpoint):
    """inputs_embeds: the per-layer inputs come from the ids found by the embedding's own rounding."""
    model = make_invariant(load_model(checkpoint, torch.bfloat16))
    samples = make_samples(model.config.vocab_size, LENGTHS)
    embed = model.get_input_embeddings()
    with torch.no_grad():
        for sample in samples:
            by_ids = model(input_ids=sample[None]).logits
            by_embeds = model(inputs_embeds=embed(sample[None])).logits
            assert torch.equal(by_ids, by_embeds)


@pytest.mark.heavy
def test_fp32_rows_equal_alone_and_an_m_dependent_linear_is_caught(checkpoint, monkeypatch):
    """fp32 rows alone in a left- and a right-padded batch and packed; then the negative control: the same
    check fails once the linear picks BLOCK_K by M (a row alone has at most 26 tokens, a batch of them more)."""
    import invariant_infer.model.layer_forwards as layer_forwards
    model = make_invariant(load_model(checkpoint, torch.float32))
    samples = make_samples(model.config.vocab_size, LENGTHS)
    batchings = [BATCHINGS[0], BATCHINGS[3]]
    with torch.no_grad():
        assert batch_mismatches(model, samples, batchings) == [] and packed_rows_equal_alone(model, samples)
        monkeypatch.setattr(layer_forwards, "linear", functools.partial(m_dependent_linear, small_m=30))
        assert batch_mismatches(model, samples, batchings) != []


def test_softcapping_is_per_element_and_batch_invariant():
    """cap * tanh(logits / cap) of a row is the same bits alone and in any batch of rows."""
    torch.manual_seed(0)
    rows = torch.randn(37, 523, dtype=torch.bfloat16) * 20
    batch = softcap_logits(rows, 5.0)
    assert all(torch.equal(batch[i], softcap_logits(rows[i:i + 1], 5.0)[0]) for i in (0, 17, 36))
    assert torch.equal(batch[5:9], softcap_logits(rows[5:9], 5.0))
    exact = 5.0 * torch.tanh(rows.double() / 5.0)
    assert (batch.double() - exact).abs().max() <= 5.0 * 2 ** -7  # bf16's rounding of |values| under 5
    assert batch.abs().max() <= 5.0


def _full_rotary_on_global_layers(reference):
    """The global layers rotated over their whole head_dim (the released RoPE rotates a quarter)."""
    rotary = reference.model.rotary_emb
    dim = reference.config.per_layer_config[1].head_dim
    theta = reference.config.rope_parameters["full_attention"]["rope_theta"]
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    rotary.full_attention_inv_freq = inv.to(rotary.full_attention_inv_freq.dtype)


def _split_heads(states: torch.Tensor, head_dim: int) -> torch.Tensor:
    """[B, H, L, D] -> [B, H * D / head_dim, L, head_dim]: each head cut into consecutive heads."""
    batch, heads, length, dim = states.shape
    return states.unflatten(-1, (dim // head_dim, head_dim)).transpose(2, 3).reshape(batch, -1, length, head_dim)


def _attention_at_the_local_head_dim(module, query, key, value, attention_mask, **kwargs):
    head_dim = getattr(module, "split_head_dim", None)  # set on the global layers: the sliding layers' head_dim
    if head_dim is not None:
        query, key, value = (_split_heads(states, head_dim) for states in (query, key, value))
    return gemma4_modeling.eager_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register("gemma4_local_head_dim", _attention_at_the_local_head_dim)
AttentionMaskInterface.register("gemma4_local_head_dim", eager_mask)


def _local_head_dim_on_global_layers(reference):
    """The global layers' attention at the sliding layers' head_dim: every head of global_head_dim
    cut into heads of head_dim (the same projections, norms and RoPE; each score over fewer dims)."""
    local = next(layer.self_attn.head_dim for layer in reference.model.layers if layer.self_attn.sliding_window)
    for layer in reference.model.layers:
        if layer.self_attn.sliding_window is None:
            layer.self_attn.split_head_dim = local
    reference.set_attn_implementation("gemma4_local_head_dim")


def _no_window(reference):
    reference.config.sliding_window = 4096
    for layer in reference.model.layers:
        layer.self_attn.sliding_window = None


def _no_kv_sharing(reference):
    """Each layer its own K/V: the sharing layers project their own, with their source's weights."""
    sources = {2: 0, 3: 1}
    for layer, source in sources.items():
        attention, own = reference.model.layers[layer].self_attn, reference.model.layers[source].self_attn
        for name in ("k_proj", "v_proj", "k_norm", "v_norm"):
            setattr(attention, name, copy.deepcopy(getattr(own, name)))
        attention.is_kv_shared_layer = False


def _no_softcapping(reference):
    reference.config.final_logit_softcapping = None


def test_accuracy_against_float64_and_what_its_tolerance_catches(checkpoint):
    stock = load_model(checkpoint, torch.float32)
    model = make_invariant(copy.deepcopy(stock))
    ids = make_samples(model.config.vocab_size, (60,))[0][None]

    def reference_logits(change=None):
        reference = copy.deepcopy(stock).double()
        if change is not None:
            change(reference)
        with torch.no_grad():
            return reference(ids, use_cache=False).logits  # no cache: the KV-shared layers own none
    exact = reference_logits()
    with torch.no_grad():
        ours = model(ids).logits.double()
    tolerance = RELATIVE_TOLERANCE * exact.abs().max().item()
    assert (ours - exact).abs().max().item() < tolerance
    for change in (_full_rotary_on_global_layers, _local_head_dim_on_global_layers, _no_window, _no_kv_sharing,
                   _no_softcapping):
        assert (ours - reference_logits(change)).abs().max().item() > 10 * tolerance, change.__name__


@pytest.mark.heavy
def test_bf16_errs_no_more_than_twice_stock_bf16(checkpoint):
    stock = load_model(checkpoint, torch.bfloat16)
    model = make_invariant(copy.deepcopy(stock))
    ids = make_samples(model.config.vocab_size, (60,))[0][None]
    with torch.no_grad():
        exact = load_model(checkpoint, torch.float32).double()(ids).logits
        ours = (model(ids).logits.double() - exact).abs().max().item()
        theirs = (stock(ids).logits.double() - exact).abs().max().item()
    assert ours <= 2 * theirs


@pytest.mark.heavy  # the fast tier decodes past a window (dynamic cache) in tests/model/test_sliding_window.py
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_generate_past_the_window_equals_prefill_and_alone(checkpoint, cache):
    assert_generate_past_the_window_equals_prefill_and_alone(make_invariant(load_model(checkpoint, torch.bfloat16)),
                                                             cache, new_tokens=3)


@pytest.mark.heavy
def test_engine_requests_equal_alone_with_prefix_hits(checkpoint):
    assert_engine_requests_equal_alone_with_prefix_hits(make_invariant(load_model(checkpoint, torch.bfloat16)),
                                                        new_tokens=4, alone_prompt_logprobs=True)


@pytest.mark.heavy
def test_embeddings_find_their_ids_where_sqrt_hidden_is_not_a_bf16_number():
    """hidden 48: the embedding module scales by sqrt(48) rounded to bf16 (6.9375), so transformers'
    reverse lookup (unrounded 6.928...) matches no row; the invariant path finds each id exactly."""
    model = make_invariant(random_model(random_config(FAMILY, "tiny", hidden_size=48), seed=2, dtype=torch.bfloat16))
    ids = make_samples(model.config.vocab_size, (12,))[0][None]
    embeds = model.get_input_embeddings()(ids)
    with torch.no_grad():
        assert torch.equal(model(inputs_embeds=embeds).logits, model(input_ids=ids).logits)
        with pytest.raises(RuntimeError, match="do not exactly match"):
            model.model.get_per_layer_inputs(None, embeds)  # transformers' own lookup


@pytest.mark.heavy
def test_engine_equals_generate_token_logprobs_and_scoring(checkpoint):
    """Greedy engine outputs (softcapped logits) equal ``model.generate``'s tokens and its logits' logprobs,
    the trainer-side ``token_logprobs`` and ``score_sequences``, prompts past the window."""
    assert_engine_equals_generate_token_logprobs_and_scoring(make_invariant(load_model(checkpoint, torch.bfloat16)))


@pytest.mark.heavy
def test_engine_with_a_padded_kv_cache_group_equals_generate():
    """Global layers of 2 KV heads x 32 beside sliding ones of 2 x 16 (twice their bytes a token): the
    sliding group's pages have room for 2 layers and hold 1 (``engine.kv_cache_layout``), as Gemma 4
    26B-A4B's global groups; the engine still gives ``generate``'s tokens and logprobs."""
    from invariant_infer.engine import Engine
    model = make_invariant(random_model(random_config(FAMILY, "tiny", num_global_key_value_heads=2), seed=1,
                                        dtype=torch.bfloat16))
    groups = Engine(model).core.runner.layout.groups
    assert [(g.layers, g.slots) for g in groups] == [((0,), 2), ((1,), 1)]
    assert_engine_equals_generate_token_logprobs_and_scoring(model)


def assert_engine_equals_generate_token_logprobs_and_scoring(model) -> None:
    from helpers.engine_runs import trainer_logprobs
    from invariant_infer import score_sequences
    from invariant_infer.engine import Engine, SamplingParams
    from invariant_infer.kernels import token_logprobs
    prompts = [s.tolist() for s in make_samples(model.config.vocab_size, (30, 3, 21), seed=5)]
    outs = Engine(model, max_num_seqs=2, max_num_batched_tokens=16).generate(
        prompts, SamplingParams(max_tokens=4, temperature=0.0, logprobs=0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        alone = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=4, do_sample=False, pad_token_id=0,
                               output_scores=True, return_dict_in_generate=True)
        assert alone.sequences[0, len(prompt):].tolist() == out.token_ids
        logits = torch.stack([score[0] for score in alone.scores]).to(torch.bfloat16)  # exact: bf16 logits as fp32
        assert token_logprobs(logits, torch.tensor(out.token_ids))[0].tolist() == out.logprobs
    sequences = [o.prompt_token_ids + o.token_ids for o in outs]
    lengths = [len(o.prompt_token_ids) for o in outs]
    with torch.no_grad():
        assert trainer_logprobs(model, sequences, lengths, 3, "left", 1.0) == [o.logprobs for o in outs]
    scored = score_sequences(model, sequences, prompt_lengths=lengths)
    assert [r.token_logprobs.tolist() for r in scored] == [o.logprobs for o in outs]
    assert all(r.greedy for r in scored)  # greedy tokens: each the argmax of its softcapped logits


def test_logits_to_keep_on_the_decoder_is_refused():
    """transformers 5.25's decoder cuts the KV-shared layers' rows to ``logits_to_keep``, which per-row
    attention bounds cannot follow; the causal LM keeps rows after the decoder instead (generate's path)."""
    from invariant_infer import NonInvariantInputError
    model = make_invariant(random_model(random_config(FAMILY, "tiny")))
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad(), pytest.raises(NonInvariantInputError, match="logits_to_keep"):
        model.model(input_ids=ids, logits_to_keep=1)
