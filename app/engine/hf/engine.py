"""The flat turn's parts, held by the runner: the KV store, the attention backend, the forward, the turn;
and `step`, one engine turn over the programs the reader queues.

A step composes the turn from the queue within the token budget (`scheduler.compose`), preparing each
program as the walk first reaches it (its prompts' ids and keys, its sequences opened in the store), so
work queued behind a full turn holds nothing; then the images of the parts the turn takes go through
the vision tower together, the turn runs as one forward, and each program gets its results. A turn that
raises fails the programs in it alone (`TurnFailed`), every block they held released.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generator, Protocol, Sequence

import torch

from app.engine.base import EngineInputError
from app.engine.hf.attention import ReferenceAttention, SegmentAttention
from app.engine.hf.blocks import BLOCK_TOKENS, KVStore, LayerShape, block_bytes
from app.engine.hf.forward import FlatForward
from app.engine.hf.graphs.pieces import GraphReport, PiecewiseConfig
from app.engine.hf.layout import Kind
from app.engine.hf.parts import encoder_layers, layer_types, text_config
from app.engine.hf.prompts import PromptState, embed_images, prepare
from app.engine.hf.scheduler import TurnFailed, compose
from app.engine.hf.sizing import plan_store
from app.engine.hf.turn import FlatTurn, Part

if TYPE_CHECKING:
    from app.engine.base import GenerateChunk, Prompt, SlotRead
    from app.engine.hf.generation import Generation
    from app.engine.hf.generations import GenerateProgram
    from app.engine.hf.host import Host
    from app.engine.hf.images import Preprocessed
    from app.engine.hf.reads import SlotAsk

log = logging.getLogger("djev.engine")


def budget_problem(budget: int, canvas: int, image_tokens: int) -> str | None:
    """Why a turn of `budget` tokens cannot serve these settings (None: it can): a widest canvas beside
    the largest image (neither is ever split across turns) must fit one turn, or such a read would wait
    for ever. Checked at start."""
    if canvas + image_tokens <= budget:
        return None
    return (f"TURN_TOKENS {budget} cannot hold a widest canvas (CANVAS {canvas}) beside the model's largest image "
            f"({image_tokens} soft tokens): set TURN_TOKENS to at least {canvas + image_tokens}, or CANVAS lower")


class Program(Protocol):
    """A read or a generation as the flat engine steps it (`ReadProgram`, `GenerateProgram`)."""

    preprocessed: Preprocessed | None
    turns: int

    @property
    def prepared(self) -> bool:
        """Whether `adopt` has given it its prompts' states."""
        ...

    def prompts(self) -> list[Prompt]: ...

    def adopt(self, states: list[PromptState]) -> None: ...

    def parts(self, store: KVStore, room: int, chunk: int, rows: int) -> list[Part]: ...

    def slot_asks(self) -> SlotAsk | None: ...

    def take(self, reads: Sequence[SlotRead] = ()) -> None: ...

    def close(self, store: KVStore) -> None: ...

    @property
    def done(self) -> bool: ...


class Entry(Protocol):
    """A queued job as the engine sees it: whose it is (`caller`), whether it is heavy (more than a
    turn's work by nature) and its program (`work`)."""

    @property
    def caller(self) -> int: ...

    @property
    def heavy(self) -> bool: ...

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
        self.plan = plan_store(store_bytes, block_bytes([shape for shape in shapes if not shape.sliding], BLOCK_TOKENS,
                                                        model.dtype),
                               block_bytes([shape for shape in shapes if shape.sliding], BLOCK_TOKENS, model.dtype),
                               block_tokens=BLOCK_TOKENS, window=window, budget=budget,
                               wanted_prompt_tokens=runner.max_prompt_tokens)
        log.info("%s", self.plan.line())
        self.max_prompt_tokens = self.plan.max_prompt_tokens  # the longest state the store holds
        self.store = KVStore(shapes, window, self.plan.full_bytes + self.plan.sliding_bytes, runner.device,
                             model.dtype, preallocate=runner.device.type == "cuda",
                             sliding_bytes=self.plan.sliding_bytes)
        # CUDA: every segment of a layer in one Triton launch; elsewhere SDPA segment by segment.
        self.attention: ReferenceAttention | SegmentAttention = (
            SegmentAttention(self.store, window) if runner.device.type == "cuda" else ReferenceAttention(self.store, window))
        pieces = PiecewiseConfig.for_budget(budget, capture=True) if graphs else None
        self.forward = FlatForward(model, self.store, self.attention, graphs=pieces, stats=runner.stats)
        self.turn = FlatTurn(self.forward, self.store, runner.device)
        # Generations stepped through the runner's own calls (`start_generation`), by their Generation,
        # and the chunk a turn gave before its caller asked for it.
        self.generations: dict[int, GenerateProgram] = {}
        self.waiting: dict[int, list[GenerateChunk]] = {}

    def refuse_wider(self, canvases: Sequence[int], images: Sequence[int]) -> None:
        """EngineInputError (400) for work whose smallest unit no turn holds: a canvas, or an image's soft
        tokens, wider than the budget (settings checked at start leave none; a read built by hand may)."""
        for widths, what in ((canvases, "a canvas"), (images, "an image")):
            widest = max(widths, default=0)
            if widest > self.budget:
                raise EngineInputError(f"{what} of {widest} tokens is wider than one engine turn holds (TURN_TOKENS "
                                       f"{self.budget})", status=400, param="questions" if widths is canvases else "images")

    def prepare_graphs(self) -> GraphReport | None:
        """Capture the forward's pieces for every token-count bucket, then freeze them: nothing is
        captured after this (a turn no bucket holds runs eagerly, counted). None without graphs."""
        graphs = self.forward.graphs
        return graphs.capture_all() if graphs is not None else None

    def step(self, queue: Sequence[Entry]) -> TurnReport:
        """One engine turn over `queue` (in its fair order): the turn composed within the budget, each
        program prepared as the walk reaches it, the images of the parts taken through the vision tower
        together, the turn run as one forward, each program that ran given its results; a program done
        is closed (its sequences released). TurnFailed where any of that raises: the programs in the
        turn (and one being prepared) are released and named in it; the others keep their state."""
        runner = self.runner
        asked: dict[int, list[Part]] = {}
        canvases = light_canvases = 0
        # While heavy work waits, light work reads at most half the turn's canvases (as compose gives
        # each kind at most half its tokens): a stream of light reads never keeps heavy canvases out.
        light_rows = runner.max_rows // 2 if len({entry.heavy for entry in queue}) > 1 else runner.max_rows
        preparing: list[Entry] = []  # the entry being prepared or asked: a failure there is its own

        def ask(entry: Entry, room: int) -> int:
            nonlocal canvases, light_canvases
            work = entry.work
            preparing[:] = [entry]
            if not work.prepared:
                self._prepare(work)
            rows = runner.max_rows - canvases
            if not entry.heavy:
                rows = min(rows, light_rows - light_canvases)
            parts = work.parts(self.store, room, runner.prefill_chunk, max(0, rows))
            preparing.clear()
            asked.setdefault(id(work), []).extend(parts)
            taken = sum(1 for part in parts if part.kind is Kind.CANVAS)
            canvases += taken
            if not entry.heavy:
                light_canvases += taken
            return sum(part.tokens for part in parts)

        ran: list[Entry] = []
        counts: Counter[Kind] = Counter()
        self.store.start_turn()
        try:
            ran = compose([entry for entry in queue if not entry.work.done], self.budget, ask)
            parts = [part for entry in ran for part in asked[id(entry.work)]]
            for part in parts:
                counts[part.kind] += part.tokens
            if parts:
                runner.step_note = (f"a flat turn of {len(parts)} part(s): {counts[Kind.PROMPT]} prompt and "
                                    f"{counts[Kind.CANVAS]} canvas token(s)")
                embed_images(runner, parts)
                self.turn.run(parts)
                slots = [entry.work.slot_asks() for entry in ran]
                reads = self._read_slots([wanted for wanted in slots if wanted is not None])
                for entry, wanted in zip(ran, slots):
                    entry.work.take(reads.pop(0) if wanted is not None else ())
                if self.runner.device.type == "cuda":
                    # A turn's wall time is its device time: a long state's chunks (no slot read copies
                    # to the host) would otherwise queue up on the GPU, and the next read that copies
                    # waits that backlog out, seconds after a 110k state.
                    torch.cuda.current_stream(self.runner.device).synchronize()
        except Exception as exc:
            failed = [entry for entry in queue if asked.get(id(entry.work))] + preparing
            for entry in failed:
                self.release(entry.work)
            self._store_counters()
            raise TurnFailed(failed, exc) from exc
        if ran:
            runner.stats["flat_turns"] += 1
            runner.stats["flat_prompt_tokens"] += counts[Kind.PROMPT]
            runner.stats["flat_canvas_tokens"] += counts[Kind.CANVAS]
            # Pass counters (dashboards and the served bench read them): a turn that wrote prompt KV
            # counts as an encoder pass, one that read canvases as a decoder pass of that many rows.
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
        for name, level in self.store.levels.items():  # after the turn's releases (the served bench checks them)
            counters[f"kv_{name}"] = level

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
        """A program that ended, was dropped or failed: its sequences released (closing twice is
        harmless)."""
        program.close(self.store)

    def _prepare(self, program: Program) -> None:
        """A program's prompts: ids, keys, sequences opened (their images wait for `embed_images`)."""
        program.adopt(prepare(self.runner, self.store, program.prompts(), program.preprocessed))

    # ------------------------------------------------------------------ one program alone

    def solo(self, program: Program) -> Generator[None, None, None]:
        """`program` stepped alone, a turn a step (a yield between two), until it is done: how the
        runner's own `read_steps` and generation calls run on the flat turn (tests, benches, the
        warm-up); the reader steps its queue together instead."""
        entry = Solo(program)
        try:
            while True:
                report = self._step_alone(entry)
                if program.done:
                    return
                if not report.ran:
                    raise RuntimeError("a program alone took no part in a turn: its next part is wider than the "
                                       "turn's token budget")
                yield
        finally:
            self.release(program)

    def _step_alone(self, entry: Solo) -> TurnReport:
        """`step` over one entry; a failed turn raises its cause (the entry is released)."""
        try:
            return self.step([entry])
        except TurnFailed as failed:
            raise failed.cause from None

    def start_generation(self, program: GenerateProgram) -> Generator[None, None, Generation]:
        """A generation's first turns, alone, until its prompt is written (its first block's pass may
        ride the last of them); then its `Generation`, which `step_generation` steps on."""
        while True:
            program.chunks = []
            report = self._step_alone(Solo(program))
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
        self._step_alone(Solo(program))
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
    heavy: bool = False
