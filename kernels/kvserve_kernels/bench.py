"""Benchmark of the fused decode kernel on a CUDA GPU: `python -m kvserve_kernels.bench [--help]`.

For each shape it times (median of `triton.testing.do_bench`, L2 flushed between runs):
  fused    decode_attention_with_scores with scores (H2O), last_probs (TOVA) and first_logit (MAT)
  h2o      the same kernel with scores only
  plain    the same kernel without any statistics
  torch    a batched PyTorch path (gather through the block table, masked softmax, scores)
  vllm     vLLM's Triton decode kernel (`unified_attention`, the TRITON_ATTN backend's), if it imports
and prints time, achieved bandwidth (K and V bytes read / time; the statistics' own traffic is not counted, so the
overhead shows as lost bandwidth), that bandwidth as a fraction of the device's peak (a table by device name, and a
measured device-to-device copy), and the scoring overhead (fused / plain - 1). Refuses to run without a GPU.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import torch

# Peak DRAM bandwidth (GB/s) from vendors' data sheets, matched by substring of torch.cuda.get_device_name().
PEAK_GBPS = {
    "H200": 4800,
    "H100 SXM": 3350,
    "H100 80GB HBM3": 3350,
    "H100 NVL": 3900,
    "H100 PCIe": 2000,
    "H100": 3350,
    "A100-SXM4-80GB": 2039,
    "A100 80GB PCIe": 1935,
    "A100": 1555,
    "L40S": 864,
    "L40": 864,
    "L4": 300,
    "A10G": 600,
    "A10": 600,
    "RTX 4090": 1008,
    "B200": 8000,
    "GH200": 4000,
}


@dataclass
class Case:
    batch: int
    seq_len: int
    q_heads: int
    kv_heads: int
    head_size: int
    block_size: int


DEFAULT_CASES = [
    Case(64, 1024, 32, 8, 128, 16),
    Case(16, 8192, 32, 8, 128, 16),
    Case(4, 32768, 32, 8, 128, 16),
    Case(32, 4096, 32, 32, 128, 16),
    Case(32, 4096, 32, 8, 64, 32),
]


def peak_from_table(name: str) -> float | None:
    for key, value in PEAK_GBPS.items():  # insertion order: specific names before generic ones
        if key in name:
            return float(value)
    return None


def measured_copy_gbps(do_bench) -> float:
    """Device-to-device copy of 1 GiB: (read + write bytes) / time."""
    src = torch.empty(1 << 29, dtype=torch.float16, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / (ms * 1e-3) / 1e9


def make_inputs(case: Case, dtype: torch.dtype, device: str = "cuda", seed: int = 0):
    from .layout import new_kv_cache, split_kv_cache

    gen = torch.Generator(device="cpu").manual_seed(seed)
    blocks_per_req = -(-case.seq_len // case.block_size)
    num_blocks = case.batch * blocks_per_req + 1
    kv = new_kv_cache(num_blocks, case.kv_heads, case.block_size, case.head_size, dtype, device)
    kv.normal_()
    key_cache, value_cache = split_kv_cache(kv, case.head_size)
    table = torch.randperm(num_blocks, generator=gen)[: case.batch * blocks_per_req]
    table = table.view(case.batch, blocks_per_req).to(torch.int32).to(device)
    seq_lens = torch.full((case.batch,), case.seq_len, dtype=torch.int32, device=device)
    q = torch.randn(case.batch, case.q_heads, case.head_size, device=device).to(dtype)
    return q, key_cache, value_cache, table, seq_lens


def torch_decode(q, key_cache, value_cache, table, seq_lens, scale, max_len, scores):
    """Batched PyTorch decode with H2O scores: gathers [R, L, Hkv, D] through the block table."""
    num_reqs, num_q_heads, dim = q.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    slots = torch.arange(max_len, device=q.device)
    blocks = table[:, slots // block_size].long()
    keys = key_cache[blocks, slots % block_size].float()  # [R, L, Hkv, D]
    values = value_cache[blocks, slots % block_size].float()
    grouped = q.float().view(num_reqs, num_kv_heads, num_q_heads // num_kv_heads, dim)
    logits = torch.einsum("rhgd,rlhd->rhgl", grouped, keys) * scale
    valid = slots[None, :] < seq_lens[:, None]
    probs = torch.softmax(logits.masked_fill(~valid[:, None, None, :], float("-inf")), dim=-1)
    scores[:, :, :max_len] += probs.sum(dim=2)
    return torch.einsum("rhgl,rlhd->rhgd", probs, values).reshape(num_reqs, num_q_heads, dim).to(q.dtype)


def vllm_decode(q, key_cache, value_cache, table, seq_lens, scale, max_len):
    """A closure running vLLM's Triton decode kernel as the TRITON_ATTN backend calls it, or raise ImportError."""
    from vllm.v1.attention.ops.triton_unified_attention import unified_attention

    num_reqs, num_q_heads, dim = q.shape
    num_kv_heads = key_cache.shape[2]
    out = torch.empty_like(q)
    cu_seqlens_q = torch.arange(num_reqs + 1, dtype=torch.int32, device=q.device)
    descale = torch.ones(1, dtype=torch.float32, device=q.device).expand(num_reqs, num_kv_heads)
    segments = 16  # vLLM's NUM_PAR_SOFTMAX_SEGMENTS; threshold as TritonAttentionMetadataBuilder sets it
    seg_out = torch.empty(
        num_reqs, num_q_heads, segments, 1 << (dim - 1).bit_length(), dtype=torch.float32, device=q.device
    )
    seg_max = torch.empty(num_reqs, num_q_heads, segments, dtype=torch.float32, device=q.device)
    seg_sum = torch.empty_like(seg_max)

    def run():
        unified_attention(
            q=q,
            k=key_cache,
            v=value_cache,
            out=out,
            cu_seqlens_q=cu_seqlens_q,
            max_seqlen_q=1,
            seqused_k=seq_lens,
            max_seqlen_k=max_len,
            softmax_scale=scale,
            causal=True,
            window_size=(-1, -1),
            block_table=table,
            softcap=0,
            q_descale=None,
            k_descale=descale,
            v_descale=descale,
            seq_threshold_3D=128 // num_kv_heads,
            num_par_softmax_segments=segments,
            softmax_segm_output=seg_out,
            softmax_segm_max=seg_max,
            softmax_segm_expsum=seg_sum,
        )
        return out

    return run


def bench_case(
    case: Case, dtype: torch.dtype, do_bench, num_splits: int | None, device: str = "cuda"
) -> dict[str, float | str]:
    from .decode_attention import decode_attention_with_scores

    q, key_cache, value_cache, table, seq_lens = make_inputs(case, dtype, device)
    scale = case.head_size**-0.5
    max_len = case.seq_len
    scores = torch.zeros(case.batch, case.kv_heads, max_len, dtype=torch.float32, device=device)
    last = torch.zeros_like(scores)
    first = torch.zeros(case.batch, case.q_heads, dtype=torch.float32, device=device)
    common = dict(max_seq_len=max_len, num_splits=num_splits)
    runs = {
        "fused": lambda: decode_attention_with_scores(
            q,
            key_cache,
            value_cache,
            table,
            seq_lens,
            scale,
            scores=scores,
            last_probs=last,
            first_logit=first,
            **common,
        ),
        "h2o": lambda: decode_attention_with_scores(
            q, key_cache, value_cache, table, seq_lens, scale, scores=scores, **common
        ),
        "plain": lambda: decode_attention_with_scores(q, key_cache, value_cache, table, seq_lens, scale, **common),
        "torch": lambda: torch_decode(q, key_cache, value_cache, table, seq_lens, scale, max_len, scores),
    }
    results: dict[str, float | str] = {}
    try:
        runs["vllm"] = vllm_decode(q, key_cache, value_cache, table, seq_lens, scale, max_len)
        ours = runs["plain"]()[0].float()
        theirs = runs["vllm"]().float()
        results["vllm_max_abs_diff"] = float((ours - theirs).abs().max())
    except Exception as exc:  # any import or launch failure: report it and go on without vLLM's kernel
        results["vllm"] = f"unavailable ({type(exc).__name__}: {exc})"
        runs.pop("vllm", None)
    for name, fn in runs.items():
        results[name] = do_bench(fn)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvserve_kernels.bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    parser.add_argument(
        "--case",
        nargs=6,
        type=int,
        action="append",
        metavar=("BATCH", "SEQ", "QH", "KVH", "D", "BS"),
        help="a shape to run instead of the defaults (repeatable)",
    )
    parser.add_argument("--splits", type=int, default=None, help="num_splits (default: the kernel's heuristic)")
    parser.add_argument(
        "--out",
        default=None,
        help="JSON file for the results (the benchmarks page's format: device, versions, command, one row per shape)",
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "kvserve_kernels.bench needs a CUDA GPU (torch.cuda.is_available() is False); nothing was measured. "
            "On CPU, the kernels' correctness is checked by tests/test_kernels.py under TRITON_INTERPRET=1.",
            file=sys.stderr,
        )
        return 2
    import triton.testing

    def do_bench(fn) -> float:
        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))

    dtype = getattr(torch, args.dtype)
    name = torch.cuda.get_device_name()
    table_peak = peak_from_table(name)
    copy_gbps = measured_copy_gbps(do_bench)
    print(f"device: {name}; peak from table: {table_peak or 'unknown'} GB/s; measured D2D copy: {copy_gbps:.0f} GB/s")
    print(f"torch {torch.__version__}, triton {triton.__version__}, dtype {args.dtype}")
    cases = [Case(*c) for c in args.case] if args.case else DEFAULT_CASES
    itemsize = torch.empty((), dtype=dtype).element_size()
    header = f"{'shape (R, L, Hq, Hkv, D, bs)':32} {'variant':7} {'ms':>9} {'GB/s':>7} {'%peak':>6} {'%copy':>6}"
    print(header)
    rows = []
    for case in cases:
        results = bench_case(case, dtype, do_bench, args.splits)
        kv_bytes = 2 * case.batch * case.seq_len * case.kv_heads * case.head_size * itemsize
        shape = f"({case.batch}, {case.seq_len}, {case.q_heads}, {case.kv_heads}, {case.head_size}, {case.block_size})"
        for variant in ("fused", "h2o", "plain", "torch", "vllm"):
            value = results.get(variant)
            if isinstance(value, float):
                gbps = kv_bytes / (value * 1e-3) / 1e9
                peak = f"{100 * gbps / table_peak:6.1f}" if table_peak else "     -"
                print(f"{shape:32} {variant:7} {value:9.4f} {gbps:7.0f} {peak} {100 * gbps / copy_gbps:6.1f}")
            elif value is not None:
                print(f"{shape:32} {variant:7} {value}")
        plain = results["plain"]
        rows.append(
            {
                "shape": [case.batch, case.seq_len, case.q_heads, case.kv_heads, case.head_size, case.block_size],
                "plain_ms": plain,
                "plain_peak_fraction": kv_bytes / (plain * 1e-3) / 1e9 / table_peak if table_peak else None,
                "h2o_overhead": results["h2o"] / plain - 1,
                "fused_overhead": results["fused"] / plain - 1,
                "torch_over_plain": results["torch"] / plain if isinstance(results.get("torch"), float) else None,
            }
        )
        print(
            f"{shape:32} scoring overhead: fused {100 * (results['fused'] / plain - 1):+.1f}%, "
            f"h2o only {100 * (results['h2o'] / plain - 1):+.1f}%"
            + (f"; |plain - vllm| max {results['vllm_max_abs_diff']:.2e}" if "vllm_max_abs_diff" in results else "")
        )
    if args.out:
        write_results(args, rows, name, copy_gbps, table_peak)
    return 0


def write_results(
    args: argparse.Namespace, rows: list[dict], device: str, copy_gbps: float, peak: float | None
) -> None:
    """The run as JSON, with the device, the versions and the exact command (kvserve's provenance record when
    kvserve is importable, as on the project's machines; the GPU machine may carry the kernels alone)."""
    import datetime as dt
    import json
    import shlex

    import triton

    command = shlex.join(["python", "-m", "kvserve_kernels.bench", *(sys.argv[1:])])
    try:
        from kvserve.provenance import provenance

        ran = provenance(command)
    except ImportError:
        ran = {"date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d"), "command": command, "machine": {"gpu": device}}
    ran["machine"]["gpu"] = device
    ran["versions"] = {"torch": torch.__version__, "triton": triton.__version__}
    record = {
        "provenance": ran,
        "dtype": args.dtype,
        "device": device,
        "peak_gbps": peak,
        "copy_gbps": copy_gbps,
        "runs": [rows],
    }
    with open(args.out, "w") as out:
        json.dump(record, out, indent=1)


if __name__ == "__main__":
    sys.exit(main())
