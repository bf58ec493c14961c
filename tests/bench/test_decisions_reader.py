"""bench/bench_gpu_decisions.py builds the reader `djev serve` builds (`hf_reader`), from its flags
turned into Settings, and only after the naive baseline has run on the model (hf_reader fuses the
experts and compiles the layers in place)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from app.config import Settings
from bench import bench_gpu_decisions
from bench.bench_gpu_decisions import parse_args, reader_settings


def settings_of(*flags: str) -> Settings:
    return reader_settings(parse_args(["--tiny", "--device", "cpu", *flags]))


def test_the_flags_are_settings():
    plain = settings_of()
    assert (plain.hf.torch_compile, plain.hf.fused_moe, plain.hf.cuda_graphs) == (False, False, True)
    assert plain.hf == dataclasses.replace(Settings.of().hf, torch_compile=False, fused_moe=False)  # else the server's
    assert plain.runtime.device == "cpu"
    given = settings_of("--compile", "--fused-moe", "--eager")
    assert (given.hf.torch_compile, given.hf.fused_moe, given.hf.cuda_graphs) == (True, True, False)
    for gone in ("--flat-turn", "--no-flat-turn", "--unshared-levels", "--eager-tokens"):  # the row path's
        with pytest.raises(SystemExit):
            settings_of(gone, "1")


class Built(Exception):
    """Raised by the stand-in for build_reader: the order is all this test wants."""


def test_the_naive_baseline_runs_on_the_model_before_hf_reader_changes_it(monkeypatch):
    from bench.models import random_model

    order: list[str] = []
    model, tokenizer, processor = random_model(True, "cpu")

    def naive(on, **kwargs):
        assert on is model
        order.append("naive")
        return {"full_read_eager": {1: 1.0}}

    def reader(args, on, *rest):
        assert on is model
        order.append("reader")
        raise Built()

    monkeypatch.setattr(bench_gpu_decisions, "random_weights", lambda args: (model, tokenizer, processor))
    monkeypatch.setattr(bench_gpu_decisions, "measure_naive", naive)
    monkeypatch.setattr(bench_gpu_decisions, "build_reader", reader)
    args = parse_args(["--tiny", "--device", "cuda", "--no-grids"])  # "cuda": the naive baseline runs on CUDA only
    with pytest.raises(Built):
        asyncio.run(bench_gpu_decisions.measure(args))
    assert order == ["naive", "reader"]


def test_the_reader_is_hf_readers_and_reports_what_it_built(capsys):
    from app.engine.hf.reader import HFReader

    args = parse_args(["--tiny", "--device", "cpu"])
    reader, settings = bench_gpu_decisions.build_reader(args, *bench_gpu_decisions.random_weights(args))
    assert isinstance(reader, HFReader) and settings.runtime.device == "cpu"
    results: dict = {}

    async def run() -> None:
        await reader.start()
        try:
            bench_gpu_decisions.ready_report(reader, results)
            bench_gpu_decisions.end_report(reader, results)
        finally:
            await reader.stop()

    asyncio.run(run())
    assert results["compile_counts_at_ready"] == {"cuda_graphs_captured": 0, "torch_compile_graphs": 0,
                                                  "triton_kernels_compiled": 0}
    assert results["after_ready"] == dict.fromkeys(results["after_ready"], 0.0) and len(results["after_ready"]) == 3
    out = capsys.readouterr().out
    assert "at ready: 0 CUDA graphs captured" in out and "at the end, built after ready:" in out and "WARNING" not in out
