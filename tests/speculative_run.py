"""Run kvserve's engine with n-gram speculative decoding on prompts whose answers repeat them (greedy), once per
eviction setting (each under its own cache salt); write per setting the token ids, the evicted counts, what each
request's lists kept (`kept_lists`), the block pool's free blocks after the requests finished, and vLLM's
speculative-decoding counters, as JSON. The engine core runs in this process so the pool can be read.

Usage: python tests/speculative_run.py SETTINGS.json OUT.json [SPECULATIVE_CONFIG [alone]]   (SETTINGS: a list of
kv_* dicts; SPECULATIVE_CONFIG: vLLM's --speculative-config as JSON, the n-gram drafter by default; its "model" may
name one of tests/drafters.py's drafters, DRAFTERS below; `alone`: each prompt in a batch of its own, its counters
its own, so "speculation" is a list per prompt)
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

if __name__ == "__main__":
    from engine_settings import (
        SPECULATIVE_CONFIG,
        SPECULATIVE_MAX_TOKENS,
        engine_kwargs,
        find_state,
        in_process_env,
        keep_finished_states,
        kept_lists,
        quoting_prompts,
        speculation_salt,
    )

    in_process_env()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    settings_path, out_path = sys.argv[1:3]
    with open(settings_path) as f:
        settings = json.load(f)
    speculative_config = json.loads(sys.argv[3]) if len(sys.argv) > 3 else SPECULATIVE_CONFIG
    from drafters import eagle3_head, eagle_head, repeated_heads_twin

    DRAFTERS = {
        "default, KV heads repeated": repeated_heads_twin,
        "default's EAGLE head, trained here": eagle_head,
        "default's EAGLE-3 head, trained here": eagle3_head,
    }
    if speculative_config.get("model") in DRAFTERS:
        speculative_config["model"] = str(DRAFTERS[speculative_config["model"]]())
    alone = sys.argv[4:5] == ["alone"]
    llm = LLM(**engine_kwargs(), speculative_config=speculative_config, disable_log_stats=False)
    core = llm.llm_engine.engine_core.engine_core
    pool = core.scheduler.kv_cache_manager.block_pool
    runner = core.model_executor.driver_worker.worker.model_runner
    finished = keep_finished_states(runner)
    prompts = quoting_prompts(llm.get_tokenizer())

    def counters() -> dict:
        names = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
        wanted = {f"vllm:spec_decode_{name}": name for name in names}
        return {wanted[m.name]: m.value for m in llm.get_metrics() if m.name in wanted}

    def generate(salted: list, params: SamplingParams) -> tuple[list, dict]:
        before = counters()
        outputs = llm.generate(salted, params, use_tqdm=False)
        after = counters()
        return outputs, {name: after[name] - before.get(name, 0) for name in after}

    results = []
    for kv in settings:
        params = SamplingParams(temperature=0, max_tokens=SPECULATIVE_MAX_TOKENS, ignore_eos=True, extra_args=kv)
        salted = [TokensPrompt(prompt_token_ids=p, cache_salt=speculation_salt(kv)) for p in prompts]
        if alone:
            runs = [generate([prompt], params) for prompt in salted]
            outputs, speculation = [run[0][0] for run in runs], [run[1] for run in runs]
        else:
            outputs, speculation = generate(salted, params)
        tables = [finished, runner.kvserve.requests]
        states = [find_state(tables, o.request_id) if kv.get("kv_policy") else None for o in outputs]
        results.append(
            {
                "kv": kv,
                "outputs": [list(o.outputs[0].token_ids) for o in outputs],
                "evicted": [(o.kv_transfer_params or {}).get("kv_tokens_evicted") for o in outputs],
                "free_blocks": pool.get_num_free_blocks(),
                "kept": [None if state is None else kept_lists(state) for state in states],
                "speculation": speculation,
            }
        )
    with open(out_path, "w") as f:
        json.dump({"total_blocks": pool.num_gpu_blocks - 1, "results": results}, f)
