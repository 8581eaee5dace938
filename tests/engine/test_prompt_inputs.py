"""``PromptInputs``: positions per rope axis (prompt, then generated at their offset), the embedding
overrides of a chunk that cuts the overridden rows anywhere, and the cache salt of each page; and
``decoder_token_inputs`` packing several chunks' overrides into one step's embeddings."""
from __future__ import annotations

import torch

from invariant_infer.model.prompt_inputs import EmbeddingOverrides, PromptInputs, decoder_token_inputs

# A prompt of 10 tokens: rows 3..6 overridden (one span, salted b"A"), row 8 too (salted b"B").
ROWS = [3, 4, 5, 6, 8]


def prompt_inputs(layer_inputs: int = 0) -> PromptInputs:
    positions = torch.stack([torch.arange(10), torch.arange(10) * 2, torch.arange(10) * 3])
    vectors = torch.arange(len(ROWS) * 4, dtype=torch.float32).view(len(ROWS), 4)
    layers = [vectors + 100 * (k + 1) for k in range(layer_inputs)]
    return PromptInputs(positions, position_offset=5, overrides=EmbeddingOverrides(ROWS, vectors, layers),
                        salt_spans=[(3, 7, b"A"), (8, 9, b"B")])


def test_positions_of_prompt_then_generated_tokens():
    inputs = prompt_inputs()
    assert torch.equal(inputs.positions_of(2, 5), inputs.positions[:, 2:5])
    # Tokens 8, 9 are the prompt's; 10, 11 generated, at index + 5 on every axis.
    want = torch.cat([inputs.positions[:, 8:], torch.tensor([[15, 16]] * 3)], dim=1)
    assert torch.equal(inputs.positions_of(8, 12), want)
    assert torch.equal(inputs.positions_of(12, 13), torch.tensor([[17]] * 3))


def test_overrides_of_a_chunk_cut_mid_span():
    inputs = prompt_inputs(layer_inputs=2)
    vectors = inputs.overrides.vectors
    chunk = inputs.overrides_of(5, 9)  # rows 5, 6 and 8, counted from 5
    assert chunk.rows == [0, 1, 3]
    assert torch.equal(chunk.vectors, vectors[2:5])
    assert [torch.equal(got, full[2:5]) for got, full in zip(chunk.layer_inputs, inputs.overrides.layer_inputs)] \
        == [True, True]
    assert inputs.overrides_of(0, 3) is None and inputs.overrides_of(9, 12) is None
    assert inputs.overrides_of(0, 4).rows == [3]
    assert PromptInputs(inputs.positions).overrides_of(0, 10) is None


def test_salt_per_page():
    inputs = prompt_inputs()
    assert [inputs.salt(first, first + 4) for first in (0, 4, 8)] == [b"A", b"A", b"B"]
    assert inputs.salt(0, 3) == b"" and inputs.salt(6, 9) == b"AB" and inputs.salt(7, 8) == b""


def test_decoder_token_inputs_pack_the_chunks_overrides():
    embed = torch.nn.Embedding(20, 4)
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    assert decoder_token_inputs(embed, ids, []).keys() == {"input_ids"}
    inputs = prompt_inputs(layer_inputs=1)
    # Chunk [5, 7) of the prompt at packed offset 0 (rows 0, 1), chunk [8, 10) at packed offset 3 (row 3).
    overrides = [(0, inputs.overrides_of(5, 7)), (3, inputs.overrides_of(8, 10))]
    with torch.no_grad():
        got = decoder_token_inputs(embed, ids, overrides)
        want = embed(ids)
    vectors = inputs.overrides.vectors
    want[0, [0, 1, 3]] = vectors[[2, 3, 4]]
    assert torch.equal(got["inputs_embeds"], want)
    assert got["visual_pos_masks"].tolist() == [[True, True, False, True, False, False]]
    assert torch.equal(got["deepstack_visual_embeds"][0], inputs.overrides.layer_inputs[0][[2, 3, 4]])
