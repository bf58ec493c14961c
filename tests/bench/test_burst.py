"""The served bench's burst (bench/bench_gpu_served.py row f): every heavy kind sent, --heavy-copies of
each, beside the steady client; heavy requests wait long enough to be answered and the steady client
sends on until they are; the report says per kind how each request ended, and whether the burst was
answered in full."""

from __future__ import annotations

import asyncio
from collections import Counter
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from bench.bench_gpu_served import (
    burst_line,
    burst_summary,
    heavy_assignment,
    heavy_summary,
    heavy_wait_s,
    parse_args,
    plan,
    report,
    worker_specs,
)
from bench.served_load import HEAVY_KINDS, Tally, heavy_client, steady_client

# ---------------------------------------------------------------------------------------- who sends what


@pytest.mark.parametrize("workers", [2, 3, 4, 8])
def test_every_heavy_kind_goes_copies_times_and_the_steady_client_has_process_0_to_itself(workers):
    heavy = heavy_assignment(HEAVY_KINDS, 4, workers)
    assert len(heavy) == workers and heavy[0] == []
    assert Counter(kind for share in heavy for kind in share) == {kind: 4 for kind in HEAVY_KINDS}
    sizes = [len(share) for share in heavy[1:]]
    assert max(sizes) - min(sizes) <= 1  # dealt evenly over the heavy processes
    for kind in HEAVY_KINDS:  # a kind's copies on as many processes as there are for them
        assert len({index for index, share in enumerate(heavy) if kind in share}) == min(4, workers - 1)


def test_every_heavy_kind_goes_whatever_the_number_of_processes():
    assert heavy_assignment(HEAVY_KINDS, 2, 1) == [[*HEAVY_KINDS, *HEAVY_KINDS]]  # beside the steady client
    assert heavy_assignment(HEAVY_KINDS, 1, 16)[1:6] == [[kind] for kind in HEAVY_KINDS]  # more processes than kinds


def test_the_steady_rows_specs_carry_the_copies_and_the_heavy_timeout():
    args = parse_args(["--tiny", "--device", "cpu", "--workers", "3", "--heavy-copies", "2", "--rows", "f"])
    (row,) = plan(args)
    assert row.key == "f" and row.clients == 1 + 2 * len(HEAVY_KINDS)
    specs = worker_specs(row, 7, args, "http://127.0.0.1:1", "", 42.0)
    assert [spec["steady"] for spec in specs] == [True, False, False]
    assert sum(spec["clients"] for spec in specs) == row.clients
    assert Counter(kind for spec in specs for kind in spec["heavy"]) == {kind: 2 for kind in HEAVY_KINDS}
    assert all(spec["heavy_timeout_s"] == 42.0 and spec["alone_s"] == args.seconds / 5 for spec in specs)


# ---------------------------------------------------------------------------------------- how long they wait


def test_the_heavy_timeout_defaults_to_120_s_on_every_device():
    gpu = parse_args(["--device", "cuda"])
    assert (gpu.heavy_copies, gpu.heavy_timeout) == (4, 120.0)
    tiny = parse_args(["--tiny", "--device", "cpu"])
    assert (tiny.heavy_copies, tiny.heavy_timeout) == (1, 120.0)
    given = parse_args(["--tiny", "--device", "cpu", "--heavy-copies", "3", "--heavy-timeout", "12.5"])
    assert (given.heavy_copies, given.heavy_timeout) == (3, 12.5)
    for flags in (["--heavy-copies", "0"], ["--heavy-timeout", "0"], ["--heavy-timeout", "-1"]):
        with pytest.raises(SystemExit):
            parse_args(["--tiny", "--device", "cpu", *flags])


def test_the_heavy_timeout_is_never_cut_by_the_deadline_the_run_waits_past_it_instead():
    """An A/B of two settings waits alike: the run may go past --deadline by row (f)'s wait (with the
    clients' grace), and only where row (f) runs."""
    from bench import bench_gpu_served

    args = parse_args(["--tiny", "--device", "cpu", "--deadline", "30", "--heavy-timeout", "120"])
    assert heavy_wait_s(args) == 120.0 + 3.0 + 5.0
    assert heavy_wait_s(parse_args(["--tiny", "--device", "cpu", "--no-steady"])) == 0.0
    assert heavy_wait_s(parse_args(["--tiny", "--device", "cpu", "--rows", "a,b"])) == 0.0
    assert not hasattr(bench_gpu_served, "heavy_timeout_s")  # nothing cuts it any more


# ---------------------------------------------------------------------------------------- the clients


class FakeClient:
    """Answers a ticket in 10 ms and a request with a think budget in `think_s`, or raises httpx's
    ReadTimeout once the call's timeout has passed."""

    def __init__(self, think_s: float) -> None:
        self.think_s = think_s

    async def post(self, path: str, json: dict[str, Any], timeout: float) -> Any:
        delay = self.think_s if "think" in json else 0.01
        await asyncio.sleep(min(delay, timeout))
        if delay > timeout:
            raise httpx.ReadTimeout("no answer in time")
        return SimpleNamespace(status_code=200, text="")


def burst(think_s: float, timeout: float) -> tuple[dict[str, Tally], Tally, float]:
    """One steady client and one heavy "think" client: alone 50 ms, the row's seconds 200 ms; the
    tallies, the heavy client's, and when the steady client stopped (s from the start)."""

    async def run() -> tuple[dict[str, Tally], Tally, float]:
        client = FakeClient(think_s)
        left = [1]
        start = asyncio.get_running_loop().time()
        alone_until, end = start + 0.05, start + 0.2
        tallies = {"steady alone": Tally(), "steady beside the heavy clients": Tally()}
        heavy = Tally()

        def done() -> None:
            left[0] -= 1

        async def steady() -> float:
            await steady_client(client, start, alone_until, end, tallies, "s", lambda: left[0] > 0, end + timeout + 1)
            return asyncio.get_running_loop().time() - start

        params = {"state_tokens": 100, "think": 64}
        stopped, _ = await asyncio.gather(steady(), heavy_client(client, "think", params, alone_until, end, timeout,
                                                                  heavy, "h", done))
        assert left == [0]
        return tallies, heavy, stopped

    return asyncio.run(run())


def test_the_steady_client_sends_on_until_the_heavy_request_is_answered():
    tallies, heavy, stopped = burst(think_s=0.6, timeout=5.0)
    assert heavy.counts == {"sent": 1} and len(heavy.latencies) == 1 and heavy.errors == {}
    assert 0.6 <= heavy.latencies[0] < 1.0  # waited for past the row's 200 ms
    assert 0.64 <= stopped < 1.0  # the steady client stopped with the burst, not at the row's end
    assert tallies["steady alone"].latencies and len(tallies["steady beside the heavy clients"].latencies) > 20


def test_a_heavy_request_past_its_timeout_is_counted_timed_out_and_ends_the_wait():
    tallies, heavy, stopped = burst(think_s=2.0, timeout=0.3)
    assert heavy.counts == {"sent": 1} and heavy.errors == {"timeout": 1} and not heavy.latencies
    assert 0.34 <= stopped < 0.8
    summary = heavy_summary(heavy.as_dict())
    assert (summary["sent"], summary["answered"], summary["timed_out"], summary["refused"], summary["other"]) == (
        1, 0, 1, {}, 0)


# ---------------------------------------------------------------------------------------- the report


def tally(latencies: list[float], errors: dict[str, int], counts: dict[str, int]) -> dict[str, Any]:
    return {"latencies": latencies, "ages": [], "guards": [], "errors": errors, "counts": counts, "elapsed": 30.0}


def test_a_heavy_kinds_requests_are_answered_timed_out_refused_or_failed_otherwise():
    summary = heavy_summary(tally([1.0, 3.0], {"timeout": 2, "529": 1, "400": 1, "ConnectError": 1},
                                  {"sent": 8, "cancelled at the end": 1}))
    assert (summary["sent"], summary["answered"], summary["timed_out"], summary["other"]) == (8, 2, 2, 2)
    assert summary["refused"] == {"529": 1, "400": 1}
    assert summary["p50_ms"] == 2000.0 and summary["max_ms"] == 3000.0 and summary["requests"] == 2


def test_the_burst_is_answered_in_full_only_when_every_kind_went_and_every_request_was_answered():
    answered = {kind: heavy_summary(tally([1.0] * 4, {}, {"sent": 4})) for kind in HEAVY_KINDS}
    full = burst_summary(answered, HEAVY_KINDS)
    assert full["in_full"] and (full["sent"], full["answered"], full["kinds_not_sent"]) == (20, 20, [])
    assert burst_line(full, 120.0).startswith("the burst was answered in full: every heavy kind sent, 20 of 20")

    one_timed_out = {**answered, "think": heavy_summary(tally([1.0] * 3, {"timeout": 1}, {"sent": 4}))}
    short = burst_summary(one_timed_out, HEAVY_KINDS)
    assert not short["in_full"] and (short["answered"], short["timed_out"]) == (19, 1)
    line = burst_line(short, 120.0)
    assert line.startswith("the burst was NOT answered in full: 19 of 20") and "(client timeout 120 s);" in line

    missing = {kind: summary for kind, summary in answered.items() if kind != "long state"}
    unsent = burst_summary(missing, HEAVY_KINDS)
    assert not unsent["in_full"] and unsent["kinds_not_sent"] == ["long state"]
    assert burst_line(unsent, 120.0).endswith("kinds never sent: long state")
    assert not burst_summary({}, HEAVY_KINDS)["in_full"]


def test_the_report_shows_the_steady_phases_each_heavy_kind_and_the_burst_line():
    heavy = {kind: heavy_summary(tally([2.0], {"529": 1} if kind == "think" else {}, {"sent": 2 if kind == "think"
                                                                                    else 1})) for kind in HEAVY_KINDS}
    phases = {"steady alone": heavy_summary(tally([0.05] * 10, {}, {})),
              "steady beside the heavy clients": heavy_summary(tally([0.1] * 50 + [5.9], {}, {}))}
    point = {"row": "f", "name": "steady ticket client beside heavy requests", "kind": "steady", "clients": 6,
             "heavy_timeout_s": 300.0, "heavy_copies": 1, "phases": phases, "heavy": heavy,
             "burst": {**burst_summary(heavy, HEAVY_KINDS), "elapsed_s": 31.0}, "counters": {}, "engine": {}}
    results = {"startup": {}, "settings": {}, "rows": [point], "notes": [],
               "args": {"seconds": 10.0, "twin_seconds": 10.0, "workers": 4, "heavy_timeout": 300.0}}
    text = report(results)
    assert "| steady beside the heavy clients | 51 | 100 | " in text and "| 5900 |" in text
    assert "| think | 2 | 1 | 0 | 529: 1 | 2000 | 2000 | - |" in text
    assert "| long state | 1 | 1 | 0 | - | 2000 | 2000 | - |" in text
    assert "the burst was NOT answered in full: 5 of 6 heavy requests answered (client timeout 300 s); " \
           "0 timed out, 1 refused, 0 failed otherwise" in text
    assert "31.0 s in all" in text
