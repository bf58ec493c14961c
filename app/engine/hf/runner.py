"""The torch side of the hf engine: transformers' DiffusionGemmaForBlockDiffusion, and what every turn
computes with it besides the forward.

`DiffusionRunner` holds the model and composes its parts: the images (`ImageInputs`: preprocessing,
the vision tower and its graphs), block diffusion's sampler (`BlockDiffusion`), and the engine that
runs the turns (`FlatEngine`: one forward a turn over every queued program's new tokens, the prompts'
KV in shared blocks). It gives them the arithmetic they share: the head and its soft cap (`logits`),
the slot reads of a turn (`slot_reads_at`), the seeded generators and the sampler step at a read's
slots (`denoise_positions`). `read` and `generate` step one program alone through the engine (tests,
benches, the start-up warm-up); the reader steps its whole queue instead.

Everything here runs on the engine's single worker thread, except `images.preprocess`, which the
reader runs in worker threads before queueing, and `images.cached`, which only looks into an LRU.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import TYPE_CHECKING, Generator, Sequence, TypeVar

import torch

from app.engine.base import (
    EngineInputError,
    GenerateResult,
    GenerateSpec,
    Prompt,
    ReadResult,
    ReadSpec,
    SlotRead,
)
from app.engine.hf.engine import FlatEngine
from app.engine.hf.generation import BlockDiffusion, Generation
from app.engine.hf.images import ImageInputs, Preprocessed
from app.engine.hf.parts import text_config
from app.engine.hf.sampler import sample_step, softcap

if TYPE_CHECKING:
    from transformers import DiffusionGemmaForBlockDiffusion
    from transformers.image_processing_utils import BaseImageProcessor

    from app.engine.base import GenerateChunk

log = logging.getLogger("djev.engine")

# HF's sampler defaults for DiffusionGemma (DiffusionGemmaGenerationConfig._get_default_generation_params);
# a checkpoint's generation_config.json overrides them.
GENERATION_DEFAULTS: dict[str, float] = {
    "max_denoising_steps": 48,
    "t_min": 0.4,
    "t_max": 0.8,
    "entropy_bound": 0.1,
    "stability_threshold": 1,
    "confidence_threshold": 0.005,
}

# The KV store on the CPU when PROMPT_CACHE_GB is 0 (its pools grow to it as they fill).
CPU_STORE_BYTES = 16 * 2**30

# Slot positions unembedded at once: their fp32 logits are SLOT_CHUNK x vocab (256 MiB for the
# 262k vocabulary).
SLOT_CHUNK = 256


Result = TypeVar("Result")


def run_steps(steps: Generator[None, None, Result]) -> Result:
    """Drive a stepwise generator (`read_steps`, `start_steps`) to its end; its result."""
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return stop.value


class DiffusionRunner:
    def __init__(
        self,
        model: DiffusionGemmaForBlockDiffusion,
        image_processor: BaseImageProcessor | None,
        *,
        device: torch.device,
        max_prompt_tokens: int,
        max_rows: int,
        turn_tokens: int,
        generation: dict[str, float] | None = None,
        cuda_graphs: bool = False,
        image_entries: int = 16,
        prefill_chunk: int = 2048,
        kv_bytes: int = 0,
    ) -> None:
        """`max_prompt_tokens` the longest state asked for (MAX_PROMPT_TOKENS, or the device's default;
        the KV store may hold fewer: `max_prompt_tokens` is then what it holds), `max_rows` the most
        canvases a turn reads, `turn_tokens` a turn's token budget, `kv_bytes` the KV store's size (0:
        CPU_STORE_BYTES), `cuda_graphs` the turn's pieces and the vision tower captured on CUDA."""
        self.model = model
        self.image_processor = image_processor
        self.device = device
        self.config = model.config
        self.text_config = text_config(model)
        self.softcap = getattr(self.text_config, "final_logit_softcapping", None)
        self.vocab_size = int(self.text_config.vocab_size)
        self.max_prompt_tokens = max_prompt_tokens
        self.max_rows = max(1, max_rows)
        self.prefill_chunk = max(16, prefill_chunk)
        self.generation = {**GENERATION_DEFAULTS, **(generation or {})}
        self.stats: Counter[str] = Counter()
        # What the last turn did (its parts and tokens), for the reader's slow-turn warning: set on
        # the engine thread; the reader resets it before a turn and reads it after (never while one runs).
        self.step_note = ""
        self.images = ImageInputs(model, image_processor, device, self.stats, entries=image_entries)
        self.blocks = BlockDiffusion(self.generation, self.vocab_size, device, model.dtype, self.logits)
        self.cuda_graphs = cuda_graphs and device.type == "cuda"
        self.flat = FlatEngine(self, budget=turn_tokens, store_bytes=kv_bytes or CPU_STORE_BYTES,
                               graphs=self.cuda_graphs)
        self.max_prompt_tokens = self.flat.max_prompt_tokens  # what the store holds, at most what was asked
        if self.cuda_graphs:
            self.use_vision_graphs(capture=True)

    def use_vision_graphs(self, *, capture: bool) -> None:
        """Give the vision tower its graphs by frame count (with `capture=False` the same static-buffer
        path runs eagerly: how the CPU tests check it)."""
        from app.engine.hf.graphs.vision import IMAGE_BUCKETS, VisionGraphs

        if getattr(self.model.model.encoder, "vision_tower", None) is None:
            return
        pool = torch.cuda.graph_pool_handle() if capture else None
        self.images.graphs = VisionGraphs(self.model, self.device, capture=capture, stats=self.stats, pool=pool,
                                          buckets=IMAGE_BUCKETS)
        self.images.chunk = IMAGE_BUCKETS[-1]

    @torch.no_grad()
    def prepare_vision_graphs(self, sample_image: Prompt) -> int:
        """Capture the vision tower's graph of every frame count for the patch layout of
        `sample_image` (a prompt of one image), then freeze them; the graphs held."""
        graphs = self.images.graphs
        if graphs is None or self.image_processor is None:
            return 0
        inputs = self.images.model_inputs(sample_image)
        graphs.prepare(inputs["pixel_values"], inputs["image_position_ids"])
        graphs.cache.freeze()
        self.images.features.clear()
        return len(graphs.cache)

    def allocator_counts(self) -> tuple[int, int]:
        """(the caching allocator's device allocations, its retries) so far: a retry is a request the
        cached blocks could not hold, met by freeing the whole cache and asking the device again (a
        synchronising pause); (0, 0) off CUDA."""
        if self.device.type != "cuda":
            return 0, 0
        stats = torch.cuda.memory_stats(self.device)
        return int(stats.get("num_device_alloc", 0)), int(stats.get("num_alloc_retries", 0))

    @property
    def image_token_id(self) -> int:
        """The id an image's soft tokens carry in a prompt (-1 for a model without images)."""
        token = self.config.image_token_id
        return -1 if token is None else int(token)

    def too_long(self, length: int) -> EngineInputError:
        """The refusal of a state of `length` tokens: Jev's context error, both numbers named."""
        return EngineInputError(
            f"the prompt is {length} tokens; this server reads at most {self.max_prompt_tokens} (MAX_PROMPT_TOKENS, "
            "within what its KV store holds)",
            status=400, param="state", error_type="max_tokens_exceeded",
        )

    # ------------------------------------------------------------------ the arithmetic the programs share

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The vocabulary logits of decoder hidden states [..., hidden] (the model's head and its
        final soft cap), [..., vocab]."""
        return softcap(self.model.lm_head(hidden), self.softcap)

    def slot_reads_at(self, hidden: torch.Tensor, labels: Sequence[Sequence[int]]) -> list[SlotRead]:
        """What each slot says, from its hidden state [slots, H] and its label ids: the slots go through
        the unembedding together, SLOT_CHUNK at a time (the 262k-row matrix is read once per chunk, not
        once per canvas), and each chunk's label log-probabilities and argmaxes come to the host in one
        copy."""
        reads: list[SlotRead] = []
        for start in range(0, len(labels), SLOT_CHUNK):
            chunk = labels[start:start + SLOT_CHUNK]
            logprobs = torch.log_softmax(self.logits(hidden[start:start + len(chunk)]), dim=-1)
            label_slots = torch.tensor([i for i, ids in enumerate(chunk) for _ in ids], dtype=torch.long,
                                       device=self.device)
            label_ids = torch.tensor([t for ids in chunk for t in ids], dtype=torch.long, device=self.device)
            both = torch.cat([logprobs[label_slots, label_ids].double(), logprobs.argmax(dim=-1).double()]).tolist()
            values, argmaxes = both[: len(label_ids)], both[len(label_ids):]
            offset = 0
            for ids, argmax in zip(chunk, argmaxes):
                reads.append(SlotRead(label_logprobs=tuple(values[offset:offset + len(ids)]), argmax_id=int(argmax)))
                offset += len(ids)
        return reads

    def seeded_generator(self, seed: int) -> torch.Generator:
        generator = torch.Generator(device=self.device)
        generator.manual_seed(seed % (2**63))
        return generator

    def denoise_positions(
        self, canvas: list[int], logits: torch.Tensor, temperature: float, positions: list[int],
        generator: torch.Generator,
    ) -> None:
        """One sampler step at `positions` of `canvas` (in place)."""
        step = sample_step(logits, temperature, top_p=1.0, entropy_bound=self.generation["entropy_bound"],
                           vocab_size=self.vocab_size, generator=generator)
        for position, token in zip(positions, step.tokens.tolist()):
            canvas[position] = int(token)

    # ------------------------------------------------------------------ one program alone

    @torch.no_grad()
    def read(self, specs: Sequence[ReadSpec], preprocessed: Preprocessed | None = None) -> list[ReadResult | Exception]:
        """Reads stepped alone through the engine to their end (`read_steps`); a spec whose prompt cannot
        be read gets its exception instead."""
        return run_steps(self.read_steps(specs, preprocessed))

    def read_steps(self, specs: Sequence[ReadSpec],
                   preprocessed: Preprocessed | None = None) -> Generator[None, None, list[ReadResult | Exception]]:
        """The same reads a turn a step (a yield between two turns); returns what `read` returns."""
        from app.engine.hf.reads import ReadProgram

        program = ReadProgram(self, specs, preprocessed)
        yield from self.flat.solo(program)
        self.stats["reads"] += len(specs)
        return program.outcomes()

    def start_steps(self, spec: GenerateSpec, canvas_length: int,
                    preprocessed: Preprocessed | None = None) -> Generator[None, None, Generation]:
        """A generation's prompt written a turn a step; then its `Generation`, which `step_generation`
        steps on."""
        from app.engine.hf.generations import GenerateProgram

        return self.flat.start_generation(GenerateProgram(self, spec, canvas_length, preprocessed))

    @torch.no_grad()
    def step_generation(self, gen: Generation) -> GenerateChunk | None:
        """One turn of a generation: the chunk it gave, if any."""
        return self.flat.step_generation(gen)

    @torch.no_grad()
    def generate(self, spec: GenerateSpec, canvas_length: int) -> GenerateResult:
        """Block diffusion alone, a turn a step: denoise a random canvas until stable and confident (or
        the step cap), commit its argmax, repeat; stop at a stop id or `max_tokens`."""
        gen = run_steps(self.start_steps(spec, canvas_length))
        ids: list[int] = []
        while True:
            chunk = self.step_generation(gen)
            if chunk is None:
                continue
            ids.extend(chunk.ids)
            if chunk.done:
                return GenerateResult(ids=tuple(ids), stopped=chunk.stopped, prompt_tokens=chunk.prompt_tokens,
                                      passes=chunk.passes)

