"""The parts of a DiffusionGemma model that the hf engine reaches into, as the classes they are.

Some are typed more loosely than a built model has them: a stack's layers as any nn.Module (torch's
ModuleList). These give them typed, and checked: TypeError for a model not built that way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar

from torch import nn

if TYPE_CHECKING:
    from transformers import DiffusionGemmaForBlockDiffusion
    from transformers.models.diffusion_gemma.modeling_diffusion_gemma import (
        DiffusionGemmaDecoderTextLayer,
        DiffusionGemmaEncoderTextLayer,
    )

ModuleT = TypeVar("ModuleT", bound=nn.Module)


def layers_of(stack: nn.ModuleList, kind: type[ModuleT]) -> list[ModuleT]:
    """The layers of `stack` as the `kind` each of them is; TypeError where one is not."""
    layers = [layer for layer in stack if isinstance(layer, kind)]
    if len(layers) != len(stack):
        raise TypeError(f"expected {kind.__name__} layers only, got {sorted({type(m).__name__ for m in stack})}")
    return layers


def encoder_layers(model: DiffusionGemmaForBlockDiffusion) -> list[DiffusionGemmaEncoderTextLayer]:
    """The prompt encoder's text layers."""
    from transformers.models.diffusion_gemma.modeling_diffusion_gemma import DiffusionGemmaEncoderTextLayer

    return layers_of(model.model.encoder.language_model.layers, DiffusionGemmaEncoderTextLayer)


def decoder_layers(model: DiffusionGemmaForBlockDiffusion) -> list[DiffusionGemmaDecoderTextLayer]:
    """The decoder's text layers."""
    from transformers.models.diffusion_gemma.modeling_diffusion_gemma import DiffusionGemmaDecoderTextLayer

    return layers_of(model.model.decoder.layers, DiffusionGemmaDecoderTextLayer)
