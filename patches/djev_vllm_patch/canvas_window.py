"""Anchor the sliding window of DiffusionGemma canvas queries at the canvas start (CPU backend).

Why: transformers' DiffusionGemma (the reference) lets every canvas position attend to the whole
cached sliding window of the prompt (its last W - 1 keys) plus the whole canvas: for a canvas
starting at position C, key k is visible to every canvas query iff k >= C - W + 1. vLLM 0.32 instead
gives each canvas query q its own window (k visible iff q - k < W), because DiffusionGemma's
`prepare_attn` only switches the per-request `causal` flag off for canvas passes and never changes
the window. So once prompt + canvas is longer than W, the canvas positions near its end lose prompt
keys that transformers keeps, and slot probabilities differ (0.97 at worst on the tiny model).

How (no kernel change): the CPU kernel places the q_len queries of a request at
seq_len - q_len + i. A canvas request of width L with seq_len S = C + L is split into L one-token
requests with the same seq_len and block-table row. Each query then sits at S - 1, and a window of
W + L - 1 puts the left edge at S - 1 - (W + L - 1) + 1 = C - W + 1, transformers' edge; the right
edge stays S (non-causal). One extra kernel call per sliding layer recomputes only those canvas rows
and overwrites them. Requests with S <= W are left alone (every key is already visible to every
query), so reads inside the window are bit-for-bit vLLM's own; causal rows (prefill, commit) are
never touched.

How to tell upstream no longer needs it: run djev's parity test (tests/patches/) with this patch
disabled (DJEV_VLLM_PATCH_DISABLE=canvas_window). When slot probabilities past the window match
transformers within 1e-4 on stock vLLM (e.g. DiffusionGemma's `prepare_attn` anchors the window at
the canvas start per request), delete this module.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

log = logging.getLogger("vllm.djev_vllm_patch")

_MARK = "_djev_canvas_window"
_counters = {"rows": 0, "mixed_steps": 0}


def installed() -> bool:
    """Whether the fix is installed on vLLM's CPU attention backend in this process."""
    from vllm.v1.attention.backends import cpu_attn

    return bool(getattr(cpu_attn.CPUAttentionMetadataBuilder, _MARK, False))


def rows_anchored() -> int:
    """Canvas rows recomputed with the anchored window in this process (all layers, all steps)."""
    return _counters["rows"]


def mixed_steps() -> int:
    """Batches (per KV-cache group) in which anchored canvas passes shared the step with causal rows
    (prompt prefill or commit chunks)."""
    return _counters["mixed_steps"]


@dataclass(frozen=True)
class AnchoredRows:
    """One extra kernel call for the canvas requests of one width L, for one sliding window W."""

    rows: torch.Tensor  # token indices of the canvas rows in the batch
    query_start_loc: torch.Tensor  # 0..n: one query per row
    seq_lens: torch.Tensor  # each row's request seq_len
    block_table: torch.Tensor  # each row's request block-table row
    window: int  # W + L - 1
    scheduler_metadata: torch.Tensor


def _sliding_windows(builder) -> tuple[int, ...]:
    """The sliding windows of the decoder layers of this builder's group (cached on the builder);
    empty for groups without one, and for models that are not diffusion models."""
    cached = getattr(builder, "_djev_windows", None)
    if cached is not None:
        return cached
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention import Attention
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    windows: set[int] = set()
    is_diffusion = bool(getattr(builder.vllm_config.model_config, "is_diffusion", False))
    if is_diffusion and not builder.is_encoder_only_attention and not builder.is_cross_attention:
        layers = get_layers_from_vllm_config(builder.vllm_config, Attention, builder.layer_names)
        windows = {layer.impl.sliding_window for layer in layers.values()
                   if isinstance(layer.impl, CPUAttentionBackendImpl) and layer.impl.sliding_window > 0}
    builder._djev_windows = tuple(sorted(windows))
    return builder._djev_windows


def _anchored_rows(builder, metadata, common) -> dict[int, list[AnchoredRows]]:
    """Per sliding window, the extra kernel calls this batch needs (empty when none)."""
    from vllm import _custom_ops as ops
    from vllm import envs

    windows = _sliding_windows(builder)
    if metadata.dynamic_causal is None or not windows:
        return {}
    num_reqs = common.num_reqs
    causal = metadata.dynamic_causal[:num_reqs].to("cpu").tolist()
    starts = common.query_start_loc_cpu[: num_reqs + 1].tolist()
    seq_lens = common.seq_lens[:num_reqs].to("cpu")
    plans: dict[int, list[AnchoredRows]] = {}
    for window in windows:
        by_width: dict[int, list[int]] = {}
        for req in range(num_reqs):
            width = starts[req + 1] - starts[req]
            # Canvas passes only, and only where the window can hide a key from some query.
            if not causal[req] and width > 0 and int(seq_lens[req]) > window:
                by_width.setdefault(width, []).append(req)
        for width, reqs in by_width.items():
            index = torch.tensor(reqs, dtype=torch.int64)
            rows = torch.cat([torch.arange(starts[r], starts[r + 1], dtype=torch.int64) for r in reqs])
            count = rows.numel()
            query_start_loc = torch.arange(count + 1, dtype=common.query_start_loc_cpu.dtype)
            row_seq_lens = common.seq_lens[:num_reqs].index_select(0, index.to(common.seq_lens.device))
            row_seq_lens = row_seq_lens.repeat_interleave(width).contiguous()
            table = common.block_table_tensor[:num_reqs].index_select(0, index.to(common.block_table_tensor.device))
            table = table.repeat_interleave(width, dim=0).contiguous()
            anchored_window = window + width - 1
            scheduler_metadata = ops.cpu_attn_get_scheduler_metadata(
                num_reqs=count,
                num_heads=builder.num_heads,
                num_kv_heads=builder.num_kv_heads,
                head_dim=builder.head_dim,
                seq_lens=row_seq_lens,
                dtype=builder.dtype,
                query_start_loc=query_start_loc,
                causal=False,
                sliding_window_size=anchored_window,
                isa=builder.isa,
                enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
                dynamic_causal=None,
                kv_cache_dtype=builder.kv_cache_dtype,
            )
            plans.setdefault(window, []).append(AnchoredRows(
                rows=rows, query_start_loc=query_start_loc, seq_lens=row_seq_lens, block_table=table,
                window=anchored_window, scheduler_metadata=scheduler_metadata))
    if plans and any(causal[r] and starts[r + 1] > starts[r] for r in range(num_reqs)):
        _counters["mixed_steps"] += 1
    return plans


def install() -> None:
    """Wrap CPUAttentionMetadataBuilder.build and CPUAttentionBackendImpl.forward (idempotent)."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backend import AttentionType
    from vllm.v1.attention.backends import cpu_attn

    builder_cls = cpu_attn.CPUAttentionMetadataBuilder
    impl_cls = cpu_attn.CPUAttentionBackendImpl
    if getattr(builder_cls, _MARK, False):
        return
    original_build = builder_cls.build
    original_forward = impl_cls.forward

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        metadata = original_build(self, common_prefix_len, common_attn_metadata, fast_build)
        metadata.djev_anchored = _anchored_rows(self, metadata, common_attn_metadata)
        return metadata

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        result = original_forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                                  output_scale=output_scale, output_block_scale=output_block_scale)
        if attn_metadata is None or self.sliding_window <= 0 or self.attn_type != AttentionType.DECODER:
            return result
        plans = getattr(attn_metadata, "djev_anchored", None) or {}
        calls = plans.get(self.sliding_window)
        if not calls:
            return result
        num_blocks, num_kv_heads, block_size, _ = kv_cache.size()
        key_cache, value_cache = kv_cache.view((num_blocks, num_kv_heads, block_size * 2, -1)).chunk(2, dim=2)
        for call in calls:
            rows_out = output.index_select(0, call.rows)
            ops.cpu_attention_with_kv_cache(
                query=query.index_select(0, call.rows),
                key_cache=key_cache,
                value_cache=value_cache,
                output=rows_out,
                query_start_loc=call.query_start_loc,
                seq_lens=call.seq_lens,
                scale=self.scale,
                causal=False,
                alibi_slopes=self.alibi_slopes,
                sliding_window=call.window,
                block_table=call.block_table,
                softcap=self.logits_soft_cap,
                scheduler_metadata=call.scheduler_metadata,
                s_aux=self.sinks,
                dynamic_causal=None,
                k_scale=layer._k_scale_float,
                v_scale=layer._v_scale_float,
                kv_cache_dtype=self.kv_cache_dtype,
            )
            output.index_copy_(0, call.rows, rows_out)
            _counters["rows"] += call.rows.numel()
        return result

    builder_cls.build = build
    impl_cls.forward = forward
    setattr(builder_cls, _MARK, (original_build, original_forward))
    log.info("djev_vllm_patch: canvas sliding window anchored at the canvas start (CPU_ATTN)")


def uninstall() -> None:
    """Restore vLLM's own methods (tests compare before and after in one process)."""
    from vllm.v1.attention.backends import cpu_attn

    originals = getattr(cpu_attn.CPUAttentionMetadataBuilder, _MARK, False)
    if not originals:
        return
    cpu_attn.CPUAttentionMetadataBuilder.build, cpu_attn.CPUAttentionBackendImpl.forward = originals
    setattr(cpu_attn.CPUAttentionMetadataBuilder, _MARK, False)
