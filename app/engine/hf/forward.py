"""One forward over a turn's flat batch: every prompt token and every canvas token of the turn through
the weights once.

The encoder and the decoder are one weight set used two ways (their layers are tied), so each layer's
projections, norms, router and experts run on all T tokens at once, and only what the two stacks do
not share is applied per token:

- the embedding: a prompt token's is the encoder's (or, for an image prompt, the embeddings given
  whole, image features merged); a canvas token's is the decoder's, then the self-conditioning block,
  which, with a zero signal (a first step), still sends it through its unscaled RMSNorm;
- attention: by segment (`attention.py`), after the prompt tokens' keys and values are written into
  their sequences' blocks;
- `layer_scalar`: separate buffers in the two stacks, each token scaled by its own stack's.

Returned: the hidden states, after the decoder's final norm, at the rows the layout asks logits for.

With a `PiecewiseConfig` (app/engine/hf/graphs/pieces.py) the layers run as pieces cut at every
attention (`PiecewiseForward`): each piece reads and writes static buffers sized for the largest
token-count bucket, a turn is padded up to its bucket, and on CUDA every piece of every bucket is a
CUDA graph captured before `ready` into one memory pool. What depends on the turn's segments stays
eager, between and around the pieces: the embeddings (self-conditioning, images given whole), the
prompt tokens' KV writes, the attention, and the final norm at the logit rows.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence

import torch

from app.engine.hf.graphs.cache import GraphCache
from app.engine.hf.graphs.pieces import GraphReport, PiecewiseConfig, bucket_for
from app.engine.hf.layers import attention_inputs, unscaled_output
from app.engine.hf.layout import TurnLayout
from app.engine.hf.parts import decoder_layers, encoder_layers, layer_types, text_config

if TYPE_CHECKING:
    from transformers import DiffusionGemmaForBlockDiffusion

    from app.engine.hf.blocks import KVStore, SequenceKV
    from app.engine.hf.graphs.cache import PoolHandle
    from app.engine.hf.layers import TextLayer

log = logging.getLogger("djev.engine")


class Attention(Protocol):
    """An attention backend of the flat turn (app/engine/hf/attention.py: `ReferenceAttention`,
    `SegmentAttention`): its metadata once a turn (`plan`), then each layer's attention (`attend`)
    over queries [heads, rows, dim] and keys and values [kv heads, rows, dim], of which it reads the
    layout's first rows (a bucket's padding follows them), written into `out` where given."""

    def plan(self, layout: TurnLayout, sequences: Sequence[SequenceKV], device: torch.device | str) -> Any: ...

    def attend(self, layer: int, sliding: bool, scaling: float, queries: torch.Tensor, keys: torch.Tensor,
               values: torch.Tensor, plan: Any, out: torch.Tensor | None = None) -> torch.Tensor: ...


@dataclass
class TurnInputs:
    """The token-level inputs of a turn, on the model's device."""

    ids: torch.Tensor  # [T] each token's id (an image soft token's embedding comes from `embeds`)
    embeds: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (flat start, [n, hidden]) given whole
    conditioning: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (flat start, [n, vocab]) logits


def untied(model: DiffusionGemmaForBlockDiffusion) -> list[str]:
    """The encoder's parameters that the decoder does not share (by storage): empty for a DiffusionGemma
    built or loaded as transformers ties it. The flat forward runs the encoder's layers for both stacks,
    so it refuses a model where this is not empty."""
    names = []
    for index, (encoder, decoder) in enumerate(zip(encoder_layers(model), decoder_layers(model))):
        theirs = dict(decoder.named_parameters())
        for name, parameter in encoder.named_parameters():
            other = theirs.get(name)
            if other is None or other.data_ptr() != parameter.data_ptr():
                names.append(f"layers.{index}.{name}")
    return names


def layer_output(layer: TextLayer, attention_out: torch.Tensor, residual: torch.Tensor, canvas: torch.Tensor,
                 decoder_scalar: torch.Tensor) -> torch.Tensor:
    """A layer's output [1, T, hidden] from its attention's [1, T, heads, dim] and its input, each token
    scaled by its own stack's `layer_scalar` (`canvas` [T]: the decoder's, else the encoder's)."""
    scalars = torch.where(canvas[:, None], decoder_scalar, layer.layer_scalar)
    return unscaled_output(layer, attention_out, residual) * scalars


class FlatForward:
    """The model's text stacks as one forward over a flat batch (`__call__`): eagerly, or, given
    `graphs`, through `PiecewiseForward` (`self.graphs`) for the turns a bucket holds. `stats` (the
    runner's counters) gets the graphs' counts (`flat_graphs_built`, `flat_graph_fallbacks`, ...);
    `pool`, the graph memory pool to capture into (the runner's, shared with its other graphs; None:
    a pool of their own)."""

    def __init__(self, model: DiffusionGemmaForBlockDiffusion, store: KVStore,
                 attention: Attention, graphs: PiecewiseConfig | None = None,
                 stats: Counter[str] | None = None, pool: PoolHandle | None = None) -> None:
        loose = untied(model)
        if loose:
            raise ValueError(f"the encoder's and decoder's layers are not tied ({', '.join(loose[:3])}, ...): "
                             "the flat turn runs one weight set for both")
        self.store = store
        self.attention = attention
        self.layers = encoder_layers(model)
        self.decoder_scalars = [layer.layer_scalar for layer in decoder_layers(model)]
        self.sliding = [kind == "sliding_attention" for kind in layer_types(model)]
        self.embed = model.model.encoder.language_model.embed_tokens
        decoder = model.model.decoder
        self.canvas_embed = decoder.embed_tokens
        self.self_conditioning = decoder.self_conditioning
        self.rotary = decoder.rotary_emb
        self.norm = decoder.norm
        self.stats: Counter[str] = stats if stats is not None else Counter()
        # A layer's two bodies around its attention; `compile` swaps in compiled ones (TORCH_COMPILE).
        self.inputs: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = attention_inputs
        self.output: Callable[..., torch.Tensor] = layer_output
        self.graphs = PiecewiseForward(self, model, graphs, self.stats, pool) if graphs is not None else None

    def compile(self, wrap: Callable[[Callable], Callable]) -> None:
        """Run the layers' two bodies through `wrap` (torch.compile, TORCH_COMPILE): one compiled body
        each for every layer of a kind (the layer is an argument), fusing the norms, rotary, router
        and residual arithmetic the pieces otherwise run kernel by kernel. Before the graphs are
        captured: their first runs compile, so nothing compiles after `ready`."""
        self.inputs = wrap(attention_inputs)
        self.output = wrap(layer_output)

    @torch.no_grad()
    def __call__(self, layout: TurnLayout, sequences: Sequence[SequenceKV], inputs: TurnInputs) -> torch.Tensor:
        """Hidden states [rows, hidden] at `layout.logit_rows()`, in that order, after the decoder's
        final norm; every prompt segment's KV written into its sequence's blocks."""
        if self.graphs is not None:
            hidden = self.graphs(layout, sequences, inputs)
            if hidden is not None:
                return hidden
        return self.eager(layout, sequences, inputs)

    @torch.no_grad()
    def eager(self, layout: TurnLayout, sequences: Sequence[SequenceKV], inputs: TurnInputs) -> torch.Tensor:
        """`__call__` layer by layer over the turn's own tokens: the path without graphs, the one a
        turn no bucket holds takes, and the reference the pieces are checked against."""
        device = inputs.ids.device
        canvas = torch.tensor(layout.canvas_tokens(), device=device)
        hidden = self.embeddings(layout, inputs, canvas)[None]  # [1, T, hidden]
        positions = torch.tensor(layout.positions(), device=device)[None]
        rotary = {sliding: self.rotary(hidden, positions, "sliding_attention" if sliding else "full_attention")
                  for sliding in set(self.sliding)}
        rows, full_slots, sliding_slots = self.write_slots(layout, sequences, device)
        plan = self.attention.plan(layout, sequences, device)
        for index, layer in enumerate(self.layers):
            sliding = self.sliding[index]
            cos, sin = rotary[sliding]
            queries, keys, values = self.inputs(layer, hidden, cos, sin)  # [1, heads, T, dim]
            if rows.numel():
                slots = sliding_slots if sliding else full_slots
                self.store.write(index, slots, keys[0, :, rows].transpose(0, 1), values[0, :, rows].transpose(0, 1))
            out = self.attention.attend(index, sliding, layer.self_attn.scaling, queries[0], keys[0], values[0], plan)
            hidden = self.output(layer, out[None], hidden, canvas, self.decoder_scalars[index])
        wanted = torch.tensor(layout.logit_rows(), dtype=torch.long, device=device)
        return self.norm(hidden[0, wanted])

    def embeddings(self, layout: TurnLayout, inputs: TurnInputs, canvas: torch.Tensor) -> torch.Tensor:
        """[T, hidden]: the encoder's embeddings for prompt tokens (or those given whole), the decoder's
        through the self-conditioning block for canvas tokens."""
        ids = inputs.ids
        embeds = torch.where(canvas[:, None], self.canvas_embed(ids), self.embed(ids))
        for start, given in inputs.embeds:
            embeds[start:start + given.shape[0]] = given.to(embeds.dtype)
        if not bool(canvas.any()):
            return embeds
        where = canvas.nonzero()[:, 0]
        signal = torch.zeros(where.numel(), embeds.shape[-1], dtype=embeds.dtype, device=embeds.device)
        if inputs.conditioning:
            # Each canvas token's row among the canvas tokens, to place its soft embedding.
            row_of = torch.full((layout.tokens,), -1, dtype=torch.long, device=embeds.device)
            row_of[where] = torch.arange(where.numel(), device=embeds.device)
            weight = self.canvas_embed.weight
            scale = self.canvas_embed.embed_scale.to(embeds.dtype)
            for start, logits in inputs.conditioning:
                soft = torch.matmul(logits.softmax(dim=-1, dtype=torch.float32).to(weight.dtype), weight) * scale
                signal[row_of[start:start + logits.shape[0]]] = soft.to(signal.dtype)
        embeds[where] = self.self_conditioning(embeds[where][None], signal[None])[0]
        return embeds

    def write_slots(self, layout: TurnLayout, sequences: Sequence[SequenceKV],
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The flat rows of the prompt tokens and their slots in the full and the sliding pool."""
        rows, full, sliding = [], [], []
        for item in layout.prompt_runs():
            segment = item.segment
            full_slots, sliding_slots = self.store.slots(sequences[segment.sequence], segment.position,
                                                         segment.position + segment.tokens)
            rows.append(torch.arange(item.start, item.end, device=device))
            full.append(full_slots)
            sliding.append(sliding_slots)
        if not rows:
            empty = torch.zeros(0, dtype=torch.long, device=device)
            return empty, empty, empty
        return torch.cat(rows), torch.cat(full).to(device), torch.cat(sliding).to(device)


# A layer's attention shape: (query heads, KV heads, head dim). Layers of one shape share buffers.
Shape = tuple[int, int, int]


@dataclass
class _Bucket:
    """One token count's pieces: the callables, and on CUDA their graphs (replayed in their place)."""

    tokens: int
    pieces: list[Callable[[], None]]
    graphs: list[torch.cuda.CUDAGraph] = field(default_factory=list)

    def run(self, piece: int) -> None:
        if self.graphs:
            self.graphs[piece].replay()
        else:
            self.pieces[piece]()


class PiecewiseForward:
    """`FlatForward.eager` cut at every attention, over static buffers padded to a token-count bucket
    (app/engine/hf/graphs/pieces.py): `__call__` a turn, `capture_all` before `ready`, `report`.

    The buffers (zeros at allocation, so padding rows always hold finite numbers) are sized for the
    largest bucket; a bucket's pieces read and write their first `bucket` rows. A layer's queries,
    keys, values and attention output are token-major ([tokens, heads, dim]: the layout the layer's
    projections give and its output projection reads), one set a shape of layer, since only the
    layer that just ran reads them.

    Padding rows (the turn's tokens to its bucket) start each turn at zero, prompt-less and at position
    0, and go through per-token arithmetic only (norms, projections, rotary, the router and experts,
    which route each token on its own), so they cannot change a real row; they write no KV (the
    writes take the prompt rows alone) and the attention reads the turn's rows alone.

    Buckets are built on first use until `capture_all` freezes the set (the engine calls it at
    start-up, before `ready`); from then on a turn whose bucket is not held, or whose tokens are past
    the largest, runs `FlatForward.eager`, counted in `flat_graph_fallbacks`, and nothing is captured.
    """

    def __init__(self, flat: FlatForward, model: DiffusionGemmaForBlockDiffusion, config: PiecewiseConfig,
                 stats: Counter[str], pool: PoolHandle | None = None) -> None:
        self.flat = flat
        self.config = config
        self.stats = stats
        parameter = next(model.parameters())
        self.device = parameter.device
        if config.capture and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs are captured on a CUDA device, not {self.device}")
        self.pool = pool if pool is not None or not config.capture else torch.cuda.graph_pool_handle()
        self._stream = torch.cuda.Stream(self.device) if config.capture else None  # every capture's (`_capture`)
        self.pieces = len(flat.layers) + 1
        self.shapes: list[Shape] = []
        for layer in flat.layers:
            attention = layer.self_attn
            dim = attention.head_dim
            self.shapes.append((attention.q_proj.out_features // dim, attention.k_proj.out_features // dim, dim))
        largest, dtype = config.buckets[-1], parameter.dtype

        def zeros(*shape: int, kind: torch.dtype = dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=kind, device=self.device)

        self.hidden = zeros(1, largest, int(text_config(model).hidden_size))
        self.positions = zeros(1, largest, kind=torch.long)
        self.canvas = zeros(largest, kind=torch.bool)
        self.rotary: dict[bool, tuple[torch.Tensor, torch.Tensor]] = {}
        for sliding in set(flat.sliding):  # cos and sin [1, tokens, rotary dim] of each kind of layer
            cos, _ = flat.rotary(self.hidden[:, :1], self.positions[:, :1], _layer_type(sliding))
            self.rotary[sliding] = (zeros(1, largest, cos.shape[-1]), zeros(1, largest, cos.shape[-1]))
        self.queries = {shape: zeros(largest, shape[0], shape[2]) for shape in set(self.shapes)}
        self.keys = {shape: zeros(largest, shape[1], shape[2]) for shape in set(self.shapes)}
        self.values = {shape: zeros(largest, shape[1], shape[2]) for shape in set(self.shapes)}
        self.outs = {shape: zeros(largest, shape[0], shape[2]) for shape in set(self.shapes)}
        self.cache: GraphCache[int, _Bucket] = GraphCache("flat", self._build, stats)
        self.captures = 0  # CUDA graphs captured (every piece of every bucket; the reader counts any after ready)
        self.memory = 0  # device memory the captures took (`capture_all`)
        self.seconds = 0.0

    # ------------------------------------------------------------------ a turn

    @torch.no_grad()
    def __call__(self, layout: TurnLayout, sequences: Sequence[SequenceKV], inputs: TurnInputs) -> torch.Tensor | None:
        """`FlatForward.__call__` through the pieces of the turn's bucket; None where no bucket is held
        for it (counted): the caller runs it eagerly."""
        held = self.cache.get(bucket_for(layout.tokens, self.config.buckets))
        if held is None:
            return None
        flat, device = self.flat, self.device
        self.stats["flat_graph_replays" if held.graphs else "flat_piecewise_turns"] += 1
        canvas = torch.tensor(layout.canvas_tokens(), device=device)
        self._load(held.tokens, layout, flat.embeddings(layout, inputs, canvas), canvas)
        rows, full_slots, sliding_slots = flat.write_slots(layout, sequences, device)
        plan = flat.attention.plan(layout, sequences, device)
        for index, layer in enumerate(flat.layers):
            held.run(index)  # layer index - 1's post-attention, layer index's pre-attention
            sliding, shape = flat.sliding[index], self.shapes[index]
            keys, values = self.keys[shape], self.values[shape]
            if rows.numel():
                flat.store.write(index, sliding_slots if sliding else full_slots, keys[rows], values[rows])
            # The bucket's rows, [heads, bucket, dim]: the attention reads the layout's and writes their
            # output rows into the buffer the next piece reads.
            bucket = held.tokens
            flat.attention.attend(index, sliding, layer.self_attn.scaling, self.queries[shape][:bucket].transpose(0, 1),
                                  keys[:bucket].transpose(0, 1), values[:bucket].transpose(0, 1), plan,
                                  out=self.outs[shape][:bucket])
        held.run(len(flat.layers))  # the last layer's post-attention
        wanted = torch.tensor(layout.logit_rows(), dtype=torch.long, device=device)
        return flat.norm(self.hidden[0, wanted])

    def _load(self, bucket: int, layout: TurnLayout, embeds: torch.Tensor, canvas: torch.Tensor) -> None:
        """The turn's embeddings, positions and canvas flags into the buffers' first rows, and the
        bucket's padding rows after them reset: zero, position 0, prompt."""
        tokens = layout.tokens
        self.hidden[0, :tokens].copy_(embeds)
        self.hidden[0, tokens:bucket].zero_()
        positions = torch.zeros(bucket, dtype=torch.long)
        positions[:tokens] = torch.tensor(layout.positions(), dtype=torch.long)
        self.positions[0, :bucket].copy_(positions)
        self.canvas[:tokens].copy_(canvas)
        self.canvas[tokens:bucket].zero_()

    # ------------------------------------------------------------------ the pieces

    @torch.no_grad()
    def _piece(self, bucket: int, piece: int) -> None:
        """Piece `piece` over the buffers' first `bucket` rows: the rotary embeddings (piece 0) or layer
        piece - 1's post-attention, then layer piece's pre-attention (but for the last piece)."""
        if piece == 0:
            self._rotate(bucket)
        else:
            self._finish(piece - 1, bucket)
        if piece < len(self.flat.layers):
            self._begin(piece, bucket)

    def _rotate(self, bucket: int) -> None:
        hidden, positions = self.hidden[:, :bucket], self.positions[:, :bucket]
        for sliding, (cos, sin) in self.rotary.items():
            new_cos, new_sin = self.flat.rotary(hidden, positions, _layer_type(sliding))
            cos[:, :bucket].copy_(new_cos)
            sin[:, :bucket].copy_(new_sin)

    def _begin(self, index: int, bucket: int) -> None:
        """Layer `index`'s queries, keys and values into the buffers of its shape."""
        cos, sin = self.rotary[self.flat.sliding[index]]
        queries, keys, values = self.flat.inputs(self.flat.layers[index], self.hidden[:, :bucket], cos[:, :bucket],
                                                 sin[:, :bucket])  # [1, heads, bucket, dim]
        shape = self.shapes[index]
        for buffer, new in ((self.queries, queries), (self.keys, keys), (self.values, values)):
            buffer[shape][:bucket].copy_(new[0].transpose(0, 1))

    def _finish(self, index: int, bucket: int) -> None:
        """Layer `index`'s output from its attention's (in the output buffer), each token scaled by its
        own stack's layer scalar, written over the hidden buffer."""
        layer, hidden = self.flat.layers[index], self.hidden[:, :bucket]
        hidden.copy_(self.flat.output(layer, self.outs[self.shapes[index]][:bucket][None], hidden,
                                      self.canvas[:bucket], self.flat.decoder_scalars[index]))

    # ------------------------------------------------------------------ capture

    def _build(self, bucket: int) -> _Bucket:
        """A bucket's pieces; with capture, each one a CUDA graph in the shared pool (`_capture`)."""
        held = _Bucket(bucket, [partial(self._piece, bucket, piece) for piece in range(self.pieces)])
        if self.config.capture:
            for piece in held.pieces:
                held.graphs.append(self._capture(piece))
        return held

    def _capture(self, piece: Callable[[], None]) -> torch.cuda.CUDAGraph:
        """`piece` as a CUDA graph in the shared pool: run once, then recorded, both on the one side
        stream every piece is captured on. The first run is needed: a shape's first call may pick
        kernels, allocate workspaces or compile a Triton tile of the experts, none of which may
        happen while recording.

        graphs/cache.py's `capture` does the same on a new side stream each call; but the caching
        allocator reuses a freed block only on the stream that allocated it, so each piece kept its
        own temporaries in the pool (the tiny model's 98 graphs for a budget of 8192 held 1.8 GiB
        so on an H100, 30 MiB on one stream). On one stream each capture reuses the blocks the
        previous ones freed: the pool holds about the largest piece's temporaries (the full-size
        model's 434 graphs: 2.7 GiB). The phases' milliseconds go where `capture` puts them."""
        started = time.perf_counter()
        stream = self._stream
        assert stream is not None
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            piece()
        torch.cuda.synchronize(self.device)
        recorded = time.perf_counter()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            graph.capture_begin(pool=self.pool)
            try:
                piece()
            finally:
                ended = time.perf_counter()
                graph.capture_end()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        self.captures += 1
        self.stats["graph_warm_ms"] += round((recorded - started) * 1000)
        self.stats["graph_record_ms"] += round((ended - recorded) * 1000)
        self.stats["graph_instantiate_ms"] += round((time.perf_counter() - ended) * 1000)
        return graph

    def capture_all(self) -> GraphReport:
        """Every bucket's pieces captured (built, without capture), largest first so the smaller ones
        reuse its pool's memory; then frozen, the buffers zeroed again, and the set logged. A capture
        that fails freezes the set where it stands (app/engine/hf/graphs/cache.py): the buckets it
        holds serve, the others fall back."""
        started = time.perf_counter()
        before = self._reserved()
        for bucket in reversed(self.config.buckets):
            if self.cache.frozen:
                break
            if bucket not in self.cache:
                self.cache.build(bucket)
        self.cache.freeze()
        self.memory = max(0, self._reserved() - before)
        for buffer in self._buffers():  # the runs before recording left numbers there
            buffer.zero_()
        self.seconds = time.perf_counter() - started
        report = self.report()
        log.info("%s", report.line())
        return report

    def _reserved(self) -> int:
        """Device memory the caching allocator holds, after the work queued and its cache emptied."""
        if not self.config.capture:
            return 0
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        return torch.cuda.memory_reserved(self.device)

    def _buffers(self) -> list[torch.Tensor]:
        buffers = [self.hidden, self.positions, self.canvas]
        buffers += [tensor for pair in self.rotary.values() for tensor in pair]
        for group in (self.queries, self.keys, self.values, self.outs):
            buffers += group.values()
        return buffers

    def report(self) -> GraphReport:
        """The buckets held, pieces a bucket, graphs held, and the memory they and the buffers hold."""
        return GraphReport(
            buckets=tuple(sorted(self.cache)), pieces=self.pieces,
            graphs=sum(len(held.graphs) for held in self.cache.graphs()), memory_bytes=self.memory,
            buffer_bytes=sum(buffer.numel() * buffer.element_size() for buffer in self._buffers()),
            seconds=self.seconds, failed=tuple(sorted(self.cache.failed)))


def _layer_type(sliding: bool) -> str:
    return "sliding_attention" if sliding else "full_attention"
