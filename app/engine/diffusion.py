"""The torch side of the hf engine: prompt KV, batched decoder passes over seeded canvases,
denoising steps and block-diffusion generation, on transformers' DiffusionGemmaForBlockDiffusion.

Everything here runs on the engine's single worker thread; nothing is shared with the event loop.

A read: the prompt is encoded once into a KV cache (causal encoder pass; kept in a bounded LRU keyed
by prompt ids and image digests), then every canvas of every read in the batch goes through ONE
bidirectional decoder pass: the prompt caches are left-padded to a common length and stacked, and an
explicit mask keeps each canvas on its own prompt and its own width. Logits are computed only at the
slots, so a 262k-token vocabulary costs rows x slots, not rows x canvas width.
"""

from __future__ import annotations

import io
import math
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from app.engine.base import (
    EngineInputError,
    GenerateResult,
    GenerateSpec,
    Prompt,
    ReadResult,
    ReadSpec,
    SlotRead,
)

# HF's sampler defaults for DiffusionGemma (DiffusionGemmaGenerationConfig._get_default_generation_params);
# a checkpoint's generation_config.json overrides them.
GENERATION_DEFAULTS = {
    "max_denoising_steps": 48,
    "t_min": 0.4,
    "t_max": 0.8,
    "entropy_bound": 0.1,
    "stability_threshold": 1,
    "confidence_threshold": 0.005,
}


@dataclass
class EncodedPrompt:
    """A prompt's KV as the decoder reads it: per layer, keys and values of shape [1, heads, n, dim]
    (sliding-window layers keep only their window). Never mutated once stored."""

    layers: list[tuple[torch.Tensor, torch.Tensor]]
    length: int  # prompt tokens as the model saw them, image soft tokens included


class PromptCache:
    """Bounded LRU of encoded prompts: a repeated prompt (the same state, the same question sheet)
    pays its encoder pass once."""

    def __init__(self, entries: int) -> None:
        self.entries = entries
        self._items: OrderedDict[tuple, EncodedPrompt] = OrderedDict()

    def get(self, key: tuple) -> EncodedPrompt | None:
        item = self._items.get(key)
        if item is not None:
            self._items.move_to_end(key)
        return item

    def put(self, key: tuple, item: EncodedPrompt) -> None:
        if self.entries <= 0:
            return
        self._items[key] = item
        self._items.move_to_end(key)
        while len(self._items) > self.entries:
            self._items.popitem(last=False)

    def __len__(self) -> int:
        return len(self._items)


def softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    logits = logits.float()
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


def gumbel_argmax(scaled: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """A sample from softmax(scaled) per row (Gumbel-max), drawn from a seeded generator."""
    uniform = torch.rand(scaled.shape, generator=generator, device=scaled.device, dtype=torch.float32)
    exponential = (-torch.log(uniform.clamp_min(1e-20))).clamp_min(1e-20)
    gumbel = -torch.log(exponential)
    return torch.argmax(scaled + gumbel, dim=-1)


def entropy_bound_accept(entropy: torch.Tensor, bound: float) -> torch.Tensor:
    """Accept the longest run of lowest-entropy positions whose summed entropy, less the largest
    of them, stays within `bound` (the entropy-bound sampler of DiffusionGemma). 1-D input."""
    order = torch.argsort(entropy)
    ordered = entropy[order]
    accepted_sorted = (torch.cumsum(ordered, dim=0) - ordered) <= bound
    accepted = torch.zeros_like(accepted_sorted)
    accepted[order] = accepted_sorted
    return accepted


def temperature_at(step_remaining: int, steps: int, t_min: float, t_max: float) -> float:
    """Linear schedule from t_max on the first step to t_min on the last (remaining counts down)."""
    return t_min + (t_max - t_min) * (step_remaining / steps)


class DiffusionRunner:
    def __init__(
        self,
        model: Any,
        image_processor: Any,
        *,
        device: torch.device,
        max_prompt_tokens: int,
        kv_entries: int,
        max_rows: int,
        generation: dict | None = None,
        cuda_graphs: bool = False,
    ) -> None:
        self.model = model
        self.image_processor = image_processor
        self.device = device
        self.config = model.config
        self.text_config = model.config.text_config
        self.layer_types: list[str] = list(self.text_config.layer_types)
        self.softcap = getattr(self.text_config, "final_logit_softcapping", None)
        self.vocab_size = int(self.text_config.vocab_size)
        self.max_prompt_tokens = max_prompt_tokens
        self.max_rows = max(1, max_rows)
        self.prompts = PromptCache(kv_entries)
        self.generation = {**GENERATION_DEFAULTS, **(generation or {})}
        self.stats: Counter[str] = Counter()
        self.graphs = None
        if cuda_graphs and device.type == "cuda":
            from app.engine.graphs import DecoderGraphs

            self.graphs = DecoderGraphs(model, self.layer_types, device, pad_id=self._pad_id(), capture=True)

    # ------------------------------------------------------------------ prompts

    def _expand(self, prompt: Prompt) -> dict[str, torch.Tensor]:
        """Token ids with each image placeholder expanded, plus the vision inputs."""
        ids = list(prompt.ids)
        inputs: dict[str, torch.Tensor] = {}
        if prompt.images:
            if self.image_processor is None:
                raise EngineInputError("this model has no image processor", status=422, param="images")
            from PIL import Image

            pictures = []
            for image in prompt.images:
                try:
                    with Image.open(io.BytesIO(image.data)) as opened:
                        pictures.append(opened.convert("RGB"))
                except Exception as exc:  # noqa: BLE001 - any decoder failure is the client's image
                    raise EngineInputError(
                        f"{image.source}: not a decodable image ({exc})", status=422, param=image.source
                    ) from exc
            processed = self.image_processor(pictures, return_tensors="pt")
            counts = [int(n) for n in processed["num_soft_tokens_per_image"]]
            expanded: list[int] = []
            placeholder = self.config.image_token_id
            images_seen = 0
            for token in ids:
                if token == placeholder and images_seen < len(counts):
                    expanded.append(self.config.boi_token_id)
                    expanded.extend([placeholder] * counts[images_seen])
                    expanded.append(self.config.eoi_token_id)
                    images_seen += 1
                else:
                    expanded.append(token)
            if images_seen != len(counts):
                raise EngineInputError(
                    f"the prompt has {images_seen} image placeholders for {len(counts)} images", status=422,
                    param="images",
                )
            ids = expanded
            dtype = self.model.dtype
            inputs["pixel_values"] = processed["pixel_values"].to(self.device, dtype)
            inputs["image_position_ids"] = processed["image_position_ids"].to(self.device)
        if len(ids) > self.max_prompt_tokens:
            raise self._too_long(len(ids))
        input_ids = torch.tensor([ids], dtype=torch.long, device=self.device)
        inputs["input_ids"] = input_ids
        if prompt.images:
            inputs["mm_token_type_ids"] = (input_ids == self.config.image_token_id).long()
        return inputs

    def _new_cache(self) -> Any:
        from transformers.cache_utils import DynamicCache

        return DynamicCache(config=self.text_config)

    @torch.no_grad()
    def encode(self, prompt: Prompt) -> EncodedPrompt:
        """The prompt's KV, from the LRU or from one encoder pass."""
        key = prompt.cache_key
        cached = self.prompts.get(key)
        if cached is not None:
            self.stats["kv_hits"] += 1
            return cached
        cache, length = self._encode_into_cache(prompt)
        self.stats["kv_misses"] += 1
        encoded = EncodedPrompt([(layer.keys, layer.values) for layer in cache.layers], length)
        self.prompts.put(key, encoded)
        return encoded

    def _encode_into_cache(self, prompt: Prompt) -> tuple[Any, int]:
        """One encoder pass over the prompt into a fresh cache; (cache, prompt tokens incl. images)."""
        inputs = self._expand(prompt)
        length = int(inputs["input_ids"].shape[1])
        cache = self._new_cache()
        positions = torch.arange(length, device=self.device).unsqueeze(0)
        self.model.model.encoder(past_key_values=cache, position_ids=positions, **inputs)
        self.stats["encoder_passes"] += 1
        return cache, length

    @torch.no_grad()
    def encode_many(self, prompts: Sequence[Prompt]) -> list[EncodedPrompt | Exception]:
        """Encode several prompts: text-only prompts missing from the LRU share left-padded encoder
        passes (at most `max_rows` prompts and `max_prompt_tokens` padded tokens a pass); prompts
        with images are encoded one by one. A prompt that cannot be read gets its exception."""
        results: list[EncodedPrompt | Exception | None] = [None] * len(prompts)
        pending: dict[tuple, list[int]] = {}
        for index, prompt in enumerate(prompts):
            key = prompt.cache_key
            cached = self.prompts.get(key)
            if cached is not None:
                self.stats["kv_hits"] += 1
                results[index] = cached
            elif key in pending:
                pending[key].append(index)
            elif prompt.images:
                try:
                    results[index] = self.encode(prompt)
                except EngineInputError as exc:
                    results[index] = exc
            elif len(prompt.ids) > self.max_prompt_tokens:
                results[index] = self._too_long(len(prompt.ids))
            else:
                pending[key] = [index]
        batch: list[tuple[tuple, list[int]]] = []
        for key, indices in sorted(pending.items(), key=lambda item: len(prompts[item[1][0]].ids)):
            longest = max([len(prompts[indices[0]].ids)] + [len(prompts[i[0]].ids) for _, i in batch])
            if batch and (len(batch) >= self.max_rows or longest * (len(batch) + 1) > self.max_prompt_tokens):
                self._encode_text_batch(prompts, batch, results)
                batch = []
            batch.append((key, indices))
        if batch:
            self._encode_text_batch(prompts, batch, results)
        return results  # type: ignore[return-value]

    def _encode_text_batch(
        self, prompts: Sequence[Prompt], batch: list[tuple[tuple, list[int]]], results: list
    ) -> None:
        rows = [list(prompts[indices[0]].ids) for _, indices in batch]
        lengths = [len(ids) for ids in rows]
        longest = max(lengths)
        pad = self._pad_id()
        input_ids = torch.tensor([[pad] * (longest - n) + ids for ids, n in zip(rows, lengths)], device=self.device)
        attention = torch.tensor([[0] * (longest - n) + [1] * n for n in lengths], device=self.device)
        offsets = torch.tensor([longest - n for n in lengths], device=self.device).unsqueeze(1)
        positions = (torch.arange(longest, device=self.device).unsqueeze(0) - offsets).clamp_min(0)
        cache = self._new_cache()
        self.model.model.encoder(input_ids=input_ids, attention_mask=attention, position_ids=positions,
                                 past_key_values=cache)
        self.stats["encoder_passes"] += 1
        self.stats["kv_misses"] += len(batch)
        for row, ((key, indices), length) in enumerate(zip(batch, lengths)):
            layers = []
            for layer in cache.layers:
                kept = layer.keys.shape[2]
                start = max(0, kept - length)  # drop the left padding this layer still holds
                layers.append((layer.keys[row:row + 1, :, start:].clone(), layer.values[row:row + 1, :, start:].clone()))
            encoded = EncodedPrompt(layers, length)
            self.prompts.put(key, encoded)
            for index in indices:
                results[index] = encoded

    def _too_long(self, length: int) -> EngineInputError:
        return EngineInputError(
            f"the prompt is {length} tokens; this server reads at most {self.max_prompt_tokens}",
            status=400, param="state", error_type="max_tokens_exceeded",
        )

    # ------------------------------------------------------------------ decoder passes

    def _decoder_hidden(
        self,
        rows: Sequence[tuple[EncodedPrompt, Sequence[int]]],
        self_conditioning_logits: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One bidirectional decoder pass over every row's canvas; returns hidden states [B, W, H]."""
        from transformers.cache_utils import DynamicCache

        if self.graphs is not None and self_conditioning_logits is None:
            replayed = self.graphs.hidden(rows)
            if replayed is not None:
                self.stats["decoder_passes"] += 1
                self.stats["decoder_rows"] += len(rows)
                self.stats["graph_replays"] += 1
                return replayed

        batch = len(rows)
        width = max(len(canvas) for _, canvas in rows)
        stacked = DynamicCache()  # full layers only: it holds exactly what we stack, no truncation
        lengths_by_type: dict[str, list[int]] = {}
        for layer_index, layer_type in enumerate(self.layer_types):
            keys = [encoded.layers[layer_index][0] for encoded, _ in rows]
            values = [encoded.layers[layer_index][1] for encoded, _ in rows]
            longest = max(k.shape[2] for k in keys)
            padded_keys = torch.cat([F.pad(k, (0, 0, longest - k.shape[2], 0)) for k in keys])
            padded_values = torch.cat([F.pad(v, (0, 0, longest - v.shape[2], 0)) for v in values])
            stacked.update(padded_keys, padded_values, layer_index)
            lengths_by_type.setdefault(layer_type, [k.shape[2] for k in keys])

        masks = {}
        for layer_type, lengths in lengths_by_type.items():
            longest = max(lengths)
            mask = torch.zeros(batch, 1, width, longest + width, dtype=torch.bool, device=self.device)
            for row, (length, (_, canvas)) in enumerate(zip(lengths, rows)):
                mask[row, :, :, longest - length:longest] = True
                mask[row, :, :, longest:longest + len(canvas)] = True
            masks[layer_type] = mask

        canvas_ids = torch.full((batch, width), self._pad_id(), dtype=torch.long)
        positions = torch.zeros((batch, width), dtype=torch.long)
        for row, (encoded, canvas) in enumerate(rows):
            canvas_ids[row, : len(canvas)] = torch.tensor(canvas, dtype=torch.long)
            positions[row] = encoded.length + torch.arange(width)
        output = self.model.model(
            past_key_values=stacked,
            decoder_input_ids=canvas_ids.to(self.device),
            decoder_attention_mask=masks,
            decoder_position_ids=positions.to(self.device),
            self_conditioning_logits=self_conditioning_logits,
        )
        self.stats["decoder_passes"] += 1
        self.stats["decoder_rows"] += batch
        return output.last_hidden_state

    def _pad_id(self) -> int:
        return int(self.text_config.pad_token_id or 0)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return softcap(self.model.lm_head(hidden), self.softcap)

    # ------------------------------------------------------------------ reads

    @torch.no_grad()
    def read(self, specs: Sequence[ReadSpec]) -> list[ReadResult | Exception]:
        """Run a batch of reads; a spec whose prompt cannot be read gets its exception instead."""
        results: list[ReadResult | Exception | None] = [None] * len(specs)
        encoded: dict[int, EncodedPrompt] = {}
        for index, outcome in enumerate(self.encode_many([spec.prompt for spec in specs])):
            if isinstance(outcome, Exception):
                results[index] = outcome
            else:
                encoded[index] = outcome
        by_steps: dict[int, list[int]] = {}
        for index in encoded:
            by_steps.setdefault(specs[index].steps, []).append(index)
        for steps, indices in by_steps.items():
            rows = [(index, canvas_no) for index in indices for canvas_no in range(len(specs[index].canvases))]
            reads: dict[tuple[int, int], tuple[SlotRead, ...]] = {}
            for start in range(0, len(rows), self.max_rows):
                chunk = rows[start:start + self.max_rows]
                for key, slot_reads in zip(chunk, self._read_rows(specs, encoded, chunk, steps)):
                    reads[key] = slot_reads
            for index in indices:
                spec = specs[index]
                results[index] = ReadResult(
                    slots=tuple(reads[(index, canvas_no)] for canvas_no in range(len(spec.canvases))),
                    prompt_tokens=encoded[index].length,
                )
        self.stats["reads"] += len(specs)
        return results  # type: ignore[return-value]

    def _read_rows(
        self,
        specs: Sequence[ReadSpec],
        encoded: dict[int, EncodedPrompt],
        rows: Sequence[tuple[int, int]],
        steps: int,
    ) -> list[tuple[SlotRead, ...]]:
        canvases = [list(specs[index].canvases[canvas_no]) for index, canvas_no in rows]
        prompts = [encoded[index] for index, _ in rows]
        self_conditioning = None
        generators = [self._generator(specs[index].seed * 1000003 + canvas_no) for index, canvas_no in rows]
        for remaining in range(steps, 0, -1):
            hidden = self._decoder_hidden(list(zip(prompts, canvases)), self_conditioning)
            if remaining == 1:
                return [
                    self._slot_reads(hidden[row], specs[index])
                    for row, (index, _) in enumerate(rows)
                ]
            # Another step follows: only the slots move; every other position stays pinned.
            temperature = temperature_at(remaining, steps, self.generation["t_min"], self.generation["t_max"])
            logits = self._logits(hidden) / temperature
            for row, (index, _) in enumerate(rows):
                slots = torch.tensor(specs[index].slots, device=self.device)
                self._denoise_positions(canvases[row], logits[row, slots], list(specs[index].slots), generators[row])
            self_conditioning = logits.to(self.model.dtype)
        raise AssertionError("unreachable: steps >= 1")

    def _slot_reads(self, hidden_row: torch.Tensor, spec: ReadSpec) -> tuple[SlotRead, ...]:
        positions = torch.tensor(spec.slots, device=self.device)
        logprobs = torch.log_softmax(self._logits(hidden_row[positions]), dim=-1)
        argmax = torch.argmax(logprobs, dim=-1).tolist()
        reads = []
        for slot_index, label_ids in enumerate(spec.label_ids):
            values = logprobs[slot_index, torch.tensor(label_ids, device=self.device)].tolist()
            reads.append(SlotRead(label_logprobs=tuple(float(v) for v in values), argmax_id=int(argmax[slot_index])))
        return tuple(reads)

    def _generator(self, seed: int) -> torch.Generator:
        generator = torch.Generator(device=self.device)
        generator.manual_seed(seed % (2**63))
        return generator

    def _denoise_positions(
        self, canvas: list[int], scaled_logits: torch.Tensor, positions: list[int], generator: torch.Generator
    ) -> None:
        """One sampler step at `positions` of `canvas` (in place): sample, accept by entropy bound,
        re-noise the rest with uniform random ids."""
        sampled = gumbel_argmax(scaled_logits, generator)
        logp = torch.log_softmax(scaled_logits, dim=-1)
        entropy = -(logp.exp() * logp).sum(dim=-1)
        accepted = entropy_bound_accept(entropy, self.generation["entropy_bound"])
        noise = torch.randint(0, self.vocab_size, (len(positions),), generator=generator, device=self.device)
        chosen = torch.where(accepted, sampled, noise).tolist()
        for position, token in zip(positions, chosen):
            canvas[position] = int(token)

    # ------------------------------------------------------------------ generation

    @torch.no_grad()
    def generate(self, spec: GenerateSpec, canvas_length: int) -> GenerateResult:
        """Block diffusion: denoise a random canvas until stable and confident (or the step cap),
        commit its argmax through the encoder, repeat; stop at a stop id or `max_tokens`."""
        # Generation extends its KV block by block, so it encodes the prompt into a cache of its own.
        cache, length = self._encode_into_cache(spec.prompt)
        prompt_tokens = length
        generator = self._generator(spec.seed)
        produced: list[int] = []
        stop = set(spec.stop_ids)
        settings = self.generation
        while len(produced) < spec.max_tokens:
            remaining_tokens = spec.max_tokens - len(produced)
            width = min(canvas_length, max(16, 16 * math.ceil(remaining_tokens / 16)))
            block = self._denoise_block(cache, length, width, generator, settings)
            cut = next((i for i, token in enumerate(block) if token in stop), None)
            take = block if cut is None else block[:cut]
            take = take[:remaining_tokens]
            produced.extend(take)
            if cut is not None and cut < remaining_tokens:
                return GenerateResult(ids=tuple(produced), stopped=True, prompt_tokens=prompt_tokens)
            if len(produced) >= spec.max_tokens:
                break
            block_ids = torch.tensor([block], dtype=torch.long, device=self.device)
            positions = (length + torch.arange(width, device=self.device)).unsqueeze(0)
            self.model.model.encoder(input_ids=block_ids, past_key_values=cache, position_ids=positions)
            self.stats["encoder_passes"] += 1
            length += width
        return GenerateResult(ids=tuple(produced), stopped=False, prompt_tokens=prompt_tokens)

    def _denoise_block(
        self, cache: Any, length: int, width: int, generator: torch.Generator, settings: dict
    ) -> list[int]:
        steps = int(settings["max_denoising_steps"])
        canvas = torch.randint(0, self.vocab_size, (1, width), generator=generator, device=self.device)
        positions = (length + torch.arange(width, device=self.device)).unsqueeze(0)
        self_conditioning = None
        history: list[torch.Tensor] = []
        argmax_canvas = canvas
        for remaining in range(steps, 0, -1):
            hidden = self.model.model(
                past_key_values=cache,
                decoder_input_ids=canvas,
                decoder_position_ids=positions,
                self_conditioning_logits=self_conditioning,
            ).last_hidden_state
            self.stats["decoder_passes"] += 1
            temperature = temperature_at(remaining, steps, settings["t_min"], settings["t_max"])
            scaled = self._logits(hidden)[0] / temperature
            argmax_canvas = torch.argmax(scaled, dim=-1)
            sampled = gumbel_argmax(scaled, generator)
            logp = torch.log_softmax(scaled, dim=-1)
            entropy = -(logp.exp() * logp).sum(dim=-1)
            accepted = entropy_bound_accept(entropy, settings["entropy_bound"])
            noise = torch.randint(0, self.vocab_size, (width,), generator=generator, device=self.device)
            canvas = torch.where(accepted, sampled, noise).unsqueeze(0)
            self_conditioning = scaled.unsqueeze(0).to(self.model.dtype)
            history.append(argmax_canvas)
            stable_needed = int(settings["stability_threshold"]) + 1
            if len(history) >= stable_needed and all(torch.equal(h, argmax_canvas) for h in history[-stable_needed:]):
                if float(entropy.mean()) < settings["confidence_threshold"]:
                    break
        return [int(t) for t in argmax_canvas.tolist()]
