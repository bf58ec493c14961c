"""How the hf engine reports the GPU memory it split at start (app/engine/hf/memory.py, the loader):
the weights counted once however many names tie them, the start-up line (weights, graphs, KV store,
the longest state, what is left free), the KV store's share of a card, and the `degraded` reason
`/health` gives when a graph capture failed."""

from __future__ import annotations

from app.engine.hf.loader import FLAT_RESERVE_BYTES, MIN_STORE_BYTES, capture_faults, store_bytes
from app.engine.hf.memory import GiB, MemorySplit, unique_bytes
from app.engine.hf.reader import HFReader
from tests.conftest import make_tiny_reader


def split(**changes) -> MemorySplit:
    values = dict(total=80 * GiB, free=9 * GiB, weights=int(47.4 * GiB), graphs=int(1.2 * GiB), store=int(22.4 * GiB),
                  prompt_tokens=131072)
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


def test_the_start_up_line_names_every_share_of_the_card():
    assert split().line() == ("GPU memory 80.0 GiB: weights 47.4 GiB, graphs 1.2 GiB, KV store 22.4 GiB (states up "
                              "to 131072 tokens), 9.0 GiB free")
    # A card whose store holds fewer tokens than asked says so in the same line (the store's size is
    # the server's configuration, not a fault).
    assert "(states up to 65536 tokens)" in split(store=int(11.2 * GiB), prompt_tokens=65536).line()


def test_the_kv_store_takes_what_the_weights_leave_less_the_turns_reserve():
    free = int(31.8 * GiB)  # what the weights leave on an H100
    assert store_bytes(free) == free - FLAT_RESERVE_BYTES
    assert store_bytes(FLAT_RESERVE_BYTES) == MIN_STORE_BYTES == store_bytes(0)  # never less than its floor


def test_a_failed_capture_is_the_reason_health_says_degraded(tiny_dir):
    assert capture_faults({}) == []
    (fault,) = capture_faults({4096: "out of memory", 1024: "out of memory"})
    assert "capture failed at 2 token bucket(s) (1024, 4096: out of memory)" in fault
    assert fault.endswith("run eagerly (slower)")
    reader = make_tiny_reader(tiny_dir)
    assert reader.degraded is None  # the CPU server captures nothing: nothing failed
    again = HFReader(reader.runner, reader.tokenizer, reader.info, reader.options, degraded=fault)
    assert again.degraded == fault
