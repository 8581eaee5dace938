"""What a prompt brings to the model besides its token ids: ``PromptInputs``.

Three things, whatever produced them (a vision-language prompt's images make all three,
``image_inputs.ImageInputs``):

- positions: the prompt's position on each rope axis (a multimodal rope takes several axes), and the
  offset of the generated tokens' positions from their indices;
- embedding overrides: prompt rows whose input embedding is replaced by a given vector, with extra
  per-layer inputs at those rows (Qwen3-VL's deepstack features); a prefill chunk may cut them anywhere;
- a cache salt: bytes that go into the prefix-cache hash of every page holding a span's tokens, so the
  same token ids with other inputs never share a page.

A step packs chunks of several prompts as ``[1, T]``; ``decoder_token_inputs`` turns its ids and its
chunks' overrides into the decoder's keyword inputs.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True, eq=False)
class EmbeddingOverrides:
    """Rows whose input embedding is replaced: ``vectors[i]`` is row ``rows[i]``'s embedding."""
    rows: list[int]                    # ascending
    vectors: torch.Tensor              # [len(rows), hidden] on the model's device
    layer_inputs: list[torch.Tensor] = field(default_factory=list)  # per extra layer input, [len(rows), hidden]

    def cut(self, start: int, end: int) -> EmbeddingOverrides | None:
        """The overrides of rows start .. end - 1, their rows counted from ``start``; None where there are none."""
        first, last = bisect.bisect_left(self.rows, start), bisect.bisect_left(self.rows, end)
        if first == last:
            return None
        return EmbeddingOverrides([row - start for row in self.rows[first:last]], self.vectors[first:last],
                                  [values[first:last] for values in self.layer_inputs])


@dataclass(eq=False)
class PromptInputs:
    """A prompt's positions, embedding overrides and cache salt (see the module's docstring)."""
    positions: torch.Tensor            # long [axes, prompt length]: each prompt token's position on each rope axis
    position_offset: int = 0           # a generated token at index p sits at position p + position_offset (every axis)
    overrides: EmbeddingOverrides | None = None  # its rows are prompt positions
    salt_spans: list[tuple[int, int, bytes]] = field(default_factory=list)  # (first position, end, salt)

    def positions_of(self, start: int, end: int) -> torch.Tensor:
        """long [axes, end - start]: the positions of tokens start .. end - 1 (prompt or generated)."""
        axes, prompt = self.positions.shape
        generated = torch.arange(max(start, prompt), max(end, prompt)) + self.position_offset
        return torch.cat([self.positions[:, start:min(end, prompt)], generated[None].expand(axes, -1)], dim=1)

    def overrides_of(self, start: int, end: int) -> EmbeddingOverrides | None:
        """The embedding overrides of tokens start .. end - 1 (a chunk), their rows counted from ``start``."""
        return None if self.overrides is None else self.overrides.cut(start, end)

    def salt(self, first: int, end: int) -> bytes:
        """The salts of the spans with tokens in positions first .. end - 1 (a page), in order."""
        return b"".join(salt for start, stop, salt in self.salt_spans if start < end and stop > first)


def decoder_token_inputs(embed_tokens, input_ids: torch.Tensor,
                         overrides: list[tuple[int, EmbeddingOverrides]]) -> dict:
    """The decoder's token arguments for packed ids [1, T] whose chunks at these packed offsets bring these
    overrides: ``input_ids`` where none does; else ``inputs_embeds``, the overridden rows replaced, and where
    the overrides carry layer inputs, Qwen3-VL's language model's ``visual_pos_masks`` and
    ``deepstack_visual_embeds`` (its deepstack features, added at those rows after the first layers)."""
    if not overrides:
        return dict(input_ids=input_ids)
    embeds = embed_tokens(input_ids)
    rows = torch.tensor([offset + row for offset, chunk in overrides for row in chunk.rows], device=embeds.device)
    embeds[0, rows] = torch.cat([chunk.vectors for _, chunk in overrides]).to(embeds.dtype)
    out = dict(inputs_embeds=embeds)
    layers = len(overrides[0][1].layer_inputs)
    if layers:
        overridden = torch.zeros(embeds.shape[:2], dtype=torch.bool, device=embeds.device)
        overridden[0, rows] = True
        out.update(visual_pos_masks=overridden, deepstack_visual_embeds=[
            torch.cat([chunk.layer_inputs[k] for _, chunk in overrides]) for k in range(layers)])
    return out
