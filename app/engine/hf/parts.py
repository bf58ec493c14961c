"""The parts of a DiffusionGemma model that the hf engine reaches into, as the classes they are.

Some are typed more loosely than a built model has them: a stack's layers as any nn.Module (torch's
ModuleList), the text config as whatever DiffusionGemmaConfig accepts (a dict or None too; its
__post_init__ always makes a DiffusionGemmaTextConfig of it, with its layer types filled in). These
give them typed, and checked: TypeError for a model not built that way.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Callable, Iterator, Sequence, TypeVar

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


def pattern_length(types: Sequence[str]) -> int:
    """How many layers from the first hold one layer of every attention type: 6 for DiffusionGemma's
    five sliding layers and a full one."""
    return 1 + max(types.index(kind) for kind in set(types))


@contextmanager
def first_layers(stack: nn.Module, count: int) -> Iterator[None]:
    """`stack` (a text model: its forward runs `stack.layers`) runs only its first `count` layers
    inside the block, its own layer objects, each at its own index; the whole stack again after.

    For a capture's run before recording (app/engine/hf/graphs/cache.py `capture`): what a shape's
    first pass must do (its compiled pieces' first call at that shape, which may compile) happens
    in the first layer of each type, since every layer of a type calls the same compiled pieces."""
    layers = stack.layers
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(f"expected the stack's layers as a ModuleList, got {type(layers).__name__}")
    stack.layers = nn.ModuleList(list(layers)[:count])
    try:
        yield
    finally:
        stack.layers = layers


def through_first_layers(stack: nn.Module, count: int, forward: Callable[[], object]) -> Callable[[], None]:
    """`forward` as a call that runs it through `stack`'s first `count` layers only (`first_layers`):
    the text graphs' run before recording."""
    def run() -> None:
        with first_layers(stack, count):
            forward()
    return run
