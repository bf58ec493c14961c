"""bench/compare_served.py: two bench_gpu_served runs' figures side by side, with the second's ratio
to the first; what a run lacks shows as "-", never as a number."""

from __future__ import annotations

import json
import math

import pytest

from bench import compare_served

MEMORY = ("GPU memory 79.2 GiB: weights 47.4 GiB, graphs 1.2 GiB, KV store 23.0 GiB (states up to 131072 tokens), "
          "3.1 GiB free")


def run(rate: float, weights_line: str = MEMORY, walk_p50: float = 430.0) -> dict:
    """A bench_gpu_served result with one row of each kind and one timed workload."""
    return {
        "date": "2026-12-07T00:00:00+00:00", "model": "random", "command": "python bench/bench_gpu_served.py",
        "machine": {"device": "NVIDIA H100 80GB HBM3"},
        "startup": {"ready_s": 70.0, "memory": weights_line, "health": {"max_sessions": 62}},
        "rows": [
            {"row": "b", "name": "one sheet (the ticket)", "kind": "rest", "clients": 32,
             "served": {"per_s": rate, "p50_ms": 145.0, "p95_ms": 246.0}, "twin": {"per_s": rate + 6}},
            {"row": "c", "name": "walk frames", "kind": "rest", "clients": 16,
             "served": {"per_s": 0.0, "p50_ms": walk_p50, "p95_ms": walk_p50}, "twin": {"per_s": 40.0}},
            {"row": "e", "name": "cameras at 2 fps", "kind": "camera_open", "clients": 64,
             "served": {"admitted": 21, "answers_per_s_per_session": 2.02, "age": {"p95_ms": 476.0},
                        "fresh_share": 1.0}},
            {"row": "f", "name": "steady", "kind": "steady", "clients": 21,
             "phases": {"steady beside the heavy clients": {"p99_ms": 508.0}}, "burst": {"answered": 23, "sent": 27}},
        ],
        "stages": [{"workload": "ticket", "clients": 32,
                    "stages": {"flat.step": {"ms_a_call": 98.3}, "flat.turn.forward": {"ms_a_call": 84.0}}}],
    }


def test_figures_read_every_kind_of_row_the_memory_line_and_the_stages():
    found = compare_served.figures(run(202.2))
    assert found["start-up to ready, s"] == 70.0 and found["camera sessions at most (/health)"] == 62
    assert (found["weights GiB"], found["KV store GiB"], found["longest state, tokens"]) == (47.4, 23.0, 131072)
    assert found["(b) one sheet (the ticket), 32 clients: served /s"] == 202.2
    assert found["(b) one sheet (the ticket), 32 clients: in-process /s"] == pytest.approx(208.2)
    assert found["(e) 64 cameras at 2 fps: admitted"] == 21
    assert found["(e) 64 cameras at 2 fps: age p95 ms"] == 476.0
    assert found["(f) steady client beside heavy requests: p99 ms"] == 508.0
    assert (found["(f) heavy requests answered"], found["(f) heavy requests sent"]) == (23, 27)
    assert found["stages, ticket x 32: its forward, ms"] == 84.0
    assert "stages, ticket x 32: vision, ms" not in found  # not timed in that workload


def test_what_a_run_lacks_is_none_not_a_number():
    found = compare_served.figures(run(202.2, weights_line="", walk_p50=math.nan))
    assert found["weights GiB"] is None and found["KV store GiB"] is None
    assert found["(c) walk frames, 16 clients: p50 ms"] is None  # NaN: the row answered nothing
    assert compare_served.figures({})["start-up to ready, s"] is None


def test_the_table_sets_the_second_run_beside_the_first_with_its_ratio():
    second = run(330.0, MEMORY.replace("weights 47.4", "weights 25.1"))
    second["rows"].append({"row": "a", "name": "own sheet", "kind": "rest", "clients": 32,
                           "served": {"per_s": 60.0, "p50_ms": 500.0, "p95_ms": 600.0}, "twin": {}})
    text = compare_served.table(run(200.0), second, ["bf16", "fp8"])
    lines = text.splitlines()
    assert lines[0] == "| figure | bf16 | fp8 | fp8 / bf16 |"
    assert "| (b) one sheet (the ticket), 32 clients: served /s | 200 | 330 | 1.65x |" in lines
    assert "| weights GiB | 47.4 | 25.1 | 0.53x |" in lines
    assert "| (c) walk frames, 16 clients: served /s | 0 | 0 | - |" in lines  # no ratio to zero
    assert "| (a) own sheet, 32 clients: served /s | - | 60 | - |" in lines  # only the second has it
    assert lines.index("| (a) own sheet, 32 clients: served /s | - | 60 | - |") == len(lines) - 4  # after the first's
    assert "| (a) own sheet, 32 clients: in-process /s | - | - | - |" in lines


def test_the_command_writes_the_table_and_refuses_bad_input(tmp_path, capsys):
    first, second = tmp_path / "bf16.json", tmp_path / "fp8.json"
    first.write_text(json.dumps(run(200.0)))
    second.write_text(json.dumps(run(330.0)))
    out = tmp_path / "ab.md"
    compare_served.main([str(first), str(second), "--out", str(out)])
    text = out.read_text()
    assert text.startswith("## bench_gpu_served A/B: bf16 and fp8")
    assert "- fp8: 2026-12-07T00:00:00+00:00, random, NVIDIA H100 80GB HBM3" in text and "1.65x" in text
    assert capsys.readouterr().out.strip() == text.strip()
    for bad in ([str(first), str(second), "--labels", "bf16"], [str(first), str(tmp_path / "missing.json")]):
        with pytest.raises(SystemExit):
            compare_served.main(bad)
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(SystemExit):
        compare_served.main([str(first), str(broken)])
    assert "not a readable bench_gpu_served JSON" in capsys.readouterr().err
