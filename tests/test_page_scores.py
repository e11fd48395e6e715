"""The engine's page-by-page CPU operations (`kvserve/engine/page_scores.py`) against the PyTorch references of the
kernels (`kvserve_kernels.reference`), on ragged lists whose pages lie anywhere in a one-head page view of vLLM's CPU
layout, written by vLLM's own cache-write op."""

from __future__ import annotations

import pytest
import torch
from kvserve_kernels.reference import (
    compact_reference,
    decode_attention_reference,
    gather_entries,
    prefill_attention_reference,
)
from vllm import _custom_ops as ops

from kvserve.engine.cache_layout import cpu_views
from kvserve.engine.page_scores import compact_rows, query_sums, read_rows

BLOCK, DIM, GROUP = 32, 64, 3
LENGTHS = torch.tensor([75, 40, 96, 1, 33])  # ragged rows: one (request, head) list each
PROB_TOL = dict(rtol=1e-4, atol=1e-6)


def page_pool(dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A page view [P, 1, bs, 2D] written by vLLM's op, and tables [R, W] of distinct pages in shuffled order."""
    generator = torch.Generator().manual_seed(seed)
    width = -(-int(LENGTHS.max()) // BLOCK)
    num_pages = len(LENGTHS) * width + 3
    tables = torch.randperm(num_pages, generator=generator)[: len(LENGTHS) * width].view(len(LENGTHS), width)
    pages = torch.zeros(num_pages, 1, BLOCK, 2 * DIM, dtype=dtype)
    key_cache, value_cache = pages.view(num_pages, 1, 2 * BLOCK, DIM).chunk(2, dim=2)
    for row, length in enumerate(LENGTHS.tolist()):
        entries = torch.arange(length)
        slots = tables[row, entries // BLOCK] * BLOCK + entries % BLOCK
        keys, values = (torch.randn(length, 1, DIM, generator=generator).to(dtype) for _ in range(2))
        ops.cpu_attn_reshape_and_cache(
            keys, values, key_cache, value_cache, slots, "vec", k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto"
        )
    return pages, tables


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_read_rows_returns_each_lists_entries(dtype):
    pages, tables = page_pool(dtype)
    cache = cpu_views(pages)
    keys, values = read_rows(cache, tables, int(LENGTHS.max()))
    for row, length in enumerate(LENGTHS.tolist()):
        want_k, want_v = gather_entries(cache.keys, cache.values, tables[row], length)
        assert torch.equal(keys[row, :length], want_k[0]) and torch.equal(values[row, :length], want_v[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_sums_and_first_logits_match_the_reference(dtype):
    pages, tables = page_pool(dtype, seed=1)
    cache = cpu_views(pages)
    queries = torch.randn(len(LENGTHS), 1, GROUP, DIM).to(dtype)
    sums, first = query_sums(queries, cache, tables, LENGTHS, DIM**-0.5, first_logits=True)
    want_sums = torch.zeros(len(LENGTHS), 1, int(LENGTHS.max()))
    want_first = torch.empty(len(LENGTHS), GROUP)
    decode_attention_reference(
        queries[:, 0],
        cache.keys,
        cache.values,
        tables.int(),
        LENGTHS.int(),
        DIM**-0.5,
        scores=want_sums,
        first_logit=want_first,
        need_output=False,
    )
    torch.testing.assert_close(sums, want_sums[:, 0], **PROB_TOL)
    torch.testing.assert_close(first, want_first, **PROB_TOL)
    for row, length in enumerate(LENGTHS.tolist()):  # nothing past a row's length, and each row sums to G
        assert not sums[row, length:].any()
        assert abs(float(sums[row].sum()) - GROUP) < 1e-4


@pytest.mark.parametrize("with_gain", [False, True])
def test_window_sums_of_a_prefill_chunk_match_the_reference(with_gain):
    """Each row's newest Q entries are this step's queries; the sums cover the last `window` of them, causally."""
    pages, tables = page_pool(torch.float32, seed=2)
    cache = cpu_views(pages)
    rows = (LENGTHS > 1).nonzero()[:, 0]  # a one-entry list cannot hold a 20-query chunk
    lengths, tables = LENGTHS[rows], tables[rows]
    chunk, window = 20, 7
    queries = torch.randn(len(rows), chunk, GROUP, DIM)
    gain = 1 + torch.rand(len(rows), window) if with_gain else None
    sums, _ = query_sums(queries[:, -window:], cache, tables, lengths, DIM**-0.5, logit_scale=gain)
    starts = torch.arange(len(rows) + 1, dtype=torch.int32) * chunk
    row_scale = None
    if with_gain:  # the reference's form: one factor per query token, 1 outside the window
        row_scale = torch.ones(len(rows), chunk)
        row_scale[:, -window:] = gain
        row_scale = row_scale.reshape(1, -1)
    _, want, _ = prefill_attention_reference(
        queries.reshape(-1, GROUP, DIM),
        cache.keys,
        cache.values,
        tables.int(),
        lengths.int(),
        starts,
        DIM**-0.5,
        window,
        score_logit_scale=row_scale,
        need_output=False,
    )
    torch.testing.assert_close(sums, want[:, 0], **PROB_TOL)
    # every query chunk of a long prefill lands in the same sums
    all_sums, _ = query_sums(queries, cache, tables, lengths, DIM**-0.5)
    _, want_all, _ = prefill_attention_reference(
        queries.reshape(-1, GROUP, DIM),
        cache.keys,
        cache.values,
        tables.int(),
        lengths.int(),
        starts,
        DIM**-0.5,
        chunk,
        need_output=False,
    )
    torch.testing.assert_close(all_sums, want_all[:, 0], **PROB_TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compaction_matches_the_reference_bit_for_bit(dtype):
    generator = torch.Generator().manual_seed(3)
    pages, tables = page_pool(dtype, seed=3)
    counts = (LENGTHS * 2 // 3).clamp(min=1)
    width = int(counts.max())
    keep = torch.zeros(len(LENGTHS), width, dtype=torch.long)
    for row, (length, count) in enumerate(zip(LENGTHS.tolist(), counts.tolist(), strict=True)):
        keep[row, :count] = torch.sort(torch.randperm(length, generator=generator)[:count]).values
    stats = torch.randn(len(LENGTHS), int(LENGTHS.max()), generator=generator)
    want_pages, want_stats = pages.clone(), stats.clone()
    want_cache = cpu_views(want_pages)
    compact_reference(
        want_cache.keys, want_cache.values, tables.int(), keep[:, None], keep_counts=counts, stats=[want_stats[:, None]]
    )
    compact_rows(cpu_views(pages), tables, keep, counts, stats=[stats])
    assert torch.equal(pages, want_pages)
    assert torch.equal(stats, want_stats)


def decoding_plans(heads: int = 3):
    """Three evicting requests decoding one token each in one layer (h2o, mat, ems), over a page view."""
    from kvserve.config import parse_kv_config
    from kvserve.engine.pages import HeadPages, PageLayout
    from kvserve.engine.request_state import RequestState
    from kvserve.engine.step import RowPlan

    layout = PageLayout(num_layers=1, num_blocks=8, num_heads=heads, block_size=BLOCK)
    cache = cpu_views(torch.randn(layout.num_blocks * heads, 1, BLOCK, 2 * DIM))
    plans = []
    for row, (policy, blocks, tokens) in enumerate([("h2o", [1, 4], 50), ("mat", [6], 20), ("ems", [2, 3, 7], 70)]):
        config = parse_kv_config({"kv_policy": policy, "kv_budget": 64}, defaults={})
        state = RequestState(config=config, policy=config.make_policy(), pages=HeadPages(layout))
        state.pages.add_blocks(blocks)
        state.pages.append(tokens)
        plans.append(
            RowPlan(
                req_id=str(row),
                state=state,
                row=row,
                query_start=row,
                query_end=row + 1,
                logical_len=tokens,
                compaction=None,
            )
        )
    query = torch.randn(len(plans), heads * GROUP, DIM)
    return plans, cache, query


def test_a_failing_batched_pass_falls_back_to_each_request_alone(monkeypatch):
    from kvserve.engine import eviction
    from kvserve.engine.step import StepContext

    def run_step() -> list:
        torch.manual_seed(5)  # the same requests, cache and queries each time
        plans, cache, query = decoding_plans()
        tables = {plan.req_id: plan.table(0) for plan in plans}
        eviction.after_attention(
            StepContext(pages=None, rows=plans), 0, query, cache, tables, DIM**-0.5, torch.empty_like(query)
        )
        return plans

    batched = run_step()

    def broken(*args, **kwargs):
        raise RuntimeError("batched pass broke")

    monkeypatch.setattr(eviction, "measure_decode_rows", broken)
    alone = run_step()
    assert all(plan.failure is None for plan in alone)  # nobody failed, the engine went on
    for with_batch, without in zip(batched, alone, strict=True):
        want, got = with_batch.state.layer(0).stats, without.state.layer(0).stats
        assert want.keys() == got.keys() and want
        for name in want:
            torch.testing.assert_close(got[name], want[name], **PROB_TOL)


def test_one_product_for_all_decoding_requests_equals_each_request_alone():
    """`measure_decode_rows` measures every decoding request of a layer at once (lists of different lengths, policies
    wanting different statistics); each request gets what `measure_pass` measures for it alone."""
    from kvserve.engine import eviction
    from kvserve.engine.step import StepContext

    plans, cache, query = decoding_plans()
    tables = {plan.req_id: plan.table(0) for plan in plans}
    batched = eviction.measure_decode_rows(StepContext(pages=None, rows=plans), 0, query, cache, tables, DIM**-0.5)
    assert set(batched) == {"0", "1", "2"}
    for plan in plans:
        lengths = plan.lengths(0)
        obs = eviction._observe(plan, plan.state.layer(0), 0, cache, lengths, DIM**-0.5)
        alone = eviction.measure_pass(
            plan.state.policy,
            obs,
            query[plan.query_start : plan.query_end],
            cache,
            tables[plan.req_id],
            lengths,
            compacting=False,
        )
        for name in ("column_sums", "first_logits"):
            want, got = getattr(alone, name), getattr(batched[plan.req_id], name)
            assert (want is None) == (got is None) == (name not in plan.state.policy.pass_statistics)
            if want is not None:
                torch.testing.assert_close(got, want, **PROB_TOL)
