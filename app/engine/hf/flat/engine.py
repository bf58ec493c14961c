"""The flat turn's parts, held by the runner: the KV store, the attention backend, the forward, the turn;
and `step`, one engine turn over the programs the reader queues.

A step prepares the programs new to it (their prompts' ids and keys, their images through the vision
tower together, their sequences opened in the store), composes the turn from the queue within the
token budget (`scheduler.compose`), runs it as one forward, and gives each program its results.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generator, Protocol, Sequence

import torch

from app.engine.hf.flat.attention import ReferenceAttention, SegmentAttention
from app.engine.hf.flat.blocks import BLOCK_TOKENS, KVStore, LayerShape, block_bytes
from app.engine.hf.flat.forward import FlatForward
from app.engine.hf.flat.layout import Kind
from app.engine.hf.flat.pieces import GraphReport, PiecewiseConfig
from app.engine.hf.flat.prompts import PromptState, prepare
from app.engine.hf.flat.scheduler import compose
from app.engine.hf.flat.turn import FlatTurn, Part
from app.engine.hf.parts import encoder_layers, layer_types, text_config

if TYPE_CHECKING:
    from app.engine.base import GenerateChunk, Prompt, SlotRead
    from app.engine.hf.flat.generate import GenerateProgram
    from app.engine.hf.flat.host import Host
    from app.engine.hf.flat.reads import SlotAsk
    from app.engine.hf.generation_state import Generation
    from app.engine.hf.prompts import Preprocessed

log = logging.getLogger("djev.engine")

# The fewest tokens a turn may hold: a widest canvas and an image beside a prompt's chunk.
MIN_TURN_TOKENS = 1024


# The full-attention pool holds this many times the sliding pool's tokens. A prompt past the window
# keeps a window of sliding blocks but every full one; with as many blocks in each pool, an H100's
# 7.8 GiB store held about 38,000 tokens a pool, and one 26,000-token state took two thirds of the
# full pool (its sliding layers, ten times the bytes a token, kept 1,024). Twice the tokens there
# costs short prompts (which need both) 8 % of their room on the full size.
FULL_TOKENS_PER_SLIDING = 2


def sliding_share(shapes: Sequence[LayerShape], store_bytes: int, dtype: torch.dtype) -> int | None:
    """The sliding pool's bytes of `store_bytes` (None: a model with one kind of layer, whose other
    pool holds nothing)."""
    sliding = block_bytes([shape for shape in shapes if shape.sliding], BLOCK_TOKENS, dtype)
    full = block_bytes([shape for shape in shapes if not shape.sliding], BLOCK_TOKENS, dtype)
    if not sliding or not full:
        return None
    return store_bytes * sliding // (sliding + FULL_TOKENS_PER_SLIDING * full)


class Program(Protocol):
    """A read or a generation as the flat engine steps it (`ReadProgram`, `GenerateProgram`)."""

    preprocessed: Preprocessed | None
    turns: int

    def prompts(self) -> list[Prompt]: ...

    def adopt(self, states: list[PromptState]) -> None: ...

    def parts(self, store: KVStore, room: int, chunk: int, rows: int) -> list[Part]: ...

    def slot_asks(self) -> SlotAsk | None: ...

    def take(self, reads: Sequence[SlotRead] = ()) -> None: ...

    def close(self, store: KVStore) -> None: ...

    @property
    def done(self) -> bool: ...


class Entry(Protocol):
    """A queued job as the engine sees it: whose it is (`caller`) and its program (`work`)."""

    @property
    def caller(self) -> int: ...

    @property
    def work(self) -> Program: ...


@dataclass(frozen=True)
class TurnReport:
    """What a step ran: the entries that took part, and the turn's tokens."""

    ran: list[Entry]
    prompt_tokens: int
    canvas_tokens: int
    canvas_parts: int


class FlatEngine:
    """The store, attention, forward and turn of one model, and the step that drives them."""

    def __init__(self, runner: Host, *, budget: int, store_bytes: int, graphs: bool = False) -> None:
        """`graphs`: the forward's pieces captured as CUDA graphs by token count (`prepare_graphs`,
        before `ready`); without, every turn runs the forward eagerly."""
        model = runner.model
        shapes = []
        for layer, kind in zip(encoder_layers(model), layer_types(model)):
            attention = layer.self_attn
            shapes.append(LayerShape(kind == "sliding_attention", attention.k_proj.out_features // attention.head_dim,
                                     attention.head_dim))
        window = int(text_config(model).sliding_window or 0) or runner.max_prompt_tokens + 1
        self.runner = runner
        self.budget = budget
        self.store = KVStore(shapes, window, store_bytes, runner.device, model.dtype,
                             preallocate=runner.device.type == "cuda",
                             sliding_bytes=sliding_share(shapes, store_bytes, model.dtype))
        # CUDA: every segment of a layer in one Triton launch; elsewhere SDPA segment by segment.
        self.attention: ReferenceAttention | SegmentAttention = (
            SegmentAttention(self.store, window) if runner.device.type == "cuda" else ReferenceAttention(self.store, window))
        pieces = PiecewiseConfig.for_budget(budget, capture=True) if graphs else None
        self.forward = FlatForward(model, self.store, self.attention, graphs=pieces, stats=runner.stats)
        self.turn = FlatTurn(self.forward, self.store, runner.device)
        self.prepared: set[int] = set()  # ids of the programs adopted
        # Generations stepped through the runner's own calls (`start_generation`), by their Generation,
        # and the chunk a turn gave before its caller asked for it.
        self.generations: dict[int, GenerateProgram] = {}
        self.waiting: dict[int, list[GenerateChunk]] = {}

    def prepare_graphs(self) -> GraphReport | None:
        """Capture the forward's pieces for every token-count bucket, then freeze them: nothing is
        captured after this (a turn no bucket holds runs eagerly, counted). None without graphs."""
        graphs = self.forward.graphs
        return graphs.capture_all() if graphs is not None else None

    def step(self, queue: Sequence[Entry]) -> TurnReport:
        """One engine turn over `queue` (in its fair order): the new programs prepared, the turn
        composed within the budget and run as one forward, each program that ran given its results;
        a program done is closed (its sequences released)."""
        runner = self.runner
        self._prepare([entry.work for entry in queue if id(entry.work) not in self.prepared])
        asked: dict[int, list[Part]] = {}
        canvases = 0

        def ask(entry: Entry, room: int) -> int:
            nonlocal canvases
            parts = entry.work.parts(self.store, room, runner.prefill_chunk, runner.max_rows - canvases)
            asked.setdefault(id(entry.work), []).extend(parts)
            canvases += sum(1 for part in parts if part.kind is Kind.CANVAS)
            return sum(part.tokens for part in parts)

        ran = compose([entry for entry in queue if not entry.work.done], self.budget, ask)
        parts = [part for entry in ran for part in asked[id(entry.work)]]
        counts: Counter[Kind] = Counter()
        for part in parts:
            counts[part.kind] += part.tokens
        if parts:
            runner.step_note = (f"a flat turn of {len(parts)} part(s): {counts[Kind.PROMPT]} prompt and "
                                f"{counts[Kind.CANVAS]} canvas token(s)")
            self.turn.run(parts)
            slots = [entry.work.slot_asks() for entry in ran]
            reads = self._read_slots([wanted for wanted in slots if wanted is not None])
            for entry, wanted in zip(ran, slots):
                entry.work.take(reads.pop(0) if wanted is not None else ())
            runner.stats["flat_turns"] += 1
            runner.stats["flat_prompt_tokens"] += counts[Kind.PROMPT]
            runner.stats["flat_canvas_tokens"] += counts[Kind.CANVAS]
            # The row path's pass counters (dashboards and the served bench read them): a turn that
            # wrote prompt KV is an encoder pass, one that read canvases a decoder pass of that many rows.
            runner.stats["encoder_passes"] += 1 if counts[Kind.PROMPT] else 0
            runner.stats["decoder_passes"] += 1 if canvases else 0
            runner.stats["decoder_rows"] += canvases
        for entry in queue:
            if entry.work.done:
                self.release(entry.work)
        self._store_counters()
        return TurnReport(ran, counts[Kind.PROMPT], counts[Kind.CANVAS], canvases)

    def _store_counters(self) -> None:
        """The KV store's totals into the runner's counters (/metrics): reads it had no room for (each
        failed alone with a 503, logged here), blocks evicted, pins broken for a running read."""
        totals, counters = self.store.totals, self.runner.stats
        refused = totals["store_full"] - counters["flat_store_full"]
        if refused > 0:
            stats = self.store.stats
            log.warning("the KV store had no room for %d read(s) this turn (failed with 503): %d of its %d blocks in "
                        "use, %d pinned; a larger PROMPT_CACHE_GB holds more", refused, stats["blocks_used"],
                        stats["blocks_allocated"], stats["blocks_pinned"])
        for name, total in totals.items():
            counters[f"flat_{name}"] = total

    def _read_slots(self, asks: list[SlotAsk]) -> list[list[SlotRead]]:
        """Every program's slot reads of the turn through one `slot_reads_at`: the unembedding's
        262k x hidden matrix read once for all of them (a chunk of SLOT_CHUNK slots at a time), and
        one copy to the host, not one a program."""
        if not asks:
            return []
        labels = [ids for ask in asks for ids in ask.labels]
        reads = self.runner.slot_reads_at(torch.cat([ask.hidden for ask in asks]), labels)
        split, offset = [], 0
        for ask in asks:
            split.append(reads[offset:offset + len(ask.labels)])
            offset += len(ask.labels)
        return split

    def release(self, program: Program) -> None:
        """A program that ended or was dropped: its sequences released, its preparation forgotten."""
        program.close(self.store)
        self.prepared.discard(id(program))

    def _prepare(self, programs: list[Program]) -> None:
        """The new programs' prompts, prepared together (their images share vision passes)."""
        if not programs:
            return
        prompts = [prompt for program in programs for prompt in program.prompts()]
        images: dict = {}
        for program in programs:
            images.update(program.preprocessed or {})
        states = prepare(self.runner, self.store, prompts, images)
        offset = 0
        for program in programs:
            count = len(program.prompts())
            program.adopt(states[offset:offset + count])
            offset += count
            self.prepared.add(id(program))

    # ------------------------------------------------------------------ one program alone

    def solo(self, program: Program) -> Generator[None, None, None]:
        """`program` stepped alone, a turn a step (a yield between two), until it is done: how the
        runner's own `read_steps` and generation calls run on the flat turn (tests, benches, the
        warm-up); the reader steps its queue together instead."""
        entry = Solo(program)
        try:
            while True:
                report = self.step([entry])
                if program.done:
                    return
                if not report.ran:
                    raise RuntimeError("a program alone took no part in a turn: its next part is wider than the "
                                       "turn's token budget")
                yield
        finally:
            self.release(program)

    def start_generation(self, program: GenerateProgram) -> Generator[None, None, Generation]:
        """A generation's first turns, alone, until its prompt is written (its first block's pass may
        ride the last of them); then its `Generation`, which `step_generation` steps on."""
        while True:
            program.chunks = []
            report = self.step([Solo(program)])
            if program.error is not None:
                self.release(program)
                raise program.error
            state, gen = program.state, program.gen
            assert state is not None and state.sequence is not None and gen is not None
            if state.sequence.written >= state.length or program.done:  # (max_tokens 0: done at once)
                self.generations[id(gen)] = program
                self.waiting[id(gen)] = list(program.chunks)
                return gen
            if not report.ran:
                raise RuntimeError("a generation's prompt took no part in a turn")
            yield

    def step_generation(self, gen: Generation) -> GenerateChunk | None:
        """One turn of a generation that `start_generation` began: the chunk it gave, if any."""
        program = self.generations.get(id(gen))
        waiting = self.waiting.get(id(gen))
        if waiting:  # a pass that rode the prompt's last turn gave this already
            return waiting.pop(0)
        if program is None or program.done:
            raise RuntimeError("this generation has finished")
        program.chunks = []
        self.step([Solo(program)])
        if program.error is not None:
            raise program.error
        if program.done:
            self.generations.pop(id(gen), None)
            self.waiting.pop(id(gen), None)
        return program.chunks[0] if program.chunks else None


@dataclass(frozen=True)
class Solo:
    """A program stepped on its own (`FlatEngine.solo`): caller 0."""

    work: Program
    caller: int = 0
