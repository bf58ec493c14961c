"""bench/check_gpu_numerics.py on the tiny model on the CPU: every check runs, its command line is
the GPU one's, and it holds one runner at a time (each built, read, dropped and its memory freed
before the next), which is what lets the 30-layer model's checks fit an 80 GB card beside each
runner's preallocated KV store."""

from __future__ import annotations

import math
import weakref

import pytest
import torch

from app.engine.hf.runner import DiffusionRunner
from bench import check_gpu_numerics


def test_the_command_line_takes_sizes_and_flags_in_any_order():
    args = check_gpu_numerics.parse_args(["6:float32", "--fused-moe", "30:bfloat16", "--device", "cuda"])
    assert args.sizes == [(6, torch.float32), (30, torch.bfloat16)] and args.fused_moe
    assert args.device == torch.device("cuda") and not args.tiny
    assert [size for size, _ in check_gpu_numerics.parse_args(["--device", "cuda"]).sizes] == [6, 6, 30]
    for bad in (["6-float32", "--device", "cuda"], ["6:float99", "--device", "cuda"], ["--device", "cpu"],
                ["--tiny", "--device", "cpu", "--fused-moe"], ["--flat-turn", "--device", "cuda"]):
        with pytest.raises(SystemExit):
            check_gpu_numerics.parse_args(bad)


def test_the_reads_are_text_of_every_length_four_draws_an_image_and_two_steps():
    from app.engine.tiny import build_config, build_tokenizer

    config = build_config(build_tokenizer())
    reads, names = check_gpu_numerics.make_reads(int(config.text_config.vocab_size), int(config.image_token_id),
                                                 b"frame")
    assert len(reads) == len(names) == 7
    lengths = [len(spec.prompt.ids) for spec in reads if not spec.prompt.images]
    assert min(lengths) == 40 and max(lengths) == 1500
    assert any(len(spec.canvases) == 4 for spec in reads)
    (image,) = [spec for spec in reads if spec.prompt.images]
    assert image.prompt.ids[-1] == config.image_token_id
    assert [spec.steps for spec in reads].count(2) == 1


@pytest.mark.timeout(300)
def test_every_check_runs_with_one_runner_alive_at_a_time(monkeypatch, capsys):
    alive: list[weakref.ref] = []
    most = [0]
    built = [0]
    freed = []
    init = DiffusionRunner.__init__

    def counted(self, *args, **kwargs):
        living = [ref for ref in alive if ref() is not None]
        most[0] = max(most[0], len(living) + 1)  # the runners alive while this one is built
        init(self, *args, **kwargs)
        alive.append(weakref.ref(self))
        built[0] += 1

    release = check_gpu_numerics.release

    def released(device):
        release(device)
        freed.append(sum(ref() is not None for ref in alive))

    monkeypatch.setattr(DiffusionRunner, "__init__", counted)
    monkeypatch.setattr(check_gpu_numerics, "PROMPT_TOKENS", (40, 200))  # shorter than the GPU's: quicker
    monkeypatch.setattr(check_gpu_numerics, "release", released)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the tiny model gains nothing from more; on a busy 2-core box they cost 10x
    try:
        check_gpu_numerics.main(["--tiny", "--device", "cpu"])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert built[0] == 4  # eager alone (and transformers' reads), eager shared, pieces alone, pieces shared
    assert most[0] == 1, f"{most[0]} runners were alive at once"
    assert freed and max(freed) == 0  # every release left no runner behind
    lines = {line.split("[")[0].strip(): line for line in out.splitlines() if "top label" in line}
    assert set(lines) == {"(1) shared turn vs alone, eager", "(2) pieces vs eager, alone",
                          "(2) pieces vs eager, shared turn", "(4) transformers vs alone, eager"}, out
    for line in lines.values():  # float32: every read agrees, to its top label
        largest = [float(d) for d in line.split("[")[1].split("]")[0].split(",")]
        assert len(largest) == 6 and max(largest) < 2e-3, line  # 300, 300 x4, 40, 200, image, 2 steps
        agree, total = line.split("top label ")[1].split()[0].split("/")
        assert agree == total, line
    assert "2 turns shared" in lines["(1) shared turn vs alone, eager"]  # one turn, and the two-step's second
    assert "as uncaptured pieces, 0 eager fallbacks" in lines["(2) pieces vs eager, shared turn"]
    assert "vision static vs library" in out


def slot(*probabilities: float):
    from app.engine.base import SlotRead

    return SlotRead(tuple(math.log(p) for p in probabilities), 0)


def test_agreement_counts_confident_slots_and_the_probability_deviation():
    from app.engine.base import ReadResult

    # Full-vocabulary log-probabilities: renormalised over the labels (0.06 / 0.02 -> 0.75 / 0.25).
    base = [ReadResult(((slot(0.06, 0.02), slot(0.5, 0.48), slot(0.2, 0.1, 0.1)),), 10)]
    other = [ReadResult(((slot(0.02, 0.06), slot(0.48, 0.5), slot(0.2, 0.1, 0.1)),), 10)]
    found = check_gpu_numerics.agreement(base, other)
    assert (found.slots, found.confident, found.agree) == (3, 2, 1)  # the 0.51/0.49 slot is not confident
    assert found.largest_deviation == pytest.approx(0.5)
    assert found.mean_deviation == pytest.approx((0.5 + 0.5 + 0.0204 * 2) / 7, abs=1e-3)
    assert "1/2 confident slots (50.0 %)" in found.line()


def test_the_fp8_check_takes_its_own_size_and_refuses_fused_moe():
    args = check_gpu_numerics.parse_args(["--weights", "fp8", "--device", "cuda"])
    assert args.sizes == [(30, torch.bfloat16)] and args.reads == 300
    for bad in (["--weights", "fp8", "--fused-moe", "--device", "cuda"], ["--weights", "int4", "--device", "cuda"],
                ["--weights", "fp8", "--reads", "0", "--device", "cuda"]):
        with pytest.raises(SystemExit):
            check_gpu_numerics.parse_args(bad)
    reads = check_gpu_numerics.fp8_reads(2794, 6)
    assert [len(spec.prompt.ids) for spec in reads] == [60, 200, 500, 60, 200, 500]
    assert len({spec.prompt.ids for spec in reads}) == 6 and all(len(spec.canvases) == 1 for spec in reads)


@pytest.mark.timeout(300)
def test_the_fp8_check_runs_on_the_tiny_model(capsys):
    check_gpu_numerics.main(["--tiny", "--device", "cpu", "--weights", "fp8", "--reads", "12"])
    out = capsys.readouterr().out
    assert "12 reads; FP8: 41 projections and 6 layers' experts" in out
    free = next(line for line in out.splitlines() if "FP8 vs float32" in line and "pinned" not in line)
    pinned = next(line for line in out.splitlines() if "FP8 vs float32" in line and "routes pinned" in line)
    for line in (free, pinned):
        assert "over 36 slots" in line and "confident slots" in line


def tiny_runs(count: int = 4):
    """The tiny model in float32, its FP8 check's first `count` reads, and a way to read them all
    through a fresh eager runner (as the check reads them)."""
    from bench.models import build_model, image_processor, model_config, served_experts

    model = build_model(model_config(True), "cpu", torch.float32, served_experts("cpu"))
    processor = image_processor(True)
    reads = check_gpu_numerics.fp8_reads(int(model.config.text_config.vocab_size), count)

    def read_all(specs=reads):
        made = check_gpu_numerics.make_runner(model, processor, torch.device("cpu"), pieces=False)
        return check_gpu_numerics.results(made.read(list(specs)))

    return model, reads, read_all


def logprobs(results):
    return [slot.label_logprobs for result in results for canvas in result.slots for slot in canvas]


@pytest.mark.timeout(300)
def test_pinned_routes_are_the_recorded_ones_and_steer_the_experts():
    model, reads, read_all = tiny_runs()
    routes = check_gpu_numerics.Routes(model)
    assert len(routes.routers) == len({id(layer.router) for layer in model.modules() if hasattr(layer, "router")})
    with pytest.raises(ValueError, match="no routes recorded"):
        routes.impose()
    with routes.record():
        own = read_all()
    calls = [len(calls) for calls in routes.recorded.values()]
    assert max(calls) > 0 and all(count in (0, max(calls)) for count in calls)  # every layer run's router, each turn
    with routes.impose():
        assert logprobs(read_all()) == logprobs(own)  # its own routes: the same reads, exactly
    with routes.record():  # the imposing hooks went with their context: a run is free again
        assert logprobs(read_all()) == logprobs(own)
    experts = int(model.config.text_config.num_experts)
    routes.recorded = {n: [(index + 1) % experts for index in calls] for n, calls in routes.recorded.items()}
    with routes.impose():
        moved = read_all()
    assert logprobs(moved) != logprobs(own)  # other experts imposed: other answers


@pytest.mark.timeout(300)
def test_pinning_other_turns_than_the_recorded_stops_with_the_router_and_call():
    model, reads, read_all = tiny_runs()
    routes = check_gpu_numerics.Routes(model)
    with routes.record():
        read_all(reads[:2])
    with routes.impose(), pytest.raises(ValueError, match=r"router \d+, call 0: the run routes .* pin only the same"):
        read_all(reads[2:])
