"""A job's reads as a program of the flat turn: its prompts' tails (in chunks where they are long),
then its canvases, a step a turn, each turn as much as the room the scheduler gives it.

Each canvas has its own seeded generator (the spec's seed and the canvas's number); between two steps
the sampler steps at its slots (`DiffusionRunner.denoise_positions`) and the next step reads the whole
canvas's logits over the temperature as its self-conditioning; its last step's slots are read in one
unembedding with every other program's (`slot_asks`). A canvas rides the turn that writes its
prompt's last chunk, and shares that forward with whatever else the turn holds, which never changes
what it reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch

from app.engine.base import CacheKey, ReadResult, ReadSpec, SlotRead
from app.engine.hf.layout import Kind
from app.engine.hf.prompts import chunk_length
from app.engine.hf.sampler import temperature_at
from app.engine.hf.turn import Part

if TYPE_CHECKING:
    from app.engine.hf.blocks import KVStore
    from app.engine.hf.host import Host
    from app.engine.hf.images import Preprocessed
    from app.engine.hf.prompts import PromptState

# A read's prompt blocks stay pinned this long after it ends: a decision's gated stage, which extends
# its first stage's prompt, comes a turn or two later and must find them under memory pressure.
FOLLOW_UP_PIN_S = 2.0


@dataclass(frozen=True)
class SlotAsk:
    """A program's slots to read after a turn: their hidden states [slots, hidden] and label ids."""

    hidden: torch.Tensor
    labels: list[Sequence[int]]


@dataclass(eq=False)
class Row:
    """One canvas of one spec, through its steps."""

    spec: int
    canvas_no: int
    canvas: list[int]
    steps_left: int
    generator: torch.Generator
    conditioning: torch.Tensor | None = None  # the previous step's logits over the temperature
    planned: Part | None = None  # its part in the turn being built
    reads: tuple[SlotRead, ...] | None = None  # what its slots say, after its last step


class ReadProgram:
    """The reads of one job, stepped by the flat engine: `prompts` to prepare, then `parts` and `take`
    once a turn until `done`; `outcomes` in the order of the specs."""

    def __init__(self, runner: Host, specs: Sequence[ReadSpec], preprocessed: Preprocessed | None) -> None:
        self.runner = runner
        self.specs = list(specs)
        self.preprocessed = preprocessed
        self.states: dict[CacheKey, PromptState] | None = None
        self.rows: list[Row] = []
        self.results: list[ReadResult | Exception | None] = [None] * len(self.specs)
        self.turns = 0

    @property
    def prepared(self) -> bool:
        return self.states is not None

    def prompts(self) -> list:
        """The distinct prompts to prepare, in order of their first spec."""
        return list({spec.prompt.cache_key: spec.prompt for spec in self.specs}.values())

    def adopt(self, states: Sequence[PromptState]) -> None:
        """Its prompts prepared (`flat.prompts.prepare`): the canvases to read, the specs that fail."""
        self.states = {state.prompt.cache_key: state for state in states}
        for index, spec in enumerate(self.specs):
            state = self.states[spec.prompt.cache_key]
            if state.error is not None:
                self.results[index] = state.error
                continue
            for canvas_no, canvas in enumerate(spec.canvases):
                generator = self.runner.seeded_generator(spec.seed * 1000003 + canvas_no)
                self.rows.append(Row(index, canvas_no, list(canvas), spec.steps, generator))

    @property
    def done(self) -> bool:
        return all(result is not None for result in self.results)

    def outcomes(self) -> list[ReadResult | Exception]:
        done = [result for result in self.results if result is not None]
        assert len(done) == len(self.results), "every read has its result or its exception"
        return done

    def parts(self, store: KVStore, room: int, chunk: int, rows: int) -> list[Part]:
        """What it runs in the turn being built, within `room` tokens: the next chunk of each prompt not
        yet written (at most `chunk` tokens each, fewer far into a long prompt: `chunk_length`), then
        the next step of the canvases whose prompts are written by the end of the turn (at most `rows`
        of them). Asked again in the same turn, it adds to what it asked for."""
        assert self.states is not None, "prepared first"
        parts: list[Part] = []
        for state in self.states.values():
            if state.error is not None or state.complete:
                continue
            part = state.chunk(store, room, chunk_length(state.planned, chunk))
            if part is None:
                if state.error is not None:
                    self._fail(state)
                    continue
                break
            parts.append(part)
            room -= part.tokens
            if state.length > chunk:  # a long prompt's chunk (counted for the benches)
                self.runner.stats["encoder_chunks"] += 1
        planned = sum(1 for row in self.rows if row.planned is not None)
        for row in self.rows:
            spec = self.specs[row.spec]
            state = self.states[spec.prompt.cache_key]
            if row.reads is not None or row.planned is not None or not state.complete:
                continue
            if planned >= rows or len(row.canvas) > room:
                break
            assert state.sequence is not None
            last = row.steps_left == 1
            row.planned = Part(Kind.CANVAS, state.sequence, state.length, list(row.canvas),
                               logits=spec.slots if last else tuple(range(len(row.canvas))),
                               conditioning=row.conditioning)
            parts.append(row.planned)
            planned += 1
            room -= len(row.canvas)
        return parts

    def slot_asks(self) -> SlotAsk | None:
        """The turn ran: what its canvases at their last step read (their slots' hidden states and
        label ids), for the engine to unembed with every other program's in one go; None if none."""
        finals = self._finals()
        if not finals:
            return None
        return SlotAsk(torch.cat([_hidden(row) for row in finals]),
                       [ids for row in finals for ids in self.specs[row.spec].label_ids])

    def take(self, reads: Sequence[SlotRead] = ()) -> None:
        """The turn ran: its last steps' slot reads (`reads`, answering `slot_asks` in order), its other
        steps' sampling; the reads now whole."""
        runner = self.runner
        ran = [row for row in self.rows if row.planned is not None]
        offset = 0
        for row in self._finals():
            count = len(self.specs[row.spec].slots)
            row.reads = tuple(reads[offset:offset + count])
            offset += count
        if offset != len(reads):
            raise ValueError(f"{len(reads)} slot reads for {offset} slots")
        settings = runner.generation
        for row in ran:
            if row.steps_left > 1:
                spec = self.specs[row.spec]
                temperature = temperature_at(row.steps_left, spec.steps, settings["t_min"], settings["t_max"])
                logits = runner.logits(_hidden(row))
                slots = list(spec.slots)
                runner.denoise_positions(row.canvas, logits[slots], temperature, slots, row.generator)
                row.conditioning = (logits / temperature).to(runner.model.dtype)
                row.steps_left -= 1
            row.planned = None
        self.turns += 1
        self._settle()

    def _finals(self) -> list[Row]:
        """The rows that ran their last step this turn."""
        return [row for row in self.rows if row.planned is not None and row.steps_left == 1]

    def close(self, store: KVStore) -> None:
        """Its prompts' sequences released (pinned a little while for a follow-up stage)."""
        for state in (self.states or {}).values():
            if state.sequence is not None:
                store.close(state.sequence, pin_seconds=FOLLOW_UP_PIN_S)

    def _settle(self) -> None:
        assert self.states is not None
        by_spec: dict[int, list[Row]] = {}
        for row in self.rows:
            by_spec.setdefault(row.spec, []).append(row)
        for index, rows in by_spec.items():
            if self.results[index] is None and all(row.reads is not None for row in rows):
                spec = self.specs[index]
                reads = tuple(row.reads for row in sorted(rows, key=lambda row: row.canvas_no) if row.reads is not None)
                self.results[index] = ReadResult(slots=reads, prompt_tokens=self.states[spec.prompt.cache_key].length)

    def _fail(self, state: PromptState) -> None:
        for index, spec in enumerate(self.specs):
            if spec.prompt.cache_key == state.prompt.cache_key and self.results[index] is None:
                self.results[index] = state.error
        self.rows = [row for row in self.rows if self.results[row.spec] is None]


def _hidden(row: Row) -> torch.Tensor:
    assert row.planned is not None and row.planned.hidden is not None, "the turn ran"
    return row.planned.hidden
