"""A model built with its parameters on the meta device, then given one real tensor per distinct
parameter on its device: what the FP8 checkpoint loader (app/engine/hf/checkpoint_fp8.py) and the
benches' random-weight builder (bench/models.py) build on, so that no weight is allocated twice (the
decoder's layers are the encoder's, tied) and none in a wider format than it is served in.

Built under a device context the decoder's layers are allocated before they are tied, and the
full-size model's build peaks near twice its 47.35 GiB of unique bf16 weights. Here the parameters
are made on the meta device, the ties are made there, then `materialise` gives every distinct
tensor one real (uninitialised) tensor, shared by every name that shares it.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator

if TYPE_CHECKING:
    import torch


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Every parameter registered while the block runs is moved to the meta device as it is
    registered (its initialisation then costs nothing); buffers stay where they were made, with the
    values the modules gave them, on the CPU. A parameter is made there (uninitialised, so no memory
    is touched) and moved at once, so at most one exists off the meta device at a time."""
    import torch
    from torch import nn

    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        with torch.device("cpu"):
            yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def materialise(model: torch.nn.Module, device: torch.device) -> None:
    """One real (uninitialised) tensor on `device` for each distinct meta parameter, set on every
    module that holds it (tied parameters stay one tensor), and every buffer moved to `device`."""
    import torch
    from torch import nn

    made: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            real = made.get(id(param))
            if real is None:
                real = made[id(param)] = nn.Parameter(torch.empty_like(param, device=device),
                                                      requires_grad=param.requires_grad)
            setattr(module, name, real)
        for name, buffer in list(module.named_buffers(recurse=False)):
            real = made.get(id(buffer))
            if real is None:
                real = made[id(buffer)] = buffer.to(device)
            setattr(module, name, real)
