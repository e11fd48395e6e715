"""Run kvserve under vLLM's pipeline parallelism (2 stages, each its own worker process) on the equivalence prompts
(greedy), once per eviction setting; write per setting the token ids, the evicted counts and the block pool's free
blocks after the requests finished, as JSON. The engine core runs in this process so the pool can be read.

Usage: python tests/pipeline_run.py SETTINGS.json OUT.json   (SETTINGS: a list of kv_* dicts)
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

PIPELINE_STAGES = 2


if __name__ == "__main__":
    from engine_settings import EQUIVALENCE_MAX_TOKENS, engine_kwargs, equivalence_prompts, in_process_env

    from kvserve.parallelism import parallel_env

    in_process_env()
    os.environ.update(parallel_env(["--pipeline-parallel-size", str(PIPELINE_STAGES)], os.environ))  # as kvserve serve
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(sys.argv[1]) as f:
        settings = json.load(f)
    llm = LLM(**engine_kwargs(), pipeline_parallel_size=PIPELINE_STAGES)
    core = llm.llm_engine.engine_core.engine_core
    pool = core.scheduler.kv_cache_manager.block_pool
    prompts = [TokensPrompt(prompt_token_ids=p) for p in equivalence_prompts(llm.get_tokenizer())]
    results = []
    for kv in settings:
        params = SamplingParams(temperature=0, max_tokens=EQUIVALENCE_MAX_TOKENS, ignore_eos=True, extra_args=kv)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        results.append(
            {
                "kv": kv,
                "outputs": [list(o.outputs[0].token_ids) for o in outputs],
                "evicted": [(o.kv_transfer_params or {}).get("kv_tokens_evicted") for o in outputs],
                "cached": [o.num_cached_tokens for o in outputs],
                "free_blocks": pool.get_num_free_blocks(),
            }
        )
    with open(sys.argv[2], "w") as f:
        json.dump(
            {
                "total_blocks": pool.num_gpu_blocks - 1,
                "scheduler": type(core.scheduler).__name__,
                "batch_queue": core.batch_queue_size,
                "results": results,
            },
            f,
        )
