"""`kvserve bench kernel`: kvserve's CPU kernel against vLLM's CPU attention op on the same pseudo rows, one process.

The engine gives the kernel the rows of requests whose policy reads every step's statistics (H2O, EMS, MAT) in place
of vLLM's op; this times both on the same pages, queries and lengths (bf16, the `vec` layout; a decode step of 4
requests x 3 KV heads, a 1,000-query prefill of one request, a 32-query window), with and without the statistics,
and the PyTorch statistics pass the kernel replaced. Each output is checked against vLLM's before it is timed.

    kvserve bench kernel --out docs/eval/costs/kernel-ops.json
"""

from __future__ import annotations

import argparse
import json
from functools import partial
from pathlib import Path

import torch
from kvserve_kernels import cpu as cpu_kernel

from kvserve.provenance import command_line, provenance
from kvserve.tools.bench.layouts import timed
from kvserve.worker.layouts import VecPages

BLOCK, DIM, GROUP, HEADS = 32, 64, 3, 3  # the default model's attention shape
SCALE = DIM**-0.5


def vllm_attention(queries: torch.Tensor, pages: torch.Tensor, tables: torch.Tensor, lengths: torch.Tensor):
    """vLLM's CPU op on [R, Q, G, D] pseudo rows over `vec` pages [P, 1, bs, 2 * D], as kvserve's backend calls it
    (scale 1/sqrt(D)): returns a function producing the output [R * Q, G, D]."""
    from vllm import _custom_ops as ops

    rows, count, group, dim = queries.shape
    block = pages.shape[2]
    starts = torch.arange(rows + 1, dtype=torch.int32) * count
    seq_lens, block_table = lengths.to(torch.int32), tables.to(torch.int32)
    packed = queries.reshape(rows * count, group, dim)
    metadata = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=rows, num_heads=group, num_kv_heads=1, head_dim=dim, seq_lens=seq_lens, dtype=queries.dtype,
        query_start_loc=starts, causal=True, sliding_window_size=-1, isa="vec", enable_kv_split=False,
        kv_cache_dtype="auto",
    )  # fmt: skip
    key_pages, value_pages = pages.view(pages.shape[0], 1, 2 * block, dim).chunk(2, dim=2)

    def run() -> torch.Tensor:
        out = torch.empty_like(packed)
        ops.cpu_attention_with_kv_cache(
            query=packed, key_cache=key_pages, value_cache=value_pages, output=out, query_start_loc=starts,
            seq_lens=seq_lens, scale=dim**-0.5, causal=True, alibi_slopes=None, sliding_window=-1,
            block_table=block_table, softcap=0.0, scheduler_metadata=metadata, s_aux=None, dynamic_causal=None,
            k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto",
        )  # fmt: skip
        return out

    return run


def measure(repeats: int, tokens: int) -> list[dict]:
    generator = torch.Generator().manual_seed(0)
    cases = [  # (name, rows, queries per row)
        (f"decode, 4 requests x {tokens:,} entries", 4 * HEADS, 1),
        (f"prefill, {tokens:,} queries of 1 request", HEADS, tokens),
        (f"window, 32 queries x {tokens:,} entries", 4 * HEADS, 32),
    ]
    results = []
    for name, rows, count in cases:
        width = -(-tokens // BLOCK)
        tables = torch.randperm(rows * width + 4, generator=generator)[: rows * width].view(rows, width)
        pages = torch.randn(rows * width + 4, 1, BLOCK, 2 * DIM, generator=generator).bfloat16()
        lengths = torch.full((rows,), tokens)
        queries = torch.randn(rows, count, GROUP, DIM, generator=generator).bfloat16()
        vllm = vllm_attention(queries, pages, tables, lengths)
        fused, _, _ = cpu_kernel.paged_attention(queries, pages, "vec", tables, lengths, SCALE)
        torch.testing.assert_close(fused.reshape_as(vllm()).float(), vllm().float(), rtol=2e-2, atol=2e-2)
        pytorch = VecPages(pages).pytorch_only()  # the statistics pass the kernel replaced
        kernel = partial(cpu_kernel.paged_attention, queries, pages, "vec", tables, lengths, SCALE)
        times = {
            "vllm": timed(vllm, repeats),
            "kernel": timed(partial(kernel, sums=False), repeats),
            "kernel_sums": timed(kernel, repeats),
            "pytorch_sums": timed(partial(pytorch.query_sums, queries.float(), tables, lengths, SCALE), repeats),
        }
        results.append({"case": name, **{f"{key}_ms": 1000 * seconds for key, seconds in times.items()}})
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="kvserve bench kernel", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=1000, help="entries per list (and prefill queries)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path, default=None, help="JSON file for the results")
    args = parser.parse_args(argv)
    if not cpu_kernel.available():
        raise SystemExit(f"kvserve bench kernel: the CPU kernel did not build: {cpu_kernel.build_error()}")
    torch.set_num_threads(1)  # as vLLM's CPU worker computes on this 2-core platform (and `bench layouts`)
    results = measure(args.repeats, args.tokens)
    print("one layer's rows, bf16, vec layout, 1 thread")
    print("| case | vLLM's op ms | kernel ms | kernel + sums ms | vs vLLM | vLLM + PyTorch sums ms | vs the kernel |")
    print("|---|---|---|---|---|---|---|")
    for row in results:
        both = row["vllm_ms"] + row["pytorch_sums_ms"]
        print(
            f"| {row['case']} | {row['vllm_ms']:.3f} | {row['kernel_ms']:.3f} | {row['kernel_sums_ms']:.3f} | "
            f"{row['kernel_sums_ms'] / row['vllm_ms']:.2f}x | {both:.3f} | {both / row['kernel_sums_ms']:.2f}x |"
        )
    if args.out:
        ran = provenance(command_line(argv, "kvserve bench kernel"))
        recorded = vars(args) | {"out": str(args.out)}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"args": recorded, "provenance": ran, "results": results}, indent=1))


if __name__ == "__main__":
    main()
