"""vLLM's FlashAttention layout (`kvserve_kernels.layout.split_kv_cache`), the one kvserve's Triton kernels read:
each slot's key, then its value. On CUDA (or with `KVSERVE_KERNELS=triton`, interpreted on CPU) the statistics and
the compaction run as the fused kernels of `kvserve.worker.kernel_dispatch`; otherwise as the page-wise PyTorch
operations every layout shares. Which one is decided once, when the layout is made."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvserve.worker import kernel_dispatch
from kvserve.worker.layouts.views import PagedKV, ViewPages


def flash_views(kv_cache: torch.Tensor, head_size: int) -> PagedKV:
    """vLLM's FlashAttention cache of one layer as `PagedKV` views (the layout the Triton kernels target)."""
    return PagedKV(*kernel_dispatch.split_kv_cache(kv_cache, head_size))


class FlashPages(ViewPages):
    name = "flash"

    def __init__(self, pages: torch.Tensor) -> None:
        super().__init__(pages, flash_views(pages, pages.shape[3] // 2))
        self.triton = kernel_dispatch.use_triton(pages.device)
        self.backend: kernel_dispatch.Backend = "triton" if self.triton else "torch"  # for every kernel call

    def query_sums(
        self,
        queries: torch.Tensor,
        tables: torch.Tensor,
        lengths: torch.Tensor,
        scale: float,
        *,
        logit_scale: torch.Tensor | None = None,
        first_logits: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not self.triton:
            return super().query_sums(
                queries, tables, lengths, scale, logit_scale=logit_scale, first_logits=first_logits
            )
        num_rows, num_queries, group, dim = queries.shape
        device, width = self.device, int(lengths.max())
        tables = tables.to(device=device, dtype=torch.int32)
        seq_lens = lengths.to(device=device, dtype=torch.int32)
        rows = queries.to(device)
        if num_queries == 1 and logit_scale is None:  # decode: sums and first logits from one pass
            sums = torch.zeros(num_rows, 1, width, device=device)
            first = torch.empty(num_rows, group, device=device) if first_logits else None
            kernel_dispatch.decode_attention_with_scores(
                rows[:, 0],
                self.views.keys,
                self.views.values,
                tables,
                seq_lens,
                scale,
                scores=sums,
                first_logit=first,
                max_seq_len=width,
                need_output=False,
                backend=self.backend,
            )
            return sums[:, 0], first
        if first_logits:
            raise ValueError("the prefill kernel does not give first logits; ask `first_logits` for them")
        starts = torch.arange(num_rows + 1, dtype=torch.int32, device=device) * num_queries
        row_scale = None if logit_scale is None else logit_scale.to(device).float().reshape(1, -1)  # per pseudo token
        _, sums, _ = kernel_dispatch.prefill_attention_with_window_sums(
            rows.reshape(num_rows * num_queries, group, dim),
            self.views.keys,
            self.views.values,
            tables,
            seq_lens,
            starts,
            scale,
            num_queries,
            score_logit_scale=row_scale,
            max_slots=width,
            max_seq_len=width,
            max_query_len=num_queries,
            need_output=False,
            backend=self.backend,
        )
        return sums[:, 0], None

    def compact(
        self,
        tables: torch.Tensor,
        keep_indices: torch.Tensor,
        keep_counts: torch.Tensor,
        stats: Sequence[torch.Tensor] = (),
        entries: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        if not self.triton:
            return super().compact(tables, keep_indices, keep_counts, stats, entries)
        device = self.device
        kernel_dispatch.compact(
            self.views.keys,
            self.views.values,
            tables.to(device),
            keep_indices.to(device)[:, None],
            keep_counts=keep_counts.to(device),
            stats=[stat[:, None] for stat in stats],
            backend=self.backend,
        )
