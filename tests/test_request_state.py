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


def test_a_steps_decode_queries_are_recorded_as_each_requests_own_window_would_record_them():
    """`record_decode_windows` (one copy for the step's decoding requests) against `QueryWindow.record` per request;
    a prefill chunk, a failed request and a request without a window are left alone, and a request whose
    recording raises fails by itself."""
    from types import SimpleNamespace

    from kvserve.worker.decoding import record_decode_windows
    from kvserve.worker.request import WorkerRequest
    from kvserve.worker.step import StepContext

    def plan(req_id: str, window: int, start: int, count: int, logical_len: int, failure=None):
        policy = SimpleNamespace(window_size=lambda: window)
        state = SimpleNamespace(gate=None, config=SimpleNamespace(question_probe=False), policy=policy, layers={})
        state.layer = lambda idx: WorkerRequest.layer(state, idx)
        return SimpleNamespace(
            req_id=req_id,
            state=state,
            query_start=start,
            query_end=start + count,
            logical_len=logical_len,
            failure=failure,
            eviction_seconds=0.0,
        )

    generator = torch.Generator().manual_seed(1)
    references = {"a": QueryWindow(4), "c": QueryWindow(3)}
    plans = {}
    for step in range(7):
        rows = [
            plan("a", 4, 0, 1, 50 + step),
            plan("prefill", 4, 1, 3, 30 + step),  # three queries: `_evict` records them
            plan("c", 3, 4, 1, 90 + step),
            plan("failed", 4, 5, 1, 10 + step, failure="an earlier layer failed"),
            plan("no window", 0, 6, 1, 20 + step),
        ]
        for row in rows:  # each request's state lives on from step to step
            row.state = plans.setdefault(row.req_id, row).state
        query = torch.randn(7, 6, 4, generator=generator)
        recorded = record_decode_windows(StepContext(pages=None, rows=rows), 2, query)
        assert recorded == {"a", "c"}
        for row in rows[:1] + rows[2:3]:
            references[row.req_id].record(query[row.query_start : row.query_end], row.logical_len - 1)
            window = row.state.layers[2].window
            assert torch.equal(window.queries(), references[row.req_id].queries()), (step, row.req_id)
            assert torch.equal(window.positions(), references[row.req_id].positions()), (step, row.req_id)
        assert all(2 not in plans[name].state.layers for name in ("prefill", "failed", "no window"))

    broken = plan("broken", 4, 0, 1, 5)
    broken.state.layer = lambda idx: (_ for _ in ()).throw(ValueError("no layer state"))
    fine = plan("fine", 4, 1, 1, 8)
    assert record_decode_windows(StepContext(pages=None, rows=[broken, fine]), 0, torch.randn(2, 6, 4)) == {"fine"}
    assert broken.failure == "ValueError: no layer state" and fine.failure is None
