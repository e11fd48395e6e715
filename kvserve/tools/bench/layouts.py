"""`kvserve bench layouts`: what kvserve's cache operations cost in each CPU cache layout, on the same entries, in one
process (no server, no vLLM kernel): the statistics of a decode step (H2O's column sums, MAT's first logits), a
SnapKV-style window of prefill queries, and a compaction.

Rows: `vec` (vLLM's plain layout), `amx` (vLLM's AMX tile format, read and rewritten in place by
`kvserve/worker/layouts/amx.py`) and `amx staged`, the path kvserve took before: every page of the lists decoded into
a plain copy for each step that read them (keys and values), the operation run there, and after a compaction every
staged page encoded back. Each operation's result is checked equal across the three (up to summation order)
before it is timed. The ratios
to `vec` are what the AMX layout costs kvserve on this CPU; on an AMX machine the attention itself (vLLM's AMX
kernel) is faster, which this benchmark does not measure.

    python -m kvserve.tools.bench layouts --requests 4 --tokens 1000 --budget 256
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch

from kvserve.provenance import command_line, provenance
from kvserve.worker.layouts import AmxPages, CachePages, VecPages


class StagedAmx:
    """The pre-layout AMX path: decode the lists' pages into a plain copy, operate there, encode back if written."""

    def __init__(self, amx: AmxPages, tables: torch.Tensor, width: int) -> None:
        self.amx = amx
        used = tables[:, : -(-width // amx.block_size)]
        self.source = used.reshape(-1)
        staged = torch.empty(self.source.numel(), *amx.pages.shape[1:], dtype=amx.dtype)
        self.cache = VecPages(staged)
        ids = torch.arange(self.source.numel())
        self.cache.store_pages(ids, amx.key_pages(self.source), amx.value_pages(self.source))
        self.tables = ids.view(used.shape)

    def write_back(self) -> None:
        ids = torch.arange(self.source.numel())
        self.amx.store_pages(self.source, self.cache.key_pages(ids), self.cache.value_pages(ids))


def timed(run: Callable[[], object], repeats: int) -> float:
    """Seconds per call of `run`, over `repeats` calls after one warm-up call."""
    run()  # warm-up
    start = time.perf_counter()
    for _ in range(repeats):
        run()
    return (time.perf_counter() - start) / repeats


def measure(
    requests: int,
    heads: int,
    tokens: int,
    budget: int,
    block_size: int,
    dim: int,
    group: int,
    window: int,
    repeats: int,
) -> list[dict]:
    rows = requests * heads  # one page list per (request, KV head) of a layer
    width = -(-tokens // block_size)
    generator = torch.Generator().manual_seed(0)
    tables = torch.randperm(rows * width + 8, generator=generator)[: rows * width].view(rows, width)
    amx_pages = torch.randn(rows * width + 8, 1, block_size, 2 * dim, generator=generator).bfloat16()
    amx = AmxPages(amx_pages)
    ids = torch.arange(amx_pages.shape[0])
    vec = VecPages(torch.empty_like(amx_pages))
    vec.store_pages(ids, amx.key_pages(ids), amx.value_pages(ids))
    lengths = torch.full((rows,), tokens)
    scale = dim**-0.5
    decode_queries = torch.randn(rows, 1, group, dim, generator=generator).bfloat16()
    window_queries = torch.randn(rows, window, group, dim, generator=generator).bfloat16()
    keep = torch.sort(torch.rand(rows, tokens, generator=generator).argsort(dim=1)[:, :budget], dim=1).values
    counts = torch.full((rows,), budget)

    def on_layout(cache: CachePages, op: str, table: torch.Tensor) -> tuple:
        if op == "decode column sums + first logits (h2o)":
            return cache.query_sums(decode_queries, table, lengths, scale, first_logits=True)
        if op == "first logits alone (mat)":
            return (cache.first_logits(decode_queries[:, 0], table, scale),)
        if op == f"window sums, {window} queries (snapkv)":
            return cache.query_sums(window_queries, table, lengths, scale)
        # op == "compaction", as the engine runs it: the lists read (the policy scores them), then compacted
        cache.compact(table, keep, counts, entries=cache.read_lists(table, lengths))
        return cache.read_lists(table, counts)

    def staged(op: str, pages: torch.Tensor):
        stage = StagedAmx(AmxPages(pages), tables, tokens)
        out = on_layout(stage.cache, op, stage.tables)
        if op == "compaction":
            stage.write_back()
        return out

    ops = [
        "decode column sums + first logits (h2o)",
        "first logits alone (mat)",
        f"window sums, {window} queries (snapkv)",
        "compaction",
    ]
    results = []
    for op in ops:
        # each check starts from the same pages (a compaction rewrites them), so the three get the same input
        outputs = [
            on_layout(VecPages(vec.pages.clone()), op, tables),
            on_layout(AmxPages(amx_pages.clone()), op, tables),
            staged(op, amx_pages.clone()),
        ]
        flat = [
            torch.cat(
                [part.float().flatten() for part in (out if isinstance(out, tuple) else (out,)) if part is not None]
            )
            for out in outputs
        ]
        # equal up to summation order (the AMX products multiply the tiles as stored)
        if not all(torch.allclose(flat[0], other, rtol=1e-4, atol=1e-5) for other in flat[1:]):
            raise AssertionError(f"{op}: the layouts disagree; the timings would compare different work")
        vec_pages, amx_copy = vec.pages.clone(), amx_pages.clone()
        times = {
            "vec": timed(lambda op=op, pages=vec_pages: on_layout(VecPages(pages), op, tables), repeats),
            "amx": timed(lambda op=op, pages=amx_copy: on_layout(AmxPages(pages), op, tables), repeats),
            "amx staged": timed(lambda op=op, pages=amx_copy: staged(op, pages), repeats),
        }
        results.append({"operation": op, **{f"{name}_ms": 1000 * seconds for name, seconds in times.items()}})
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="kvserve bench layouts", description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=4, help="evicting requests in the step")
    parser.add_argument("--heads", type=int, default=3, help="KV heads per layer (the default model: 3)")
    parser.add_argument("--tokens", type=int, default=1000, help="entries in each list")
    parser.add_argument("--budget", type=int, default=256, help="entries a compaction keeps")
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--head-size", type=int, default=64)
    parser.add_argument("--group", type=int, default=3, help="query heads per KV head")
    parser.add_argument("--window", type=int, default=32, help="queries of the window sums")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # as vLLM's CPU worker computes on this 2-core platform
    results = measure(
        args.requests,
        args.heads,
        args.tokens,
        args.budget,
        args.block_size,
        args.head_size,
        args.group,
        args.window,
        args.repeats,
    )
    print(f"one layer, {args.requests} requests x {args.heads} KV heads x {args.tokens} entries, bf16, 1 thread")
    print("| operation | vec ms | amx ms | amx / vec | amx staged ms | staged / vec |")
    print("| --- | --- | --- | --- | --- | --- |")
    for row in results:
        vec, amx, staged = row["vec_ms"], row["amx_ms"], row["amx staged_ms"]
        print(f"| {row['operation']} | {vec:.3f} | {amx:.3f} | {amx / vec:.2f}x | {staged:.3f} | {staged / vec:.2f}x |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        ran = provenance(command_line(argv, "kvserve bench layouts"))
        recorded = vars(args) | {"out": str(args.out)}
        args.out.write_text(json.dumps({"args": recorded, "provenance": ran, "results": results}, indent=1))
