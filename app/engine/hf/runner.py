"""The torch side of the hf engine: batched reads of seeded canvases on transformers'
DiffusionGemmaForBlockDiffusion, with prompt encoding (app/engine/hf/prompts.py) and block-diffusion
generation (app/engine/hf/generation.py) mixed in.

Everything here runs on the engine's single worker thread, except `preprocess` (image decoding and
the image processor, app/engine/hf/prompts.py), which HFReader runs in worker threads before queueing,
and `images_cached`, which only looks into the LRUs.

A read: the prompt is encoded once into a KV cache (causal encoder pass, replayed as a CUDA graph
where a bucket fits; kept in a bounded LRU keyed by prompt ids and image digests), then every canvas
of every read in the batch goes through ONE bidirectional decoder pass (replayed as a CUDA graph,
app/engine/hf/graphs/decoder.py): the prompt caches are left-padded to a common length and stacked, and an
explicit mask keeps each canvas on its own prompt and its own width. Logits are computed only at the
slots, so a 262k-token vocabulary costs rows x slots, not rows x canvas width.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter
from functools import partial
from typing import TYPE_CHECKING, Callable, Generator, Sequence, TypeVar

import torch
import torch.nn.functional as F

from app.engine.base import EngineInputError, Prompt, ReadResult, ReadSpec, SlotRead, StartupProgress
from app.engine.hf.generation import GenerationMixin
from app.engine.hf.graphs.shapes import ShapePolicy
from app.engine.hf.layers import choose_attention_kernels
from app.engine.hf.parts import layer_types, text_config
from app.engine.hf.pixels import splittable
from app.engine.hf.prompts import (
    PREFIX_ENTRIES,
    EncodedPrompt,
    PrefixIndex,
    Preprocessed,
    PromptCache,
    PromptEncodingMixin,
    hold,
)
from app.engine.hf.sampler import sample_step, softcap, temperature_at

if TYPE_CHECKING:
    from transformers import DiffusionGemmaForBlockDiffusion
    from transformers.cache_utils import DynamicLayer
    from transformers.image_processing_utils import BaseImageProcessor

    from app.engine.hf.flat.engine import FlatEngine
    from app.engine.hf.graphs.decoder import DecoderGraphs
    from app.engine.hf.graphs.encoder import EncoderGraphs
    from app.engine.hf.graphs.vision import VisionGraphs

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


# The flat turn's KV store on the CPU when PROMPT_CACHE_GB is 0 (its pools grow to it as they fill).
FLAT_STORE_BYTES = 16 * 2**30

# Slot positions unembedded at once: their fp32 logits are SLOT_CHUNK x vocab (256 MiB for the
# 262k vocabulary).
SLOT_CHUNK = 256


Result = TypeVar("Result")


def held_layer(keys: torch.Tensor, values: torch.Tensor) -> DynamicLayer:
    """A cache layer holding `keys` and `values` as they are (`hold`)."""
    from transformers.cache_utils import DynamicLayer

    layer = DynamicLayer()
    hold(layer, keys, values)
    return layer


def run_steps(steps: Generator[None, None, Result]) -> Result:
    """Drive a stepwise engine generator (`read_steps`, `encode_steps`) to its end; its result."""
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return stop.value


def left_padded(kv: torch.Tensor, length: int) -> torch.Tensor:
    """A prompt's keys or values [1, heads, tokens, dim] left-padded with zeros to `length` tokens,
    or the tensor itself when it has them: `torch.cat` copies it either way, and a zero-width pad
    is one more copy and launch each (the H200 profile of a 32-canvas eager pass over one prompt:
    1,920 zero-width pads, 35-57 ms of its 180-290 ms on the host; docs/results/h200_probe_cudnn_plan.txt)."""
    missing = length - kv.shape[2]
    return F.pad(kv, (0, 0, missing, 0)) if missing else kv


class DiffusionRunner(PromptEncodingMixin, GenerationMixin):
    def __init__(
        self,
        model: DiffusionGemmaForBlockDiffusion,
        image_processor: BaseImageProcessor | None,
        *,
        device: torch.device,
        max_prompt_tokens: int,
        kv_entries: int,
        max_rows: int,
        generation: dict[str, float] | None = None,
        cuda_graphs: bool = False,
        canvas: int = 128,
        canvas_step: int = 16,
        max_images: int = 8,
        prefill_chunk: int = 2048,
        kv_bytes: int = 0,
        turn_tokens: int = 0,
        graph_slots: tuple[int, int] | None = None,
    ) -> None:
        choose_attention_kernels()  # every pass of every runner (served or benched) takes the same kernels
        self.model = model
        self.image_processor = image_processor
        self.device = device
        self.split_pixels = device.type == "cuda" and image_processor is not None and splittable(image_processor)
        self.config = model.config
        self.text_config = text_config(model)
        self.layer_types = layer_types(model)
        self.softcap = getattr(self.text_config, "final_logit_softcapping", None)
        self.vocab_size = int(self.text_config.vocab_size)
        self.max_prompt_tokens = max_prompt_tokens
        self.max_rows = max(1, max_rows)
        self.prefill_chunk = max(16, prefill_chunk)
        self.prompts = PromptCache(kv_entries, max_bytes=kv_bytes, size=lambda encoded: encoded.nbytes)
        # Image features by the images' digests: a frame restated in a later stage skips the vision
        # tower (a few MiB an entry).
        self.vision = PromptCache(min(kv_entries, 16))
        # Shared prefixes' KV (a question sheet's system turn), and where prompts' prefixes were seen.
        self.prefixes = PromptCache(min(kv_entries, PREFIX_ENTRIES))
        self.prefix_index = PrefixIndex()
        # Image prompts encoded whole, by their images' digests (the newest few): a later stage that
        # restates the same frame is encoded over their shared prefix (`_over_image_prefixes`).
        self.image_sources = PromptCache(min(kv_entries, 64))
        self.generation = {**GENERATION_DEFAULTS, **(generation or {})}
        self.stats: Counter[str] = Counter()
        # What the last step of `read_steps` did (a chunk, the encoding, a decoder pass), for the
        # reader's slow-turn warning: set on the engine thread; the reader resets it before a turn
        # and reads it after (never while one runs).
        self.step_note = ""
        self.policy = ShapePolicy(max_rows=self.max_rows, canvas=canvas, canvas_step=canvas_step,
                                  max_prompt_tokens=max_prompt_tokens, max_images=max_images,
                                  sliding_window=int(getattr(self.text_config, "sliding_window", None) or max_prompt_tokens))
        if graph_slots is not None:  # the static buffers the card's memory leaves room for (loader.plan_graphs)
            self.policy = dataclasses.replace(self.policy, decoder_slots=graph_slots[0], encoder_slots=graph_slots[1])
        self.graphs: DecoderGraphs | None = None
        self.encoder_graphs: EncoderGraphs | None = None
        self.graphs_left_out: dict[str, int] = {}  # by kind: shapes `prepare_graphs` could not hold
        self.vision_graphs: VisionGraphs | None = None
        # FLAT_TURN: each engine turn one forward over a flat batch of `turn_tokens` tokens at most, the
        # prompts' KV in the flat engine's blocks (app/engine/hf/flat/); 0: the row path.
        self.flat: FlatEngine | None = None
        if turn_tokens:
            from app.engine.hf.flat.engine import FlatEngine

            self.flat = FlatEngine(self, budget=turn_tokens, store_bytes=kv_bytes or FLAT_STORE_BYTES,
                                   graphs=cuda_graphs and device.type == "cuda")
            self.max_prompt_tokens = self.flat.max_prompt_tokens  # what the store holds, at most what was asked
        if cuda_graphs and device.type == "cuda":
            self.use_graphs(capture=True)

    def use_graphs(self, *, capture: bool) -> None:
        """Give the runner its decoder, encoder and vision graphs over one memory pool (with
        `capture=False`, the same static-buffer paths run eagerly: how the CPU tests check them). On
        the flat turn, the vision graphs alone."""
        from app.engine.hf.graphs.decoder import DecoderGraphs
        from app.engine.hf.graphs.encoder import EncoderGraphs
        from app.engine.hf.graphs.vision import VisionGraphs

        pool = torch.cuda.graph_pool_handle() if capture else None
        model = self.model
        if getattr(model.model.encoder, "vision_tower", None) is not None:
            self.vision_graphs = VisionGraphs(model, self.device, capture=capture, stats=self.stats, pool=pool,
                                              buckets=self.policy.image_buckets)
        if self.flat is not None:  # the flat turn has its own graphs, by token count (app/engine/hf/flat/pieces.py)
            return
        self.graphs = DecoderGraphs(model, self.layer_types, self.device, pad_id=self.pad_id, capture=capture,
                                    policy=self.policy, stats=self.stats, pool=pool)
        self.encoder_graphs = EncoderGraphs(model, self.layer_types, self.device, capture=capture, policy=self.policy,
                                            sliding_window=self.policy.sliding_window, stats=self.stats, pool=pool)

    @torch.no_grad()
    def prepare_graphs(self, progress: StartupProgress | None = None, *, reserve_bytes: int = 0,
                       sample_image: Prompt | None = None) -> dict[str, int]:
        """Capture every graph of the shape policy's set before the server is ready, most used shapes
        first, while the device keeps `reserve_bytes` free (a shape left out runs eagerly, counted),
        then freeze the caches: nothing is captured after this. `sample_image` (a prompt of one
        image) gives the vision graphs their patch layout. Returns the graphs held per kind."""
        report = progress or (lambda phase, done, total: None)
        decoder, encoder, vision = self.graphs, self.encoder_graphs, self.vision_graphs
        jobs: list[tuple[str, Callable[[], object]]] = []
        if decoder is not None:
            jobs += [("decoder", partial(decoder.prepare, key)) for key in self.policy.decoder_keys()]
        if encoder is not None:
            jobs += [("encoder", partial(encoder.prepare, key)) for key in self.policy.encoder_keys()]
        if vision is not None and sample_image is not None and self.image_processor is not None:
            inputs = self.model_inputs(sample_image)
            jobs.append(("vision", partial(vision.prepare, inputs["pixel_values"], inputs["image_position_ids"])))
        skipped: Counter[str] = Counter()
        caches = [graphs.cache for graphs in (decoder, encoder, vision) if graphs is not None]
        for done, (kind, job) in enumerate(jobs):
            if done % 8 == 0:
                report("capturing graphs", done, len(jobs))
            if any(cache.failed for cache in caches):  # the pool they share may be broken: stop
                skipped[kind] += 1
                continue
            if reserve_bytes and self.device.type == "cuda" and not self.room_left(reserve_bytes):
                skipped[kind] += 1
                continue
            job()
        report("capturing graphs", len(jobs), len(jobs))
        self.graphs_left_out = dict(skipped)
        if skipped:
            log.warning("graphs left out, after a failed capture or to keep %.1f GiB of GPU memory free (their "
                        "passes run eagerly, counted): %s", reserve_bytes / 2**30, dict(skipped))
        self.freeze_graphs()
        return self.graphs_held()

    def room_left(self, reserve_bytes: int) -> bool:
        """Whether the device has `reserve_bytes` free, counting what the allocator keeps cached (the
        captures' warm runs leave their memory there: capture frees nothing between graphs)."""
        if torch.cuda.mem_get_info(self.device)[0] >= reserve_bytes:
            return True
        torch.cuda.empty_cache()
        return torch.cuda.mem_get_info(self.device)[0] >= reserve_bytes

    def graph_memory_bytes(self) -> int:
        return sum(graphs.memory_bytes for graphs in (self.graphs, self.encoder_graphs) if graphs is not None)

    def graphs_held(self) -> dict[str, int]:
        return {name: len(graphs.cache) for name, graphs in
                (("decoder", self.graphs), ("encoder", self.encoder_graphs), ("vision", self.vision_graphs))
                if graphs is not None}

    def freeze_graphs(self) -> None:
        """From now on a shape without a graph runs eagerly (counted): nothing is captured."""
        for graphs in (self.graphs, self.encoder_graphs, self.vision_graphs):
            if graphs is not None:
                graphs.cache.freeze()

    def allocator_counts(self) -> tuple[int, int]:
        """(the caching allocator's device allocations, its retries) so far: a retry is a request the
        cached blocks could not hold, met by freeing the whole cache and asking the device again (a
        synchronising pause); (0, 0) off CUDA."""
        if self.device.type != "cuda":
            return 0, 0
        stats = torch.cuda.memory_stats(self.device)
        return int(stats.get("num_device_alloc", 0)), int(stats.get("num_alloc_retries", 0))

    def clear_caches(self) -> None:
        """Forget every encoded prompt, image feature and shared prefix (the warm-up's)."""
        for cache in (self.prompts, self.vision, self.prefixes, self.prefix_index, self.image_sources):
            cache.clear()

    # ------------------------------------------------------------------ decoder passes

    def decoder_hidden(
        self,
        rows: Sequence[tuple[EncodedPrompt, Sequence[int]]],
        self_conditioning_logits: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One bidirectional decoder pass over every row's canvas, each row reading its own encoded
        prompt (a CUDA-graph replay where one fits, else eager); hidden states [rows, width, hidden],
        canvases shorter than the widest padded with `pad_id`. `logits` unembeds them."""
        from transformers.cache_utils import DynamicCache

        if self.graphs is not None:
            replayed = self.graphs.hidden(rows, self_conditioning_logits)
            if replayed is not None:
                self.stats["decoder_passes"] += 1
                self.stats["decoder_rows"] += len(rows)
                self.stats["graph_replays"] += 1
                return replayed
            self.stats["decoder_eager_passes"] += 1

        batch = len(rows)
        width = max(len(canvas) for _, canvas in rows)
        stacked = DynamicCache()  # full layers only: it holds exactly what we stack, no truncation
        lengths_by_type: dict[str, list[int]] = {}
        for layer_index, layer_type in enumerate(self.layer_types):
            keys = [encoded.layers[layer_index][0] for encoded, _ in rows]
            values = [encoded.layers[layer_index][1] for encoded, _ in rows]
            if len(rows) == 1:  # one row reads its prompt's KV as it is: no copy of a long prompt's
                padded_keys, padded_values = keys[0], values[0]
            else:
                longest = max(k.shape[2] for k in keys)
                padded_keys = torch.cat([left_padded(k, longest) for k in keys])
                padded_values = torch.cat([left_padded(v, longest) for v in values])
            stacked.layers.append(held_layer(padded_keys, padded_values))
            lengths_by_type.setdefault(layer_type, [k.shape[2] for k in keys])

        masks = {}
        for layer_type, lengths in lengths_by_type.items():
            longest = max(lengths)
            mask = torch.zeros(batch, 1, width, longest + width, dtype=torch.bool, device=self.device)
            for row, (length, (_, canvas)) in enumerate(zip(lengths, rows)):
                mask[row, :, :, longest - length:longest] = True
                mask[row, :, :, longest:longest + len(canvas)] = True
            masks[layer_type] = mask

        canvas_ids = torch.full((batch, width), self.pad_id, dtype=torch.long)
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

    @property
    def image_token_id(self) -> int:
        """The id an image's soft tokens carry in a prompt (-1 for a model without images)."""
        token = self.config.image_token_id
        return -1 if token is None else int(token)

    @property
    def pad_id(self) -> int:
        """The id that pads canvases and left-pads prompts in a batch: the text config's pad_token_id
        (0 where it has none)."""
        return int(self.text_config.pad_token_id or 0)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The vocabulary logits of decoder hidden states [..., hidden] (the model's head and its
        final soft cap), [..., vocab]."""
        return softcap(self.model.lm_head(hidden), self.softcap)

    # ------------------------------------------------------------------ reads

    @torch.no_grad()
    def read(self, specs: Sequence[ReadSpec], preprocessed: Preprocessed | None = None) -> list[ReadResult | Exception]:
        """Run a batch of reads at once (`read_steps` to the end); a spec whose prompt cannot be read
        gets its exception instead. `preprocessed` holds images already decoded and processed off
        this thread (HFReader); images missing there are preprocessed here."""
        return run_steps(self.read_steps(specs, preprocessed))

    def read_steps(self, specs: Sequence[ReadSpec],
                   preprocessed: Preprocessed | None = None) -> Generator[None, None, list[ReadResult | Exception]]:
        """The same batch of reads as a generator that yields after each bounded step, so the engine
        can run other work between any two (app/engine/base.py's scheduling contract): each chunk of
        `prefill_chunk` tokens of a long prompt's encoding, the encoding of the other prompts, and
        each decoder pass (a multi-step read's passes, and the passes of more canvases than one pass
        holds: `ShapePolicy.decoder_passes`, at most `max_rows`, and fewer over long prompts). Returns
        what `read` returns. Run it on the engine thread only."""
        if self.flat is not None:
            from app.engine.hf.flat.reads import ReadProgram

            program = ReadProgram(self, specs, preprocessed)
            yield from self.flat.solo(program)
            self.stats["reads"] += len(specs)
            return program.outcomes()
        results: list[ReadResult | Exception | None] = [None] * len(specs)
        # (No grad mode held across a yield: each step sets its own, so other work between two
        # steps runs in whatever mode it sets.)
        long = self._long_prompts(specs)
        for prompt, indices in long.items():
            try:
                yield from self.encode_steps(prompt, preprocessed)
            except EngineInputError as exc:
                for index in indices:
                    results[index] = exc
            yield  # the last chunk was a step: the next one is the next prompt's, or the rest
        pending = [index for index, result in enumerate(results) if result is None]
        encoded: dict[int, EncodedPrompt] = {}
        self.step_note = f"encoding {len(pending)} prompt(s)"
        outcomes = self.encode_many([specs[index].prompt for index in pending], preprocessed)
        for index, outcome in zip(pending, outcomes):
            if isinstance(outcome, Exception):
                results[index] = outcome
            else:
                encoded[index] = outcome
        by_steps: dict[int, list[int]] = {}
        for index in encoded:
            by_steps.setdefault(specs[index].steps, []).append(index)
        passes = 0
        for steps, indices in by_steps.items():
            rows = [(index, canvas_no) for index in indices for canvas_no in range(len(specs[index].canvases))]
            reads: dict[tuple[int, int], tuple[SlotRead, ...]] = {}
            shapes = [(encoded[index].length, len(specs[index].canvases[canvas_no])) for index, canvas_no in rows]
            for group in self.policy.decoder_passes(shapes, conditioned=steps > 1, graphs=self.graphs is not None):
                chunk = [rows[row] for row in group]
                if passes:
                    yield  # the next decoder pass of this batch: other work may go first
                passes += steps
                chunk_reads = yield from self._read_rows(specs, encoded, chunk, steps)
                for key, slot_reads in zip(chunk, chunk_reads):
                    reads[key] = slot_reads
            for index in indices:
                spec = specs[index]
                results[index] = ReadResult(
                    slots=tuple(reads[(index, canvas_no)] for canvas_no in range(len(spec.canvases))),
                    prompt_tokens=encoded[index].length,
                )
        self.stats["reads"] += len(specs)
        done = [result for result in results if result is not None]
        assert len(done) == len(results), "every read has its result or its exception"
        return done

    def _long_prompts(self, specs: Sequence[ReadSpec]) -> dict[Prompt, list[int]]:
        """The distinct prompts of `specs` to encode in chunks: text longer than `prefill_chunk`
        tokens (within `max_prompt_tokens`) and not in the LRU, with the indices of the specs that
        read them."""
        long: dict[Prompt, list[int]] = {}
        for index, spec in enumerate(specs):
            if self.needs_chunks(spec.prompt):
                long.setdefault(spec.prompt, []).append(index)
        return long

    def long_encoding(self, prompt: Prompt) -> int:
        """The tokens a light read's prompt adds to its batch's encoding when it is long (over half
        of `prefill_chunk`) and not in the LRU, else 0: a read batch holds at most `prefill_chunk` of
        them (HFReader), so five 1.8k-token prompts of one decision never make one turn encode 9k
        tokens while a steady client's read waits in it. Shorter prompts are left out: tickets
        (~400 tokens), question sheets and walk frames (~755 with the image) mostly encode over a
        shared prefix, and their suffixes batch into one encoder pass; counting them whole would cap
        a walk batch at three frames. Safe to ask from the event loop (one LRU membership test)."""
        n = len(prompt.ids)
        return n if 2 * n > self.prefill_chunk and prompt.cache_key not in self.prompts else 0

    def needs_chunks(self, prompt: Prompt) -> bool:
        """Whether the prompt's encoding takes more than one engine turn (`prefill_chunk` tokens).
        Safe to ask from the event loop (one LRU membership test)."""
        n = len(prompt.ids)
        return self.prefill_chunk < n <= self.max_prompt_tokens and prompt.cache_key not in self.prompts

    def _read_rows(
        self,
        specs: Sequence[ReadSpec],
        encoded: dict[int, EncodedPrompt],
        rows: Sequence[tuple[int, int]],
        steps: int,
    ) -> Generator[None, None, list[tuple[SlotRead, ...]]]:
        """`steps` decoder passes over `rows` (a yield between two passes); their slot reads."""
        canvases = [list(specs[index].canvases[canvas_no]) for index, canvas_no in rows]
        prompts = [encoded[index] for index, _ in rows]
        self_conditioning = None
        generators = [self.seeded_generator(specs[index].seed * 1000003 + canvas_no) for index, canvas_no in rows]
        shape = (f"{len(rows)} canvas(es) of up to {max(len(canvas) for canvas in canvases)} tokens over prompts "
                 f"of up to {max(prompt.length for prompt in prompts)}")
        for remaining in range(steps, 0, -1):
            note = self.step_note = f"decoder pass {steps - remaining + 1} of {steps}: {shape}"
            started = time.perf_counter()
            with torch.no_grad():
                hidden = self.decoder_hidden(list(zip(prompts, canvases)), self_conditioning)
                if remaining == 1:
                    return self._slot_reads(hidden, [specs[index] for index, _ in rows])
                passed = time.perf_counter()
                # Another step follows: only the slots move; every other position stays pinned.
                temperature = temperature_at(remaining, steps, self.generation["t_min"], self.generation["t_max"])
                logits = self.logits(hidden)
                for row, (index, _) in enumerate(rows):
                    slots = torch.tensor(specs[index].slots, device=self.device)
                    self.denoise_positions(canvases[row], logits[row, slots], temperature, list(specs[index].slots),
                                            generators[row])
                self_conditioning = (logits / temperature).to(self.model.dtype)
            # Host time: the pass is queued, the sampling waits for it (each row's tokens come back).
            self.step_note = (f"{note} (the pass queued in {(passed - started) * 1000:.0f} ms, sampled by "
                              f"{(time.perf_counter() - started) * 1000:.0f} ms)")
            yield
        raise AssertionError("unreachable: steps >= 1")

    def _slot_reads(self, hidden: torch.Tensor, specs: Sequence[ReadSpec]) -> list[tuple[SlotRead, ...]]:
        """Every row's slot reads from the decoder's hidden states [rows, width, H] (row r holds a
        canvas of specs[r]), through `slot_reads_at`."""
        slots = [(row, position) for row, spec in enumerate(specs) for position in spec.slots]
        rows = torch.tensor([row for row, _ in slots], device=self.device)
        positions = torch.tensor([position for _, position in slots], device=self.device)
        flat = self.slot_reads_at(hidden[rows, positions], [ids for spec in specs for ids in spec.label_ids])
        reads: list[tuple[SlotRead, ...]] = []
        offset = 0
        for spec in specs:
            reads.append(tuple(flat[offset:offset + len(spec.slots)]))
            offset += len(spec.slots)
        return reads

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
