"""The GPU benches' `--tiny` smoke runs: each script runs end to end on the tiny model's config on the
CPU, so a bench that no longer matches the code it measures fails here rather than on a borrowed GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def run_bench(script: str, *args: str, out: Path, env: dict[str, str] | None = None) -> dict:
    completed = subprocess.run(
        [sys.executable, str(REPO / "bench" / script), "--tiny", "--device", "cpu", *args],
        cwd=REPO, capture_output=True, text=True, timeout=600, env={**os.environ, "OUT": str(out), **(env or {})},
    )
    assert completed.returncode == 0, completed.stdout[-2000:] + completed.stderr[-4000:]
    return {"stdout": completed.stdout}


NOTHING_AFTER_READY = {"captures_after_ready": 0.0, "recompiles_after_ready": 0.0, "triton_compiles_after_ready": 0.0}


def said_nothing_built_after_ready(stdout: str) -> bool:
    """The bench printed its after-ready counters, and no WARNING about them."""
    lines = stdout.splitlines()
    return any("built after ready: captures_after_ready 0, recompiles_after_ready 0, triton_compiles_after_ready 0"
               in line for line in lines) and not any("WARNING" in line and "after ready" in line for line in lines)


@pytest.mark.timeout(600)
def test_bench_gpu_tiny_runs(tmp_path):
    result = run_bench("bench_gpu.py", "--reps", "2", "--warmup", "1", "--out", str(tmp_path / "bench_gpu.json"),
                       out=tmp_path)
    data = json.loads((tmp_path / "bench_gpu.json").read_text())
    assert data and "|" in result["stdout"]  # a markdown table was printed
    cases = {case["case"]: case for case in data["cases"]}
    assert len(cases) == 6 and all(case["turns_per_call"] >= 1 for case in cases.values())
    # A new prompt is written whole every call; a repeated one comes from the KV store (its last partial block again).
    assert cases["(a) one read, new prompt [eager]"]["prompt_tokens_per_call"] == 300
    assert cases["(b) one read, prompt KV cached [eager]"]["prompt_tokens_per_call"] < 16
    assert data["readers"]["eager"]["at_end"] == data["readers"]["eager"]["at_ready"]  # nothing built by the cases


@pytest.mark.timeout(600)
def test_bench_gpu_decisions_tiny_runs(tmp_path):
    result = run_bench("bench_gpu_decisions.py", "--seconds", "1", "--reps", "2", "--no-grids", "--levels", "1,4",
                       "--think", "16", "--think-reps", "1", "--out", str(tmp_path / "bench_gpu_decisions.json"),
                       out=tmp_path)
    data = json.loads((tmp_path / "bench_gpu_decisions.json").read_text())
    assert data and "|" in result["stdout"] and data["unique"]["p50_ms"] > 0
    assert data["settings"]["turn_tokens"] == 2048 and data["cuda_graphs"] is None  # the CPU's budget, no graphs
    # Each level's engine turns, timed in the reader's loop.
    assert all(point["timeline"]["turns"] > 0 and point["prompt_tokens_per_request"] > 0 for point in data["curve"])
    assert "engine turns at each level" in result["stdout"]
    # The reader djev serve builds (hf_reader), what it built by ready, and nothing after.
    assert set(data["compile_counts_at_ready"]) == {"cuda_graphs_captured", "torch_compile_graphs",
                                                    "triton_kernels_compiled"}
    assert "at ready: 0 CUDA graphs captured" in result["stdout"]
    assert data["after_ready"] == NOTHING_AFTER_READY and said_nothing_built_after_ready(result["stdout"])


@pytest.mark.timeout(300)
def test_bench_gpu_decisions_turnaround_answers_every_read_at_once(tmp_path):
    run_bench("bench_gpu_decisions.py", "--turnaround", "--levels", "1,2", "--seconds", "1", out=tmp_path)
    points = json.loads((tmp_path / "bench_gpu_decisions.json").read_text())["turnaround"]
    assert [point["clients"] for point in points] == [1, 2]
    for point in points:  # every level's turns answered at once: no prompt ever written
        assert point["requests"] > 0 and point["ms_a_decision"] > 0 and point["timeline"]["turns"] > 0
        assert point["prompt_tokens_per_request"] == 0


@pytest.mark.timeout(300)
def test_bench_gpu_served_tiny_runs(tmp_path):
    from PIL import Image

    result = run_bench("bench_gpu_served.py", "--seconds", "1", "--workers", "4", "--sheet-clients", "2",
                       "--ticket-clients", "2", "--walk-clients", "2", "--closed-cameras", "1", "--open-cameras", "1,2",
                       "--heavy-tokens", "1000", "--heavy-timeout", "20", "--deadline", "150", "--restart", out=tmp_path)
    data = json.loads((tmp_path / "bench_gpu_served.json").read_text())
    assert [row["row"] for row in data["rows"]] == ["a", "b", "c", "d", "e", "e", "f"], data["notes"]
    assert data["startup"]["ready_s"] > 0 and data["restart"]["ready_s"] > 0
    assert {run["workload"] for run in data["stages"]} == {"walk", "ticket"}
    assert all(row["engine"] for row in data["rows"] if row["row"] in "abc")  # the engine's work, by row
    assert any(row.get("served", {}).get("requests", 0) > 0 for row in data["rows"])
    assert all("twin" in row for row in data["rows"] if row["row"] != "f")
    assert (tmp_path / "bench_gpu_served.md").read_text().count("|") > 20
    assert "| (b) one sheet (the ticket) | 2 |" in result["stdout"]
    assert Image.open(tmp_path / "camera_curve.png").format == "PNG"
    # What the server built by ready, nothing after; each row's KV blocks in use read before and after it.
    assert data["compile_counts_at_ready"]["counts"]["cuda_graphs_captured"] == 0
    assert "the server at ready: 0 CUDA graphs captured" in result["stdout"]
    assert data["after_ready"] == NOTHING_AFTER_READY and said_nothing_built_after_ready(result["stdout"])
    assert all(row["blocks_used_before"] is not None and row["blocks_used_after"] is not None for row in data["rows"])
    assert not any("KV blocks not checked" in note for note in data["notes"])
    assert data["settings"]["turn_tokens"] == 0  # the server's: by the device
    assert data["rows"][-1]["heavy_timeout_s"] == 20.0  # --heavy-timeout as given, never cut by --deadline
    # Nothing left behind: the server's process group and the client processes are gone.
    with pytest.raises(ProcessLookupError):
        os.killpg(data["server_pid"], 0)
    for pid in data["client_pids"]:
        assert not Path(f"/proc/{pid}").exists()


@pytest.mark.timeout(300)
def test_bench_gpu_served_gives_every_rows_kv_blocks_back(tmp_path):
    result = run_bench("bench_gpu_served.py", "--seconds", "1", "--workers", "2", "--rows", "b,c,f",
                       "--ticket-clients", "2", "--walk-clients", "2", "--heavy-tokens", "1000", "--heavy-timeout", "20",
                       "--no-stages", "--deadline", "120", out=tmp_path)
    data = json.loads((tmp_path / "bench_gpu_served.json").read_text())
    assert [row["row"] for row in data["rows"]] == ["b", "c", "f"], data["notes"]
    for row in data["rows"]:  # read before each row, idle; back to it after
        assert row["blocks_used_before"] is not None and row["blocks_used_after"] is not None, row["row"]
        assert row["blocks_used_after"] <= row["blocks_used_before"], (row["row"], data["notes"])
    assert "KV BLOCKS NOT BACK" not in result["stdout"] and "the KV store's blocks in use" in result["stdout"]
    assert data["after_ready"] == NOTHING_AFTER_READY and said_nothing_built_after_ready(result["stdout"])


@pytest.mark.timeout(300)
def test_bench_gpu_served_runs_each_row_at_each_switch_interval_gather_cap_and_headroom(tmp_path):
    run_bench("bench_gpu_served.py", "--seconds", "1", "--workers", "2", "--sheet-clients", ",", "--ticket-clients", "2",
              "--walk-clients", ",", "--closed-cameras", ",", "--open-cameras", "2", "--no-steady", "--no-stages",
              "--switch-intervals", "5,0.2", "--gather-rows", "0,2", "--session-headroom", "0.5,1",
              "--deadline", "200", out=tmp_path)
    data = json.loads((tmp_path / "bench_gpu_served.json").read_text())
    knobs = [(switch, rows, share) for switch in (5.0, 0.2) for rows in (0, 2) for share in (0.5, 1.0)]
    assert [(row["row"], row["switch_ms"], row["gather_rows"], row["headroom"]) for row in data["rows"]] == [
        (key, *knob) for key in "be" for knob in knobs], data["notes"]
    assert all(row["name"].endswith(f"switch interval {row['switch_ms']:g} ms, gather rows {row['gather_rows']}, "
                                    f"headroom {row['headroom']:g}") for row in data["rows"])
    assert all(row["served"]["requests"] > 0 for row in data["rows"] if row["row"] == "b")
    # A camera row of 1 s on 2 busy cores may end before its first answer: the rows ran, and those
    # answered report their age with the pacing added.
    answered = [row["served"] for row in data["rows"] if row["row"] == "e" and row["served"]["answers"] > 0]
    assert answered and all(served["age_plus_next"]["p95_ms"] >= served["age"]["p95_ms"] for served in answered)
    assert "| 2 (switch ms 5, gather rows 0, headroom 0.5) |" in (tmp_path / "bench_gpu_served.md").read_text()


@pytest.mark.timeout(600)
def test_bench_gpu_long_tiny_runs(tmp_path):
    result = run_bench("bench_gpu_long.py", "--sizes", "200,900", "--prefill-chunk", "256", "--out-dir", str(tmp_path),
                       out=tmp_path)
    data = json.loads((tmp_path / "bench_gpu_long.json").read_text())
    rows = data["in_process"]["rows"]
    assert [row["size"] for row in rows] == [200, 900] and rows[1]["chunks"] >= 3  # 900 tokens in 256s
    assert all(row["warm_reads"] == 5 and row["warm_max_s"] >= row["warm_s"] for row in rows)
    assert all(row["statuses"] == [200, 200] for row in data["served"]["rows"])
    assert "|" in result["stdout"] and (tmp_path / "bench_gpu_long.md").exists()
    # What the start-up built (the reader hf_reader made, and the server's), nothing after, in both runs.
    assert set(data["in_process"]["compile_counts_at_ready"]) == {"cuda_graphs_captured", "torch_compile_graphs",
                                                                  "triton_kernels_compiled"}
    assert data["served"]["compile_counts_at_ready"]["counts"] is not None
    assert data["in_process"]["after_ready"] == NOTHING_AFTER_READY == data["served"]["after_ready"]
    assert all(row["captures_after_ready"] == 0 and row["recompiles_after_ready"] == 0 for row in rows)
    assert "in process at the end, built after ready" in result["stdout"] and said_nothing_built_after_ready(result["stdout"])


@pytest.mark.timeout(300)
def test_probe_gpu_vision_tiny_runs(tmp_path):
    result = run_bench("probe_gpu_vision.py", "--repeats", "1", "--out", str(tmp_path / "vision.json"), out=tmp_path)
    data = json.loads((tmp_path / "vision.json").read_text())
    assert [(row["layers"], row["kernel_first"]) for row in data["rows"]] == [
        ("eager", "cudnn"), ("eager", "efficient"), ("compiled", "cudnn"), ("compiled", "efficient")]
    assert all(row[f"ms_{count}"] > 0 for row in data["rows"] for count in (1, 4, 8))
    assert all(row["attention_seen"] for row in data["rows"])  # the profiler named the attention it ran
    assert data["real_patches"] > 0 and not data["graphed"]
    assert "| compiled | cudnn |" in result["stdout"]


@pytest.mark.timeout(300)
def test_profile_gpu_tiny_runs(tmp_path):
    result = run_bench("profile_gpu.py", "--levels", "1,2", "--modes", "eager", "--top", "5", out=tmp_path)
    data = json.loads((tmp_path / "profile_gpu.json").read_text())
    turns = {(turn["mode"], turn["workload"], turn["level"]): turn for turn in data["turns"]}
    assert list(turns) == [("eager", workload, level) for workload in ("ticket", "walk") for level in (1, 2)]
    assert list(data["modes"]) == ["eager"] and "eager" in data["modes"]["eager"]
    families = {"vision tower", "slot reads", "router and sort", "experts", "attention", "norms and rotary",
                "dense projections", "copies", "other", "host between kernels"}
    for (_, workload, level), turn in turns.items():
        assert turn["reads"] == turn["of_reads"] == level and turn["prompt_tokens"] > 0 and turn["canvases"] == level
        assert set(turn["families"]) == families
        for name in ("attention", "dense projections", "slot reads", "router and sort", "norms and rotary"):
            assert turn["families"][name]["ms"] > 0, (workload, level, name)
        # Only the walk's turns run the vision tower (each frame new).
        assert (turn["families"]["vision tower"]["ms"] > 0) == (workload == "walk")
        kernels = sum(entry["ms"] for name, entry in turn["families"].items() if name != "host between kernels")
        assert abs(kernels - turn["kernels_ms"]) < 0.1 and 0 < turn["busy_ms"] <= turn["wall_ms"] + 0.1
        assert turn["families"]["host between kernels"]["ms"] == pytest.approx(turn["wall_ms"] - turn["busy_ms"], abs=0.01)
        floor = turn["floor"]
        assert floor["tokens"] == turn["prompt_tokens"] + turn["canvas_tokens"] and floor["floor_ms"] > 0
        assert turn["over_floor"] == round(turn["busy_ms"] / floor["floor_ms"], 2)
        assert len(turn["top"]) == 5
    assert "| op family |" in result["stdout"] and result["stdout"].count("x the floor") == 4
    assert "| mode | workload | requests |" in result["stdout"]
    assert "still referenced" not in result["stdout"]  # the reader's model was given back after its mode


@pytest.mark.timeout(300)
def test_bench_overhead_runs(tmp_path):
    """The server-overhead bench end to end: its server child, its client processes, its table."""
    out = tmp_path / "overhead.json"
    completed = subprocess.run(
        [sys.executable, str(REPO / "bench" / "bench_overhead.py"), "--clients", "2", "--processes", "1",
         "--seconds", "1.5", "--json", str(out)], cwd=REPO, capture_output=True, text=True, timeout=280)
    assert completed.returncode == 0, completed.stdout[-2000:] + completed.stderr[-4000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert row["clients"] == 2 and row["answered"] > 0 and row["loop_ms_per_request"] > 0
    assert "event loop CPU / request" in completed.stdout
