"""The default attention implementation (`KVSERVE_ATTENTION=vllm`): vLLM's own CPU ops over head-granular pages, then
kvserve's eviction step in the same layer pass.

Every request is written and read through the page view (`kvserve/worker/pages.py`) with vLLM's
`cpu_attn_reshape_and_cache` and `cpu_attention_with_kv_cache`, called on pseudo-sequences: one row per (KV head,
request), one KV head, the G query heads of that KV head (`kvserve/worker/step.py`). On vLLM 0.32 this call is
bit-identical to the normal one for requests that do not evict (`tests/test_head_pages.py`), and lets each
(layer, head) of an evicting request keep its own count in its own pages.

The stock kernel returns no probabilities. The rows of requests whose policy reads statistics of every step's
queries (H2O and EMS their column sums, MAT its first logits) are therefore computed by kvserve's CPU kernel instead
(`kvserve_kernels.cpu`, routed by `kvserve/worker/fused.py`): output and statistics from one pass over their pages,
while vLLM's op computes the other rows. Statistics needed only at a compaction (SnapKV's and AhaKV's windows, TOVA's
last query) are measured right after, from the pages the step just read, by the same kernel without the output (or
page-wise PyTorch where the kernel does not read the cache: fp8, or no compiler). Compaction happens here too, after
this layer's attention for the step is done, so the step's output is unaffected and the next step reads the
compacted lists.
"""

from __future__ import annotations

from typing import Any

import torch
from kvserve_kernels import cpu as cpu_kernel
from vllm import _custom_ops as ops
from vllm import envs
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

from kvserve import phases
from kvserve.vllm.model import is_drafter_layer, layer_index, pages_this_layer
from kvserve.worker import fused, layouts
from kvserve.worker.eviction import after_attention, pseudo_queries, relocate_protected
from kvserve.worker.step import StepPages, current_step


class KVServeAttentionImpl(CPUAttentionBackendImpl):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # vLLM's constructor as it is (its parameters are checked at `attention_init`, kvserve/vllm/points.py)
        super().__init__(*args, **kwargs)
        self.paged = pages_this_layer(self, "KVSERVE_ATTENTION=vllm")
        self._layout: layouts.CachePages | None = None
        if self.paged and cpu_kernel.enabled():
            cpu_kernel.load()  # built or loaded at start-up (once per process), not at the first request that needs it

    def do_kv_cache_update(
        self, layer, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        step = current_step()
        # a dummy run, or a layer that stays vLLM's (a draft model's too): vLLM's own slots
        if step is None or not self.paged or is_drafter_layer(layer):
            return super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        pages = step.pages
        tokens = pages.num_tokens
        page_keys, page_values = split_pages(pages)
        with phases.timed("attention"):
            ops.cpu_attn_reshape_and_cache(
                key[:tokens].reshape(-1, 1, self.head_size),
                value[:tokens].reshape(-1, 1, self.head_size),
                page_keys,
                page_values,
                pages.slots[layer_index(layer, pages.layout)],
                layer.isa,
                k_scale=layer._k_scale_float,
                v_scale=layer._v_scale_float,
                kv_cache_dtype=self.kv_cache_dtype,
            )

    def forward(
        self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None, output_block_scale=None
    ) -> torch.Tensor:
        step = current_step()
        if step is None or attn_metadata is None or not self.paged or is_drafter_layer(layer):
            return super().forward(
                layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale
            )
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported by kvserve's attention")
        pages = step.pages
        layer_idx = layer_index(layer, pages.layout)
        tokens = pages.num_tokens
        cache = self._cache_pages(pages.pages, layer) if step.rows else None
        measured = None
        with phases.timed("attention"):
            rows = pseudo_queries(query[:tokens], self.num_kv_heads)
            out_rows = torch.empty_like(rows)
            split = step.memo("fused", lambda: fused.plan_split(step, self.num_kv_heads)) if cache else None
            if split is not None and cache.uses_kernel():  # these rows' attention and statistics in one pass
                measured = split.run(
                    layer_idx,
                    query[:tokens],
                    rows,
                    out_rows,
                    cache,
                    self.scale,
                    lambda *part: self._vllm_attention(layer, query, pages, layer_idx, *part, part="unfused"),
                )
            else:
                self._vllm_attention(
                    layer,
                    query,
                    pages,
                    layer_idx,
                    rows,
                    out_rows,
                    pages.query_start_loc,
                    pages.seq_lens[layer_idx],
                    pages.tables[layer_idx],
                )
            output[:tokens] = (
                out_rows.view(self.num_kv_heads, tokens, -1, self.head_size)
                .transpose(0, 1)
                .reshape(output[:tokens].shape)
            )
        if step.rows:
            self._evict(step, layer, layer_idx, query, output, cache, measured)
        return output

    def _vllm_attention(
        self,
        layer,
        query: torch.Tensor,
        pages: StepPages,
        layer_idx: int,
        rows: torch.Tensor,
        out_rows: torch.Tensor,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        block_table: torch.Tensor,
        part: str = "all",
    ) -> None:
        """vLLM's CPU attention op on pseudo rows (`part` names which, for the work partition it reuses)."""
        page_keys, page_values = split_pages(pages)
        metadata = pages.metadata(layer_idx, part, seq_lens, self._metadata_builder(layer, query, query_start_loc))
        ops.cpu_attention_with_kv_cache(
            query=rows,
            key_cache=page_keys,
            value_cache=page_values,
            output=out_rows,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            scale=self.scale,
            causal=True,
            alibi_slopes=None,
            sliding_window=-1,
            block_table=block_table,
            softcap=self.logits_soft_cap,
            scheduler_metadata=metadata,
            s_aux=None,
            dynamic_causal=None,
            k_scale=layer._k_scale_float,
            v_scale=layer._v_scale_float,
            kv_cache_dtype=self.kv_cache_dtype,
        )

    def _metadata_builder(self, layer, query: torch.Tensor, query_start_loc: torch.Tensor):
        group = self.num_heads // self.num_kv_heads

        def build(seq_lens: torch.Tensor):
            return ops.cpu_attn_get_scheduler_metadata(
                num_reqs=seq_lens.shape[0],
                num_heads=group,
                num_kv_heads=1,
                head_dim=self.head_size,
                seq_lens=seq_lens,
                dtype=query.dtype,
                query_start_loc=query_start_loc,
                causal=True,
                sliding_window_size=-1,
                isa=layer.isa,
                enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
                kv_cache_dtype=self.kv_cache_dtype,
            )

        return build

    def _evict(self, step, layer, layer_idx: int, query: torch.Tensor, output: torch.Tensor, cache, measured) -> None:
        relocate_protected(step, layer_idx, cache)
        after_attention(step, layer_idx, query, cache, step.tables(layer_idx), self.scale, output, measured=measured)

    def _cache_pages(self, pages: torch.Tensor, layer) -> layouts.CachePages:
        """The page view in the layout vLLM picked for this layer (its ISA, fixed at engine start), read through
        the layer's fp8 scales on a quantised cache: made once and kept while the page view is the same tensor."""
        if not layouts.same_view(self._layout, pages):
            self._layout = layouts.for_cache(
                pages, getattr(layer, "isa", "vec"), self.kv_cache_dtype, layer._k_scale_float, layer._v_scale_float
            )
        return self._layout


def split_pages(pages: StepPages) -> tuple[torch.Tensor, torch.Tensor]:
    """The page view as the key and value halves vLLM's ops take (as `CPUAttentionBackendImpl.forward` splits a
    layer's cache): [P, 1, block_size, D] each."""
    if pages.key_value_pages is None:  # made once per step, for every layer
        view = pages.pages
        pages.key_value_pages = view.view(view.shape[0], 1, 2 * view.shape[2], -1).chunk(2, dim=2)
    return pages.key_value_pages
