"""The KV block store (app/engine/hf/blocks.py), on tiny float32 CPU pools: where a position's KV
lives, which prompts share blocks, how much sliding KV a long sequence holds, what eviction takes,
what pins keep, and how the pools grow within their cap.

The store here: two sliding layers (2 heads x 8) and one full layer (1 head x 16), a window of 40
and blocks of 4 tokens, so a sliding block takes 1 KiB, a full one 512 bytes."""

from __future__ import annotations

import random
from collections.abc import Hashable, Sequence

import pytest
import torch

from app.engine.hf.blocks import KVStore, LayerShape, SequenceKV, StoreFull

LAYERS = [LayerShape(True, 2, 8), LayerShape(True, 2, 8), LayerShape(False, 1, 16)]
WINDOW = 40
B = 4
SLIDING_BLOCK = 2 * 2 * B * 2 * 8 * 4  # two layers, keys and values, float32
FULL_BLOCK = 2 * B * 1 * 16 * 4
PAIR = SLIDING_BLOCK + FULL_BLOCK  # what one position's block costs in both pools

Written = list[tuple[torch.Tensor, torch.Tensor]]  # per layer, the keys and values of positions [0, n)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_store(pairs: int = 64, **options) -> KVStore:
    """A store whose cap is `pairs` blocks in each pool (unless `sliding_bytes` splits it otherwise)."""
    return KVStore(LAYERS, WINDOW, options.pop("max_bytes", pairs * PAIR), "cpu", torch.float32, block_tokens=B,
                   **options)


def extend(store: KVStore, seq: SequenceKV, keys: Sequence[Hashable], written: Written | None = None) -> Written:
    """Reserves `keys` after the sequence's positions and writes them (`write_reserved`)."""
    store.reserve(seq, keys)
    return write_reserved(store, seq, written)


def write_reserved(store: KVStore, seq: SequenceKV, written: Written | None = None) -> Written:
    """Writes random KV (never zeros) at the reserved positions not yet written, in every layer, and
    marks them written: what a forward does. Returns a copy of `written` with the new positions."""
    start, end = seq.written, seq.reserved
    full, sliding = store.slots(seq, start, end)
    written = list(written) if written is not None else [(torch.empty(0, s.kv_heads, s.head_dim),) * 2 for s in LAYERS]
    for layer, shape in enumerate(LAYERS):
        new_keys, new_values = (torch.rand(end - start, shape.kv_heads, shape.head_dim) + 0.5 for _ in range(2))
        store.write(layer, sliding if shape.sliding else full, new_keys, new_values)
        old_keys, old_values = written[layer]
        written[layer] = (torch.cat([old_keys[:start], new_keys]), torch.cat([old_values[:start], new_values]))
    store.mark_written(seq, end)
    return written


def prompt(store: KVStore, keys: Sequence[Hashable]) -> tuple[SequenceKV, Written]:
    """A prompt opened and written whole, the way a first read of it leaves it."""
    seq = store.open(keys)
    assert seq.cached == 0
    return seq, extend(store, seq, keys)


def assert_reads(store: KVStore, seq: SequenceKV, written: Written, start: int, end: int, layers=range(3)) -> None:
    for layer in layers:
        keys, values = store.gather(layer, seq, start, end)
        assert torch.equal(keys, written[layer][0][start:end]) and torch.equal(values, written[layer][1][start:end])


def held(seq: SequenceKV) -> list[int]:
    """The indices of the sliding blocks the sequence holds."""
    return [index for index, block in enumerate(seq.sliding) if block is not None]


def keys_of(first: int, count: int) -> list[Hashable]:
    return list(range(first, first + count))


# ---------------------------------------------------------------------- where KV lives

def test_slots_are_block_times_block_tokens_plus_offset_in_each_pool_and_kv_round_trips():
    store = make_store()
    seq = store.open(keys_of(0, 10))
    written = extend(store, seq, keys_of(0, 6))  # a partly used tail block ...
    written = extend(store, seq, keys_of(6, 4), written)  # ... that the next reserve fills first
    assert seq.reserved == seq.written == 10 and len(seq.full) == len(seq.sliding) == 3
    full, sliding = store.slots(seq, 0, 10)
    assert full.dtype == torch.int64
    assert full.tolist() == [seq.full[p // B] * B + p % B for p in range(10)]
    assert sliding.tolist() == [seq.sliding[p // B] * B + p % B for p in range(10)]
    assert_reads(store, seq, written, 0, 10)
    assert_reads(store, seq, written, 3, 9)  # across block edges
    keys, values = store.pool_tensors(2)  # the full layer's pool: [blocks, B, heads, dim]
    assert torch.equal(keys[seq.full[2], 1], written[2][0][9]) and torch.equal(values[seq.full[0], 3], written[2][1][3])
    keys, _ = store.pool_tensors(1)
    block = seq.sliding[1]
    assert block is not None and torch.equal(keys[block, 0], written[1][0][4])


def test_misuse_is_refused():
    store = make_store()
    seq, _ = prompt(store, keys_of(0, 60))  # its sliding blocks 0-4 lie wholly before 60 - 39: released
    with pytest.raises(ValueError):
        store.slots(seq, 0, 4)  # position 0's sliding block is released
    assert store.full_slots(seq, 0, 4).tolist() == [seq.full[0] * B + offset for offset in range(B)]
    with pytest.raises(ValueError):
        store.mark_written(seq, 61)
    with pytest.raises(ValueError):
        store.gather(2, seq, 0, 61)
    store.close(seq)
    with pytest.raises(ValueError):
        store.reserve(seq, [1])


# ---------------------------------------------------------------------- sharing

def test_prompts_with_a_common_prefix_share_its_whole_blocks():
    store = make_store()
    first_keys = keys_of(0, 22)
    second_keys = first_keys[:14] + keys_of(100, 10)  # 14 common tokens: 3 whole blocks of 4
    first, first_written = prompt(store, first_keys)
    used = store.stats["blocks_used"]
    second = store.open(second_keys)
    assert second.cached == second.written == 12 and second.keys == second_keys[:12]
    assert second.full == first.full[:3] and second.sliding == first.sliding[:3]
    assert store.stats["blocks_used"] == used  # shared by reference: nothing allocated
    assert store.stats["hit_tokens"] == 12
    assert_reads(store, second, first_written, 0, 12)  # what the first wrote
    written = extend(store, second, second_keys[12:], first_written)  # the tail starts at a block boundary
    assert second.full[3] not in first.full and store.slots(second, 12, 13)[0].tolist() == [second.full[3] * B]
    assert_reads(store, first, first_written, 0, 22)  # the first's own KV is untouched
    store.close(first)
    assert store.stats["blocks_used"] == 2 * len(second.full)  # the shared blocks live on in the second
    assert_reads(store, second, written, 0, 24)


def test_per_token_keys_not_token_ids_decide_sharing():
    text, tail = keys_of(1, 8), keys_of(9, 4)
    image_a = [("img", "digestA", index) for index in range(8)]  # the same soft-token id in the model ...
    image_b = [("img", "digestB", index) for index in range(8)]  # ... but another image
    store = make_store()
    first, _ = prompt(store, text + image_a + tail)
    assert store.open(text + image_b + tail).cached == 8  # nothing past the image
    assert store.open(text + image_a + tail).cached == 20  # the same image: all of it


def test_the_partial_last_block_is_never_shared_and_a_repeat_shares_every_whole_block():
    store = make_store()
    ten, _ = prompt(store, keys_of(0, 10))
    store.close(ten)
    stats = store.stats
    assert stats["blocks_cached"] == 4 and stats["blocks_free"] == stats["blocks_allocated"] - 4  # its tail is free
    again = store.open(keys_of(0, 10))
    assert again.cached == 8  # the repeat rewrites positions 8 and 9 in a block of its own
    twelve, _ = prompt(store, keys_of(50, 12))
    assert store.open(keys_of(50, 12)).cached == 12  # all of a prompt of whole blocks: nothing left to write


def test_an_equal_block_written_twice_is_named_once():
    store = make_store()
    one, two = store.open(keys_of(0, 8)), store.open(keys_of(0, 8))  # opened before either was written
    extend(store, one, keys_of(0, 8))
    extend(store, two, keys_of(0, 8))
    assert set(one.full).isdisjoint(two.full)
    store.close(one)
    store.close(two)
    stats = store.stats
    assert stats["blocks_cached"] == 4 and stats["blocks_used"] == 0  # two's copies went back to the free list
    assert store.open(keys_of(0, 8)).full == one.full


def test_a_copy_whose_shared_twin_was_evicted_is_shared_when_it_closes():
    store = make_store(4, preallocate=True)
    one, two = store.open(keys_of(0, 8)), store.open(keys_of(0, 8))
    extend(store, one, keys_of(0, 8))
    two_written = extend(store, two, keys_of(0, 8))  # two's blocks are private copies of one's
    store.close(one)
    newcomer = store.open(keys_of(50, 8))
    store.reserve(newcomer, keys_of(50, 8))  # no free block: one's two cached blocks go
    assert store.open(keys_of(0, 8)).cached == 0
    store.close(two)  # its copies now take the evicted blocks' place, chain and all
    again = store.open(keys_of(0, 8))
    assert again.cached == 8 and again.full == two.full
    assert_reads(store, again, two_written, 0, 8)


# ---------------------------------------------------------------------- the sliding window

def test_a_long_sequence_holds_every_full_block_but_only_its_window_of_sliding_ones():
    """A sequence that has written x of its reserved positions holds the sliding blocks
    [max(0, (m - W + 1) // B), ceil(reserved / B)) with m = x rounded down to a block: what a canvas
    at x reads (the last W - 1 positions) and what reopening it at m needs. That is at most
    ceil((W - 1) / B) + ceil((reserved - x + B - 1) / B) blocks: 10 + 1 = 11 here once all is
    written, 10 + 3 = 13 while a chunk of 7 is reserved and not yet written."""
    full_blocks, sliding_blocks, chunk = 50, 13, 7
    store = make_store(max_bytes=full_blocks * FULL_BLOCK + sliding_blocks * SLIDING_BLOCK,
                       sliding_bytes=sliding_blocks * SLIDING_BLOCK, preallocate=True)
    assert store.sliding_bound() == 11 and store.sliding_bound(chunk) == 13
    seq, written = store.open(keys_of(0, 200)), None
    for start in range(0, 200, chunk):
        keys = keys_of(start, min(chunk, 200 - start))
        store.reserve(seq, keys)
        assert len(held(seq)) <= store.sliding_bound(len(keys))  # the chunk's attention reads them all
        written = write_reserved(store, seq, written)
        boundary = seq.written // B * B
        assert held(seq) == list(range(max(0, (boundary - WINDOW + 1) // B), -(-seq.written // B)))
        assert len(held(seq)) <= store.sliding_bound()
        assert store.stats["bytes"] == full_blocks * FULL_BLOCK + sliding_blocks * SLIDING_BLOCK
    assert written is not None and len(set(seq.full)) == 50  # every full block stays
    assert_reads(store, seq, written, 0, 200, layers=[2])
    assert_reads(store, seq, written, 200 - WINDOW + 1, 200, layers=[0, 1])  # what a canvas at 200 reads
    assert store.stats["evictions"] > 0  # released sliding blocks made room for later ones


@pytest.mark.parametrize("window", [1, 2, 5, 16, 17, 40, 64])
@pytest.mark.parametrize("block_tokens", [1, 3, 4, 16])
def test_the_sliding_bound_holds_and_is_reached(window, block_tokens):
    layers = [LayerShape(True, 1, 1), LayerShape(False, 1, 1)]
    store = KVStore(layers, window, 1 << 20, "cpu", torch.float32, block_tokens=block_tokens)
    seq, most = store.open([]), 0
    for position in range(3 * window + 2 * block_tokens):
        store.reserve(seq, [position])
        assert len(held(seq)) <= store.sliding_bound(1)
        store.mark_written(seq, seq.reserved)
        most = max(most, len(held(seq)))
    assert most == store.sliding_bound()  # and reached


def test_a_prefix_is_shared_only_as_far_as_the_sliding_pool_holds_the_window_before_it():
    store = make_store(max_bytes=40 * FULL_BLOCK + 16 * SLIDING_BLOCK, sliding_bytes=16 * SLIDING_BLOCK,
                       preallocate=True)
    long_keys = keys_of(0, 60)
    long, _ = prompt(store, long_keys)  # 15 blocks in each pool; writing released sliding 0-4 (cached)
    store.close(long)  # all 15 cached; sliding blocks released tail first: 14, 13, ..., 5
    reader = store.open(long_keys[:40] + keys_of(900, 8))
    assert reader.cached == 40 and held(reader) == list(range(10))  # it holds sliding blocks 0-9
    filler = store.open(keys_of(500, 12))
    store.reserve(filler, keys_of(500, 12))  # 3 blocks, 1 free: evicts the 2 oldest cached, 14 and 13
    assert store.stats["evictions"] == 2
    again = store.open(long_keys + keys_of(700, 8))
    # All 15 full blocks are cached, but sharing 60 or 56 positions needs sliding block 13 or 14; 52
    # needs blocks 3-12 (positions 13-51), all still in the pool.
    assert again.cached == 52 and held(again) == list(range(3, 13))


# ---------------------------------------------------------------------- eviction and pins

def test_eviction_takes_the_least_recently_released_block_first():
    store = make_store(4, preallocate=True)  # 4 blocks in each pool
    a_keys, b_keys = keys_of(0, 8), keys_of(10, 8)
    for keys in (a_keys, b_keys):
        seq, _ = prompt(store, keys)
        store.close(seq)
    repeat = store.open(a_keys)
    assert repeat.cached == 8
    store.close(repeat)  # a's blocks now released after b's
    newcomer = store.open(keys_of(20, 4))
    store.reserve(newcomer, keys_of(20, 4))  # one block in each pool: b's tail block goes
    assert store.stats["evictions"] == 2
    assert store.open(b_keys).cached == 4 and store.open(a_keys).cached == 8


def test_referenced_blocks_are_never_evicted_and_a_reserve_that_cannot_fit_changes_nothing():
    store = make_store(4, preallocate=True)
    live, live_written = prompt(store, keys_of(0, 8))  # 2 blocks in each pool, referenced
    done, _ = prompt(store, keys_of(10, 8))
    store.close(done)  # 2 cached: all that can be evicted
    seq = store.open(keys_of(20, 12))
    before = (store.stats, list(seq.full), list(seq.sliding), list(seq.keys))
    with pytest.raises(StoreFull):
        store.reserve(seq, keys_of(20, 12))  # 3 blocks
    assert (store.stats, seq.full, seq.sliding, seq.keys) == before  # (a refusal is counted by `give_way`)
    assert_reads(store, live, live_written, 0, 8)
    check = store.open(keys_of(10, 8))
    assert check.cached == 8  # nothing was evicted
    store.close(check)
    store.reserve(seq, keys_of(20, 8))  # 2 blocks fit: the cached ones go
    assert store.open(keys_of(10, 8)).cached == 0
    assert_reads(store, live, live_written, 0, 8)


def cached_tokens(store: KVStore, keys: Sequence[Hashable]) -> int:
    """How many of a prompt's positions the store would share now (opened and closed again)."""
    seq = store.open(keys)
    store.close(seq)
    return seq.cached


def test_pinned_blocks_go_last_and_only_for_a_running_reads_room():
    clock = Clock()
    store = make_store(4, preallocate=True, clock=clock)
    pinned, _ = prompt(store, keys_of(0, 8))
    store.close(pinned, pin_seconds=10)
    assert store.stats["blocks_pinned"] == 4  # 2 full, 2 sliding
    done, _ = prompt(store, keys_of(10, 8))
    store.close(done)
    first = store.open(keys_of(20, 8))
    store.reserve(first, keys_of(20, 8))  # 2 blocks: done's, unpinned, go first
    assert cached_tokens(store, keys_of(0, 8)) == 8 and store.stats["pins_broken"] == 0
    second = store.open(keys_of(30, 4))
    store.reserve(second, keys_of(30, 4))  # no unpinned block left: a pinned one goes, not the read
    assert store.stats["pins_broken"] == 2 and store.stats["store_full"] == 0  # one in each pool
    third = store.open(keys_of(40, 8))
    with pytest.raises(StoreFull):  # 2 blocks wanted, 1 cached: used blocks are never taken
        store.reserve(third, keys_of(40, 8))


def test_of_pinned_blocks_the_soonest_to_expire_goes_first():
    clock = Clock()
    store = make_store(4, preallocate=True, clock=clock)
    late, _ = prompt(store, keys_of(0, 4))
    store.close(late, pin_seconds=10)
    soon, _ = prompt(store, keys_of(10, 4))
    store.close(soon, pin_seconds=2)
    for first in (20, 30, 40):  # the 2 free blocks, then one pinned
        prompt(store, keys_of(first, 4))
    assert cached_tokens(store, keys_of(0, 4)) == 4 and cached_tokens(store, keys_of(10, 4)) == 0


def test_a_pin_keeps_what_extending_the_sequence_at_its_last_whole_block_needs():
    """A decision's first stage closes pinned; whatever else runs meanwhile, its gated second stage
    reopens it at the first stage's last whole block. Unpinned, the same traffic loses it."""
    for pin_seconds, shared in ((5.0, 60), (0.0, 0)):
        store = make_store(max_bytes=64 * FULL_BLOCK + 24 * SLIDING_BLOCK, sliding_bytes=24 * SLIDING_BLOCK,
                           preallocate=True, clock=Clock())
        stage_keys = keys_of(0, 62)
        stage, written = store.open(stage_keys), None
        for start in range(0, 62, 8):
            written = extend(store, stage, stage_keys[start:start + 8], written)
        store.close(stage, pin_seconds=pin_seconds)  # pinned: full 0-14, sliding 5-14 (15 is partial)
        other = store.open(keys_of(1000, 100))
        for start in range(1000, 1100, 8):
            extend(store, other, keys_of(start, min(8, 1100 - start)))
        extension = store.open(stage_keys + keys_of(2000, 10))
        assert extension.cached == shared
        if shared:
            assert written is not None
            assert_reads(store, extension, written, 0, 60, layers=[2])
            assert_reads(store, extension, written, 60 - WINDOW + 1, 60, layers=[0, 1])


# ---------------------------------------------------------------------- accounting and growth

def test_closing_twice_is_harmless_and_the_stats_add_up():
    store = make_store(32)
    live = [prompt(store, keys_of(0, 30))[0], store.open(keys_of(0, 26))]
    done, _ = prompt(store, keys_of(100, 50))
    store.close(done)
    store.close(done)
    live.append(store.open(keys_of(100, 50)))
    extend(store, live[1], keys_of(200, 5))
    stats = store.stats
    assert stats["blocks_used"] + stats["blocks_cached"] + stats["blocks_free"] == stats["blocks_allocated"]
    referenced = len({b for s in live for b in s.full}) + len({b for s in live for b in s.sliding if b is not None})
    assert stats["blocks_used"] == referenced
    assert stats["hit_tokens"] == sum(s.cached for s in live) == 24 + 48
    for seq in live:
        store.close(seq)
        store.close(seq)
    stats = store.stats
    assert stats["blocks_used"] == 0 and stats["blocks_cached"] + stats["blocks_free"] == stats["blocks_allocated"]


def test_growing_pools_double_up_to_the_cap_and_never_past_it():
    store = make_store(40)
    assert store.stats["bytes"] == 0
    seq, written, sizes = store.open(keys_of(0, 200)), None, []
    for start in range(0, 160, 8):
        written = extend(store, seq, keys_of(start, 8), written)
        sizes.append((store.stats["full_blocks"], store.stats["sliding_blocks"]))
        assert store.stats["bytes"] <= 40 * PAIR
    assert sorted(set(sizes)) == [(16, 16), (32, 32), (40, 40)]  # released sliding blocks stay cached
    assert written is not None
    assert_reads(store, seq, written, 0, 160, layers=[2])  # copied along as the pools grew
    assert_reads(store, seq, written, 160 - WINDOW + 1, 160, layers=[0, 1])
    with pytest.raises(StoreFull):
        store.reserve(seq, [160])  # every full block is the sequence's
    assert store.stats["bytes"] == 40 * PAIR


def test_preallocated_pools_hold_the_cap_from_the_start_at_fixed_addresses():
    store = make_store(max_bytes=10 * PAIR + PAIR - 1, preallocate=True)
    assert store.stats["bytes"] == 10 * PAIR and store.stats["blocks_free"] == 20
    addresses = [tensor.data_ptr() for layer in range(3) for tensor in store.pool_tensors(layer)]
    assert store.pool_tensors(0)[0].shape == (10, B, 2, 8) and store.pool_tensors(2)[1].shape == (10, B, 1, 16)
    prompt(store, keys_of(0, 40))
    assert [tensor.data_ptr() for layer in range(3) for tensor in store.pool_tensors(layer)] == addresses
    split = make_store(max_bytes=10 * FULL_BLOCK + 3 * SLIDING_BLOCK, sliding_bytes=3 * SLIDING_BLOCK,
                       preallocate=True)
    assert (split.stats["full_blocks"], split.stats["sliding_blocks"]) == (10, 3)


# ---------------------------------------------------------------------- all of it at once

def model_kv(keys: Sequence[Hashable]) -> Written:
    """What a model would write for these keys: each position's KV a function of the keys up to it
    (a chain of hashes seeds it), so a block shared from another prompt must hold exactly this."""
    written: Written = []
    for layer, shape in enumerate(LAYERS):
        rows, seed = [], layer
        for key in keys:
            seed = hash((seed, key)) & 0x7FFF_FFFF
            rows.append(torch.rand(2, shape.kv_heads, shape.head_dim, generator=torch.Generator().manual_seed(seed)) + 0.5)
        both = torch.stack(rows) if rows else torch.empty(0, 2, shape.kv_heads, shape.head_dim)
        written.append((both[:, 0], both[:, 1]))
    return written


def test_random_traffic_keeps_every_sequence_reading_its_own_kv():
    """Prompts on a few shared stems, written in random chunks and closed (some pinned) at random in a
    store small enough to evict and to refuse: after every step each open sequence reads exactly the
    KV of its own keys, a refused reserve changed nothing, and the stats add up."""
    rng, clock = random.Random(7), Clock()
    store = make_store(24, clock=clock)
    stems = [keys_of(1000 * stem, 48) for stem in range(3)]
    live: dict[int, tuple[SequenceKV, list[Hashable], Written]] = {}
    refused = 0
    for step in range(400):
        clock.now += rng.random()
        action = rng.random()
        if action < 0.25 or not live:
            keys = rng.choice(stems)[: rng.randint(0, 48)] + keys_of(5000 + 100 * rng.randint(0, 3), rng.randint(0, 24))
            seq = store.open(keys)
            assert seq.cached % B == 0 and seq.keys == keys[: seq.cached]
            live[step] = (seq, keys, model_kv(keys))
        elif action < 0.85:
            seq, keys, kv = rng.choice(list(live.values()))
            end = min(len(keys), seq.reserved + rng.randint(1, 12))
            before = (store.stats, list(seq.full), list(seq.sliding), seq.reserved)
            try:
                store.reserve(seq, keys[seq.reserved:end])
            except StoreFull:
                refused += 1
                assert (store.stats, seq.full, seq.sliding, seq.reserved) == before
                continue
            full, sliding = store.slots(seq, seq.written, end)
            for layer, shape in enumerate(LAYERS):
                store.write(layer, sliding if shape.sliding else full, kv[layer][0][seq.written:end],
                            kv[layer][1][seq.written:end])
            store.mark_written(seq, end)
        else:
            key = rng.choice(list(live))
            store.close(live.pop(key)[0], pin_seconds=rng.choice([0.0, 0.0, 3.0]))
        stats = store.stats
        assert stats["blocks_used"] + stats["blocks_cached"] + stats["blocks_free"] == stats["blocks_allocated"]
        assert stats["bytes"] <= 24 * PAIR
        assert stats["blocks_used"] == (len({b for s, _, _ in live.values() for b in s.full})
                                        + len({b for s, _, _ in live.values() for b in s.sliding if b is not None}))
        for seq, _, kv in live.values():
            assert len(held(seq)) <= store.sliding_bound(seq.reserved - seq.written)
            assert_reads(store, seq, kv, 0, seq.written, layers=[2])
            if held(seq) and seq.written:
                assert_reads(store, seq, kv, held(seq)[0] * B, seq.written, layers=[0, 1])
    stats = store.stats
    assert refused and stats["evictions"] and stats["hit_tokens"]  # the traffic did reach all three


def test_one_read_a_turn_gives_way_for_room_and_the_others_wait():
    store = make_store(4)
    store.start_turn()
    assert store.give_way() and not store.give_way() and not store.give_way()
    assert store.stats["store_full"] == 1  # counted once: one read failed, two waited
    store.start_turn()
    assert store.give_way() and store.stats["store_full"] == 2
