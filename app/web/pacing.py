"""Camera-session pacing and admission: how often each camera should send, and whether one more fits.

Pure: no I/O and no clock of its own; every call that needs the time is given `now` (monotonic
seconds). app/web/stream.py feeds it what each answered frame took and sends its decisions to the
clients. The rule and why are in docs/design.md ("Camera sessions: pacing and admission").

Two rates, in answered frames per second over all sessions, are measured in tumbling windows of at
least `window_s` seconds and MIN_SAMPLES answers: `capacity`, what the engine has been seen to
answer (admission promises from it), and `pace`, what the sessions are paced to in all (next_frame_ms
shares it out), which runs ahead of the capacity to find out whether the engine can do more.

- A window where at least SATURATED_SHARE of the answers were *engine-bound* (the answer took at
  least the interval its session was paced at and at least BOUND_AGE_MS, or a newer frame of the
  session was already waiting) saw the engine answer all it could: capacity and pace both become
  that window's answers per second. (An answer within BOUND_AGE_MS is not engine-bound however
  short the interval: a batching engine's pass can outlast the interval while it still has room
  for more frames, and calling that saturated would pin the estimate to the sessions already in.)
- A window where the engine kept up, with at most FRESH_SHARE of its answers engine-bound, proves
  the engine answers that rate fresh: the capacity rises to it over `headroom` (never falls), so
  admission, which promises at most capacity x headroom, promises no more than was answered fresh.
  The sessions' own senders set that rate (a 2 fps camera never uses a 4 fps pace), so this is how
  a server whose cameras send slower than they are paced still learns: each such window lets in
  about 1 / headroom times the answers it saw, and the first window that saturates stops it.
- A window where the engine kept up and the sessions asked for at least PRESSING_SHARE of the pace
  probes the pace PROBE_GAIN higher: the next window tests it.
- A window where the engine kept up, when the reader says how long its engine was busy (the hf
  engine's `busy_ms`), also says how much more it could do: its answers per second over the share
  of the window the engine was busy, times EXTRAPOLATION_SAFETY, at most MAX_EXTRAPOLATION times the
  rate seen. Linear in the engine's time, so conservative: batching makes more frames cost less than
  linearly, and busy time other traffic took counts against the cameras. This lets a server that
  has seen four cameras cost 10 % of its engine admit many more within one window, rather than
  PROBE_GAIN more a window.
- Any other window (too few answers fresh, a pace the sessions did not press) says nothing new.

Both start from `capacity_start`, a conservative prior, or from what the engine measured itself at
start-up where that is more (`start_from`: the hf engine reads a burst of frames before `ready`): a
session admitted on an optimistic guess can never be closed again, so the server admits only what it
has seen it can serve, and more once it has measured more. A probe that overshoots costs one window
of answers about PROBE_GAIN times older; it never admits anyone, since admission reads the capacity,
not the pace.

A session is admitted while (sessions + 1) x min_session_fps <= capacity x headroom; a server with no
session open always admits one (a lone camera crowds nobody out). Admitted sessions are never closed
for load: when the capacity falls, their `next_frame_ms` rises instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# A window is judged only on at least this many answers: fewer say too little about a rate.
MIN_SAMPLES = 8
# At least this share of a window's answers engine-bound: the engine was the limit (saturated).
SATURATED_SHARE = 0.5
# At most this share engine-bound: the engine answered the window's rate fresh (the capacity may grow).
FRESH_SHARE = 0.1
# An answer younger than this is never engine-bound: half the walk page's 1.5 s stale guard.
BOUND_AGE_MS = 750
# The sessions asked for at least this share of the pace and the engine kept up: probe higher.
PRESSING_SHARE = 0.8
# How much higher a probe goes, once a window: the next window paces the sessions to it and tells
# whether the engine keeps up (a window of overshoot costs answers about PROBE_GAIN times as old).
PROBE_GAIN = 1.25
# Neither rate falls below this (frames/s): next_frame_ms stays finite however slow the engine.
MIN_CAPACITY = 0.1
# An estimate from the engine's busy share: this share of the linear extrapolation, at most this many
# times the rate the window saw, from a busy share of at least MIN_BUSY_SHARE.
EXTRAPOLATION_SAFETY = 0.7
MAX_EXTRAPOLATION = 4.0
MIN_BUSY_SHARE = 0.05


@dataclass(frozen=True)
class PacingRules:
    """The knobs (Settings' stream section; docs/configuration.md says what each means)."""

    min_session_fps: float  # the fewest answers a second an admitted session is promised
    max_session_fps: float  # the most a session is asked for: next_frame_ms never goes below 1000 / this
    capacity_start: float  # frames/s assumed until measured (conservative)
    headroom: float  # the share of the estimate admission may promise away
    window_s: float  # the shortest measuring window, seconds

    @property
    def floor_ms(self) -> int:
        return math.ceil(1000 / self.max_session_fps)


@dataclass(frozen=True)
class SessionAdmission:
    """Whether a new camera session may open; `reason` says why not (a close reason, < 120 bytes)."""

    admitted: bool
    reason: str = ""


@dataclass(frozen=True)
class Window:
    """What one closed measuring window saw, and what the estimate became (for tests and logs)."""

    answers: int
    engine_bound: int
    seconds: float
    rate: float  # answers per second over the window
    verdict: str  # "saturated", "extrapolated", "grown", "probed" or "unchanged"
    capacity: float  # the estimate after this window
    pace: float


class Pacer:
    """One app's camera sessions: the capacity estimate, the admitted sessions, each one's pace."""

    def __init__(self, rules: PacingRules) -> None:
        self.rules = rules
        self.capacity = float(rules.capacity_start)  # frames/s the engine has been seen to answer
        self.pace = float(rules.capacity_start)  # frames/s the sessions are paced to, in all
        self.measured = False  # a saturated window has set the estimate at least once
        self.sessions: set[str] = set()
        self.last_window: Window | None = None
        self._start: float | None = None  # the first answer of the window being counted
        self._answers = 0
        self._bound = 0
        self._busy_start: float | None = None  # the engine's busy ms when the window began, if known

    def start_from(self, rate: float) -> bool:
        """The engine's own measure of the camera frames a second it reads (`ReaderInfo.frame_rate`,
        taken at start-up): capacity and pace start there where it is more than they are and no window
        has measured them yet. Returns whether it raised them."""
        if self.measured or not rate > self.capacity:
            return False
        self.capacity = self.pace = float(rate)
        return True

    # ------------------------------------------------------------------ sessions

    def admit(self, session: str) -> SessionAdmission:
        """Admit `session` if one more fits the capacity; an admitted session stays until `leave`."""
        count = len(self.sessions)
        if count and (count + 1) * self.rules.min_session_fps > self.capacity * self.rules.headroom:
            each = min(self.rules.max_session_fps, self.capacity / count)
            return SessionAdmission(False, f"the server is at its camera capacity: {count} sessions at "
                                    f"~{each:.1f} answers/s each; try again later")
        self.sessions.add(session)
        return SessionAdmission(True)

    def admissible(self) -> int:
        """How many sessions the capacity admits in all (at least one)."""
        return max(1, math.floor(self.capacity * self.rules.headroom / self.rules.min_session_fps + 1e-9))

    def leave(self, session: str) -> None:
        self.sessions.discard(session)
        if not self.sessions:
            self._reset_window()  # an idle stretch says nothing about the engine's rate

    def next_frame_ms(self) -> int:
        """The interval each session should send at now: its share of the pace, never faster than
        max_session_fps."""
        share = 1000 * max(len(self.sessions), 1) / self.pace
        return max(self.rules.floor_ms, math.ceil(share))

    # ------------------------------------------------------------------ measuring

    def answered(self, now: float, age_s: float, interval_ms: float, waiting: bool,
                 busy_ms: float | None = None) -> Window | None:
        """One frame answered at `now`, `age_s` after it arrived; its session was paced at
        `interval_ms`, and `waiting` says whether a newer frame of the session was already queued.
        `busy_ms`: the engine's busy milliseconds so far, where the reader counts them. Returns the
        window this answer closed, if it closed one."""
        closed = None
        if self._start is None:
            self._start, self._busy_start = now, busy_ms
        elif now - self._start >= self.rules.window_s and self._answers >= MIN_SAMPLES:
            busy = None
            if busy_ms is not None and self._busy_start is not None:
                busy = (busy_ms - self._busy_start) / 1000
            closed = self._close(now - self._start, busy)
            self._start, self._busy_start = now, busy_ms
        self._answers += 1
        if waiting or age_s * 1000 >= max(interval_ms, BOUND_AGE_MS):
            self._bound += 1
        return closed

    def _close(self, seconds: float, busy_s: float | None = None) -> Window:
        answers, bound = self._answers, self._bound
        rate = answers / seconds
        if bound >= SATURATED_SHARE * answers:
            verdict = "saturated"
            self.capacity = self.pace = max(rate, MIN_CAPACITY)
            self.measured = True
        elif busy_s is not None and busy_s > 0 and (implied := self._implied(rate, busy_s / seconds)) > self.capacity:
            verdict = "extrapolated"
            self.capacity = implied
            self.pace = max(self.pace, implied)
            self.measured = True
        else:
            verdict = "unchanged"
            if bound <= FRESH_SHARE * answers and rate / self.rules.headroom > self.capacity:
                verdict = "grown"
                self.capacity = rate / self.rules.headroom
            if rate >= PRESSING_SHARE * self.pace:
                verdict = "probed" if verdict == "unchanged" else verdict
                self.pace = max(self.pace, rate) * PROBE_GAIN
            self.pace = max(self.pace, self.capacity)
        self._answers = self._bound = 0
        self.last_window = Window(answers, bound, seconds, rate, verdict, self.capacity, self.pace)
        return self.last_window

    @staticmethod
    def _implied(rate: float, busy_share: float) -> float:
        """The frames a second the engine could answer, from `rate` answered while it was busy
        `busy_share` of the time (see the module)."""
        linear = rate / max(busy_share, MIN_BUSY_SHARE)
        return min(linear * EXTRAPOLATION_SAFETY, rate * MAX_EXTRAPOLATION)

    def _reset_window(self) -> None:
        self._start = None
        self._answers = self._bound = 0
