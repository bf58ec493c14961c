"""What the flat turn uses of the runner that holds it (DiffusionRunner), as a protocol: the flat
package depends on this, never on the runner's module, which imports the flat package."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Protocol, Sequence

if TYPE_CHECKING:
    import torch
    from transformers import DiffusionGemmaForBlockDiffusion

    from app.engine.base import EngineInputError, GenerateChunk, Prompt, SlotRead
    from app.engine.hf.generation_state import Block, Generation
    from app.engine.hf.prompts import Preprocessed


class Host(Protocol):
    """The runner's model, settings and arithmetic that the flat programs and engine share with it."""

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

    step_note: str

    def model_inputs(self, prompt: Prompt, *, reuse_vision: bool = False,
                     preprocessed: Preprocessed | None = None) -> dict[str, torch.Tensor]: ...

    def image_features(self, expanded: list[dict[str, torch.Tensor]], digests: list[tuple[str, ...]]) -> None: ...

    def input_embeds(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor: ...

    def too_long(self, length: int) -> EngineInputError: ...

    def seeded_generator(self, seed: int) -> torch.Generator: ...

    def logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def slot_reads_at(self, hidden: torch.Tensor, labels: Sequence[Sequence[int]]) -> list[SlotRead]: ...

    def denoise_positions(self, canvas: list[int], logits: torch.Tensor, temperature: float, positions: list[int],
                          generator: torch.Generator) -> None: ...

    def next_block(self, gen: Generation) -> Block: ...

    def sample_pass(self, gen: Generation, block: Block, hidden: torch.Tensor) -> list[int] | None: ...

    def end_block(self, gen: Generation, block_ids: list[int]) -> GenerateChunk: ...
