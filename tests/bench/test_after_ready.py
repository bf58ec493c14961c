"""What the benches say about the engine beside their figures: what the start-up built and what was
built after ready (bench/common.py, bench/server.py, the bench server's `/bench/compile-counts`), and
the served bench's check that every row gives its KV blocks back (bench/bench_gpu_served.py
`kv_blocks_used`, `BlocksCheck`)."""

from __future__ import annotations

from types import SimpleNamespace

from starlette.applications import Starlette
from starlette.testclient import TestClient

from bench import bench_gpu_served
from bench.bench_gpu_served import KV_GAUGE, BlocksCheck, kv_blocks_used
from bench.common import (
    AFTER_READY,
    after_ready,
    after_ready_lines,
    after_ready_metrics,
    compile_counts_line,
    named_compile_counts,
)
from bench.served_load import bench_routes
from bench.server import compile_report_lines, engine_of

HF = 'djev_info{device="cpu",engine="hf",model="tiny",tiny="true"}'


def test_the_benches_name_the_counters_the_reader_keeps():
    from app.engine.hf.reader import AFTER_READY as READER

    assert AFTER_READY == READER


def test_the_after_ready_counters_are_read_from_stats_or_metrics_and_missing_ones_are_none():
    assert after_ready({"captures_after_ready": 0, "recompiles_after_ready": 2, "triton_compiles_after_ready": 0}) == {
        "captures_after_ready": 0.0, "recompiles_after_ready": 2.0, "triton_compiles_after_ready": 0.0}
    # /metrics: as counters (`_total`), or as the gauges a name ending in `_ready` makes today
    series = {"djev_hf_captures_after_ready_total": 1.0, "djev_hf_recompiles_after_ready": 0.0,
              "djev_hf_captures_after_ready_ms_total": 40.0}
    assert after_ready_metrics(series) == {
        "captures_after_ready": 1.0, "recompiles_after_ready": 0.0, "triton_compiles_after_ready": None}


def test_zero_after_ready_is_one_line_and_anything_else_a_warning_naming_it():
    zeros = dict.fromkeys(AFTER_READY, 0.0)
    (line,) = after_ready_lines(zeros, "at the end")
    assert "captures_after_ready 0" in line and "each must be 0" in line and "WARNING" not in line
    lines = after_ready_lines({**zeros, "recompiles_after_ready": 3.0, "triton_compiles_after_ready": 1.0}, "at the end")
    assert len(lines) == 2 and lines[1].startswith("WARNING: at the end: built after ready: ")
    assert "recompiles_after_ready = 3" in lines[1] and "triton_compiles_after_ready = 1" in lines[1]
    assert "captures_after_ready" not in lines[1]
    assert "not reported" in after_ready_lines({**zeros, "captures_after_ready": None}, "x")[0]


def test_the_compile_counts_are_named_and_said():
    counts = named_compile_counts((12, 3, 40))
    assert compile_counts_line(counts, "at ready") == (
        "at ready: 12 CUDA graphs captured, 3 torch.compile graphs, 40 Triton kernels compiled")
    report = {"engine": "hf", "counts": counts, "graphs_built": {"flat": 12.0}, "after_ready": {}}
    assert compile_report_lines(report, "served")[1] == "served: graphs captured by kind (/metrics " \
        "*_graphs_built_total): flat 12"
    assert "not reported" in compile_report_lines({**report, "counts": None}, "served")[0]


def test_the_bench_server_says_the_readers_compile_counts():
    runner = SimpleNamespace(images=SimpleNamespace(graphs=None),
                             flat=SimpleNamespace(forward=SimpleNamespace(graphs=SimpleNamespace(captures=5))))
    reader = SimpleNamespace(runner=runner, stats={"captures_after_ready": 0, "recompiles_after_ready": 0,
                                                   "triton_compiles_after_ready": 0})
    app = Starlette(routes=bench_routes())
    app.state.services = SimpleNamespace(reader=reader)
    body = TestClient(app).get("/bench/compile-counts").json()
    assert body["counts"]["cuda_graphs_captured"] == 5 and set(body["counts"]) == {
        "cuda_graphs_captured", "torch_compile_graphs", "triton_kernels_compiled"}
    assert body["after_ready"] == dict.fromkeys(AFTER_READY, 0.0)
    app.state.services = SimpleNamespace(reader=SimpleNamespace())
    assert TestClient(app).get("/bench/compile-counts").status_code == 400


# ---------------------------------------------------------------------------------------- KV blocks


def test_the_blocks_in_use_come_from_the_hf_engines_gauge_and_are_none_elsewhere():
    assert engine_of({HF: 1.0}) == "hf"
    assert kv_blocks_used({HF: 1.0, KV_GAUGE: 7.0}) == (7.0, "")
    assert kv_blocks_used({HF: 1.0, "djev_hf_flat_turn_count_total": 0.0}) == (0.0, "")  # no turn yet
    assert kv_blocks_used({HF: 1.0}) == (0.0, "")  # (nor the turns' count: none exported yet)
    used, why = kv_blocks_used({HF: 1.0, "djev_hf_flat_turn_count_total": 4.0})
    assert used is None and "missing" in why
    used, why = kv_blocks_used({'djev_info{engine="vllm"}': 1.0})
    assert used is None and "vllm" in why
    assert kv_blocks_used({}) == (None, "/metrics did not answer")


def scripted_metrics(monkeypatch, readings: list[dict[str, float]]) -> list[dict[str, float]]:
    """/metrics answers the readings in turn (the last one again once they run out)."""
    seen: list[dict[str, float]] = []

    def read(url: str, timeout: float = 10.0) -> dict[str, float]:
        seen.append(readings[min(len(seen), len(readings) - 1)])
        return seen[-1]

    monkeypatch.setattr(bench_gpu_served, "read_metrics", read)
    return seen


def check(notes: list[str]) -> BlocksCheck:
    return BlocksCheck(SimpleNamespace(url="http://127.0.0.1:1"), notes, settle_s=1.0)  # type: ignore[arg-type]


def test_the_resting_count_is_read_once_the_server_is_idle(monkeypatch):
    busy = {HF: 1.0, KV_GAUGE: 9.0, "djev_in_flight": 2.0}
    seen = scripted_metrics(monkeypatch, [busy, {**busy, "djev_queue_depth": 1.0, "djev_in_flight": 0.0},
                                          {HF: 1.0, KV_GAUGE: 3.0, "djev_in_flight": 0.0, "djev_queue_depth": 0.0}])
    assert check([]).resting() == 3.0 and len(seen) == 3


def test_a_row_whose_blocks_come_back_records_both_counts_and_says_nothing(monkeypatch, capsys):
    seen = scripted_metrics(monkeypatch, [{HF: 1.0, KV_GAUGE: 12.0}, {HF: 1.0, KV_GAUGE: 4.0}])
    notes: list[str] = []
    assert check(notes).settled("row (b)", 4.0) == {"blocks_used_before": 4.0, "blocks_used_after": 4.0}
    assert len(seen) == 2 and notes == [] and "NOT BACK" not in capsys.readouterr().out


def test_a_row_whose_blocks_stay_in_use_says_so_after_waiting(monkeypatch, capsys):
    scripted_metrics(monkeypatch, [{HF: 1.0, KV_GAUGE: 12.0}])
    notes: list[str] = []
    assert check(notes).settled("row (b) one sheet", 4.0) == {"blocks_used_before": 4.0, "blocks_used_after": 12.0}
    assert len(notes) == 1 and notes[0].startswith("KV BLOCKS NOT BACK after row (b) one sheet: 12 blocks in use")
    assert "(the server idle)" in notes[0]
    assert "KV BLOCKS NOT BACK" in capsys.readouterr().out


def test_a_row_that_leaves_work_running_says_so_beside_its_blocks(monkeypatch):
    scripted_metrics(monkeypatch, [{HF: 1.0, KV_GAUGE: 12.0, "djev_in_flight": 1.0}])
    notes: list[str] = []
    assert check(notes).settled("row (f)", 4.0)["blocks_used_after"] == 12.0
    assert "(1 decision(s) still in flight, 0 queued)" in notes[0]


def test_without_a_gauge_the_rows_record_none_and_it_is_said_once(monkeypatch, capsys):
    scripted_metrics(monkeypatch, [{'djev_info{engine="vllm"}': 1.0}])
    notes: list[str] = []
    blocks = check(notes)
    for _ in range(3):
        resting = blocks.resting()
        assert blocks.settled("a row", resting) == {"blocks_used_before": None, "blocks_used_after": None}
    assert len(notes) == 1 and "vllm" in notes[0] and "None" in notes[0]
    assert capsys.readouterr().out.count("KV blocks not checked") == 1


def test_before_the_first_engine_turn_the_store_rests_at_zero(monkeypatch):
    first = {HF: 1.0, "djev_hf_flat_turn_count_total": 0.0}
    scripted_metrics(monkeypatch, [first, {HF: 1.0, KV_GAUGE: 0.0, "djev_hf_flat_turn_count_total": 3.0}])
    blocks = check([])
    resting = blocks.resting()
    assert resting == 0.0
    assert blocks.settled("row (a)", resting) == {"blocks_used_before": 0.0, "blocks_used_after": 0.0}
