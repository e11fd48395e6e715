"""`python -m kvserve.tools.bench.step_profile POLICY`: one in-process engine, N long prompts at once, every engine step
timed; prints the median decode step, the compaction histogram's mean and the engine's phases
(`kvserve:engine_seconds_total`). Run it under py-spy for a flame graph of one decode step and one compaction:

    py-spy record -r 100 --nonblocking --format raw -o h2o.txt -- \\
        python -m kvserve.tools.bench.step_profile h2o --budget 1190 --prompts 4 --prompt-tokens 1000 --max-tokens 64
    python -m kvserve.tools.bench.flame h2o.txt --root LLMEngine.step

`--vanilla` runs the same with vLLM's plugins off (no kvserve), for the ratio. Not a benchmark against vanilla by
itself: compare runs on the same machine only.

`--prefix-tokens N` puts one N-token document, cached before the timed steps, in front of every prompt: a chat turn
over a shared document, whose prefill computes only the prompt's own tokens (e.g. `--prefix-tokens 1536
--prompt-tokens 260 --max-tokens 1` times seven such prefills in one step, `full` against `snapkv`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("policy", help="kv_policy of every request (full: scoring off)")
    parser.add_argument("--budget", type=int, default=None)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--vanilla", action="store_true", help="vLLM without kvserve (VLLM_PLUGINS=none)")
    parser.add_argument("--prefix-tokens", type=int, default=0, help="a cached document in front of every prompt")
    args = parser.parse_args(argv)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core and worker in this process
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    if args.vanilla:
        os.environ["VLLM_PLUGINS"] = "none"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from kvserve.model import ensure_default_model
    from kvserve.tools.eval.haystack import haystack

    llm = LLM(
        model=str(ensure_default_model()),
        dtype=args.dtype,
        enforce_eager=True,
        block_size=args.block_size,
        # room in each block-table row for a compaction's copies out of cached blocks (else the hit is cut)
        max_model_len=args.prefix_tokens
        + args.prompt_tokens
        + args.max_tokens
        + 2 * args.block_size
        + (args.budget or 0),
        max_num_batched_tokens=2048,
        seed=0,
    )
    tokenizer = llm.get_tokenizer()
    prefix = haystack(tokenizer, args.prefix_tokens, seed=299) if args.prefix_tokens else []
    prompts = [
        TokensPrompt(prompt_token_ids=prefix + haystack(tokenizer, args.prompt_tokens, seed=300 + i))
        for i in range(args.prompts + 1)
    ]
    kv = {} if args.vanilla else {"kv_policy": args.policy, **({"kv_budget": args.budget} if args.budget else {})}
    llm.generate(prompts[:1], SamplingParams(max_tokens=2, extra_args=kv), use_tqdm=False)  # warm-up
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True, extra_args=kv)
    engine = llm.llm_engine
    for number, prompt in enumerate(prompts[1:]):
        engine.add_request(f"profile-{number}", prompt, params)
    if not args.vanilla:
        from kvserve.metrics import metrics
        from kvserve.phases import PHASES

        phase_counter = metrics().engine_seconds
        histogram = metrics().compaction_seconds.labels(policy=args.policy)
        before = {p: phase_counter.labels(phase=p)._value.get() for p in PHASES}
        compactions_before, compaction_sum_before = _count(histogram), histogram._sum.get()
    steps = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - start)
    decode = steps[len(steps) - (args.max_tokens - 1) :]  # every request decodes together after the prefill steps
    result = {
        "policy": "vanilla" if args.vanilla else args.policy,
        "budget": args.budget,
        "steps": len(steps),
        "total_s": round(sum(steps), 2),
        "median_decode_step_ms": round(1000 * statistics.median(decode), 1) if decode else None,
    }
    if not args.vanilla:
        result["phases_s"] = {p: round(phase_counter.labels(phase=p)._value.get() - before[p], 3) for p in PHASES}
        count = _count(histogram) - compactions_before
        result["compactions"] = count
        result["mean_compaction_step_ms"] = (
            round(1000 * (histogram._sum.get() - compaction_sum_before) / count, 1) if count else None
        )
    print(json.dumps(result), flush=True)


def _count(histogram) -> float:
    return sum(bucket.get() for bucket in histogram._buckets)


if __name__ == "__main__":
    main()
