"""GPU time per kernel launch of the fused decode, per statistic: `python -m kvserve_kernels.profile`.

`kvserve_kernels.bench` times whole calls; this splits them into the split pass, the reduction and the score launch
(torch.profiler, 20 calls after 5 warm-ups, L2 not flushed), for the two shapes where scoring cost most on an H100
(docs/results.md). Variants: no statistics, H2O's sums, TOVA's row, MAT's first logit, all three. Needs a CUDA GPU.
"""

from __future__ import annotations

import functools
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from .bench import Case, make_inputs
from .decode_attention import decode_attention_with_scores

CASES = [Case(16, 8192, 32, 8, 128, 16), Case(32, 4096, 32, 8, 64, 32)]
CALLS = 20


def main() -> int:
    if not torch.cuda.is_available():
        print("kvserve_kernels.profile needs a CUDA GPU; nothing was measured.", file=sys.stderr)
        return 2
    for case in CASES:
        q, key_cache, value_cache, table, seq_lens = make_inputs(case, torch.bfloat16)
        scores = torch.zeros(case.batch, case.kv_heads, case.seq_len, device="cuda")
        last = torch.zeros_like(scores)
        first = torch.zeros(case.batch, case.q_heads, device="cuda")
        variants = {
            "plain": {},
            "h2o": dict(scores=scores),
            "last": dict(last_probs=last),
            "first": dict(first_logit=first),
            "fused": dict(scores=scores, last_probs=last, first_logit=first),
        }
        for name, statistics in variants.items():
            call = functools.partial(
                decode_attention_with_scores,
                q,
                key_cache,
                value_cache,
                table,
                seq_lens,
                case.head_size**-0.5,
                max_seq_len=case.seq_len,
                **statistics,
            )
            for _ in range(5):
                call()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(CALLS):
                    call()
                torch.cuda.synchronize()
            rows = [(e.key, e.device_time_total / e.count, e.count) for e in prof.key_averages() if e.device_time_total]
            total = sum(per_launch * count for _, per_launch, count in rows) / CALLS
            launches = "; ".join(f"{key[:40]} {per_launch:.1f} us x{count // CALLS}" for key, per_launch, count in rows)
            print(f"{case} {name}: {total:.1f} us per call; {launches}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
