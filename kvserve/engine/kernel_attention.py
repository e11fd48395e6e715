"""kvserve's own paged attention (attention mode `kernels`): the attention output AND the eviction statistics come
from one `kvserve.kernel_dispatch` operation per layer, over vLLM's cache read as the kernels' views.

This is the GPU path of the design: on CUDA the operations are the fused Triton kernels of `kvserve_kernels`, where
the scores cost one extra fp32 write per (query head, entry) of a pass that reads every key anyway. On CPU the same
operations run as their PyTorch references, slower than vLLM's C++ kernel, so there the mode is opt-in
(`KVSERVE_ATTENTION=kernels`) and exists to run the whole path in the real engine; the default CPU mode (`vllm`)
keeps vLLM's kernel and measures the statistics after it (`kvserve/engine/attention.py`).

The cache tensor vLLM allocates for the CPU backend, `[num_blocks, num_kv_heads, block_size, 2 * head_size]`
(LBHNC), is read in the FlashAttention form (`cache_layout.flash_views`): each slot's key, then its value, with a
contiguous head dimension, which is what the kernels need. This backend writes that cache itself and vLLM's CPU
kernels never touch it, so the two modes only differ in the interior of a block, never in its shape or its blocks.
"""

from __future__ import annotations

import torch
from vllm.v1.attention.backend import AttentionType

from kvserve import kernel_dispatch
from kvserve.engine.attention import KVServeAttentionImpl, layer_index
from kvserve.engine.cache_layout import flash_views, write_slots
from kvserve.engine.worker_state import current_step
from kvserve.kernel_dispatch import ATTENTION_ENV
from kvserve.policies.base import PassStatistics


class KVServeKernelAttentionImpl(KVServeAttentionImpl):
    def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                 logits_soft_cap=None, attn_type=AttentionType.DECODER, kv_sharing_target_layer_name=None,
                 sinks=None) -> None:
        super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                         logits_soft_cap, attn_type, kv_sharing_target_layer_name, sinks)
        unsupported = {
            "attention type other than decoder": attn_type != AttentionType.DECODER,
            "ALiBi": alibi_slopes is not None,
            "sliding window": self.sliding_window != -1,
            "logit soft-capping": bool(self.logits_soft_cap),
            "attention sinks": sinks is not None,
            "quantised KV cache": self.is_fp8_kv_cache,
            "KV sharing between layers": kv_sharing_target_layer_name is not None,
        }
        refused = [name for name, present in unsupported.items() if present]
        if refused:
            raise RuntimeError(f"{ATTENTION_ENV}=kernels does not support {', '.join(refused)} (this model uses it); "
                               f"run with {ATTENTION_ENV}=vllm")

    def do_kv_cache_update(self, layer, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor) -> None:
        tokens = min(key.shape[0], slot_mapping.shape[0])
        slots = slot_mapping[:tokens]
        written = slots >= 0  # padded tokens carry slot -1
        write_slots(flash_views(kv_cache, self.head_size), slots[written], key[:tokens][written],
                    value[:tokens][written])

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise RuntimeError(f"{ATTENTION_ENV}=kernels does not fuse output quantisation")
        if attn_metadata is None:  # warm-up
            return output
        tokens = attn_metadata.num_actual_tokens
        num_reqs = attn_metadata.query_start_loc.shape[0] - 1
        cache = flash_views(kv_cache, self.head_size)
        step = current_step()
        column_rows = step.pass_rows("column_sums") if step is not None else {}  # batch row -> its cache length
        width = max(column_rows.values(), default=0)
        queries = query[:tokens]
        block_table = attn_metadata.block_table[:num_reqs]
        seq_lens = attn_metadata.seq_lens[:num_reqs]
        first_rows: dict[int, int] = {}
        first = None
        if attn_metadata.max_query_len == 1:  # a decode batch: one query per request
            first_rows = step.pass_rows("first_logits") if step is not None else {}
            sums = torch.zeros(num_reqs, self.num_kv_heads, width, device=query.device) if column_rows else None
            if first_rows:
                first = torch.empty(num_reqs, self.num_heads, device=query.device)
            out, _ = kernel_dispatch.decode_attention_with_scores(
                queries, cache.keys, cache.values, block_table, seq_lens, self.scale, scores=sums, first_logit=first,
                max_seq_len=attn_metadata.max_seq_len)
        else:  # prefill, chunked prefill or a mixed batch: causal varlen attention (first logits: the policy's)
            out, sums, _ = kernel_dispatch.prefill_attention_with_window_sums(
                queries, cache.keys, cache.values, block_table, seq_lens, attn_metadata.query_start_loc,
                self.scale, attn_metadata.max_query_len if column_rows else 0, max_slots=width,
                max_seq_len=attn_metadata.max_seq_len, max_query_len=attn_metadata.max_query_len)
        output[:tokens] = out.view_as(output[:tokens])
        if step is None or not step.rows or self.attn_type != AttentionType.DECODER:
            return output
        layer_idx = layer_index(layer)
        measured = {row: PassStatistics(column_sums=sums[row, :, :column_rows[row]] if row in column_rows else None,
                                        first_logits=first[row : row + 1] if row in first_rows else None)
                    for row in column_rows.keys() | first_rows.keys()}
        step.after_attention(layer_idx, query, cache, attn_metadata.block_table, self.scale, output,
                             measured=measured)
        return output
