"""Capacity of one fixed KV pool under each policy, in-process: `python -m kvserve.tools.bench.pages_capacity`.

One engine (default model, fp32, block size 32, a pool of `--num-blocks` blocks) serves the same batch of long
prompts once per policy, all requests at once; the scheduler's own counters give the peak number of requests decoding
together and the preemptions, `kvserve:blocks_freed_total` the blocks eviction returned. Policies without a budget
(Attention-Gate) are passed as `name`; others as `name:budget`. Prints and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import time


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--policies", default="full,attention_gate")
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--prompt-tokens", type=int, default=1500)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=80)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the scheduler's counters in this process
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from kvserve.metrics import metrics
    from kvserve.model import ensure_default_model
    from kvserve.tools.eval.haystack import haystack

    llm = LLM(
        model=str(ensure_default_model()),
        dtype="float32",
        enforce_eager=True,
        block_size=32,
        max_model_len=args.prompt_tokens + args.max_tokens + 32,
        num_gpu_blocks_override=args.num_blocks,
        max_num_batched_tokens=1024,
        seed=0,
    )
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    tokenizer = llm.get_tokenizer()
    prompts = [haystack(tokenizer, args.prompt_tokens, seed=200 + i) for i in range(args.prompts)]
    rows = []
    for spec in args.policies.split(","):
        name, _, budget = spec.partition(":")
        kv = {"kv_policy": name, **({"kv_budget": int(budget)} if budget else {})}
        scheduler.peak_running = scheduler.peak_decoding = scheduler.num_preemptions = 0
        freed_before = metrics().blocks_freed.labels(policy=name)._value.get()
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True, extra_args=kv)
        start = time.perf_counter()
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        seconds = time.perf_counter() - start
        freed = metrics().blocks_freed.labels(policy=name)._value.get() - freed_before
        evicted = [(o.kv_transfer_params or {}).get("kv_tokens_evicted", 0) for o in outputs]
        rows.append(
            {
                "policy": spec,
                "requests": len(prompts),
                "peak_decoding": scheduler.peak_decoding,
                "peak_running": scheduler.peak_running,
                "preemptions": scheduler.num_preemptions,
                "blocks_freed_per_request": freed / len(prompts),
                "tokens_evicted_per_request": sum(evicted) / len(prompts),
                "seconds": round(seconds, 1),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    result = {
        "pool_blocks": args.num_blocks,
        "block_size": 32,
        "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens,
        "rows": rows,
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
