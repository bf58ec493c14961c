"""One forward over a turn's flat batch: every prompt token and every canvas token of the turn through
the weights once.

The encoder and the decoder are one weight set used two ways (their layers are tied), so each layer's
projections, norms, router and experts run on all T tokens at once, and only what the two stacks do
not share is applied per token:

- the embedding: a prompt token's is the encoder's (or, for an image prompt, the embeddings given
  whole, image features merged); a canvas token's is the decoder's, then the self-conditioning block,
  which, with a zero signal (a first step), still sends it through its unscaled RMSNorm;
- attention: by segment (`attention.py`), after the prompt tokens' keys and values are written into
  their sequences' blocks;
- `layer_scalar`: separate buffers in the two stacks, each token scaled by its own stack's.

Returned: the hidden states, after the decoder's final norm, at the rows the layout asks logits for.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import torch

from app.engine.hf.flat.layout import TurnLayout
from app.engine.hf.layers import attention_inputs, unscaled_output
from app.engine.hf.parts import decoder_layers, encoder_layers, layer_types

if TYPE_CHECKING:
    from transformers import DiffusionGemmaForBlockDiffusion

    from app.engine.hf.flat.attention import ReferenceAttention
    from app.engine.hf.flat.blocks import KVStore, SequenceKV


@dataclass
class TurnInputs:
    """The token-level inputs of a turn, on the model's device."""

    ids: torch.Tensor  # [T] each token's id (an image soft token's embedding comes from `embeds`)
    embeds: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (flat start, [n, hidden]) given whole
    conditioning: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (flat start, [n, vocab]) logits


def untied(model: DiffusionGemmaForBlockDiffusion) -> list[str]:
    """The encoder's parameters that the decoder does not share (by storage): empty for a DiffusionGemma
    built or loaded as transformers ties it. The flat forward runs the encoder's layers for both stacks,
    so it refuses a model where this is not empty."""
    names = []
    for index, (encoder, decoder) in enumerate(zip(encoder_layers(model), decoder_layers(model))):
        theirs = dict(decoder.named_parameters())
        for name, parameter in encoder.named_parameters():
            other = theirs.get(name)
            if other is None or other.data_ptr() != parameter.data_ptr():
                names.append(f"layers.{index}.{name}")
    return names


class FlatForward:
    """The model's text stacks as one forward over a flat batch (`__call__`)."""

    def __init__(self, model: DiffusionGemmaForBlockDiffusion, store: KVStore, attention: ReferenceAttention) -> None:
        loose = untied(model)
        if loose:
            raise ValueError(f"the encoder's and decoder's layers are not tied ({', '.join(loose[:3])}, ...): "
                             "the flat turn runs one weight set for both")
        self.store = store
        self.attention = attention
        self.layers = encoder_layers(model)
        self.decoder_scalars = [layer.layer_scalar for layer in decoder_layers(model)]
        self.sliding = [kind == "sliding_attention" for kind in layer_types(model)]
        self.embed = model.model.encoder.language_model.embed_tokens
        decoder = model.model.decoder
        self.canvas_embed = decoder.embed_tokens
        self.self_conditioning = decoder.self_conditioning
        self.rotary = decoder.rotary_emb
        self.norm = decoder.norm

    @torch.no_grad()
    def __call__(self, layout: TurnLayout, sequences: Sequence[SequenceKV], inputs: TurnInputs) -> torch.Tensor:
        """Hidden states [rows, hidden] at `layout.logit_rows()`, in that order, after the decoder's
        final norm; every prompt segment's KV written into its sequence's blocks."""
        device = inputs.ids.device
        canvas = torch.tensor(layout.canvas_tokens(), device=device)
        hidden = self._embeddings(layout, inputs, canvas)[None]  # [1, T, hidden]
        positions = torch.tensor(layout.positions(), device=device)[None]
        rotary = {sliding: self.rotary(hidden, positions, "sliding_attention" if sliding else "full_attention")
                  for sliding in set(self.sliding)}
        rows, full_slots, sliding_slots = self._write_slots(layout, sequences, device)
        plan = self.attention.plan(layout, sequences, device)
        for index, layer in enumerate(self.layers):
            sliding = self.sliding[index]
            cos, sin = rotary[sliding]
            queries, keys, values = attention_inputs(layer, hidden, cos, sin)  # [1, heads, T, dim]
            if rows.numel():
                slots = sliding_slots if sliding else full_slots
                self.store.write(index, slots, keys[0, :, rows].transpose(0, 1), values[0, :, rows].transpose(0, 1))
            out = self.attention.attend(index, sliding, layer.self_attn.scaling, queries[0], keys[0], values[0], plan)
            scalars = torch.where(canvas[:, None], self.decoder_scalars[index], layer.layer_scalar)
            hidden = unscaled_output(layer, out[None], hidden) * scalars
        wanted = torch.tensor(layout.logit_rows(), dtype=torch.long, device=device)
        return self.norm(hidden[0, wanted])

    def _embeddings(self, layout: TurnLayout, inputs: TurnInputs, canvas: torch.Tensor) -> torch.Tensor:
        """[T, hidden]: the encoder's embeddings for prompt tokens (or those given whole), the decoder's
        through the self-conditioning block for canvas tokens."""
        ids = inputs.ids
        embeds = torch.where(canvas[:, None], self.canvas_embed(ids), self.embed(ids))
        for start, given in inputs.embeds:
            embeds[start:start + given.shape[0]] = given.to(embeds.dtype)
        if not bool(canvas.any()):
            return embeds
        where = canvas.nonzero()[:, 0]
        signal = torch.zeros(where.numel(), embeds.shape[-1], dtype=embeds.dtype, device=embeds.device)
        if inputs.conditioning:
            # Each canvas token's row among the canvas tokens, to place its soft embedding.
            row_of = torch.full((layout.tokens,), -1, dtype=torch.long, device=embeds.device)
            row_of[where] = torch.arange(where.numel(), device=embeds.device)
            weight = self.canvas_embed.weight
            scale = self.canvas_embed.embed_scale.to(embeds.dtype)
            for start, logits in inputs.conditioning:
                soft = torch.matmul(logits.softmax(dim=-1, dtype=torch.float32).to(weight.dtype), weight) * scale
                signal[row_of[start:start + logits.shape[0]]] = soft.to(signal.dtype)
        embeds[where] = self.self_conditioning(embeds[where][None], signal[None])[0]
        return embeds

    def _write_slots(self, layout: TurnLayout, sequences: Sequence[SequenceKV],
                     device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The flat rows of the prompt tokens and their slots in the full and the sliding pool."""
        rows, full, sliding = [], [], []
        for item in layout.prompt_runs():
            segment = item.segment
            full_slots, sliding_slots = self.store.slots(sequences[segment.sequence], segment.position,
                                                         segment.position + segment.tokens)
            rows.append(torch.arange(item.start, item.end, device=device))
            full.append(full_slots)
            sliding.append(sliding_slots)
        if not rows:
            empty = torch.zeros(0, dtype=torch.long, device=device)
            return empty, empty, empty
        return torch.cat(rows), torch.cat(full).to(device), torch.cat(sliding).to(device)
