"""What the engine and its programs use of the runner that holds them (DiffusionRunner), as a
protocol: they depend on this, never on the runner's module, which imports them."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Protocol, Sequence

if TYPE_CHECKING:
    import torch
    from transformers import DiffusionGemmaForBlockDiffusion

    from app.engine.base import EngineInputError, SlotRead
    from app.engine.hf.generation import BlockDiffusion
    from app.engine.hf.images import ImageInputs


class Host(Protocol):
    """The runner's model, settings, parts and arithmetic that the engine and its programs share."""

    @property
    def model(self) -> DiffusionGemmaForBlockDiffusion: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def stats(self) -> Counter[str]: ...

    @property
    def generation(self) -> dict[str, float]: ...

    @property
    def max_prompt_tokens(self) -> int: ...

    @property
    def prefill_chunk(self) -> int: ...

    @property
    def max_rows(self) -> int: ...

    @property
    def image_token_id(self) -> int: ...

    @property
    def images(self) -> ImageInputs: ...

    @property
    def blocks(self) -> BlockDiffusion: ...

    step_note: str

    def too_long(self, length: int) -> EngineInputError: ...

    def seeded_generator(self, seed: int) -> torch.Generator: ...

    def logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def slot_reads_at(self, hidden: torch.Tensor, labels: Sequence[Sequence[int]]) -> list[SlotRead]: ...

    def denoise_positions(self, canvas: list[int], logits: torch.Tensor, temperature: float, positions: list[int],
                          generator: torch.Generator) -> None: ...
