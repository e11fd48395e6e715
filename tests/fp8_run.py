"""Run the engine with an fp8 KV cache (`kv_cache_dtype="fp8"`, the test engine's settings otherwise) and write what
tests/test_fp8.py compares, as JSON. The engine core and worker run in this process so the eviction state and the
pool can be read.

Usage: python tests/fp8_run.py kvserve OUT.json
       VLLM_PLUGINS=none python tests/fp8_run.py vanilla OUT.json   (the equivalence prompts only)
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

KV_CACHE_DTYPE = "fp8"
SNAPKV = {"kv_policy": "snapkv", "kv_budget": 128, "kv_span": 1}  # the per-token choice the reference makes
SNAPKV_PROMPT = (400, 4)  # haystack tokens, seed
EVERY_POLICY_BUDGET, EVERY_POLICY_TOKENS = 96, 80  # decode reaches budget + block size: a decode compaction too
# the ways a request's lists are chosen and shared, each on its own prompt (a prefix hit needs the same prompt twice)
SETTINGS = {
    "prefix": {"kv_policy": "snapkv", "kv_budget": 96},
    "heads": {"kv_policy": "snapkv", "kv_budget": 96, "kv_allocation": "heads"},
    "global": {"kv_policy": "snapkv", "kv_budget": 96, "kv_allocation": "global"},
    "span": {"kv_policy": "tova", "kv_budget": 96, "kv_span": 8},
    "every_chunk": {"kv_policy": "streamingllm", "kv_budget": 96, "kv_evict_every_chunk": True},
    "attention_gate": {"kv_policy": "attention_gate"},
    "duoattention": {"kv_policy": "duoattention", "kv_budget": 128},
}
CHECKPOINT = {"kv_policy": "snapkv", "kv_budget": 64, "kv_checkpoint": 64}
PRESSURE = {"kv_policy": "snapkv", "kv_budget": 64, "kv_evict_when": "pressure"}


def main(mode: str, out_path: str) -> None:
    from engine_settings import EQUIVALENCE_MAX_TOKENS, engine_kwargs, equivalence_prompts, in_process_env

    in_process_env()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from kvserve.tools.eval.haystack import haystack

    llm = LLM(**engine_kwargs(), kv_cache_dtype=KV_CACHE_DTYPE)
    tokenizer = llm.get_tokenizer()
    core = llm.llm_engine.engine_core.engine_core
    pool = core.scheduler.kv_cache_manager.block_pool

    def generate(prompts, max_tokens: int, kv: dict | list | None, salt: str | None = None):
        kvs = kv if isinstance(kv, list) else [kv] * len(prompts)
        params = [SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, extra_args=one) for one in kvs]
        extra = {} if salt is None else {"cache_salt": salt}
        return llm.generate([TokensPrompt(prompt_token_ids=p, **extra) for p in prompts], params, use_tqdm=False)

    def tokens(outputs) -> list[list[int]]:
        return [list(o.outputs[0].token_ids) for o in outputs]

    def evicted(outputs) -> list[int]:
        return [(o.kv_transfer_params or {}).get("kv_tokens_evicted", 0) for o in outputs]

    equivalence = equivalence_prompts(tokenizer)
    result = {
        "scheduler": type(core.scheduler).__name__,
        "total_blocks": pool.num_gpu_blocks - 1,
        "equivalence": {"full": tokens(generate(equivalence, EQUIVALENCE_MAX_TOKENS, None))},
    }
    if mode == "vanilla":
        _write(out_path, result)
        return

    from engine_settings import find_state, fitting_window, keep_finished_states

    from kvserve.policies import POLICIES, POLICY_NAMES
    from kvserve.vllm.worker import requests_of

    runner = core.model_executor.driver_worker.worker.model_runner
    finished = keep_finished_states(runner, limit=64)

    def state_of(output):
        return find_state((requests_of(runner).requests, finished), output.request_id)

    above = {"kv_policy": "snapkv", "kv_budget": 2048}
    result["equivalence"]["budget_above_sequence"] = tokens(generate(equivalence, EQUIVALENCE_MAX_TOKENS, above))

    (snapkv,) = generate([haystack(tokenizer, *SNAPKV_PROMPT)], 1, SNAPKV)
    state = state_of(snapkv)
    result["snapkv"] = {
        "prompt": list(snapkv.prompt_token_ids),
        "kept": [state.layers[layer].kept_positions.tolist() for layer in sorted(state.layers)],
    }

    budgeted = [
        n
        for n in POLICY_NAMES
        if n != "full" and not (POLICIES[n].ragged or POLICIES[n].own_counts or POLICIES[n].reconstructs)
    ]
    prompts = [haystack(tokenizer, 300, seed=70 + i) for i in range(len(budgeted))]
    kvs = [fitting_window({"kv_policy": name, "kv_budget": EVERY_POLICY_BUDGET}) for name in budgeted]
    outputs = generate(prompts, EVERY_POLICY_TOKENS, kvs)
    result["every_policy"] = {}
    for name, output in zip(budgeted, outputs, strict=True):
        state = state_of(output)
        result["every_policy"][name] = {
            "tokens": len(output.outputs[0].token_ids),
            "compactions": state.compactions,
            "kept_shapes": sorted({tuple(layer.kept_positions.shape) for layer in state.layers.values()}),
            "ascending": all(
                bool((layer.kept_positions[:, 1:] > layer.kept_positions[:, :-1]).all())
                for layer in state.layers.values()
            ),
        }

    result["settings"] = {}
    for number, (label, kv) in enumerate(SETTINGS.items()):
        ids = haystack(tokenizer, 300, seed=200 + number)
        first, again = generate([ids], 16, kv)[0], generate([ids], 16, kv)[0]  # the second reads the first's blocks
        result["settings"][label] = {
            "tokens": tokens([first, again]),
            "evicted": evicted([first, again]),
            "cached": [first.num_cached_tokens, again.num_cached_tokens],
            "compactions": state_of(again).compactions,
        }

    # checkpoints: the second request resumes from the first's latest; a salted twin computes everything itself
    document = haystack(tokenizer, 330, seed=300)
    question = tokenizer.encode(" Who would read this text?", add_special_tokens=False)
    generate([document], 8, CHECKPOINT, salt="fp8-checkpoint")
    (hit,) = generate([document + question], 8, CHECKPOINT, salt="fp8-checkpoint")
    (miss,) = generate([document + question], 8, CHECKPOINT, salt="fp8-fresh")
    result["checkpoint"] = {
        "cached": [hit.num_cached_tokens, miss.num_cached_tokens],
        "tokens": tokens([hit, miss]),
        "evicted": evicted([hit, miss]),
        "kept": [
            [state_of(output).layers[layer].kept_positions.tolist() for layer in sorted(state_of(output).layers)]
            for output in (hit, miss)
        ],
    }

    # deferred eviction: six 400-token prompts decoding together outgrow the 80-block pool
    crowd = [haystack(tokenizer, 400, seed=400 + i) for i in range(6)]
    outputs = generate(crowd, 64, PRESSURE)
    result["pressure"] = {"tokens": [len(t) for t in tokens(outputs)], "evicted": evicted(outputs)}

    generate([[1, 2, 3]], 1, None)  # one more step lets the worker drop the finished requests' state
    result["free_blocks"] = pool.get_num_free_blocks()
    result["layout"] = type(
        next(impl for impl in _attention_impls(runner) if getattr(impl, "_layout", None) is not None)._layout
    ).__name__
    _write(out_path, result)


def _attention_impls(runner):
    from vllm.model_executor.layers.attention import Attention

    return [module.impl for module in runner.model.modules() if isinstance(module, Attention)]


def _write(path: str, result: dict) -> None:
    with open(path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
