"""Background run for tests/test_prefix_hit.py: misses and prefix hits with eviction off (policy `full`), in
bfloat16, the dtype in which vLLM's CPU backend computes a hit's numbers differently from a miss's. Run once with
kvserve's plugin and once without (VLLM_PLUGINS=none); writes each request's greedy tokens, their logprobs and its
cached-token count to the JSON file named by argv[1].

    python tests/prefix_hit_run.py OUT.json
"""

from __future__ import annotations

import json
import os
import sys
import uuid

sys.path.insert(0, os.path.dirname(__file__))

from engine_settings import engine_kwargs, in_process_env  # noqa: E402

MAX_TOKENS = 12
DOCUMENT_TOKENS = 1400  # two prefill chunks on a miss (max_num_batched_tokens 1024), one short tail on a hit


def main(out: str) -> None:
    in_process_env()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from kvserve.tools.eval.haystack import haystack

    llm = LLM(**{**engine_kwargs(), "dtype": "bfloat16", "enable_prefix_caching": True})
    tokenizer = llm.get_tokenizer()
    document = haystack(tokenizer, DOCUMENT_TOKENS, seed=77)
    ask = [tokenizer.encode(f" {q} It is about", add_special_tokens=False) for q in ("What is this?", "Who reads it?")]
    first, second = document + ask[0], document + ask[1]
    salt = uuid.uuid4().hex  # this run's requests share blocks with each other only
    plan = [  # (name, prompt, salt): in this order, so that the hits find the blocks the first request published
        ("first, miss", first, salt),
        ("first again, hit", first, salt),
        ("second, hit on the document", second, salt),
        ("second, miss", second, uuid.uuid4().hex),
    ]
    params = SamplingParams(
        temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0, extra_args={"kv_policy": "full"}
    )
    results = {}
    for name, prompt, request_salt in plan:
        request = TokensPrompt(prompt_token_ids=prompt, cache_salt=request_salt)
        (output,) = llm.generate([request], params, use_tqdm=False)
        completion = output.outputs[0]
        tokens = completion.token_ids
        results[name] = {
            "tokens": list(completion.token_ids),
            "logprobs": [step[token].logprob for step, token in zip(completion.logprobs, tokens, strict=True)],
            "cached_tokens": output.num_cached_tokens,
            "prompt_tokens": len(prompt),
        }
    with open(out, "w") as f:
        json.dump({"plugins": os.environ.get("VLLM_PLUGINS"), "requests": results}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
