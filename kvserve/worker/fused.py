"""Which pseudo rows of a step kvserve's CPU kernel computes itself, attention and statistics in one pass
(`kvserve_kernels.cpu`), and which stay with vLLM's attention op.

A request whose policy reads statistics of every step's queries (column sums: H2O, EMS; first logits: MAT) would
otherwise pay twice: vLLM's kernel reads its keys for the output, then a second pass reads them again for the
probabilities. Its rows go to the kernel instead, which returns the output and the statistics from the same logits;
every other row (`full`, requests that score only at a compaction) keeps vLLM's op, called on the remaining rows.
An Attention-Gate request's prompt chunk is gated before its attention here and attended once, with the gate's mask
(`kvserve/worker/gated.py`), instead of by vLLM's op and again with the mask afterwards. The split is made once per
step (`plan_split`) and applied per layer (`FusedSplit.run`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from kvserve_kernels import cpu as cpu_kernel

from kvserve.policies.base import PassStatistics
from kvserve.worker.gated import in_prompt_chunk, prompt_attention
from kvserve.worker.layouts import CachePages
from kvserve.worker.step import RowPlan, StepContext

logger = logging.getLogger(__name__)

EVERY_STEP = frozenset({"column_sums", "first_logits"})  # statistics a policy reads from every step's queries


@dataclass(frozen=True)
class KernelGroup:
    """Requests with the same number of queries this step, computed by one kernel call per layer."""

    plans: tuple[RowPlan, ...]
    num_queries: int
    tokens: torch.Tensor  # [n * H * Q] pseudo tokens (h * T + t) of the rows' queries, row by row
    tables: torch.Tensor  # [L, n * H, W] int64 the rows' page lists (pseudo rows h * R + r, request by request)
    lengths: torch.Tensor  # [L, n * H] int64
    widths: list[list[int]]  # [L][n] each request's longest list in each layer
    sums: bool  # some request wants the column sums
    first_logits: bool  # some request wants the first logits


@dataclass(frozen=True)
class FusedSplit:
    groups: tuple[KernelGroup, ...]
    gated: tuple[tuple[RowPlan, torch.Tensor], ...]  # attention_gate prompt chunks and their pseudo tokens
    vllm_tokens: torch.Tensor  # pseudo tokens of the rows vLLM's op computes
    vllm_query_start_loc: torch.Tensor  # [V + 1] int32
    vllm_tables: torch.Tensor  # [L, V, W] int32
    vllm_lengths: torch.Tensor  # [L, V] int32

    def run(
        self,
        layer_idx: int,
        query: torch.Tensor,
        rows: torch.Tensor,
        out_rows: torch.Tensor,
        cache: CachePages,
        scale: float,
        vllm_attention: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None],
    ) -> dict[str, PassStatistics]:
        """Layer `layer_idx`: `query` [T, Hq, D] the layer's queries, `rows` [H * T, G, D] as pseudo rows, `out_rows`
        their outputs (written). `vllm_attention(queries, outputs, query_start_loc, seq_lens, block_table)` runs
        vLLM's op on the other rows. Returns each kernel request's statistics."""
        num_heads = rows.shape[0] // query.shape[0]
        if self.vllm_tokens.numel():
            vllm_out = torch.empty(self.vllm_tokens.shape[0], *rows.shape[1:], dtype=rows.dtype)
            vllm_attention(
                rows.index_select(0, self.vllm_tokens),
                vllm_out,
                self.vllm_query_start_loc,
                self.vllm_lengths[layer_idx],
                self.vllm_tables[layer_idx],
            )
            out_rows.index_copy_(0, self.vllm_tokens, vllm_out)
        measured = {}
        for group in self.groups:
            count = group.tables.shape[1]
            queries = rows.index_select(0, group.tokens).view(count, group.num_queries, *rows.shape[1:])
            try:
                out, sums, firsts = cpu_kernel.paged_attention(
                    queries,
                    cache.pages,
                    cache.kernel_format,
                    group.tables[layer_idx],
                    group.lengths[layer_idx],
                    scale,
                    sums=group.sums,
                    first_logits=group.first_logits,
                )
            except Exception as error:  # fails these requests (the scheduler ends them), never the engine
                logger.exception("kvserve: the CPU attention kernel failed for %d requests", len(group.plans))
                for plan in group.plans:
                    plan.failure = plan.failure or f"kvserve's CPU attention kernel failed: {error}"
                out_rows.index_fill_(0, group.tokens, 0)
                continue
            out_rows.index_copy_(0, group.tokens, out.view(-1, *rows.shape[1:]))
            for index, (plan, width) in enumerate(zip(group.plans, group.widths[layer_idx], strict=True)):
                heads = slice(index * num_heads, (index + 1) * num_heads)
                wanted = plan.state.policy.pass_statistics
                first = None
                if "first_logits" in wanted:  # [H, Q * G] -> [Q, H * G], query heads in the model's order
                    first = firsts[heads].view(num_heads, group.num_queries, -1).transpose(0, 1)
                    first = first.reshape(group.num_queries, -1)
                measured[plan.req_id] = PassStatistics(
                    column_sums=sums[heads, :width] if "column_sums" in wanted else None, first_logits=first
                )
        for plan, tokens in self.gated:
            queries = query[plan.query_start : plan.query_end]
            try:
                if plan.failure is not None:  # failed in an earlier layer: the scheduler ends it after this step
                    raise RuntimeError(plan.failure)
                attended = prompt_attention(
                    plan, plan.state.layer(layer_idx), layer_idx, queries, cache, plan.table(layer_idx), scale
                )
            except Exception as error:  # the gate's failure fails its request (the scheduler ends it), never the engine
                if plan.failure is None:
                    plan.failure = f"{type(error).__name__}: {error}"
                    logger.exception("kvserve: request %s: the attention gate failed", plan.req_id)
                attended = torch.zeros_like(queries)
            grouped = attended.view(queries.shape[0], num_heads, -1, queries.shape[-1]).transpose(0, 1)
            out_rows.index_copy_(0, tokens, grouped.reshape(-1, *rows.shape[1:]).to(out_rows.dtype))
        return measured


def plan_split(step: StepContext, num_heads: int) -> FusedSplit | None:
    """The rows the kernel computes this step: those of every evicting request (not gated, not failed) whose policy
    reads `EVERY_STEP` statistics. None when there are none (vLLM's op then computes every row)."""
    chosen = [
        plan
        for plan in step.rows
        if plan.failure is None and plan.state.gate is None and EVERY_STEP & set(plan.state.policy.pass_statistics)
    ]
    gated = [plan for plan in step.rows if plan.failure is None and in_prompt_chunk(plan)]
    if not chosen and not gated:
        return None
    pages = step.pages
    num_reqs, num_tokens, num_layers = pages.num_reqs, pages.num_tokens, pages.tables.shape[0]
    heads = torch.arange(num_heads)
    by_queries: dict[int, list[RowPlan]] = {}
    for plan in chosen:
        by_queries.setdefault(plan.query_end - plan.query_start, []).append(plan)
    groups = []
    kernel_rows = torch.zeros(num_heads * num_reqs, dtype=torch.bool)

    def pseudo_rows(plan: RowPlan) -> torch.Tensor:  # [H] the request's rows h * R + r
        return heads * num_reqs + plan.row

    def pseudo_tokens(plan: RowPlan) -> torch.Tensor:  # [H * Q] its queries' tokens h * T + t, head by head
        return (heads[:, None] * num_tokens + torch.arange(plan.query_start, plan.query_end)[None, :]).reshape(-1)

    for num_queries, plans in sorted(by_queries.items()):
        rows = torch.cat([pseudo_rows(plan) for plan in plans])
        tokens = torch.cat([pseudo_tokens(plan) for plan in plans])
        kernel_rows[rows] = True
        lengths = pages.seq_lens[:, rows].long()
        widths = lengths.view(num_layers, len(plans), num_heads).amax(dim=2).tolist()
        wanted = {name for plan in plans for name in plan.state.policy.pass_statistics}
        table = pages.tables[:, rows].long().contiguous()
        groups.append(
            KernelGroup(
                tuple(plans),
                num_queries,
                tokens,
                table,
                lengths,
                widths,
                sums="column_sums" in wanted,
                first_logits="first_logits" in wanted,
            )
        )
    for plan in gated:
        kernel_rows[pseudo_rows(plan)] = True
    vllm_rows = torch.nonzero(~kernel_rows).flatten()
    starts = pages.query_start_loc.long()
    vllm_counts = (starts[1:] - starts[:-1]).index_select(0, vllm_rows)
    packed_starts = vllm_counts.cumsum(0) - vllm_counts  # where each row's tokens start in vLLM's packed queries
    vllm_tokens = torch.repeat_interleave(starts.index_select(0, vllm_rows) - packed_starts, vllm_counts)
    vllm_tokens += torch.arange(vllm_tokens.shape[0])
    return FusedSplit(
        groups=tuple(groups),
        gated=tuple((plan, pseudo_tokens(plan)) for plan in gated),
        vllm_tokens=vllm_tokens,
        vllm_query_start_loc=torch.cat([torch.zeros(1, dtype=torch.long), vllm_counts.cumsum(0)]).to(torch.int32),
        vllm_tables=pages.tables[:, vllm_rows].contiguous(),
        vllm_lengths=pages.seq_lens[:, vllm_rows].contiguous(),
    )
