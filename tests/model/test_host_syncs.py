"""No host sync inside the patched decoder's forward (counted on CPU by ``invariant_infer.testing.host_syncs``):
a padded batch forward ``model(input_ids, attention_mask=...)`` checks its layout once at the model's entry,
outside the decoder, and every decode step of ``generate`` reads nothing back (generate checks once, at its
entry). Dense and MoE (expert dispatch reads no expert counts) and hybrid (Gated DeltaNet) models. The
checks still refuse what they refused; the control: a layer that reads a value back is counted and named."""
from __future__ import annotations

import pytest
import torch

from invariant_infer import make_invariant
from invariant_infer.errors import NonInvariantInputError
from invariant_infer.generation import seeded_sampling
from invariant_infer.model.checks import base_model
from invariant_infer.model.padding import left_pad
from invariant_infer.testing.host_syncs import count_host_syncs
from invariant_infer.testing.random_checkpoints import random_config, random_model

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]


@pytest.fixture(scope="module")
def models():
    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = make_invariant(random_model(random_config(family, "tiny"), dtype=torch.bfloat16).eval())
        return cache[family]
    return get


@pytest.mark.parametrize("family", ["qwen2", "qwen3_moe", pytest.param("glm4_moe", marks=pytest.mark.heavy)])
def test_a_padded_forward_reads_nothing_back_inside_the_decoder(models, family):
    model = models(family)
    ids, mask = left_pad(PROMPTS)
    with torch.no_grad(), count_host_syncs() as whole, count_host_syncs(inside=base_model(model)) as inside:
        model(ids, attention_mask=mask)
    assert inside.count == 0, inside.summary()
    assert whole.count == 1, whole.summary()  # the layout checks, once, at the model's entry


def forward_syncs(model, run) -> list[int]:
    """Syncs inside the decoder during each of its forwards while ``run()`` runs."""
    base, starts = base_model(model), []
    with count_host_syncs(inside=base) as inside:
        handle = base.register_forward_pre_hook(lambda module, args: starts.append(len(inside.events)))
        try:
            run()
        finally:
            handle.remove()
    return [end - start for start, end in zip(starts, [*starts[1:], inside.count])]


@pytest.mark.parametrize("family", ["qwen2", *(pytest.param(family, marks=pytest.mark.heavy)
                                             for family in ("qwen3_moe", "qwen3_5_text"))])
def test_generate_decode_steps_read_nothing_back(models, family):
    model = models(family)
    ids, mask = left_pad(PROMPTS)
    sampling = seeded_sampling([1, 2, 3], temperature=0.8, top_k=20, top_p=0.9)
    counts = forward_syncs(model, lambda: model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3,
                                                         do_sample=False, logits_processor=sampling))
    assert len(counts) == 3
    # The prefill too, but for transformers' own all-ones test of the Gated DeltaNet mask (Qwen3.5).
    assert counts[1:] == [0, 0] and counts[0] == (family == "qwen3_5_text"), counts


def test_the_checks_still_refuse_at_the_entry_and_in_a_decoder_called_alone(models):
    model = models("qwen2")
    ids, holes = torch.tensor([[5, 6, 7, 8]]), torch.tensor([[1, 0, 1, 1]])
    for call in (model, base_model(model)):
        with pytest.raises(NonInvariantInputError, match="holes"):
            call(input_ids=ids, attention_mask=holes)
        with pytest.raises(NonInvariantInputError, match="max_position_embeddings"):
            call(input_ids=ids, position_ids=torch.tensor([[0, 1, 2, 10 ** 6]]), attention_mask=torch.ones_like(ids))


def test_a_generate_running_in_another_thread_never_skips_this_threads_checks(models):
    """The calls checked at their entry are counted per thread: while one thread is inside a ``generate``
    on the model, another thread's ``model(...)`` with a mask with holes is still refused."""
    import threading

    from invariant_infer.model.input_checks import checked_call
    model = models("qwen2")
    ids, holes = torch.tensor([[5, 6, 7, 8]]), torch.tensor([[1, 0, 1, 1]])
    inside, done = threading.Event(), threading.Event()

    def generating():
        with checked_call(base_model(model)):
            inside.set()
            done.wait(timeout=60)
    thread = threading.Thread(target=generating)
    thread.start()
    try:
        assert inside.wait(timeout=60)
        with pytest.raises(NonInvariantInputError, match="holes"):
            model(input_ids=ids, attention_mask=holes)
        # Control: inside a checked generate call in this thread, the same forward is not checked again.
        with checked_call(base_model(model)):
            model(input_ids=ids, attention_mask=holes)
    finally:
        done.set()
        thread.join(timeout=60)


def test_control_a_layer_that_reads_a_value_back_is_counted_and_named(models):
    model = models("qwen2")
    ids, mask = left_pad(PROMPTS)
    def reads(module, args):
        bool(args[0].any())
    handle = base_model(model).layers[0].mlp.register_forward_pre_hook(reads)
    try:
        counts = forward_syncs(model, lambda: model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2,
                                                             do_sample=False))
    finally:
        handle.remove()
    assert counts == [1, 1]
