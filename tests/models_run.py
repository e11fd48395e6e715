"""Serve each tiny random-weight model (kvserve/tools/bench/tiny_models.py) in turn, in this process, and write what
each request got as JSON: greedy token ids with `full`, with each evicting policy at a small budget and with a budget
above the prompt, the evicted counts, the error of a request the model refuses, and the free blocks before and after.
Run once with kvserve (plugins on, server-wide defaults `SERVER_DEFAULTS` as `kvserve serve --kv-*` sets them) and
once as vanilla vLLM (`VLLM_PLUGINS=none`, eviction settings ignored).

Usage: python tests/models_run.py OUT.json ARCH [ARCH ...]
"""

import gc
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

PROMPT_TOKENS = 631  # past several 128-token windows, and several 32-token blocks
MAX_TOKENS = 24
SMALL_BUDGET = 64
SERVER_DEFAULTS = {"kv_policy": "snapkv", "kv_budget": SMALL_BUDGET}  # the kvserve pass's server-wide defaults
SETTINGS = [
    {"kv_policy": "full"},
    None,  # the server's default: evicts where the model can, serves `full` where it cannot
    {"kv_policy": "snapkv", "kv_budget": SMALL_BUDGET},
    {"kv_policy": "h2o", "kv_budget": SMALL_BUDGET},
    {"kv_policy": "streamingllm", "kv_budget": SMALL_BUDGET},
    {"kv_policy": "snapkv", "kv_budget": 1024},  # above the prompt and the reply: nothing to evict
]


def _tied(logprobs: dict) -> bool:
    """No single best token here: the top two tie, or the logits are not finite numbers (NaN ranks nothing)."""
    values = [entry.logprob for entry in logprobs.values()]
    if not all(math.isfinite(value) for value in values):
        return True
    best = sorted(values, reverse=True)
    return len(best) > 1 and best[0] - best[1] < 1e-6


def run_model(architecture: str) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.distributed import cleanup_dist_env_and_memory
    from vllm.inputs import TokensPrompt

    from kvserve.tools.bench.tiny_models import tiny_model
    from kvserve.tools.eval.haystack import haystack

    llm = LLM(
        model=str(tiny_model(architecture)),
        dtype="float32",
        enforce_eager=True,
        block_size=32,
        max_model_len=2048,
        max_num_batched_tokens=1024,
        num_gpu_blocks_override=400,  # a hybrid model's groups share the pool
        seed=0,
    )
    try:
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        pool = scheduler.kv_cache_manager.block_pool
        support = getattr(scheduler, "support", None)  # kvserve's reading of the model (absent in vanilla vLLM)
        prompt = haystack(llm.get_tokenizer(), PROMPT_TOKENS, seed=7)[:PROMPT_TOKENS]
        free_before = pool.get_num_free_blocks()
        results = []
        for index, kv in enumerate(SETTINGS):
            logprobs = 2 if index == 0 else None  # `full`'s: the test compares it only where no two tokens tie
            params = SamplingParams(
                temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, extra_args=kv, logprobs=logprobs
            )
            try:  # a fresh salt per setting: no request reads another's prefix-cache blocks
                output = llm.generate(
                    [TokensPrompt(prompt_token_ids=prompt, cache_salt=f"setting-{index}")], params, use_tqdm=False
                )[0]
            except Exception as error:  # noqa: BLE001 - the refusal is what the test reads
                results.append({"kv": kv, "error": f"{type(error).__name__}: {error}"})
                continue
            transfer = output.kv_transfer_params or {}
            results.append(
                {
                    "kv": kv,
                    "tokens": list(output.outputs[0].token_ids),
                    "evicted": transfer.get("kv_tokens_evicted"),
                    # positions where greedy decoding had no single best token (a tie at the top): there the token
                    # is any of the tied ones, so runs may differ without a difference in the model's output
                    "ties": sum(_tied(position) for position in output.outputs[0].logprobs or []),
                    # the first positions' top log-probabilities, for the failure message when tokens differ
                    "top_logprobs": [
                        sorted((entry.logprob for entry in position.values()), reverse=True)
                        for position in (output.outputs[0].logprobs or [])[:3]
                    ],
                }
            )
        return {
            "results": results,
            "free_before": free_before,
            "free_after": pool.get_num_free_blocks(),
            "paged_layers": None if support is None else list(support.paged_layers),
            "reason": None if support is None else support.reason,
        }
    finally:
        del llm
        gc.collect()
        cleanup_dist_env_and_memory()


if __name__ == "__main__":
    from engine_settings import in_process_env

    from kvserve.config import DEFAULTS_ENV

    in_process_env()
    os.environ[DEFAULTS_ENV] = json.dumps(SERVER_DEFAULTS)
    out = {}
    for architecture in sys.argv[2:]:
        try:
            out[architecture] = run_model(architecture)
        except Exception as error:  # noqa: BLE001 - a model that does not start is a result too
            out[architecture] = {"start_error": f"{type(error).__name__}: {error}"}
    with open(sys.argv[1], "w") as f:
        json.dump(out, f)
