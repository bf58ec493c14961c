"""Prompts encoded over a shared prefix (app/engine/hf/prompts.py `PrefixIndex`, the static path's prefix
slots in app/engine/hf/graphs/encoder.py), run eagerly on the CPU (capture=False): which prefix a prompt
gets, where its KV comes from, and that the whole prompt's KV equals the eager encoder's."""

from __future__ import annotations

import torch

from app.engine.base import Prompt
from app.engine.hf.graphs.shapes import EAGER_STEP
from app.engine.hf.prompts import PrefixIndex, PromptCache
from tests.engine.hf.graphs.test_encoder import assert_same_kv, graphed_runner

# The tiny model's sliding window is 64 tokens: a pass over a prefix must fit it, so the buckets are
# fine and the prefix blocks small.
LENGTHS = (8, 16, 24, 32, 40, 48, 64, 128)
SHEET = "Question q1: is the customer angry?"  # the prompts of this sheet share 24 tiny-tokenizer tokens
UNALIGNED = SHEET + " urgent"  # 28 tokens shared: a prefix of 28 right-aligned in 32 slots


def prefixed_runner(tiny_dir, **options):
    runner = graphed_runner(tiny_dir, lengths=options.pop("lengths", LENGTHS), **options)
    runner.prefix_index = PrefixIndex(block=4, minimum=8)
    return runner


def sheet_prompt(tokenizer, state: str, sheet: str = SHEET) -> Prompt:
    return Prompt(tuple(tokenizer.render_chat(sheet, state, 0, False)))


def shared_length(a: Prompt, b: Prompt) -> int:
    n = 0
    while a.ids[n] == b.ids[n]:
        n += 1
    return n


# ---------------------------------------------------------------------- PrefixIndex (pure)

def test_hashes_are_chained_per_block_and_always_leave_a_suffix():
    index = PrefixIndex(block=4, minimum=8)
    assert len(index.hashes(range(9))) == 2  # 4 and 8 tokens: each leaves at least one token
    assert len(index.hashes(range(8))) == 1  # not 8: nothing would be left to encode
    assert index.hashes([1, 2, 3, 4, 5, 6, 7, 8, 9])[:1] == index.hashes([1, 2, 3, 4, 0])
    assert index.hashes([1, 2, 3, 4, 5, 6, 7, 8, 9])[1] != index.hashes([0, 2, 3, 4, 5, 6, 7, 8, 9])[1]  # chained


def test_seen_finds_the_longest_prefix_another_prompt_began_with():
    index = PrefixIndex(block=4, minimum=8)
    first, second = tuple(range(20)), tuple(range(13)) + (99,) * 7
    index.record(index.hashes(first), ("first",))
    assert index.seen(index.hashes(first), ("first",)) is None  # a prompt does not share with itself
    assert index.seen(index.hashes(second), ("second",)) == (12, ("first",))  # 12: the last whole block in common
    short = tuple(range(5)) + (99,) * 10  # shares 4 tokens: under the minimum
    assert index.seen(index.hashes(short), ("short",)) is None


def test_the_index_forgets_the_oldest_hashes_past_its_bound():
    index = PrefixIndex(block=4, minimum=4, entries=3)
    index.record(index.hashes(tuple(range(17))), ("a",))  # four hashes into three entries
    assert index.seen(index.hashes(tuple(range(17))), ("b",)) == (16, ("a",))
    assert index.seen(index.hashes((0, 1, 2, 3, 9)), ("c",)) is None  # the first block's hash is gone


# ---------------------------------------------------------------------- the static path's keys

def test_a_pass_over_a_prefix_takes_slots_from_the_buckets_and_must_fit_the_window(tiny_dir):
    graphs = prefixed_runner(tiny_dir).encoder_graphs
    assert graphs.key(2, 10, 20) == (2, 16, 24) and graphs.graphed((2, 16, 24))
    assert graphs.key(2, 30, 40) is None  # 64 prefix slots + 32 tokens: past the 64-token window
    assert graphs.key(1, 10, 0) == (1, 16, 0)  # no prefix, no slots
    large = prefixed_runner(tiny_dir, eager_tokens=32).encoder_graphs
    key = large.key(3, 13, 21)  # 4 x 16 holds 32 tokens or more: its own rows, lengths to EAGER_STEP
    assert key == (3, 2 * EAGER_STEP, 3 * EAGER_STEP) and not large.graphed(key)


# ---------------------------------------------------------------------- encoding over a prefix

@torch.no_grad()
def test_prompts_that_share_a_sheet_are_encoded_over_its_prefix_and_equal_the_eager_encoder(tiny_dir, eager_runner,
                                                                                            tokenizer):
    runner = prefixed_runner(tiny_dir)
    first = sheet_prompt(tokenizer, "my invoice is wrong")
    later = [sheet_prompt(tokenizer, "the login page is down again"), sheet_prompt(tokenizer, "refund please")]
    assert len(first.ids) < 64 and shared_length(first, later[0]) >= 8
    runner.encode_many([first])  # the first of its sheet: encoded whole
    assert "prefix_hits" not in runner.stats
    together = runner.encode_many(later)
    # Both share the first prompt's prefix: its KV sliced from the first prompt's, one pass over the rest.
    assert runner.stats["prefixes_sliced"] == 1 and "prefixes_encoded" not in runner.stats
    assert runner.stats["prefix_hits"] == 2 and len(runner.prefixes) == 1
    for prompt, encoded in zip(later, together):
        assert encoded.length == len(prompt.ids)
        assert_same_kv(eager_runner.encode_many([prompt])[0], encoded)
    (ids, prefix), = runner.prefixes.values()
    assert len(ids) % 4 == 0 and len(ids) <= shared_length(first, later[0]) and prefix.length == len(ids)
    assert_same_kv(eager_runner.encode_many([Prompt(ids)])[0], prefix)
    passes = runner.stats["encoder_passes"]
    again = sheet_prompt(tokenizer, "the export is slow")  # the cached prefix: one pass, nothing new
    assert_same_kv(eager_runner.encode_many([again])[0], runner.encode_many([again])[0])
    assert runner.stats["prefix_hits"] == 3 and runner.stats["encoder_passes"] == passes + 1
    assert runner.stats["prefixes_sliced"] == 1 and len(runner.prefixes) == 1


@torch.no_grad()
def test_a_prefix_whose_first_prompt_left_the_lru_is_encoded_once(tiny_dir, eager_runner, tokenizer):
    runner = prefixed_runner(tiny_dir)
    runner.prompts = PromptCache(1)
    runner.encode_many([sheet_prompt(tokenizer, "first state")])
    runner.encode_many([Prompt(tuple(tokenizer.encode("an unrelated prompt")))])  # evicts the first
    prompt = sheet_prompt(tokenizer, "second state here")
    encoded = runner.encode_many([prompt])[0]
    assert runner.stats["prefixes_encoded"] == 1 and runner.stats["prefix_hits"] == 1
    assert_same_kv(eager_runner.encode_many([prompt])[0], encoded)


@torch.no_grad()
def test_a_large_batch_over_a_prefix_runs_unbucketed_and_equals_the_eager_encoder(tiny_dir, eager_runner, tokenizer):
    runner = prefixed_runner(tiny_dir, eager_tokens=32)
    runner.encode_many([sheet_prompt(tokenizer, "seed")])
    prompts = [sheet_prompt(tokenizer, state) for state in ("one two", "three four five six", "seven")]
    together = runner.encode_many(prompts)
    assert runner.stats["prefix_hits"] == 3 and runner.stats["encoder_unbucketed_passes"] >= 1
    for prompt, encoded in zip(prompts, together):
        assert_same_kv(eager_runner.encode_many([prompt])[0], encoded)


@torch.no_grad()
def test_prompts_a_prefix_pass_cannot_hold_are_encoded_whole(tiny_dir, eager_runner, tokenizer):
    runner = prefixed_runner(tiny_dir)
    runner.encode_many([sheet_prompt(tokenizer, "seed")])
    long_state = " ".join(f"w{i}" for i in range(40))  # prefix slots + its rest: past the window
    prompt = sheet_prompt(tokenizer, long_state)
    encoded = runner.encode_many([prompt])[0]
    assert "prefix_hits" not in runner.stats
    assert "prefixes_sliced" not in runner.stats and "prefixes_encoded" not in runner.stats  # none made for it
    assert_same_kv(eager_runner.encode_many([prompt])[0], encoded)


@torch.no_grad()
def test_without_encoder_graphs_or_an_lru_nothing_is_encoded_over_a_prefix(tiny_dir, eager_runner, tokenizer):
    prompts = [sheet_prompt(tokenizer, "one"), sheet_prompt(tokenizer, "two")]
    eager_runner.encode_many(prompts)  # the CPU runner: no encoder graphs, no static path
    assert "prefix_hits" not in eager_runner.stats and len(eager_runner.prefixes) == 0
    runner = prefixed_runner(tiny_dir)
    runner.prefixes = PromptCache(0)  # KV_CACHE_ENTRIES=0 turns the LRUs off
    runner.encode_many(prompts)
    assert "prefix_hits" not in runner.stats


@torch.no_grad()
def test_reads_over_a_prefix_equal_reads_of_the_whole_prompt(tiny_dir, eager_runner, tokenizer):
    """The decoder reads what the encoder left: a read whose prompt was encoded over a prefix gives
    the same slot logprobs as the eager runner's."""
    from app.engine.base import ReadSpec

    runner = prefixed_runner(tiny_dir)
    runner.encode_many([sheet_prompt(tokenizer, "seed")])
    prompt = sheet_prompt(tokenizer, "the site is down")
    yes, no = tokenizer.encode("yes")[0], tokenizer.encode("no")[0]
    spec = ReadSpec(prompt, ((tokenizer.pad_id,) * 4,), (1,), ((yes, no),))
    a, = eager_runner.read([spec])
    b, = runner.read([spec])
    assert runner.stats["prefix_hits"] == 1
    assert a.prompt_tokens == b.prompt_tokens == len(prompt.ids)
    for slot_a, slot_b in zip(a.slots[0], b.slots[0]):
        assert slot_a.argmax_id == slot_b.argmax_id
        assert all(abs(x - y) < 1e-4 for x, y in zip(slot_a.label_logprobs, slot_b.label_logprobs))


@torch.no_grad()
def test_a_longer_prefix_is_made_only_where_it_saves_a_minimum_more(tiny_dir, eager_runner, tokenizer):
    runner = prefixed_runner(tiny_dir)
    runner.encode_many([sheet_prompt(tokenizer, "seed"), sheet_prompt(tokenizer, "sprout")])
    (sheet_ids, _), = runner.prefixes.values()
    # Two states that begin alike by less than the minimum more: the sheet's prefix serves both.
    alike = [sheet_prompt(tokenizer, "ab one"), sheet_prompt(tokenizer, "ab two")]
    assert shared_length(*alike) - len(sheet_ids) < 8 + 4
    runner.encode_many(alike)
    assert len(runner.prefixes) == 1 and runner.stats["prefix_hits"] == 3
    # A state that repeats a long opening: a prefix of its own, sliced from the first prompt with it.
    opening = "the same long opening of a state "
    repeated = [sheet_prompt(tokenizer, opening + "x"), sheet_prompt(tokenizer, opening + "y")]
    assert shared_length(*repeated) - len(sheet_ids) >= 8 + 4
    runner.encode_many(repeated[:1])
    encoded = runner.encode_many(repeated[1:])[0]
    assert len(runner.prefixes) == 2 and runner.stats["prefixes_sliced"] == 2
    longest = max(len(ids) for ids, _ in runner.prefixes.values())
    assert longest - len(sheet_ids) >= 8
    assert_same_kv(eager_runner.encode_many([repeated[1]])[0], encoded)


@torch.no_grad()
def test_a_sheet_and_its_followers_in_one_call_equal_the_eager_encoder(tiny_dir, eager_runner, tokenizer):
    runner = prefixed_runner(tiny_dir)
    prompts = [sheet_prompt(tokenizer, state) for state in ("first one", "the second", "and a third")]
    together = runner.encode_many(prompts)  # the first whole; the others over a prefix sliced from it
    assert runner.stats["prefixes_sliced"] == 1 and runner.stats["prefix_hits"] == 2
    for prompt, encoded in zip(prompts, together):
        assert_same_kv(eager_runner.encode_many([prompt])[0], encoded)


@torch.no_grad()
def test_a_prefix_right_aligned_in_its_slots_never_reads_the_slots_before_it(tiny_dir, eager_runner, tokenizer):
    runner = prefixed_runner(tiny_dir)
    seed = sheet_prompt(tokenizer, "seed", UNALIGNED)
    prompts = [sheet_prompt(tokenizer, state, UNALIGNED) for state in ("my invoice is wrong", "refund please")]
    length = shared_length(seed, prompts[0])
    assert length // 4 * 4 == 28 and runner.encoder_graphs.key(2, 32, 28)[2] == 32  # 4 slots before it
    runner.encode_many([seed])
    for buffer in runner.encoder_graphs.buffers.values():  # whatever earlier passes left there
        if buffer.is_floating_point():
            buffer.fill_(100.0)
    together = runner.encode_many(prompts)
    assert runner.stats["prefix_hits"] == 2
    for prompt, encoded in zip(prompts, together):
        assert_same_kv(eager_runner.encode_many([prompt])[0], encoded)


@torch.no_grad()
def test_a_prefix_is_not_sliced_from_a_prompt_whose_sliding_layers_were_cropped(tiny_dir, eager_runner, tokenizer):
    runner = prefixed_runner(tiny_dir)
    long_prompt = sheet_prompt(tokenizer, " ".join(f"w{i}" for i in range(20)))
    assert len(long_prompt.ids) >= 64  # its KV in the LRU keeps only the window's last 63 tokens
    runner.encode_many([long_prompt])
    prompt = sheet_prompt(tokenizer, "a short one")
    encoded = runner.encode_many([prompt])[0]
    assert runner.stats["prefixes_encoded"] == 1 and "prefixes_sliced" not in runner.stats
    assert_same_kv(eager_runner.encode_many([prompt])[0], encoded)


@torch.no_grad()
def test_suffixes_the_static_path_turns_down_are_encoded_whole(tiny_dir, eager_runner, tokenizer, monkeypatch):
    runner = prefixed_runner(tiny_dir)
    graphs = runner.encoder_graphs
    real = graphs.encode_ids
    monkeypatch.setattr(graphs, "encode_ids", lambda rows, pad, prefix=None: None if prefix else real(rows, pad))
    prompts = [sheet_prompt(tokenizer, state) for state in ("seed", "one", "two")]
    together = runner.encode_many(prompts)
    assert "prefix_hits" not in runner.stats and runner.stats["kv_misses"] == 3
    for prompt, encoded in zip(prompts, together):
        assert_same_kv(eager_runner.encode_many([prompt])[0], encoded)


@torch.no_grad()
def test_prompts_whose_prefix_hashes_collide_are_never_given_each_others_kv(tiny_dir, eager_runner, tokenizer):
    runner = prefixed_runner(tiny_dir)
    index = runner.prefix_index
    index.hashes = lambda ids: list(range(1, (len(ids) - 1) // index.block + 1))  # every prompt's k-th hash is k
    a, b, c = (sheet_prompt(tokenizer, "one", "Sheet A?"), sheet_prompt(tokenizer, "two", "Another sheet B?"),
               sheet_prompt(tokenizer, "three", "Sheet A?"))
    runner.encode_many([a])
    results = runner.encode_many([b]) + runner.encode_many([c])
    # b "saw" a's hashes and c found b's prefix in the LRU under its hash: the ids differ, so nothing is
    # sliced from the wrong prompt and no prefix of another sheet is used.
    assert "prefixes_sliced" not in runner.stats
    # One call, two prompts of one length (so one longest hash) and different sheets: the second
    # may not join the first's group.
    pair = [sheet_prompt(tokenizer, "x", "Sheet C?"), sheet_prompt(tokenizer, "y", "Sheet D?")]
    assert len(pair[0].ids) == len(pair[1].ids) and pair[0].ids[:20] != pair[1].ids[:20]
    together = runner.encode_many(pair)
    for prompt, encoded in zip([b, c, *pair], results + together):
        assert_same_kv(eager_runner.encode_many([prompt])[0], encoded)


@torch.no_grad()
def test_a_calls_prompts_share_the_prefix_most_of_them_can_take(tiny_dir, eager_runner, tokenizer):
    """Two of a call's prompts begin their states alike (a block or so past the sheet), the rest share
    only the sheet: all go over the sheet's prefix in one pass, not the two over a prefix a block
    longer in a pass of their own (each group is an encoder pass)."""
    runner = prefixed_runner(tiny_dir)
    runner.encode_many([sheet_prompt(tokenizer, "seed")])
    prompts = [sheet_prompt(tokenizer, "ab cd one"), sheet_prompt(tokenizer, "ab cd two"),
               sheet_prompt(tokenizer, "refund"), sheet_prompt(tokenizer, "login")]
    extra = shared_length(*prompts[:2]) - shared_length(*prompts[2:4])
    assert 4 <= extra < 8  # a longer prefix, by a block at least and less than PREFIX_MIN, was on offer
    passes = runner.stats["encoder_passes"]
    encoded = runner.encode_many(prompts)
    assert runner.stats["encoder_passes"] == passes + 1 and runner.stats["prefix_hits"] == 4
    assert len(runner.prefixes) == 1
    for prompt, kv in zip(prompts, encoded):
        assert_same_kv(eager_runner.encode_many([prompt])[0], kv)


@torch.no_grad()
def test_two_sheets_that_begin_alike_keep_a_prefix_each(tiny_dir, eager_runner, tokenizer):
    """The prompts of two sheets sharing a long opening: each sheet's prompts go over their own sheet,
    not all of them over the opening the two share (a shorter prefix by PREFIX_MIN or more)."""
    runner = prefixed_runner(tiny_dir)
    first, second = SHEET + " Question q2: refund now?", SHEET + " Question q2: which team?"
    runner.encode_many([sheet_prompt(tokenizer, "seed", first), sheet_prompt(tokenizer, "seed", second)])
    a = [sheet_prompt(tokenizer, state, first) for state in ("one", "two")]
    b = [sheet_prompt(tokenizer, state, second) for state in ("three", "four")]
    assert shared_length(a[0], a[1]) - shared_length(a[0], b[0]) >= 8  # each sheet's own prefix is longer
    opening = shared_length(a[0], b[0])
    before = {ids for ids, _ in runner.prefixes.values()}
    hits = runner.stats["prefix_hits"]
    runner.encode_many([*a, *b])
    made = [ids for ids, _ in runner.prefixes.values() if ids not in before]
    assert len(made) == 2 and all(len(ids) > opening for ids in made), [len(ids) for ids in made]
    assert runner.stats["prefix_hits"] == hits + 4
    for prompt in (*a, *b):
        assert_same_kv(eager_runner.encode_many([prompt])[0], runner.encode_many([prompt])[0])
