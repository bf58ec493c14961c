"""The parts of a DiffusionGemma model that the hf engine reaches into, as the classes they are.

Some are typed more loosely than a built model has them: a stack's layers as any nn.Module (torch's
ModuleList), the text config as whatever DiffusionGemmaConfig accepts (a dict or None too; its
__post_init__ always makes a DiffusionGemmaTextConfig of it, with its layer types filled in). These
give them typed, and checked: TypeError for a model not built that way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar

from torch import nn

if TYPE_CHECKING:
    from transformers import DiffusionGemmaForBlockDiffusion, DiffusionGemmaTextConfig
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


def text_config(model: DiffusionGemmaForBlockDiffusion) -> DiffusionGemmaTextConfig:
    """The model's text config."""
    from transformers import DiffusionGemmaTextConfig

    config = model.config.text_config
    if not isinstance(config, DiffusionGemmaTextConfig):
        raise TypeError(f"the model's text config is a {type(config).__name__}, not a DiffusionGemmaTextConfig")
    return config


def layer_types(model: DiffusionGemmaForBlockDiffusion) -> list[str]:
    """Each text layer's attention type ("sliding_attention", "full_attention"), in layer order."""
    types = text_config(model).layer_types
    if types is None:
        raise TypeError("the model's text config has no layer types")
    return list(types)
