"""The served benches' weights follow QUANTIZE, and the served report carries the server's memory split."""

from __future__ import annotations

from pathlib import Path

from app.config import Settings
from bench.bench_gpu_served import memory_line
from bench.models import random_weights

SPLIT = ("GPU memory 79.2 GiB: weights 47.3 GiB, graphs 1.5 GiB, KV store 15.1 GiB (states up to 131072 tokens), "
         "13.4 GiB free")


def test_random_weights_follow_quantize():
    assert random_weights(Settings.of()) == "bf16"
    assert random_weights(Settings.of(quantize="fp8")) == "fp8"


def test_the_memory_split_is_read_from_the_server_log(tmp_path: Path):
    log = tmp_path / "server.log"
    log.write_text("2026-12-07 00:33:43,651 INFO djev.engine: camera frames: 36.0 a second\n"
                   f"2026-12-07 00:33:43,651 INFO djev.engine: {SPLIT}\n")
    assert memory_line(log) == SPLIT
    log.write_text("2026-12-07 00:33:43,651 INFO djev.engine: weights: fp32\n")  # the CPU logs no split
    assert memory_line(log) == ""
    assert memory_line(tmp_path / "missing.log") == ""
