"""kvserve's own paged attention (attention mode `kernels`): the attention output AND the eviction statistics come
from one `kvserve.worker.kernel_dispatch` operation per layer, over the head-granular page view.

This is the GPU path of the design: on CUDA the operations are the fused Triton kernels of `kvserve_kernels`, where
the scores cost one extra fp32 write per (query head, entry) of a pass that reads every key anyway. On CPU the same
operations run as their PyTorch references, slower than vLLM's C++ kernel, so there the mode is opt-in
(`KVSERVE_ATTENTION=kernels`) and exists to run the whole path in the real engine; the default CPU mode (`vllm`)
keeps vLLM's kernel and measures the statistics after it (`kvserve/vllm/attention.py`).

The pages are read in the FlashAttention form (`kvserve/worker/layouts/flash.py`): `[pages, block_size, 1, head_size]`
keys and values, each slot's key then its value, which is what the kernels need; the kernels take the same
pseudo rows as vLLM's op in the default mode (one per (KV head, request), one KV head), so the two modes differ only
in the interior of a page, never in which pages a request holds. This backend writes the pages itself and vLLM's CPU
kernels never touch them.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

from kvserve.policies.base import PassStatistics
from kvserve.vllm.model import layer_index, pages_this_layer
from kvserve.worker import kernel_dispatch
from kvserve.worker.eviction import after_attention, pseudo_queries, relocate_protected
from kvserve.worker.kernel_dispatch import ATTENTION_ENV
from kvserve.worker.layouts import CachePages, FlashPages, same_view
from kvserve.worker.step import current_step


class KVServeKernelAttentionImpl(CPUAttentionBackendImpl):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # vLLM's constructor as it is (its parameters are checked at `attention_init`, kvserve/vllm/points.py)
        super().__init__(*args, **kwargs)
        self.paged = pages_this_layer(self, f"{ATTENTION_ENV}=kernels")
        self._layout: CachePages | None = None
        if self.paged and self.logits_soft_cap:
            raise RuntimeError(
                f"{ATTENTION_ENV}=kernels does not support logit soft-capping (this model uses it); "
                f"run with {ATTENTION_ENV}=vllm"
            )

    def do_kv_cache_update(
        self, layer, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        if not self.paged:  # a layer that stays vLLM's (a model that does not evict, a sliding-window layer)
            return super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        step = current_step()
        if step is None:  # a dummy run: its output is thrown away, and nothing reads what it would write
            return
        pages = step.pages
        tokens = pages.num_tokens
        slots = pages.slots[layer_index(layer, pages.layout)]
        written = slots >= 0  # padded tokens carry slot -1
        self._cache_pages(pages.pages).write_slots(
            slots[written],
            key[:tokens].reshape(-1, self.head_size)[written],
            value[:tokens].reshape(-1, self.head_size)[written],
        )

    def forward(
        self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None, output_block_scale=None
    ) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise RuntimeError(f"{ATTENTION_ENV}=kernels does not fuse output quantisation")
        if not self.paged:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output)
        step = current_step()
        if attn_metadata is None or step is None:  # warm-up or a dummy run: nothing reads this output
            output.zero_()
            return output
        pages = step.pages
        layer_idx = layer_index(layer, pages.layout)
        tokens, num_reqs, heads = pages.num_tokens, pages.num_reqs, self.num_kv_heads
        cache = self._cache_pages(pages.pages)
        rows = pseudo_queries(query[:tokens], heads)
        tables, seq_lens = pages.tables[layer_idx], pages.seq_lens[layer_idx]
        column_plans = step.pass_rows("column_sums")
        width = max((int(plan.lengths(layer_idx).max()) for plan in column_plans), default=0)
        first_plans, first, sums = [], None, None
        max_seq_len = int(seq_lens.max())
        if attn_metadata.max_query_len == 1:  # a decode batch: one query per request, so per pseudo row
            first_plans = step.pass_rows("first_logits")
            sums = torch.zeros(heads * num_reqs, 1, width, device=query.device) if column_plans else None
            if first_plans:
                first = torch.empty(heads * num_reqs, rows.shape[1], device=query.device)
            out, _ = kernel_dispatch.decode_attention_with_scores(
                rows,
                cache.views.keys,
                cache.views.values,
                tables,
                seq_lens,
                self.scale,
                scores=sums,
                first_logit=first,
                max_seq_len=max_seq_len,
                backend=cache.backend,
            )
        else:  # prefill, chunked prefill or a mixed batch: causal varlen attention (first logits: the policy's)
            out, sums, _ = kernel_dispatch.prefill_attention_with_window_sums(
                rows,
                cache.views.keys,
                cache.views.values,
                tables,
                seq_lens,
                pages.query_start_loc,
                self.scale,
                attn_metadata.max_query_len if column_plans else 0,
                max_slots=width,
                max_seq_len=max_seq_len,
                max_query_len=attn_metadata.max_query_len,
                backend=cache.backend,
            )
        output[:tokens] = out.view(heads, tokens, -1, self.head_size).transpose(0, 1).reshape(output[:tokens].shape)
        if not step.rows:
            return output
        head_rows = torch.arange(heads) * num_reqs  # pseudo row of (head h, request r) = h * R + r
        with_columns = {plan.req_id for plan in column_plans}
        with_first = {plan.req_id for plan in first_plans}
        measured = {}
        for plan in {plan.req_id: plan for plan in column_plans + first_plans}.values():
            n = int(plan.lengths(layer_idx).max())
            measured[plan.req_id] = PassStatistics(
                column_sums=sums[head_rows + plan.row, 0, :n] if plan.req_id in with_columns else None,
                first_logits=first[head_rows + plan.row].reshape(1, -1) if plan.req_id in with_first else None,
            )
        relocate_protected(step, layer_idx, cache)
        after_attention(
            step,
            layer_idx,
            query,
            cache,
            step.tables(layer_idx),
            self.scale,
            output,
            measured=measured,
        )
        return output

    def _cache_pages(self, pages: torch.Tensor) -> CachePages:
        """The page view in the FlashAttention layout: made once and kept while the page view is the same tensor."""
        if not same_view(self._layout, pages):
            self._layout = FlashPages(pages)
        return self._layout
