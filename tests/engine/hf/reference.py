"""The semantics the hf engine implements, written over transformers' own forward: a reference the flat
turn is checked against (tests/engine/hf/test_reference.py), with no djev engine code in the
forward path.

`model` is a `DiffusionGemmaForBlockDiffusion` loaded by transformers alone (`reference_model`): no
layer of it patched, no cache of djev's, every forward over the whole prompt (re-encoded each call,
cheap on the tiny model) plus the canvas, the canvas's positions right after the prompt. Sliding
layers read the prompt's last W - 1 positions and image tokens are read causally, as transformers'
cache and masks have it.

What the engine adds around a forward is taken from the engine, since it is the engine's choice and
not the model's: the prompt's data (`ImageInputs.model_inputs`: ids with each image placeholder
expanded, pixel values, image position ids, mm token type ids), the seeded generators and the
sampler step (`seeded_generator`, `temperature_at`, `denoise_positions`), and a generation's
bookkeeping (`Generation`; `BlockDiffusion`'s `next_block`, `sample_pass`, `end_block`). `sample_pass`
unembeds the hidden states it is given with the engine's head (`DiffusionRunner.logits`: the same
`lm_head` weights and soft cap as transformers' `DiffusionGemmaForBlockDiffusion.forward`).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import torch

from app.engine.base import GenerateResult, Prompt, ReadResult, ReadSpec, SlotRead
from app.engine.hf.generation import Generation, check_spec
from app.engine.hf.images import ImageInputs
from app.engine.hf.sampler import temperature_at

if TYPE_CHECKING:
    from transformers import DiffusionGemmaForBlockDiffusion

    from app.engine.base import GenerateSpec
    from app.engine.hf.runner import DiffusionRunner

# The keys of `model_inputs` the encoder takes besides `input_ids` (how images enter its forward).
IMAGE_INPUTS = ("pixel_values", "image_position_ids", "mm_token_type_ids")


def reference_model(checkpoint: str | Path) -> DiffusionGemmaForBlockDiffusion:
    """The checkpoint as transformers loads it, float32 on the CPU, in eval mode, nothing installed."""
    from transformers import DiffusionGemmaForBlockDiffusion

    model = DiffusionGemmaForBlockDiffusion.from_pretrained(str(checkpoint), dtype=torch.float32,
                                                            attn_implementation="sdpa")
    return model.eval()


def prompt_inputs(runner: DiffusionRunner, prompt: Prompt) -> dict[str, torch.Tensor]:
    """The prompt as the encoder takes it: `input_ids` [1, n] (image placeholders expanded) and, for an
    image prompt, `pixel_values`, `image_position_ids` and `mm_token_type_ids` (data preparation only:
    the runner's image processing, without its feature LRU, which would give features, not pixels)."""
    if not prompt.images:  # (`ImageInputs.model_inputs` is for prompts with images)
        return {"input_ids": torch.tensor([list(prompt.ids)], dtype=torch.long, device=runner.device)}
    images = ImageInputs(runner.model, runner.images.processor, runner.device, Counter(), entries=0)
    inputs = images.model_inputs(prompt)
    return {key: inputs[key] for key in ("input_ids", *IMAGE_INPUTS) if key in inputs}


def image_kwargs(model: DiffusionGemmaForBlockDiffusion, inputs: dict[str, torch.Tensor]) -> dict:
    """What transformers' forward needs for the prompt's images: their features through the encoder's
    own vision tower and embedder (`get_image_features`, as the encoder's forward computes them from
    `pixel_values`), given as `mm_encoder_outputs`, and the soft tokens' type ids. Empty for text."""
    if "pixel_values" not in inputs:
        return {}
    features = model.model.encoder.get_image_features(inputs["pixel_values"], inputs["image_position_ids"],
                                                      return_dict=True)
    return {"mm_encoder_outputs": {"image": features}, "mm_token_type_ids": inputs["mm_token_type_ids"]}


def canvas_forward(model: DiffusionGemmaForBlockDiffusion, inputs: dict[str, torch.Tensor], images: dict,
                   canvas: Sequence[int] | torch.Tensor, conditioning: torch.Tensor | None, *,
                   logits: bool = True) -> torch.Tensor:
    """One transformers forward: the prompt `inputs["input_ids"]` [1, n] encoded causally, then one
    bidirectional decoder pass over `canvas` at positions n, n + 1, ... with `conditioning` [1, width,
    vocab] as its self-conditioning logits (None: the first pass). The softcapped float32 logits [width,
    vocab] of `DiffusionGemmaForBlockDiffusion.forward`, or with `logits=False` the decoder's last
    hidden states [1, width, hidden] (`DiffusionGemmaModel.forward`)."""
    ids = inputs["input_ids"]
    canvas_ids = canvas if isinstance(canvas, torch.Tensor) else torch.tensor([list(canvas)], dtype=torch.long)
    canvas_ids = canvas_ids.to(ids.device)
    width = int(canvas_ids.shape[1])
    positions = (ids.shape[1] + torch.arange(width, device=ids.device)).unsqueeze(0)
    with torch.no_grad():
        if logits:
            return model(input_ids=ids, decoder_input_ids=canvas_ids, decoder_position_ids=positions,
                         self_conditioning_logits=conditioning, **images).logits[0]
        return model.model(input_ids=ids, decoder_input_ids=canvas_ids, decoder_position_ids=positions,
                           self_conditioning_logits=conditioning, **images).last_hidden_state


def slot_reads(logits: torch.Tensor, slots: Sequence[int], label_ids: Sequence[Sequence[int]]) -> tuple[SlotRead, ...]:
    """What each slot says from the canvas's logits [width, vocab]: its labels' log-probabilities
    (log_softmax over the vocabulary) and its argmax."""
    reads = []
    for slot, labels in zip(slots, label_ids, strict=True):
        logprobs = torch.log_softmax(logits[slot], dim=-1)
        reads.append(SlotRead(label_logprobs=tuple(float(logprobs[label]) for label in labels),
                              argmax_id=int(logprobs.argmax())))
    return tuple(reads)


def reference_read(model: DiffusionGemmaForBlockDiffusion, spec: ReadSpec, *, runner: DiffusionRunner) -> ReadResult:
    """A read as the design names it: each canvas through `spec.steps` forwards, denoised at its slots
    between two (canvas `c`'s generator seeded `spec.seed * 1000003 + c`, the step's temperature from
    the checkpoint's schedule, the engine's sampler step), the next forward self-conditioned on the
    whole canvas's logits over that temperature in the model's dtype; the last forward's slot reads."""
    inputs = prompt_inputs(runner, spec.prompt)
    images = image_kwargs(model, inputs)
    settings = runner.generation
    slots = list(spec.slots)
    canvases = []
    for canvas_no, start in enumerate(spec.canvases):
        canvas = list(start)
        generator = runner.seeded_generator(spec.seed * 1000003 + canvas_no)
        conditioning = None
        for remaining in range(spec.steps, 0, -1):
            logits = canvas_forward(model, inputs, images, canvas, conditioning)
            if remaining == 1:
                canvases.append(slot_reads(logits, slots, spec.label_ids))
                break
            temperature = temperature_at(remaining, spec.steps, settings["t_min"], settings["t_max"])
            runner.denoise_positions(canvas, logits[slots], temperature, slots, generator)
            conditioning = (logits / temperature).to(model.dtype)[None]
    return ReadResult(slots=tuple(canvases), prompt_tokens=int(inputs["input_ids"].shape[1]))


def reference_generate(model: DiffusionGemmaForBlockDiffusion, spec: GenerateSpec, canvas_length: int, *,
                       runner: DiffusionRunner) -> GenerateResult:
    """Block diffusion as the engine does it, the engine's own bookkeeping (`Generation`, `next_block`,
    `sample_pass`, `end_block`) over hidden states from transformers' forward: each denoise pass one
    forward over the prompt plus every token committed so far as `input_ids` and the block's canvas as
    `decoder_input_ids`, self-conditioned on the previous pass's processed logits; a finished block's
    argmax ids committed (appended to `input_ids`) before the next block is drawn. The result's `ids`
    are the generated ids."""
    check_spec(spec)
    inputs = prompt_inputs(runner, spec.prompt)
    images = image_kwargs(model, inputs)
    length = int(inputs["input_ids"].shape[1])
    # Greedy decoding owes nothing to the seed: its starting canvas comes from a fixed one (as the engine).
    generator = runner.seeded_generator(spec.seed if spec.temperature > 0.0 else 0)
    gen = Generation(spec=spec, canvas_length=canvas_length, length=length, prompt_tokens=length,
                     generator=generator, stop=frozenset(spec.stop_ids))
    ids: list[int] = []
    stopped = False
    context = inputs["input_ids"]
    while not gen.done:
        if gen.spec.max_tokens - len(gen.produced) <= 0:
            gen.done = True
            break
        if gen.pending is not None:  # the finished block, committed: the next block reads it as prompt
            committed = torch.tensor([gen.pending], dtype=torch.long, device=context.device)
            context = torch.cat([context, committed], dim=1)
            gen.length += len(gen.pending)
            gen.pending = None
        block = runner.blocks.next_block(gen)
        assert int(block.positions[0, 0]) == context.shape[1] == gen.length
        hidden = canvas_forward(model, {**inputs, "input_ids": context}, images, block.canvas, block.conditioning,
                                logits=False)
        block_ids = runner.blocks.sample_pass(gen, block, hidden)
        if block_ids is not None:
            chunk = runner.blocks.end_block(gen, block_ids)
            ids.extend(chunk.ids)
            stopped = chunk.stopped
    return GenerateResult(ids=tuple(ids), stopped=stopped, prompt_tokens=gen.prompt_tokens, passes=gen.passes)
