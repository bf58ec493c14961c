"""How the hf engine reports the GPU memory it split at start (app/engine/hf/memory.py): the weights
counted once however many names tie them, the graphs held and left out, the prompt limit, and the
`degraded` reason `/health` gives when the card was too small for the defaults."""

from __future__ import annotations

import torch

from app.engine.hf.memory import (
    CAPTURE_BYTES,
    MIN_DECODER_SLOTS,
    MIN_ENCODER_SLOTS,
    GiB,
    GraphPlan,
    MemorySplit,
    plan_graphs,
    unique_bytes,
)
from app.engine.hf.reader import HFReader
from tests.conftest import make_tiny_reader


def split(**changes) -> MemorySplit:
    values = dict(total=80 * GiB, free=9 * GiB, weights=int(47.4 * GiB), graphs=int(18.2 * GiB), prompt_tokens=131072,
                  prompt_wanted=131072, prompt_forced=False, held={"decoder": 204, "encoder": 290, "vision": 4})
    values.update(changes)
    return MemorySplit(**values)


def test_the_weights_count_each_tied_tensor_once(tiny_dir):
    model = make_tiny_reader(tiny_dir).runner.model
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    every_name = sum(t.numel() * t.element_size() for _, t in named)
    distinct = {t.data_ptr(): t.numel() * t.element_size() for _, t in named}
    assert unique_bytes(model) == sum(distinct.values())
    assert every_name > 1.8 * unique_bytes(model)  # the decoder's layers are the encoder's: one copy in memory
    decoder = model.model.decoder.layers[0].self_attn.q_proj.weight
    encoder = model.model.encoder.language_model.layers[0].self_attn.q_proj.weight
    assert decoder.data_ptr() == encoder.data_ptr()


def test_a_card_that_fits_the_defaults_reports_its_split_and_no_reason():
    line = split().line()
    assert line == ("GPU memory 80.0 GiB: weights 47.4 GiB, graphs 18.2 GiB (decoder 204, encoder 290, vision 4 held), "
                    "prompts up to 131072 tokens, 9.0 GiB free")
    assert split().forced() is None


def test_a_smaller_card_says_what_it_forced():
    small = split(prompt_tokens=65536, prompt_forced=True, left_out={"encoder": 40})
    assert "(decoder 204, encoder 290, vision 4 held; left out: encoder 40)" in small.line()
    assert "prompts up to 65536 tokens (not 131072: the free memory)" in small.line()
    assert small.forced() == ("the GPU's 80 GiB forced prompts up to 65536 tokens, not 131072 and 40 CUDA graph(s) "
                              "left out, their passes run eagerly (slower)")
    assert split(left_out={"decoder": 3}).forced().startswith("the GPU's 80 GiB forced 3 CUDA graph(s) left out")
    # MAX_PROMPT_TOKENS set by hand is the operator's choice, not the card's: nothing forced.
    assert split(prompt_tokens=8192, prompt_wanted=8192).forced() is None


@torch.no_grad()
def test_prepare_graphs_counts_the_graphs_it_left_out(tiny_dir):
    runner = make_tiny_reader(tiny_dir).runner
    runner.use_graphs(capture=False)
    assert runner.graphs is not None and runner.encoder_graphs is not None
    runner.graphs.cache.failed[(1, 16, 256, 64, False)] = "a test"  # a failed capture: every capture after it is skipped
    held = runner.prepare_graphs()
    assert held["decoder"] == 0 and held["encoder"] == 0
    assert runner.graphs_left_out == {"decoder": len(runner.policy.decoder_keys()),
                                      "encoder": len(runner.policy.encoder_keys())}


def test_the_reader_says_degraded_with_the_cards_reason(tiny_dir):
    reader = make_tiny_reader(tiny_dir)
    assert reader.degraded is None
    forced = split(prompt_tokens=65536, prompt_forced=True).forced()
    again = HFReader(reader.runner, reader.tokenizer, reader.info, reader.options, degraded=forced)
    assert again.degraded == forced


TOKEN_KV = 225 * 1024  # the full-size model's keys and values a token, over its 30 layers, in bf16


def test_an_h200_keeps_the_default_graph_buffers_and_prompt_cache():
    plan = plan_graphs(int(92 * GiB), TOKEN_KV, decoder_slots=72 * 1024, encoder_slots=16 * 1024,
                       cache_bytes=16 * GiB, reserve=12 * GiB)
    assert plan == GraphPlan(72 * 1024, 16 * 1024, 16 * GiB, ())


def test_an_80_gb_card_cuts_the_prompt_cache_and_the_graph_buffers_to_fit():
    free = int(31.8 * GiB)  # what the weights leave on an H100
    plan = plan_graphs(free, TOKEN_KV, decoder_slots=72 * 1024, encoder_slots=16 * 1024, cache_bytes=16 * GiB,
                       reserve=12 * GiB)
    assert plan.prompt_cache_bytes == free // 4
    assert (plan.decoder_slots, plan.encoder_slots) == (18 * 1024, 16 * 1024)  # halved twice, the larger first
    budget = free - 12 * GiB - plan.prompt_cache_bytes - CAPTURE_BYTES
    assert (plan.decoder_slots + plan.encoder_slots) * TOKEN_KV <= budget
    assert len(plan.cuts) == 2 and "the prompt cache to 7.9 GiB" in plan.cuts[0]
    assert split(cuts=plan.cuts).forced().endswith(plan.cuts[1])  # /health names what was cut


def test_the_flat_turn_on_an_80_gb_card_cuts_no_graph_buffers():
    free = int(31.8 * GiB)  # the flat turn asks for no static KV buffers: only the prompt cache is cut
    plan = plan_graphs(free, TOKEN_KV, decoder_slots=0, encoder_slots=0, cache_bytes=16 * GiB, reserve=12 * GiB)
    assert plan == GraphPlan(0, 0, free // 4, (plan.cuts[0],)) and "prompt cache" in plan.cuts[0]


def test_the_buffers_stop_at_their_floor_and_an_unbounded_cache_stays_unbounded():
    plan = plan_graphs(13 * GiB, TOKEN_KV, decoder_slots=72 * 1024, encoder_slots=16 * 1024, cache_bytes=0,
                       reserve=12 * GiB)
    # Halved while a half stays at its floor or above: 72k -> 9k, 16k -> 4k.
    assert (plan.decoder_slots, plan.encoder_slots) == (9 * 1024, 4 * 1024)
    assert MIN_DECODER_SLOTS <= plan.decoder_slots < 2 * MIN_DECODER_SLOTS and plan.encoder_slots == MIN_ENCODER_SLOTS
    assert plan.prompt_cache_bytes == 0  # PROMPT_CACHE_GB=0: bounded by entries only, as asked
