"""Run an engine with LoRA enabled (vanilla vLLM with VLLM_PLUGINS=none, or kvserve's) on the equivalence prompts
(greedy), base model and adapter, once per eviction setting (kvserve only), each setting under a cache salt of its
own; then the adapter after the base model on one prompt and salt (vLLM keys the prefix cache by adapter). Writes
the token ids, evicted counts, cached tokens and the pool's free blocks as JSON.

Usage: [VLLM_PLUGINS=none] python tests/lora_run.py ADAPTER_DIR SETTINGS.json OUT.json
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

if __name__ == "__main__":
    from engine_settings import EQUIVALENCE_MAX_TOKENS, engine_kwargs, equivalence_prompts, in_process_env
    from lora_adapter import ADAPTER_RANK

    in_process_env()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    adapter, settings_path, out_path = sys.argv[1:4]
    with open(settings_path) as f:
        settings = json.load(f)
    llm = LLM(**engine_kwargs(), enable_lora=True, max_lora_rank=ADAPTER_RANK, max_loras=1)
    pool = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool
    lora = LoRARequest("trained", 1, adapter)
    prompts = equivalence_prompts(llm.get_tokenizer())

    def run(kv: dict | None, salt: str, adapter_request, token_lists=prompts) -> list:
        params = SamplingParams(temperature=0, max_tokens=EQUIVALENCE_MAX_TOKENS, ignore_eos=True, extra_args=kv)
        salted = [TokensPrompt(prompt_token_ids=p, cache_salt=salt) for p in token_lists]
        outputs = llm.generate(salted, params, lora_request=adapter_request, use_tqdm=False)
        return [
            {
                "tokens": list(o.outputs[0].token_ids),
                "evicted": (o.kv_transfer_params or {}).get("kv_tokens_evicted"),
                "cached": o.num_cached_tokens,
            }
            for o in outputs
        ]

    results = []
    for kv in settings:
        salt = "lora " + json.dumps(kv, sort_keys=True)
        results.append({"kv": kv, "base": run(kv or None, salt, None), "adapter": run(kv or None, salt + " a", lora)})
    # the prefix cache is keyed by adapter: the adapter's request after the base model's finds nothing, its second
    # request finds its own blocks
    kv = settings[-1] or None
    order = [run(kv, "order", request, prompts[:1])[0] for request in (None, lora, lora)]
    with open(out_path, "w") as f:
        json.dump(
            {
                "results": results,
                "order": order,
                "free_blocks": pool.get_num_free_blocks(),
                "total_blocks": pool.num_gpu_blocks - 1,
            },
            f,
        )
