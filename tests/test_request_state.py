"""What the worker remembers per evicting request and layer: the query window ring and the cached positions, each
against a recomputation from scratch."""

from __future__ import annotations

import torch

from kvserve.worker.request import POSITION_HEADROOM, LayerState, QueryWindow


def test_query_window_keeps_the_last_queries_oldest_first():
    generator = torch.Generator().manual_seed(0)
    size, seen, position = 8, [], 0
    window = QueryWindow(size)
    for count in (3, 1, 1, 2, 1, 1, 5, 1, 9, 1, 1, 4, 1):  # prefill chunks and decode steps, wrapping many times
        queries = torch.randn(count, 6, 4, generator=generator)
        window.record(queries, position)
        seen += [(position + i, queries[i]) for i in range(count)]
        position += count
        want = seen[-size:]
        assert torch.equal(window.positions(), torch.tensor([p for p, _ in want]))
        assert torch.equal(window.queries(), torch.stack([q for _, q in want]))


def fresh_positions(layer: LayerState, lengths: torch.Tensor, since: int) -> torch.Tensor:
    """LayerState.positions computed without its cache."""
    width = int(lengths.max())
    positions = layer._unmasked_positions(lengths.shape[0], width, since)
    return positions.masked_fill(torch.arange(width)[None, :] >= lengths[:, None], -1)


def test_cached_positions_follow_appends_and_compactions():
    layer = LayerState()
    lengths, since = torch.tensor([40, 40, 40]), 0
    for step in range(2 * POSITION_HEADROOM + 5):  # decode past the headroom: the cache is rebuilt, not overrun
        if step in (3, 300):  # a ragged compaction: new kept positions and counts, `since` moves
            counts = torch.tensor([20, 11, 17])
            kept = torch.stack([torch.sort(torch.randperm(int(lengths.max()))[:20]).values for _ in range(3)])
            kept = kept.masked_fill(torch.arange(20)[None, :] >= counts[:, None], -1)
            layer.kept_positions, layer.kept_counts = kept, counts
            since, lengths = since + int(lengths.max()), counts.clone()
        got = layer.positions(lengths, since)
        assert torch.equal(got, fresh_positions(layer, lengths, since)), step
        got.fill_(7)  # a caller writing its copy must not change the cache
        assert torch.equal(layer.positions(lengths, since), fresh_positions(layer, lengths, since))
        lengths = lengths + 1


def test_layer_tables_make_a_requests_table_only_when_it_is_read():
    from kvserve.worker.step import LayerTables

    class Plan:
        def __init__(self, req_id: str) -> None:
            self.req_id, self.reads = req_id, []

        def table(self, layer_idx: int) -> torch.Tensor:
            self.reads.append(layer_idx)
            return torch.full((2, 3), layer_idx)

    plans = [Plan("a"), Plan("b")]
    tables = LayerTables({plan.req_id: plan for plan in plans}, 5)
    assert "a" in tables and "z" not in tables and len(tables) == 2 and list(tables) == ["a", "b"]
    assert all(plan.reads == [] for plan in plans)  # asking which requests it holds makes no table
    assert torch.equal(tables["a"], plans[0].table(5)) and tables.get("z") is None
    tables["a"]
    assert plans[0].reads == [5, 5] and plans[1].reads == []  # made once (one read here, one by the test)
