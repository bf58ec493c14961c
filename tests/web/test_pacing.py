"""The pure camera pacer (app/web/pacing.py): the capacity estimate from answered frames, admission
by MIN_SESSION_FPS and headroom, next_frame_ms rising with load, and admitted sessions never closed."""

from __future__ import annotations

import pytest

from app.config import Settings
from app.web.pacing import MIN_SAMPLES, PROBE_GAIN, Pacer, PacingRules, Window
from app.web.services import pacing_rules

RULES = PacingRules(min_session_fps=1.5, max_session_fps=4.0, capacity_start=8.0, headroom=0.8, window_s=2.0)


def pacer(**changes: float) -> Pacer:
    return Pacer(PacingRules(**{**RULES.__dict__, **changes}))


def feed(pacer: Pacer, start: float, rate: float, seconds: float, age_s: float, interval_ms: float,
         waiting: bool = False) -> float:
    """Answers at `rate` a second for `seconds` from `start`, each `age_s` old; returns the end."""
    count = round(rate * seconds)
    for index in range(count):
        pacer.answered(start + index / rate, age_s, interval_ms, waiting)
    return start + count / rate


def closing(pacer: Pacer, now: float, age_s: float, interval_ms: float, waiting: bool = False) -> Window:
    """The answer that closes a window, and the window it closed."""
    window = pacer.answered(now, age_s, interval_ms, waiting)
    assert window is not None, "the window did not close"
    return window


def test_the_rules_come_from_settings():
    rules = pacing_rules(Settings.of(min_session_fps=2.0, max_session_fps=5.0, session_capacity_start=12.0,
                                     session_headroom=0.7, session_window=1.5))
    assert rules == PacingRules(min_session_fps=2.0, max_session_fps=5.0, capacity_start=12.0, headroom=0.7,
                                window_s=1.5)
    assert rules.floor_ms == 200
    for bad in ({"min_session_fps": 5.0, "max_session_fps": 4.0}, {"session_headroom": 1.5},
                {"session_capacity_start": 0.0}, {"session_window": 0.0}):
        with pytest.raises(ValueError):
            Settings.of(**bad)


def test_it_starts_from_the_conservative_prior_and_admits_by_it():
    p = pacer()
    assert p.capacity == 8.0 and not p.measured
    # (n + 1) x 1.5 <= 8 x 0.8 = 6.4: four sessions, not five.
    assert all(p.admit(f"s{i}").admitted for i in range(4))
    refused = p.admit("s4")
    assert not refused.admitted
    assert refused.reason == ("the server is at its camera capacity: 4 sessions at ~2.0 answers/s each; "
                              "try again later")
    assert len(refused.reason.encode()) < 120  # fits a close frame
    assert p.sessions == {"s0", "s1", "s2", "s3"}


def test_a_server_with_no_session_always_admits_one():
    p = pacer(capacity_start=0.5)
    assert p.admit("only").admitted
    assert not p.admit("second").admitted
    p.leave("only")
    assert p.admit("again").admitted


def test_next_frame_ms_rises_with_load_from_the_floor():
    p = pacer(capacity_start=20.0)
    intervals = []
    for index in range(10):
        assert p.admit(f"s{index}").admitted
        intervals.append(p.next_frame_ms())
    assert intervals[0] == 250  # 1000 / MAX_SESSION_FPS: one session is not asked for 20 fps
    assert intervals == sorted(intervals) and intervals[-1] == 500  # 10 sessions share 20 fps: 2 each
    assert intervals[5] == 300  # 6 sessions
    for index in range(10):
        p.leave(f"s{index}")
    assert p.next_frame_ms() == 250


def test_a_saturated_window_sets_the_estimate_to_what_the_engine_answered():
    p = pacer()
    for index in range(4):
        p.admit(f"s{index}")
    # Answers at 5/s, each older than the interval its session was paced at: the engine is the limit.
    end = feed(p, 0.0, rate=5.0, seconds=2.0, age_s=0.9, interval_ms=500)
    window = closing(p, end, 0.9, 500)
    assert window.verdict == "saturated"
    assert p.capacity == pytest.approx(5.0) and p.pace == pytest.approx(5.0) and p.measured
    assert p.next_frame_ms() == 800  # 4 sessions share 5 frames/s
    # Newer frames waiting (a client that does not pace) count as engine-bound too.
    q = pacer()
    end = feed(q, 0.0, rate=6.0, seconds=2.0, age_s=0.05, interval_ms=500, waiting=True)
    assert closing(q, end, 0.05, 500, True).verdict == "saturated" and q.capacity == pytest.approx(6.0)


def test_a_kept_up_window_that_pressed_the_pace_probes_higher():
    p = pacer()
    # 7/s with a third of the answers engine-bound: not saturated, not fresh. The engine kept up with
    # most of the pace (8): the pace runs ahead, and the next window tests it. The capacity stays
    # (7/s is under the prior), and admission reads the capacity: a probe lets nobody more in.
    end = 0.0
    for index in range(14):
        end = index / 7
        p.answered(end, 0.8 if index % 3 == 0 else 0.1, 500, False)
    window = closing(p, end + 1 / 7, 0.1, 500)
    assert window.verdict == "probed" and p.pace == pytest.approx(8.0 * PROBE_GAIN)
    assert p.capacity == 8.0 and not p.measured


def test_a_fresh_window_grows_the_capacity_to_what_admission_may_promise_from_it():
    """Six cameras that send 2 fps whatever the pace (12/s), every answer fresh: the capacity rises
    to 12 / headroom, so admission promises at most the 12/s answered fresh (eight sessions at
    1.5/s), and the pace probes on from there. A window that is kept up but not fresh grows nothing."""
    p = pacer(capacity_start=12.6)
    assert sum(p.admit(f"s{i}").admitted for i in range(8)) == 6
    end = feed(p, 0.0, rate=12.0, seconds=2.0, age_s=0.2, interval_ms=500)
    window = closing(p, end, 0.2, 500)
    assert window.verdict == "grown" and p.capacity == pytest.approx(12.0 / 0.8, rel=0.02)
    assert p.pace >= p.capacity
    assert sum(p.admit(f"t{i}").admitted for i in range(8)) == 2  # 8 sessions x 1.5 = the 12/s answered fresh
    q = pacer(capacity_start=12.6)
    end = 0.0
    for index in range(24):  # a fifth of the answers older than their interval: kept up, not fresh
        end = index / 12
        q.answered(end, 0.8 if index % 5 == 0 else 0.2, 500, False)
    assert closing(q, end + 1 / 12, 0.2, 500).verdict == "probed" and q.capacity == 12.6


def test_cameras_slower_than_their_pace_fill_a_batching_engine_without_going_stale():
    """A batching engine of 40 frames/s (16 frames a 0.4 s pass), phones that send at 2 fps (later
    when next_frame_ms asks) and retry 2 s after a refusal: the admitted sessions grow window by window toward
    what MIN_SESSION_FPS and the headroom allow, and every admitted one is answered at least at
    MIN_SESSION_FPS, no answer a second old."""
    batch, pass_s, fps = 16, 0.4, 2.0
    p = pacer(max_session_fps=4.0, capacity_start=8.0, window_s=3.0)
    due: dict[str, float] = {}
    retry = {f"phone{n}": 0.0 for n in range(40)}
    inflight: dict[str, float] = {}
    queue: list[str] = []
    answers: dict[str, int] = {}
    opened: dict[str, float] = {}
    worst, next_pass = 0.0, 0.0
    for step in range(6000):  # 10 ms steps: 60 s
        now = step / 100
        for name, when in list(retry.items()):
            if now >= when:
                if p.admit(name).admitted:
                    del retry[name]
                    due[name] = opened[name] = now
                else:
                    retry[name] = now + 2.0
        for name, when in due.items():
            if name not in inflight and now >= when - 1e-9:
                inflight[name] = now
                queue.append(name)
                due[name] = when + 1 / fps
        if now >= next_pass - 1e-9 and queue:
            taken, queue[:] = queue[:batch], queue[batch:]
            next_pass = answered_at = now + pass_s
            for name in taken:
                sent = inflight.pop(name)
                age = answered_at - sent
                p.answered(answered_at, age, p.next_frame_ms(), False)
                due[name] = max(due[name], sent + p.next_frame_ms() / 1000)  # later if asked, as the page
                if now > 40:
                    answers[name] = answers.get(name, 0) + 1
                    worst = max(worst, age)
    admitted = len(p.sessions)
    assert 16 <= admitted <= 21, admitted  # 21 x 1.5 = 31.5 fits 40 x 0.8; 6 fit the prior
    settled = [name for name, when in opened.items() if when < 40]
    assert settled and all(answers[name] >= RULES.min_session_fps * 19.5 for name in settled), answers
    assert worst < 1.0, worst  # two passes and a little queueing: under the 64-camera row's 1 s


def test_a_light_window_changes_nothing():
    p = pacer()
    end = feed(p, 0.0, rate=4.0, seconds=2.0, age_s=0.1, interval_ms=250)  # one session at its floor
    assert closing(p, end, 0.1, 250, False).verdict == "unchanged" and p.capacity == 8.0


def test_a_window_needs_its_time_and_enough_answers():
    p = pacer()
    for index in range(MIN_SAMPLES - 1):  # spread over 10 s: time enough, answers not
        assert p.answered(index * 10.0 / MIN_SAMPLES, 2.0, 500, False) is None
    assert p.answered(10.0, 2.0, 500, False) is None  # the eighth: counted; the next closes the window
    assert closing(p, 10.5, 2.0, 500, False).verdict == "saturated"
    quick = pacer()
    for index in range(50):  # many answers within the window's 2 s: not judged yet
        assert quick.answered(index * 0.02, 2.0, 500, False) is None


def test_the_estimate_converges_on_a_batching_engine_and_sessions_stay_fresh():
    """A simulated batching engine (B frames a pass of T seconds: capacity B / T) behind sessions
    that follow next_frame_ms and wait for their answer: the pacer's estimate climbs from the prior
    to the engine's capacity, admission stops where MIN_SESSION_FPS would no longer fit, and the
    admitted sessions' next_frame_ms + answer age stay under the walk page's 1.5 s."""
    batch, pass_s = 4, 0.2  # 20 frames/s
    p = pacer()
    due: dict[str, tuple[float, int]] = {}  # session -> (when it sends next, the interval it was told)
    inflight: dict[str, tuple[float, int]] = {}  # session -> (sent at, the interval it was paced at)
    queue: list[str] = []
    knocks, worst, next_pass = 0, 0.0, 0.0
    for step in range(2000):  # 10 ms steps: 20 s
        now = step / 100
        if step % 50 == 0:  # a phone knocks every 0.5 s
            knocks += 1
            if p.admit(f"s{knocks}").admitted:
                due[f"s{knocks}"] = (now, p.next_frame_ms())
        for name, (when, interval) in due.items():
            if name not in inflight and now >= when - 1e-9:
                inflight[name] = (now, interval)
                queue.append(name)
        if now >= next_pass - 1e-9 and queue:
            taken, queue[:] = queue[:batch], queue[batch:]
            next_pass = answered_at = now + pass_s
            for name in taken:
                sent, interval = inflight.pop(name)
                age = answered_at - sent
                p.answered(answered_at, age, interval, False)
                told = p.next_frame_ms()
                due[name] = (max(sent + told / 1000, answered_at), told)  # not before the answer comes
                if now > 10:  # once it has had 10 s to learn
                    worst = max(worst, told / 1000 + age)
    admitted = len(p.sessions)
    # At most what was answered fresh over the headroom: admission never promises past 20 frames/s.
    assert 15 <= p.capacity <= 20 / 0.8 + 1e-6, p.capacity
    assert (admitted + 1) * 1.5 > p.capacity * 0.8  # the last phones were refused because they did not fit
    assert 8 <= admitted <= 13 and knocks > admitted
    assert worst < 1.5, worst


def test_admitted_sessions_are_never_closed_when_the_capacity_falls():
    p = pacer(capacity_start=20.0)
    for index in range(10):
        assert p.admit(f"s{index}").admitted
    before = p.next_frame_ms()
    end = feed(p, 0.0, rate=2.0, seconds=8.0, age_s=3.0, interval_ms=before)  # the engine slowed down
    assert closing(p, end, 3.0, before, False).verdict == "saturated"
    assert p.capacity == pytest.approx(2.0)
    assert len(p.sessions) == 10  # nobody is put out; each is paced slower instead
    assert p.next_frame_ms() == 5000 > before
    assert not p.admit("eleventh").admitted


def test_an_engine_busy_a_small_share_of_the_window_extrapolates_the_capacity_at_once():
    from app.web.pacing import EXTRAPOLATION_SAFETY, MAX_EXTRAPOLATION

    p = pacer()
    for i in range(4):
        assert p.admit(f"s{i}").admitted
    # Four cameras at 2 fps, answered fresh, the engine busy 10 % of the time: 8 fps seen, so about
    # 8 / 0.1 x 0.7 = 56 it could do, capped at 4 x 8 = 32.
    start, busy = 0.0, 0.0
    for index in range(round(8 * RULES.window_s)):
        busy += 1000 * 0.1 / 8  # 12.5 ms of engine time an answer
        assert p.answered(start + index / 8, 0.1, 500, False, busy_ms=busy) is None
    window = p.answered(RULES.window_s, 0.1, 500, False, busy_ms=busy + 12.5)
    assert window is not None and window.verdict == "extrapolated"
    assert window.capacity == pytest.approx(min(8 / 0.1 * EXTRAPOLATION_SAFETY, 8 * MAX_EXTRAPOLATION), rel=0.1)
    assert p.measured and p.pace >= p.capacity
    # Now (n + 1) x 1.5 <= 32 x 0.8: 17 sessions fit, where the prior admitted 4.
    assert all(p.admit(f"t{i}").admitted for i in range(13)) and not p.admit("one more").admitted


def test_without_busy_time_nothing_is_extrapolated():
    p = pacer()
    p.admit("s0")
    for index in range(round(8 * RULES.window_s)):
        p.answered(index / 8, 0.1, 500, False)
    window = p.answered(RULES.window_s, 0.1, 500, False)
    assert window is not None and window.verdict != "extrapolated"


def test_the_engines_start_up_frame_rate_raises_the_prior_until_a_window_measures():
    p = pacer()
    assert not p.start_from(6.0) and p.capacity == 8.0  # below the prior: the prior stands
    assert p.start_from(40.0) and p.capacity == p.pace == 40.0 and not p.measured
    # (n + 1) x 1.5 <= 40 x 0.8 = 32: twenty-one sessions at open, with no window measured.
    assert p.admissible() == 21
    assert all(p.admit(f"s{i}").admitted for i in range(21)) and not p.admit("s21").admitted
    measured = pacer()
    end = feed(measured, 0.0, 5.0, 2.0, age_s=1.0, interval_ms=500)  # engine-bound: saturated at 5/s
    closing(measured, end, 1.0, 500)
    assert measured.measured and not measured.start_from(40.0)  # a measurement outranks the start-up's
