"""Gemma 4's released checkpoints (model type ``gemma4``: ``Gemma4ForConditionalGeneration``, vision and
audio towers beside the text model), text only. A tiny random checkpoint whose text_config is
``gemma4_text``'s tiny preset, saved and loaded back as users load one: each row is bitwise itself alone
in any padded batch and packed (bf16, fp16, fp32) and equal to the same weights run as
``Gemma4ForCausalLM``; ``generate`` (dynamic and static caches) and the engine give each row its bits
alone, scoring and ``token_logprobs`` the text model's. Images and audio are refused by name
before any compute, and the towers stay unpatched (their attention too, also under the engine's stock
baseline). Negative control: an M-dependent linear."""
from __future__ import annotations

import functools

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma4ForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from helpers.controls import m_dependent_linear
from helpers.models import BATCHINGS, batch_mismatches, load_model, make_samples
from invariant_infer import NonInvariantInputError, make_invariant
from invariant_infer.checkpoints.loading import auto_class_for
from invariant_infer.model.families import is_vision_language
from invariant_infer.model.kinds import model_kinds
from invariant_infer.testing.random_checkpoints import random_config, random_model, save_random_checkpoint
from test_gemma4 import packed_rows_equal_alone
from test_sliding_window import (assert_engine_requests_equal_alone_with_prefix_hits,
                                 assert_generate_past_the_window_equals_prefill_and_alone,
                                 assert_rows_equal_alone_in_any_batch_and_packed)

FAMILY = "gemma4"
LENGTHS = (9, 1, 26, 5)  # past the 16-key window


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_random_checkpoint(tmp_path_factory.mktemp("gemma4_multimodal"), random_config(FAMILY, "tiny"), seed=1)


@pytest.fixture(scope="module")
def text_checkpoint(checkpoint, tmp_path_factory):
    """The checkpoint's text weights (language model and lm_head) saved as ``gemma4_text``'s causal LM."""
    wrapper = load_model(checkpoint, torch.float32)
    text = Gemma4ForCausalLM(wrapper.config.text_config).eval()
    state = {f"model.{name}": value for name, value in wrapper.model.language_model.state_dict().items()}
    state["lm_head.weight"] = wrapper.lm_head.weight
    text.load_state_dict(state, strict=True)
    path = tmp_path_factory.mktemp("gemma4_text_of_multimodal")
    text.save_pretrained(path)
    return path


def _assert_rows_equal_the_text_model(model, text, samples):
    with torch.no_grad():
        for sample in samples:
            assert torch.equal(model(input_ids=sample[None]).logits, text(input_ids=sample[None]).logits)


def test_rows_equal_alone_in_a_padded_batch_and_the_text_model(checkpoint, text_checkpoint):
    """bf16: a left-padded batch gives each row its bits alone, and each row alone is the same weights'
    Gemma4ForCausalLM's bits (every batching, embeddings and fp32: the heavy test)."""
    stock = load_model(checkpoint, torch.bfloat16)
    assert type(stock).__name__ == "Gemma4ForConditionalGeneration"
    text = make_invariant(load_model(text_checkpoint, stock.dtype))
    assert type(text).__name__ == "Gemma4ForCausalLM"
    model = make_invariant(stock)
    samples = make_samples(model.config.text_config.vocab_size, LENGTHS)
    with torch.no_grad():
        assert batch_mismatches(model, samples, [BATCHINGS[0]]) == []
    _assert_rows_equal_the_text_model(model, text, samples)


def test_images_and_audio_are_refused_by_name_before_any_compute(checkpoint):
    model = make_invariant(load_model(checkpoint, torch.float32))
    ran = []
    model.model.language_model.register_forward_pre_hook(lambda module, args: ran.append(module))
    ids = torch.tensor([[5, 6, 7]])
    media = {"pixel_values": torch.zeros(1, 4, 3 * 16 * 16), "input_features": torch.zeros(1, 8, 128),
             "pixel_values_videos": torch.zeros(1, 1, 4, 3 * 16 * 16)}
    with torch.no_grad():
        for name, value in media.items():
            with pytest.raises(NonInvariantInputError, match=f"{name}: make_invariant does not run images, videos and "
                                                             "audio on Gemma 4"):
                model(input_ids=ids, **{name: value})
            with pytest.raises(NonInvariantInputError, match=name):
                model.model(input_ids=ids, **{name: value})
    assert ran == []


def test_the_text_model_is_patched_and_the_towers_are_not(checkpoint):
    """Not a vision-language model on any surface (no image runs); every decoder linear is patched, no
    tower module; restore brings transformers' forwards back."""
    from invariant_infer import restore
    model = load_model(checkpoint, torch.float32)
    assert not is_vision_language(model.config) and auto_class_for(model.config) is AutoModelForCausalLM
    assert type(model).__name__ in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES["gemma4"]
    assert "vision_language" not in model_kinds(model) and "gemma4_text" in model_kinds(model)
    configs = [model.config.text_config, model.config.vision_config, model.config.audio_config]
    loaded = [config._attn_implementation for config in configs]
    make_invariant(model)
    assert [config._attn_implementation for config in configs] == ["invariant"] + loaded[1:]  # the towers' as loaded
    towers = [model.model.vision_tower, model.model.audio_tower, model.model.embed_vision, model.model.embed_audio]
    assert not any("forward" in module.__dict__ for tower in towers for module in tower.modules())
    decoder = model.model.language_model
    assert all("forward" in module.__dict__ for module in decoder.modules() if type(module) is torch.nn.Linear)
    assert "forward" in model.lm_head.__dict__ and "forward" in model.__dict__ and "forward" in model.model.__dict__
    restore(model)
    assert not any("forward" in module.__dict__ for module in model.modules())
    assert [config._attn_implementation for config in configs] == loaded


@pytest.mark.heavy
def test_fp32_rows_equal_alone_and_the_text_model_and_an_m_dependent_linear_is_caught(checkpoint, text_checkpoint,
                                                                                     monkeypatch):
    """fp32, four batchings of helpers.models (padding both sides, extra padding, embeddings, positions
    passed), packed rows and the embeddings' rows; then the negative control: the
    same check fails once the linear picks BLOCK_K by M (a row alone has at most 26 tokens, a batch more)."""
    import invariant_infer.model.layer_forwards as layer_forwards
    stock = load_model(checkpoint, torch.float32)
    text = make_invariant(load_model(text_checkpoint, stock.dtype))
    assert type(text).__name__ == "Gemma4ForCausalLM"
    model = make_invariant(stock)
    samples = make_samples(model.config.text_config.vocab_size, LENGTHS)
    embed = model.get_input_embeddings()
    with torch.no_grad():
        assert batch_mismatches(model, samples, BATCHINGS[1:5]) == [] and packed_rows_equal_alone(model, samples)
        _assert_rows_equal_the_text_model(model, text, samples)
        for sample in samples:
            assert torch.equal(model(inputs_embeds=embed(sample[None])).logits, text(input_ids=sample[None]).logits)
        monkeypatch.setattr(layer_forwards, "linear", functools.partial(m_dependent_linear, small_m=30))
        assert batch_mismatches(model, samples, BATCHINGS[:2]) != []


@pytest.mark.heavy
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
def test_rows_equal_alone_in_any_batch_and_packed(checkpoint, dtype):
    """Every batching of helpers.models (both paddings, ids and embeddings, positions passed or derived)
    and packed rows, through the multimodal model's own forward (fp32: the negative control's test)."""
    assert_rows_equal_alone_in_any_batch_and_packed(make_invariant(load_model(checkpoint, dtype)), LENGTHS)


@pytest.mark.heavy
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_generate_past_the_window_equals_prefill_and_alone(checkpoint, cache):
    assert_generate_past_the_window_equals_prefill_and_alone(make_invariant(load_model(checkpoint, torch.bfloat16)),
                                                             cache, new_tokens=3)


@pytest.mark.heavy
def test_engine_requests_equal_alone_with_prefix_hits(checkpoint):
    assert_engine_requests_equal_alone_with_prefix_hits(make_invariant(load_model(checkpoint, torch.bfloat16)),
                                                        new_tokens=4, alone_prompt_logprobs=True)


@pytest.mark.heavy
def test_the_stock_engine_baseline_sets_and_gives_back_the_text_models_attention_alone(checkpoint):
    """The engine's stock baseline (kernels="stock") swaps the text model's attention, never the towers'
    (the audio tower takes no other), and gives the text model's back once released."""
    import gc
    from invariant_infer.engine import Engine, SamplingParams
    model = load_model(checkpoint, torch.bfloat16)
    configs = [model.config.text_config, model.config.vision_config, model.config.audio_config]
    loaded = [config._attn_implementation for config in configs]
    engine = Engine(model, kernels="stock", max_num_seqs=2)
    outs = engine.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    assert [len(out.token_ids) for out in outs] == [2, 2]
    assert [config._attn_implementation for config in configs[1:]] == loaded[1:]
    del engine, outs
    gc.collect()
    assert [config._attn_implementation for config in configs] == loaded


def test_vision_bidirectional_attention_leaves_text_causal_and_image_token_types_are_refused():
    """use_bidirectional_attention="vision" (image tokens attend each other both ways) runs: text rows
    attend causally, as transformers' own forward does given text token types (all 0); token types
    marking an image are refused by name."""
    config = random_config(FAMILY, "tiny")
    config.text_config.use_bidirectional_attention = "vision"
    stock = random_model(config)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        expected = stock(input_ids=ids, mm_token_type_ids=torch.zeros_like(ids)).logits
        model = make_invariant(stock)
        ours = model(input_ids=ids, mm_token_type_ids=torch.zeros_like(ids)).logits
        assert torch.equal(ours, model(input_ids=ids).logits)
        assert (ours - expected).abs().max() < 1e-4 * expected.abs().max()  # fp32: stock's numbers
        with pytest.raises(NonInvariantInputError, match="mm_token_type_ids"):
            model(input_ids=ids, mm_token_type_ids=torch.tensor([[0, 1, 1, 0, 0]]))


@pytest.mark.heavy
def test_scoring_and_token_logprobs_equal_the_text_models(checkpoint, text_checkpoint):
    """score_sequences of a batch of rows: each row's token logprobs are the text model's bits, and so
    are the trainer-side ``token_logprobs`` (no grad) in right-padded micro-batches."""
    from helpers.engine_runs import trainer_logprobs
    from invariant_infer import score_sequences
    model = make_invariant(load_model(checkpoint, torch.bfloat16))
    text = make_invariant(load_model(text_checkpoint, torch.bfloat16))
    sequences = [s.tolist() for s in make_samples(model.config.text_config.vocab_size, (21, 4, 12), seed=3)]
    prompt_lengths = [5, 1, 3]
    ours = score_sequences(model, sequences, prompt_lengths=prompt_lengths)
    theirs = [r.token_logprobs.tolist() for r in score_sequences(text, sequences, prompt_lengths=prompt_lengths)]
    assert [r.token_logprobs.tolist() for r in ours] == theirs
    with torch.no_grad():
        assert trainer_logprobs(model, sequences, prompt_lengths, 2, "right", 1.0) == theirs
