"""The KV block store of the token-flat turn: every prompt's KV in fixed-size blocks of
`block_tokens` positions, shared by reference between prompts that begin alike (prefix caching).
A turn's one forward writes many sequences' new tokens at once (`slots`: flat indices into a pool)
and reads each sequence's earlier KV through its block list: no prompt needs a contiguous buffer,
and prompts that share a prefix hold (and compute) its KV once.

Two pools, one per kind of layer (a block id indexes every layer of its pool). A full-attention
layer reads every earlier key: a sequence keeps all its full blocks. A sliding-window layer reads
the `window` − 1 positions before a query: a sequence lets go of its sliding blocks as its writing
moves past them (`mark_written`), so a 110k-token prompt holds only about a window of them
(`sliding_bound`).

Sharing: a fully written block is named by its chain, the pair (identity of the chain before it,
its per-token keys), and each distinct chain gets an identity (a counter, never reused). Keys are
compared, not only hashed: prompts share a block only when every key up to its end is equal, so
no hash collision can hand one prompt another's KV. A prompt shares the longest run of whole
cached blocks that begins it and whose sliding blocks still cover the window before its end (a
sequence continuing at position m reads sliding KV at [m − W + 1, m)).

A block is used (referenced by sequences), cached (whole and named, referenced by none: kept for
later prompts, evicted least recently released first, pinned ones only when a running read needs
their room) or free. The pools hold at
most `max_bytes`, split between them once (`sliding_bytes`); a pool doubles up to its share (or
is allocated whole at once: fixed CUDA addresses) and evicts only once it is reached. The engine
thread alone uses a store: nothing here locks.
"""

from __future__ import annotations

import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from itertools import islice

import torch

BLOCK_TOKENS = 16  # tokens a block holds
GROW_BLOCKS = 16  # a growing pool's first size in blocks; it doubles from there
ROOT = 0  # the identity of the empty chain before a sequence's first block (real ones count from 1)


@dataclass(frozen=True)
class LayerShape:
    """One attention layer's KV as the store holds it: its kind and its keys' (and values') shape."""

    sliding: bool
    kv_heads: int
    head_dim: int


class StoreFull(Exception):
    """No room for a sequence's KV even after evicting every unpinned block no sequence uses. The
    runner fails that read alone with a 503; everything else goes on."""


@dataclass(eq=False)
class SequenceKV:
    """One sequence's KV in the store (a prompt; a generation's prompt and committed blocks)."""

    full: list[int]  # block ids in the full-attention pool, block i holds positions [i*B, (i+1)*B)
    sliding: list[int | None]  # block ids in the sliding pool; None where released (wholly outside the window)
    keys: list[Hashable]  # the per-token keys of every reserved position, in order
    written: int = 0  # positions [0, written) hold their KV
    cached: int = 0  # positions shared from the store when it was opened (whole blocks)
    chain: list[int] = field(default_factory=list)  # the chain identity of each whole written block
    closed: bool = False

    @property
    def reserved(self) -> int:
        """Positions with a slot."""
        return len(self.keys)


def block_bytes(shapes: Sequence[LayerShape], block_tokens: int, dtype: torch.dtype) -> int:
    """The bytes one block takes across these layers, keys and values."""
    element = torch.empty((), dtype=dtype).element_size()
    return sum(2 * block_tokens * shape.kv_heads * shape.head_dim for shape in shapes) * element


class _Pool:
    """The blocks of one kind of layer: per layer a keys and a values tensor [blocks, block_tokens,
    kv_heads, head_dim], and each block's references, name and pin."""

    def __init__(self, shapes: list[LayerShape], block_tokens: int, limit: int, device: torch.device,
                 dtype: torch.dtype, preallocate: bool) -> None:
        self.shapes = shapes
        self.limit = limit  # the most blocks it may allocate
        self.blocks = 0  # allocated
        self.block_bytes = block_bytes(shapes, block_tokens, dtype)
        self.keys = [torch.empty((0, block_tokens, s.kv_heads, s.head_dim), device=device, dtype=dtype) for s in shapes]
        self.values = [keys.clone() for keys in self.keys]
        self.refs: list[int] = []  # sequences referencing each block
        self.name: list[Hashable | None] = []  # each block's registry key; None: unnamed (private)
        self.ident: list[int] = []  # a named block's chain identity
        self.free: list[int] = []  # taken from the end
        self.registry: dict[Hashable, int] = {}  # name -> block
        self.lru: OrderedDict[int, None] = OrderedDict()  # the cached blocks, least recently released first
        self.pins: dict[int, float] = {}  # block -> pinned until (clock time)
        if preallocate and shapes:  # a pool without layers is bookkeeping alone: nothing to allocate
            self.grow(limit)

    def grow(self, blocks: int) -> None:
        """`blocks` more free blocks. The tensors are copied into larger ones (new addresses)."""
        if blocks <= 0:
            return
        size = self.blocks + blocks
        for tensors in (self.keys, self.values):
            for index, old in enumerate(tensors):
                new = old.new_empty((size, *old.shape[1:]))
                new[: self.blocks].copy_(old)
                tensors[index] = new  # the old one goes here: one layer's copy at a time
        self.refs += [0] * blocks
        self.name += [None] * blocks
        self.ident += [ROOT] * blocks
        self.free += reversed(range(self.blocks, size))  # the lowest id is taken first
        self.blocks = size

    def take(self, blocks: int) -> list[int]:
        """`blocks` free blocks, referenced once each (that many must be free)."""
        taken = [self.free.pop() for _ in range(blocks)]
        for block in taken:
            self.refs[block] = 1
        return taken

    def retain(self, block: int) -> None:
        if self.refs[block] == 0:
            del self.lru[block]  # an unreferenced block that can be found is a cached one
        self.refs[block] += 1

    def release(self, block: int) -> None:
        self.refs[block] -= 1
        if self.refs[block] == 0:
            if self.name[block] is None:
                self.free.append(block)
            else:
                self.lru[block] = None

    def register(self, block: int, name: Hashable, identity: int) -> None:
        self.registry[name] = block
        self.name[block] = name
        self.ident[block] = identity

    def evictable(self, wanted: int, now: float) -> list[int]:
        """Up to `wanted` cached blocks: those not pinned now, least recently released first, then,
        where they fall short, pinned ones, the soonest to expire first. A pin keeps a block for a
        gated stage that may come; a read that is running never fails for it (the stage encodes its
        prompt again instead)."""
        blocks = list(islice((block for block in self.lru if self.pins.get(block, now) <= now), wanted))
        if len(blocks) < wanted:
            pinned = sorted((block for block in self.lru if self.pins.get(block, now) > now), key=self.pins.__getitem__)
            blocks += pinned[:wanted - len(blocks)]
        return blocks

    def pinned_now(self, blocks: list[int], now: float) -> int:
        """How many of `blocks` are pinned now."""
        return sum(1 for block in blocks if self.pins.get(block, now) > now)

    def evict(self, blocks: list[int]) -> None:
        for block in blocks:
            del self.lru[block]
            del self.registry[self.name[block]]
            self.name[block] = None
            self.pins.pop(block, None)
            self.free.append(block)

    def pin(self, block: int, until: float) -> None:
        self.pins[block] = max(until, self.pins.get(block, until))

    def pinned(self, now: float) -> int:
        """Cached blocks pinned now (not evictable)."""
        return sum(1 for block, until in self.pins.items() if until > now and self.refs[block] == 0)


class KVStore:
    """The prompts' KV in two pools of blocks (see the module's docstring); a `SequenceKV` says which
    blocks hold a sequence's positions."""

    def __init__(self, layers: Sequence[LayerShape], window: int, max_bytes: int, device: torch.device | str,
                 dtype: torch.dtype, block_tokens: int = BLOCK_TOKENS, preallocate: bool = False,
                 sliding_bytes: int | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        """`sliding_bytes`: the part of `max_bytes` the sliding pool may hold, the full pool the rest.
        None gives both pools as many blocks: every reserved position can then have its sliding KV,
        which suits prompts of up to a few windows; a store for much longer ones does better with a
        smaller sliding share (a sequence holds at most `sliding_bound` sliding blocks)."""
        if not layers or window < 1 or block_tokens < 1 or max_bytes < 0:
            raise ValueError("a KV store needs layers, a window and a block of at least 1, and max_bytes >= 0")
        self.layers = list(layers)
        self.window = window
        self.block_tokens = block_tokens
        self.device = torch.device(device)
        self._clock = clock
        shapes = [[s for s in self.layers if not s.sliding], [s for s in self.layers if s.sliding]]
        sizes = [block_bytes(kind, block_tokens, dtype) for kind in shapes]
        if sliding_bytes is None:
            limits = [max_bytes // sum(sizes)] * 2
        elif 0 <= sliding_bytes <= max_bytes:
            budgets = [max_bytes - sliding_bytes, sliding_bytes]
            limits = [budget // size if size else sys.maxsize for budget, size in zip(budgets, sizes)]
        else:
            raise ValueError(f"sliding_bytes {sliding_bytes} is not within max_bytes {max_bytes}")
        self._full, self._sliding = (_Pool(kind, block_tokens, limit, self.device, dtype, preallocate)
                                     for kind, limit in zip(shapes, limits))
        self._pools = (self._full, self._sliding)
        # Each layer's pool and its index there.
        self._where = [(self._pools[shape.sliding], sum(other.sliding == shape.sliding for other in self.layers[:layer]))
                       for layer, shape in enumerate(self.layers)]
        self._identities = ROOT  # the last chain identity given
        self._hit_tokens = self._evictions = self._store_full = self._pins_broken = 0
        self._gave_way = False  # a read failed for room in the turn being built (`give_way`)

    # ------------------------------------------------------------------ tensors

    def pool_tensors(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """That layer's keys and values pools [blocks, block_tokens, kv_heads, head_dim]. Without
        `preallocate` a pool's tensors are replaced when it grows (in `reserve`): ask again after one."""
        pool, index = self._where[layer]
        return pool.keys[index], pool.values[index]

    def slots(self, seq: SequenceKV, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat slots (block_id * block_tokens + offset, int64, on the store's device) of positions
        [start, end) in the full pool and in the sliding pool: where the forward writes their KV.
        The positions must be reserved and their sliding blocks held. Those of written positions are
        for reading only: their blocks may be shared."""
        return self.full_slots(seq, start, end), self.sliding_slots(seq, start, end)

    def full_slots(self, seq: SequenceKV, start: int, end: int) -> torch.Tensor:
        """`slots` in the full pool alone (e.g. to read positions whose sliding blocks are released)."""
        return self._slots(seq, seq.full, start, end)

    def sliding_slots(self, seq: SequenceKV, start: int, end: int) -> torch.Tensor:
        """`slots` in the sliding pool alone."""
        return self._slots(seq, seq.sliding, start, end)

    def _slots(self, seq: SequenceKV, blocks: Sequence[int | None], start: int, end: int) -> torch.Tensor:
        if not 0 <= start <= end <= seq.reserved:
            raise ValueError(f"positions [{start}, {end}) are not within the {seq.reserved} reserved")
        size, first = self.block_tokens, start // self.block_tokens
        ids = blocks[first: -(-end // size)]
        if None in ids:
            raise ValueError(f"positions [{start}, {end}) reach sliding blocks the sequence has released")
        positions = torch.arange(start, end, dtype=torch.int64)
        return (torch.tensor(ids, dtype=torch.int64)[positions // size - first] * size + positions % size).to(self.device)

    def write(self, layer: int, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """keys and values [n, kv_heads, head_dim] into that layer's pool at `slots` (of its pool)."""
        pool, index = self._where[layer]
        shape = (slots.shape[0], pool.shapes[index].kv_heads, pool.shapes[index].head_dim)
        if tuple(keys.shape) != shape or tuple(values.shape) != shape:
            raise ValueError(f"layer {layer} takes {shape} keys and values, not {tuple(keys.shape)}, {tuple(values.shape)}")
        for pooled, new in ((pool.keys[index], keys), (pool.values[index], values)):
            pooled.view(-1, *shape[1:]).index_copy_(0, slots, new)

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [n, kv_heads, head_dim] at `slots` of that layer's pool (from `full_slots` or
        `sliding_slots`, by the layer's kind): `gather` with the slots worked out once a turn."""
        pool, index = self._where[layer]
        keys, values = pool.keys[index], pool.values[index]
        return keys.view(-1, *keys.shape[2:])[slots], values.view(-1, *values.shape[2:])[slots]

    def sliding_layer(self, layer: int) -> bool:
        """Whether `layer` keeps its KV in the sliding pool."""
        return self._where[layer][0] is self._sliding

    def gather(self, layer: int, seq: SequenceKV, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [end − start, kv_heads, head_dim] of reserved positions [start, end) (held
        ones, for a sliding layer): what the CPU reference attention reads. Positions past `written`
        are the ones the turn being run writes before its attention reads them (`mark_written` comes
        after the turn)."""
        if end > seq.reserved:
            raise ValueError(f"positions [{start}, {end}) are not all reserved ({seq.reserved})")
        pool, index = self._where[layer]
        slots = self._slots(seq, seq.sliding if pool is self._sliding else seq.full, start, end)
        keys, values = pool.keys[index], pool.values[index]
        return keys.view(-1, *keys.shape[2:])[slots], values.view(-1, *values.shape[2:])[slots]

    # ------------------------------------------------------------------ sequences

    def open(self, keys: Sequence[Hashable]) -> SequenceKV:
        """A sequence for a prompt with these per-token keys, sharing by reference the longest run of
        whole cached blocks that begins it and whose window the sliding pool still holds (possibly
        the whole prompt). Nothing is allocated; cached == written == the shared positions."""
        size = self.block_tokens
        full: list[int] = []
        chain: list[int] = []
        for start in range(0, len(keys) - size + 1, size):
            block = self._full.registry.get((chain[-1] if chain else ROOT, tuple(keys[start:start + size])))
            if block is None:
                break
            full.append(block)
            chain.append(self._full.ident[block])
        sliding = [self._sliding.registry.get(identity) for identity in chain]
        # The longest run of j blocks whose sliding blocks [_first_held(j * size), j) are all cached.
        shared, missing = 0, -1
        for blocks in range(1, len(chain) + 1):
            if sliding[blocks - 1] is None:
                missing = blocks - 1
            if missing < self._first_held(blocks * size):
                shared = blocks
        first = self._first_held(shared * size)
        held = [None] * first + sliding[first:shared]
        for block in full[:shared]:
            self._full.retain(block)
        for block in held[first:]:
            if block is not None:
                self._sliding.retain(block)
        self._hit_tokens += shared * size
        return SequenceKV(full=full[:shared], sliding=held, keys=list(keys[:shared * size]), written=shared * size,
                          cached=shared * size, chain=chain[:shared])

    def reserve(self, seq: SequenceKV, keys: Sequence[Hashable]) -> None:
        """Slots for len(keys) more positions after seq.reserved, in both pools (the tail block may be
        partly used). A pool grows within its share, else evicts cached blocks not pinned, least
        recently released first. StoreFull, with the sequence and the store as they were, where that
        cannot make room."""
        self._check_open(seq)
        blocks = -(-(seq.reserved + len(keys)) // self.block_tokens) - len(seq.full)
        if blocks > 0:
            self._make_room(blocks)
            seq.full += self._full.take(blocks)
            seq.sliding += self._sliding.take(blocks)
        seq.keys += keys

    def _make_room(self, blocks: int) -> None:
        """`blocks` free blocks in each pool, or StoreFull having changed nothing."""
        now = self._clock()
        short = [max(0, blocks - len(pool.free)) for pool in self._pools]
        room = [pool.limit - pool.blocks for pool in self._pools]
        victims = [pool.evictable(max(0, need - grow), now) for pool, need, grow in zip(self._pools, short, room)]
        for pool, need, grow, evictable in zip(self._pools, short, room, victims):
            if need > grow + len(evictable):
                kind = "sliding" if pool is self._sliding else "full"
                raise StoreFull(f"no room for {blocks} KV blocks: the {kind} pool has {len(pool.free)} free, "
                                f"{grow} more within its cap and {len(evictable)} evictable")
        for pool, need, grow, evictable in zip(self._pools, short, room, victims):
            if need:
                # Grow before evicting (a cached block may be hit again), doubling: few copies on the way up.
                pool.grow(min(grow, max(need, pool.blocks, GROW_BLOCKS - pool.blocks)))
                evicted = evictable[: max(0, blocks - len(pool.free))]
                self._pins_broken += pool.pinned_now(evicted, now)
                pool.evict(evicted)
                self._evictions += len(evicted)

    def start_turn(self) -> None:
        """A new turn is being built: no read has given way in it yet (`give_way`)."""
        self._gave_way = False

    def give_way(self) -> bool:
        """A read found no room (StoreFull): True if it fails now, counted (the first such read of the
        turn), False if it waits for the next turn, when the blocks of the one that failed are back.
        Reads that all grow at once (long states chunked together) would otherwise all fail in the
        turn the store fills; this way one a turn gives way and the others go on."""
        if self._gave_way:
            return False
        self._gave_way = True
        self._store_full += 1
        return True

    def mark_written(self, seq: SequenceKV, upto: int) -> None:
        """The KV of positions [.., upto) is written. Each block now whole becomes shareable (unless an
        equal block already is: that one stays the shared one), and the sliding blocks wholly before
        the window of the last whole block's end are released. Call it once the turn's attention no
        longer reads them."""
        self._check_open(seq)
        if upto > seq.reserved:
            raise ValueError(f"position {upto} is past the {seq.reserved} reserved")
        if upto <= seq.written:
            return
        size = self.block_tokens
        for index in range(len(seq.chain), upto // size):
            self._name(seq, index)
        seq.written = upto
        # The held sliding blocks run from some block to the tail: release those now before the
        # window, earliest first (so evicted first: a later block serves longer prefixes).
        first = start = self._first_held(upto // size * size)
        while start > 0 and seq.sliding[start - 1] is not None:
            start -= 1
        for index in range(start, first):
            block, seq.sliding[index] = seq.sliding[index], None
            if block is not None:
                self._sliding.release(block)

    def close(self, seq: SequenceKV, pin_seconds: float = 0.0) -> None:
        """The sequence is done: its references are released. Blocks not whole and written go back to
        the free list; the others stay cached (evictable). With pin_seconds > 0 the shared copies of
        its whole blocks (every full one, the sliding ones it holds: what reopening it at its last
        whole block reads) are pinned for that long. Closing twice is harmless."""
        if seq.closed:
            return
        seq.closed = True
        named = [self._name(seq, index) for index in range(len(seq.chain))]
        if pin_seconds > 0:
            until = self._clock() + pin_seconds
            for (full, sliding), own in zip(named, seq.sliding):
                self._full.pin(full, until)
                if sliding is not None and own is not None:
                    self._sliding.pin(sliding, until)
        # Tail first: of the blocks released together the last is evicted first, so a prompt's cached
        # prefix shortens rather than losing its beginning.
        for index in reversed(range(len(seq.full))):
            self._full.release(seq.full[index])
            sliding = seq.sliding[index]
            if sliding is not None:
                self._sliding.release(sliding)

    def _name(self, seq: SequenceKV, index: int) -> tuple[int, int | None]:
        """Makes the sequence's whole written block `index` shareable: in each pool its own block is
        named unless an equal one already is (one evicted since is replaced by it), and
        seq.chain[index] is the named one's identity. Returns the named full and sliding blocks."""
        size = self.block_tokens
        name = (seq.chain[index - 1] if index else ROOT, tuple(seq.keys[index * size:(index + 1) * size]))
        full = self._full.registry.get(name)
        if full is None:
            full = seq.full[index]
            if index == len(seq.chain):  # a chain not seen before
                self._identities += 1
                seq.chain.append(self._identities)
            self._full.register(full, name, seq.chain[index])
        identity = self._full.ident[full]
        seq.chain[index:index + 1] = [identity]  # set, or appended as the chain's next
        sliding = self._sliding.registry.get(identity)
        own = seq.sliding[index]
        if sliding is None and own is not None:
            sliding = own
            self._sliding.register(own, identity, identity)
        return full, sliding

    def _first_held(self, boundary: int) -> int:
        """The first sliding block a sequence continuing at `boundary` (a block boundary) reads: the
        one holding position boundary − (window − 1)."""
        return max(0, (boundary - self.window + 1) // self.block_tokens)

    def sliding_bound(self, unwritten: int = 0) -> int:
        """The most sliding blocks a sequence holds with all but `unwritten` of its reserved positions
        written: ceil((W − 1) / B) + ceil((unwritten + B − 1) / B). With all written, ceil((W − 1) / B)
        + 1 (one fewer while it stands at a block boundary)."""
        size = self.block_tokens
        return -(-(self.window - 1) // size) + -(-(unwritten + size - 1) // size)

    @staticmethod
    def _check_open(seq: SequenceKV) -> None:
        if seq.closed:
            raise ValueError("the sequence is closed")

    # ------------------------------------------------------------------ accounting

    @property
    def totals(self) -> dict[str, int]:
        """The running counts alone (what the engine copies into its counters every turn; `stats`
        also walks the pins): reads refused for room, blocks evicted, pins broken."""
        return {"store_full": self._store_full, "evictions": self._evictions, "pins_broken": self._pins_broken}

    @property
    def levels(self) -> dict[str, int]:
        """The blocks used, cached and allocated now, both pools: what `stats` says of them, counted
        without walking the pins (the engine copies them into its gauges every turn)."""
        pools = self._pools
        return {"blocks_used": sum(pool.blocks - len(pool.free) - len(pool.lru) for pool in pools),
                "blocks_cached": sum(len(pool.lru) for pool in pools),
                "blocks_allocated": sum(pool.blocks for pool in pools)}

    @property
    def stats(self) -> dict[str, int]:
        """Blocks of both pools: allocated = used (referenced) + cached (whole, unreferenced) + free;
        pinned: the cached ones pinned now. bytes: the pools' allocated bytes."""
        now, pools = self._clock(), self._pools
        return {
            "blocks_allocated": sum(pool.blocks for pool in pools),
            "blocks_used": sum(pool.blocks - len(pool.free) - len(pool.lru) for pool in pools),
            "blocks_cached": sum(len(pool.lru) for pool in pools),
            "blocks_pinned": sum(pool.pinned(now) for pool in pools),
            "blocks_free": sum(len(pool.free) for pool in pools),
            "full_blocks": self._full.blocks,
            "sliding_blocks": self._sliding.blocks,
            "full_limit": self._full.limit,  # the blocks each pool may hold (its share of max_bytes)
            "sliding_limit": self._sliding.limit,
            "full_block_bytes": self._full.block_bytes,
            "sliding_block_bytes": self._sliding.block_bytes,
            "bytes": sum(pool.blocks * pool.block_bytes for pool in pools),
            "hit_tokens": self._hit_tokens,
            **self.totals,  # pins_broken: pinned blocks evicted for a running read's room
        }
