"""Run kvserve with its own attention (KVSERVE_ATTENTION=kernels) and write greedy token ids, kept positions and the
pool's free blocks as JSON.

Usage: KVSERVE_ATTENTION=kernels python tests/kernel_attention_run.py OUT.json [--triton]
- default: the kernels' PyTorch references (what the dispatch picks on CPU): the equivalence prompts without
  eviction, then one batch of every kind of policy.
- `--triton`: the Triton kernels themselves, under Triton's interpreter (slow: a small batch only).
It runs in its own process because vLLM picks the attention implementation once, at engine start.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from kvserve.policies import POLICIES, representative_policies  # noqa: E402

# every registered policy that ranks entries against a budget, DuoAttention's own counts included (Attention-Gate's
# gated path is tested elsewhere)
KERNEL_POLICIES = representative_policies(ragged=False) + [n for n, cls in POLICIES.items() if cls.own_counts]
KERNEL_BUDGET, KERNEL_MAX_TOKENS = 96, 40  # a prefill compaction, then one in decode (cache 96 -> 128 -> 96)
# Triton's interpreter is slow: one policy per statistic the attention pass measures
TRITON_POLICIES = [
    next(name for name in KERNEL_POLICIES if statistic in POLICIES[name].pass_statistics)
    for statistic in ("column_sums", "window_sums", "first_logits")
]
TRITON_PROMPT, TRITON_BUDGET, TRITON_MAX_TOKENS = 80, 48, 6


def policy_batch(tokenizer, triton: bool = False):
    """(prompts, per-request kv settings, max_tokens) of the batch both engines run."""
    from kvserve.tools.eval.haystack import haystack

    names, length, budget = (
        (TRITON_POLICIES, TRITON_PROMPT, TRITON_BUDGET) if triton else (KERNEL_POLICIES, 300, KERNEL_BUDGET)
    )
    prompts = [haystack(tokenizer, length, seed=90 + i) for i in range(len(names))]
    settings = [{"kv_policy": name, "kv_budget": budget} for name in names]
    return prompts, settings, TRITON_MAX_TOKENS if triton else KERNEL_MAX_TOKENS


def run_batch(llm, prompts, kv_settings, max_tokens):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = [
        SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, extra_args=kv) for kv in kv_settings
    ]
    return llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)


def kept_positions(state) -> list:
    """Every layer's kept positions [H, B] of a request's eviction state, by layer index."""
    return [state.layers[i].kept_positions.tolist() for i in sorted(state.layers)]


def count_kernel_launches() -> dict[str, int]:
    """Count calls of the Triton kernels' entry points (the dispatch looks them up at each call)."""
    import importlib

    counts: dict[str, int] = {}
    for module_name, function in (
        ("decode_attention", "decode_attention_with_scores"),
        ("prefill_window", "prefill_attention_with_window_sums"),
        ("compaction", "compact"),
    ):
        module = importlib.import_module(f"kvserve_kernels.{module_name}")
        original = getattr(module, function)
        counts[function] = 0

        def counted(*args, _original=original, _name=function, **kwargs):
            counts[_name] += 1
            return _original(*args, **kwargs)

        setattr(module, function, counted)
    return counts


if __name__ == "__main__":
    assert os.environ.get("KVSERVE_ATTENTION") == "kernels", "run with KVSERVE_ATTENTION=kernels"
    triton_kernels = "--triton" in sys.argv
    if triton_kernels:
        os.environ["KVSERVE_KERNELS"] = "triton"
        os.environ["TRITON_INTERPRET"] = "1"  # vLLM on CPU: CPU tensors, so Triton's interpreter runs the kernels
        import triton.language  # noqa: F401 - before vLLM's import fixes Triton's library functions as compiled
    from engine_settings import (
        EQUIVALENCE_MAX_TOKENS,
        engine_kwargs,
        equivalence_prompts,
        find_state,
        in_process_env,
        keep_finished_states,
    )

    in_process_env()
    from vllm import LLM

    llm = LLM(**engine_kwargs())
    core = llm.llm_engine.engine_core.engine_core
    runner = core.model_executor.driver_worker.worker.model_runner
    finished = keep_finished_states(runner)
    pool = core.scheduler.kv_cache_manager.block_pool
    tokenizer = llm.get_tokenizer()
    launches = count_kernel_launches() if triton_kernels else {}
    free_before = pool.get_num_free_blocks()
    print("kernel_attention_run: engine ready", flush=True)  # the log says which phase a run that hangs was in
    plain = [] if triton_kernels else run_batch(llm, equivalence_prompts(tokenizer), [None] * 3, EQUIVALENCE_MAX_TOKENS)
    print("kernel_attention_run: plain batch done", flush=True)
    prompts, kv_settings, max_tokens = policy_batch(tokenizer, triton_kernels)
    evicting = run_batch(llm, prompts, kv_settings, max_tokens)
    print("kernel_attention_run: policy batch done", flush=True)
    result = {
        "impls": sorted({type(module.impl).__name__ for module in runner.model.modules() if hasattr(module, "impl")}),
        "plain": [list(o.outputs[0].token_ids) for o in plain],
        "tokens": [list(o.outputs[0].token_ids) for o in evicting],
        "kept": [kept_positions(find_state([runner.kvserve.requests, finished], o.request_id)) for o in evicting],
    }
    run_batch(llm, [[1, 2, 3]], [None], 1)  # one more step lets the worker drop the finished requests' state
    result["free_blocks"] = [free_before, pool.get_num_free_blocks()]
    result["triton_launches"] = launches
    with open(sys.argv[1], "w") as f:
        json.dump(result, f)
