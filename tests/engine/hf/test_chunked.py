"""Long prompts encoded in chunks of PREFILL_CHUNK tokens (app/engine/hf/prompts.py `encode_steps`,
app/engine/hf/runner.py `read_steps`), on the tiny model in float32: the same KV and the same slot
distributions as the prompt encoded whole, across the sliding-window boundary (the tiny model's window
is 64 tokens) and with an image ahead of the text; and the chunks take turns with other reads."""

from __future__ import annotations

import asyncio
import re

import pytest
import torch

from app.engine.base import GenerateSpec, ImageInput, Prompt
from app.engine.hf.runner import run_steps
from tests.conftest import make_tiny_reader
from tests.engine.hf.graphs.test_encoder import assert_same_kv, jpeg
from tests.engine.hf.test_reader import spec_for

LONG_STATE = " ".join(f"word{i % 97} and{i % 13}" for i in range(120))


def long_spec(tokenizer, state: str = LONG_STATE):
    return spec_for(tokenizer, state, "q1: yes\nq2: no", [42, 7, 3])


def assert_same_reads(a, b):
    for ra, rb in zip(a, b):
        assert ra.prompt_tokens == rb.prompt_tokens
        for canvas_a, canvas_b in zip(ra.slots, rb.slots):
            for slot_a, slot_b in zip(canvas_a, canvas_b):
                assert slot_a.label_logprobs == pytest.approx(slot_b.label_logprobs, abs=1e-4)
                assert slot_a.argmax_id == slot_b.argmax_id


@pytest.mark.parametrize("chunk", [16, 48, 100])  # under, near and past the 64-token window
@torch.no_grad()
def test_a_long_prompt_encoded_in_chunks_reads_as_encoded_whole(tiny_dir, eager_runner, tokenizer, chunk):
    spec = long_spec(tokenizer)
    assert len(spec.prompt.ids) > 4 * 64  # well past the sliding window
    whole = eager_runner.encode_many([spec.prompt])[0]
    runner = make_tiny_reader(tiny_dir, flat_turn=False, prefill_chunk=chunk).runner
    assert runner.needs_chunks(spec.prompt)
    chunked = run_steps(runner.encode_steps(spec.prompt))
    assert_same_kv(whole, chunked)
    assert runner.stats["encoder_chunks"] == -(-len(spec.prompt.ids) // chunk)
    assert not runner.needs_chunks(spec.prompt)  # now in the LRU: a warm read is a decoder pass
    reader = make_tiny_reader(tiny_dir, flat_turn=False, prefill_chunk=chunk).runner
    assert_same_reads(eager_runner.read([spec]), reader.read([spec]))
    assert reader.stats["encoder_chunks"] > 1


@torch.no_grad()
def test_an_image_ahead_of_a_long_text_is_encoded_in_chunks_the_same(tiny_dir, eager_runner, tokenizer):
    frame = (ImageInput(jpeg((120, 30, 200)), "image/jpeg", "frame"),)
    prompt = Prompt(tuple(tokenizer.render_chat("Look.", LONG_STATE, 1, False)), frame)
    whole = eager_runner.encode_many([prompt])[0]
    runner = make_tiny_reader(tiny_dir, flat_turn=False, prefill_chunk=40).runner
    chunked = run_steps(runner.encode_steps(prompt))
    assert chunked.length == whole.length > len(prompt.ids)  # the soft tokens expanded, then chunked
    assert_same_kv(whole, chunked)
    assert runner.stats["vision_passes"] == 1 and runner.stats["encoder_chunks"] > 1


def test_a_prompt_past_the_limit_is_refused_before_any_chunk(tiny_dir, tokenizer):
    runner = make_tiny_reader(tiny_dir, flat_turn=False, prefill_chunk=16, max_prompt_tokens=200).runner
    spec = long_spec(tokenizer)
    assert len(spec.prompt.ids) > 200 and not runner.needs_chunks(spec.prompt)
    (result,) = runner.read([spec])
    assert isinstance(result, Exception) and "at most 200" in str(result)
    assert runner.stats["encoder_chunks"] == 0


def test_the_chunks_of_a_long_read_take_turns_with_short_reads(tiny_dir, tokenizer):
    """Through the reader: a long prompt's chunks are heavy turns; short reads arriving meanwhile are
    answered between them, long before the long read ends."""
    reader = make_tiny_reader(tiny_dir, flat_turn=False, prefill_chunk=48)
    long = long_spec(tokenizer)
    chunks = -(-len(long.prompt.ids) // 48)
    order: list[str] = []

    async def scenario():
        await reader.start()
        task = asyncio.create_task(reader.read([long]))
        task.add_done_callback(lambda _: order.append("long"))
        await asyncio.sleep(0)  # queued first
        for n in range(3):
            await reader.read([spec_for(tokenizer, f"short {n}", "q1: yes", [5])])
            order.append(f"short {n}")
        turns_when_short_done = reader.stats["heavy_turns"]
        (result,) = await task
        await reader.stop()
        return turns_when_short_done, result

    turns, result = asyncio.run(scenario())
    assert len(spec_for(tokenizer, "short 0", "q1: yes", [5]).prompt.ids) <= 48  # one turn each
    assert order == ["short 0", "short 1", "short 2", "long"]
    assert turns < chunks  # the short reads were answered while the long prompt was still encoding
    assert reader.stats["heavy_turns"] == chunks + 1  # every chunk, then its decoder pass
    assert len(result.slots) == 3


def test_a_slow_turn_names_the_step_it_ran(tiny_dir, tokenizer, monkeypatch, caplog):
    """The slow-turn warning says what the turn's last step was: which chunk of how long a prompt,
    or which decoder pass over how many canvases, so a long turn in a served log points at its step."""
    import app.engine.hf.reader as reader_module

    monkeypatch.setattr(reader_module, "SLOW_TURN_S", 0.0)  # every turn is "slow": each says its step
    reader = make_tiny_reader(tiny_dir, flat_turn=False, prefill_chunk=48)
    long = long_spec(tokenizer)

    async def scenario():
        await reader.start()
        await reader.read([long])
        await reader.read([spec_for(tokenizer, "two steps", "q1: yes", [5, 6], steps=2)])
        await reader.read([spec_for(tokenizer, "short", "q1: yes", [5])])
        await reader.stop()

    with caplog.at_level("WARNING", logger="djev.engine"):
        asyncio.run(scenario())
    notes = [r.getMessage() for r in caplog.records if "an engine turn took" in r.getMessage()]
    chunks = -(-len(long.prompt.ids) // 48)
    assert any(f"step 2 of a heavy read for 1 request(s); its last step: chunk 2 of {chunks} (48 tokens at 48)"
               in note for note in notes), notes
    assert any("its last step: decoder pass 1 of 1: 3 canvas(es)" in note for note in notes)
    # A multi-step read's pass before another says where its host time went: queuing the pass, sampling.
    assert any(re.search(r"its last step: decoder pass 1 of 2: 2 canvas\(es\) .* \(the pass queued in \d+ ms, "
                         r"sampled by \d+ ms\)", note) for note in notes), notes
    assert notes[-1].endswith("its last step: decoder pass 1 of 1: 1 canvas(es) of up to 16 tokens over prompts of up "
                              f"to {len(spec_for(tokenizer, 'short', 'q1: yes', [5]).prompt.ids)}; the allocator asked "
                              "the device for memory 0 time(s), 0 after freeing its cache")  # (the CPU counts none)


def test_the_prompt_lru_is_bounded_in_bytes_and_evicts_the_oldest_first():
    from app.engine.hf.prompts import PromptCache

    cache: PromptCache[str, bytes] = PromptCache(10, max_bytes=100, size=len)
    cache.put("a", b"x" * 40)
    cache.put("b", b"x" * 40)
    assert cache.bytes == 80 and len(cache) == 2
    cache.get("a")  # used: b is now the oldest
    cache.put("c", b"x" * 40)  # 120 > 100: the least recently used goes
    assert "b" not in cache and "a" in cache and "c" in cache and cache.bytes == 80
    cache.put("huge", b"x" * 101)  # larger than the bound alone: not kept, nothing evicted for it
    assert "huge" not in cache and len(cache) == 2
    cache.put("a", b"x" * 10)  # replacing an entry counts its new size only
    assert cache.bytes == 50
    cache.clear()
    assert cache.bytes == 0 and len(cache) == 0


@torch.no_grad()
def test_long_states_kv_is_kept_within_prompt_cache_gb(tiny_dir, tokenizer):
    """The runner's prompt LRU holds at most PROMPT_CACHE_GB of KV: on the tiny model a bound of two
    long states' KV keeps the last two."""
    probe = make_tiny_reader(tiny_dir, flat_turn=False, prefill_chunk=64).runner
    one = run_steps(probe.encode_steps(long_spec(tokenizer).prompt)).nbytes
    runner = make_tiny_reader(tiny_dir, flat_turn=False, prefill_chunk=64, prompt_cache_gb=2.5 * one / 2**30).runner
    prompts = [long_spec(tokenizer, LONG_STATE + f" variant {n}").prompt for n in range(4)]
    for prompt in prompts:
        run_steps(runner.encode_steps(prompt))
    assert runner.prompts.bytes <= 2.5 * one and len(runner.prompts) == 2
    assert prompts[3].cache_key in runner.prompts and prompts[0].cache_key not in runner.prompts


def test_the_prompt_limit_is_sized_to_the_free_memory_on_cuda_and_32768_elsewhere(tiny_dir, caplog):
    import logging

    from app.engine.hf.loader import GRAPH_RESERVE_BYTES, LONG_PROMPT_MARGIN, prompt_kv_bytes
    from app.engine.hf.loader import sized_prompt_limit as prompt_limit

    model = make_tiny_reader(tiny_dir, flat_turn=False).runner.model
    cpu = torch.device("cpu")
    assert prompt_limit(model, cpu, 0) == 32768 and prompt_limit(model, cpu, 5000) == 5000
    assert prompt_kv_bytes(model, 4000) < 2 * prompt_kv_bytes(model, 2000)  # the sliding layers keep a window
    plenty = 200 * 2**30
    assert prompt_limit(model, cpu, 0, free_bytes=plenty) == 131072
    just = GRAPH_RESERVE_BYTES + round(LONG_PROMPT_MARGIN * prompt_kv_bytes(model, 65536)) + 1
    with caplog.at_level(logging.WARNING, logger="djev.engine"):
        assert prompt_limit(model, cpu, 0, free_bytes=just) == 65536
    assert "prompts up to 65536 tokens, not 131072" in caplog.text
    assert prompt_limit(model, cpu, 0, free_bytes=2**30) == 32768  # never below the CPU's
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="djev.engine"):
        assert prompt_limit(model, cpu, 131072, free_bytes=2**30) == 131072  # set: kept, and said
    assert "such a read may fail with a 503" in caplog.text


def test_the_decision_core_reads_the_engines_prompt_limit_unless_one_is_set():
    from app.build import prompt_limit, read_settings
    from app.config import Settings
    from app.engine.base import ReaderInfo

    info = ReaderInfo(model="m", engine="hf", device="cuda", tiny=False, canvas_length=128, max_prompt_tokens=131072)
    assert read_settings(Settings.of(), info).max_prompt_tokens == 131072
    assert read_settings(Settings.of()).max_prompt_tokens == 32768  # the engine says nothing
    assert read_settings(Settings.of(max_prompt_tokens=9000), info).max_prompt_tokens == 9000
    assert prompt_limit(Settings.of(max_prompt_tokens=9000), info) == 9000


@pytest.mark.parametrize("window", [None, 8])
@pytest.mark.parametrize("past", [0, 5, 37])
def test_chunk_attention_matches_attention_under_the_full_mask(window, past):
    """`chunk_attention` (no mask over the earlier tokens of a full layer, two softmaxes merged by
    their log-sum-exps) against SDPA under the materialised mask, query heads sharing KV heads."""
    from app.engine.hf.layers import chunk_attention

    generator = torch.Generator().manual_seed(past + (window or 0))
    tokens, heads, kv_heads, dim = 11, 4, 2, 16
    kept = past if window is None else min(past, window - 1)  # a sliding layer's cache holds its window
    queries = torch.randn(1, heads, tokens, dim, generator=generator)
    keys = torch.randn(1, kv_heads, kept + tokens, dim, generator=generator)
    values = torch.randn(1, kv_heads, kept + tokens, dim, generator=generator)
    rows = torch.arange(tokens).unsqueeze(1) + kept
    columns = torch.arange(kept + tokens).unsqueeze(0)
    mask = columns <= rows
    if window is not None:
        mask &= columns > rows - window
    expected = torch.nn.functional.scaled_dot_product_attention(
        queries, keys.repeat_interleave(2, dim=1), values.repeat_interleave(2, dim=1), attn_mask=mask, scale=0.5)
    got = chunk_attention(queries, keys, values, 0.5, window)
    assert got.shape == (1, tokens, heads, dim)
    assert torch.allclose(got.transpose(1, 2), expected, atol=1e-5)


def test_chunks_shorten_as_the_prompt_grows_and_cover_it_exactly():
    from app.engine.hf.prompts import CHUNK_ALIGN, chunk_bounds, chunk_length

    assert chunk_length(0, 2048) == 2048 and chunk_length(30_000, 2048) == 2048  # short prompts: the setting
    assert chunk_length(100_000, 2048) == 1024  # 2048 x 2 x 38k / 138k = 1128, in 128s
    lengths = [chunk_length(start, 2048) for start in range(0, 131_072, 4096)]
    assert lengths == sorted(lengths, reverse=True) and min(lengths) >= CHUNK_ALIGN
    assert chunk_length(10**9, 2048) == CHUNK_ALIGN and chunk_length(0, 16) == 16
    bounds = chunk_bounds(110_119, 2048)
    assert bounds[0] == (0, 2048) and bounds[-1][1] == 110_119
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    assert 54 < len(bounds) < 80  # a few more turns than 54 equal chunks, each bounded in time


@torch.no_grad()
def test_a_chunked_prompt_keeps_its_full_attention_kv_in_its_own_buffers(tiny_dir, tokenizer):
    """No copy at the end and no oversized buffers: each full-attention layer's keys fill a
    token-major buffer of exactly the prompt's length."""
    runner = make_tiny_reader(tiny_dir, flat_turn=False, prefill_chunk=48).runner
    spec = long_spec(tokenizer)
    encoded = run_steps(runner.encode_steps(spec.prompt))
    full = [keys for keys, _ in encoded.layers if keys.shape[2] == encoded.length]
    assert full  # the tiny model has full-attention layers
    for keys in full:
        assert keys.untyped_storage().nbytes() == keys.numel() * keys.element_size()
        assert keys.stride(2) == keys.shape[1] * keys.shape[3]  # token-major, as copy_rows lays KV out


@pytest.mark.parametrize("causal", [False, True])
def test_attention_with_lse_equals_the_arithmetic_it_stands_for(causal):
    """The CPU's flash kernel (what `attention_with_lse` calls there) against the float32 arithmetic."""
    from app.engine.hf.layers import attention_with_lse

    generator = torch.Generator().manual_seed(3)
    queries = torch.randn(1, 2, 40, 16, generator=generator)
    keys = torch.randn(1, 2, 40 if causal else 75, 16, generator=generator)
    values = torch.randn(1, 2, keys.shape[2], 16, generator=generator)
    scores = torch.matmul(queries.double(), keys.double().transpose(-1, -2)) * 0.7
    if causal:
        scores = scores.masked_fill(torch.ones(40, 40, dtype=torch.bool).triu(1), float("-inf"))
    out, lse = attention_with_lse(queries, keys, values, 0.7, causal)
    assert lse.dtype == torch.float32 and lse.shape == (1, 2, 40)
    assert torch.allclose(lse.double(), torch.logsumexp(scores, -1), atol=1e-5)
    assert torch.allclose(out.double(), torch.matmul(torch.softmax(scores, -1), values.double()), atol=1e-5)


def test_only_long_uncached_prompts_count_against_a_batchs_encoding(tiny_dir):
    """`long_encoding`: a prompt over half of PREFILL_CHUNK and not in the LRU counts its tokens
    (a read batch holds PREFILL_CHUNK of them); a shorter one (a ticket, a walk frame over its sheet)
    counts nothing, nor does one already encoded."""
    runner = make_tiny_reader(tiny_dir, flat_turn=False, prefill_chunk=64).runner
    short, long = Prompt(tuple(range(100, 132))), Prompt(tuple(range(100, 160)))
    assert runner.long_encoding(short) == 0 and runner.long_encoding(long) == 60
    runner.encode_many([long])
    assert runner.long_encoding(long) == 0  # in the LRU now: nothing to encode


def long_generation(tokenizer, max_tokens: int = 40):
    """A think-like generation over a prompt past the sliding window (greedy: the ids owe nothing to
    noise, so two encodings of its prompt that agree give the same ids)."""
    prompt = Prompt(tuple(tokenizer.render_chat("Think.", LONG_STATE, 0, thinking=True)))
    return GenerateSpec(prompt, max_tokens, (), seed=3, temperature=0.0)


@torch.no_grad()
def test_a_generations_long_prompt_is_encoded_in_chunks_and_generates_as_encoded_whole(tiny_dir, tokenizer):
    spec = long_generation(tokenizer)
    whole = make_tiny_reader(tiny_dir, flat_turn=False).runner  # PREFILL_CHUNK's default: one pass
    chunked = make_tiny_reader(tiny_dir, flat_turn=False, prefill_chunk=48).runner
    assert not whole.needs_chunks(spec.prompt) and chunked.needs_chunks(spec.prompt)
    assert whole.generate(spec, 32).ids == chunked.generate(spec, 32).ids
    assert chunked.stats["encoder_chunks"] == -(-len(spec.prompt.ids) // 48)
    # Its prompt is in the LRU now: a second generation over it encodes nothing before its first pass.
    passes = chunked.stats["encoder_passes"]
    state = chunked.start_generation(spec, 32)
    assert chunked.stats["encoder_passes"] == passes and state.length == len(spec.prompt.ids)


def test_no_generation_turn_encodes_more_than_prefill_chunk_tokens(tiny_dir, tokenizer):
    """Through the reader: a generation's long prompt takes a chunk a turn, like a read's, and a short
    read sent meanwhile is answered before the generation's prompt is encoded."""
    reader = make_tiny_reader(tiny_dir, flat_turn=False, prefill_chunk=48)
    runner = reader.runner
    spec = long_generation(tokenizer, max_tokens=20)
    encoded: list[int] = []  # tokens through the encoder in the turn running now
    per_turn: list[int] = []

    def count(module, args, kwargs):
        embeds = kwargs.get("inputs_embeds")
        ids = kwargs.get("input_ids")
        encoded.append(int((embeds if embeds is not None else ids).shape[1]))

    start, step = runner.start_steps, runner.step_generation

    def counted_start(*args):
        """The prompt's encoding, each step of it (a turn) counted."""
        inner = start(*args)
        while True:
            encoded.clear()  # (a read's turn between two steps encodes too)
            try:
                next(inner)
            except StopIteration as stop:
                per_turn.append(sum(encoded))
                return stop.value
            per_turn.append(sum(encoded))
            yield

    def counted_step(*args):
        encoded.clear()
        try:
            return step(*args)
        finally:
            per_turn.append(sum(encoded))

    handle = runner.model.model.encoder.language_model.register_forward_pre_hook(count, with_kwargs=True)
    runner.start_steps, runner.step_generation = counted_start, counted_step
    order: list[str] = []

    async def scenario():
        await reader.start()
        task = asyncio.create_task(reader.generate(spec))
        task.add_done_callback(lambda _: order.append("generation"))
        await asyncio.sleep(0)  # queued first
        await reader.read([spec_for(tokenizer, "short", "q1: yes", [5])])
        order.append("short")
        first_encoding_turns = sum(1 for tokens in per_turn if tokens)
        result = await task
        await reader.stop()
        return first_encoding_turns, result

    try:
        turns_when_short_done, result = asyncio.run(scenario())
    finally:
        handle.remove()
    chunks = -(-len(spec.prompt.ids) // 48)
    assert len(result.ids) == 20
    assert max(per_turn) <= 48, per_turn
    assert sum(per_turn[:chunks]) == len(spec.prompt.ids)  # the prompt, a chunk a turn
    assert order == ["short", "generation"] and turns_when_short_done < chunks
