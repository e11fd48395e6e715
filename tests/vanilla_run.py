"""Run vanilla vLLM (kvserve's plugin filtered out) on the equivalence prompts (greedy) and on the seeded-sampling
prompt (alone, so in one prefill chunk: vanilla vLLM 0.32 on CPU crashes on a seeded prompt prefilled in chunks);
write the token ids as JSON.

Usage: VLLM_PLUGINS=none python tests/vanilla_run.py OUT.json
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

if __name__ == "__main__":
    assert os.environ.get("VLLM_PLUGINS") == "none", "run with VLLM_PLUGINS=none: this is the no-kvserve baseline"
    from engine_settings import (
        ANSWER_SCHEMA,
        EQUIVALENCE_MAX_TOKENS,
        FEATURE_MAX_TOKENS,
        SEEDED_SAMPLING,
        engine_kwargs,
        equivalence_prompts,
        in_process_env,
        json_prompt,
        seeded_prompt,
    )

    in_process_env()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(**engine_kwargs())
    scheduler_cls = type(llm.llm_engine.engine_core.engine_core.scheduler).__name__
    prompts = equivalence_prompts(llm.get_tokenizer())
    params = SamplingParams(temperature=0, max_tokens=EQUIVALENCE_MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    seeded = llm.generate(
        [TokensPrompt(prompt_token_ids=seeded_prompt(llm.get_tokenizer()))],
        SamplingParams(**SEEDED_SAMPLING),
        use_tqdm=False,
    )
    # the features an evicting request must serve as vanilla does (tests/test_vanilla_features.py)
    from vllm.sampling_params import StructuredOutputsParams

    with_prompt_logprobs = llm.generate(
        [TokensPrompt(prompt_token_ids=prompts[0])],
        SamplingParams(temperature=0, max_tokens=FEATURE_MAX_TOKENS, prompt_logprobs=1, logprobs=1),
        use_tqdm=False,
    )[0]
    structured = llm.generate(
        [TokensPrompt(prompt_token_ids=json_prompt(llm.get_tokenizer()))],
        SamplingParams(
            temperature=0,
            max_tokens=EQUIVALENCE_MAX_TOKENS,
            structured_outputs=StructuredOutputsParams(json=ANSWER_SCHEMA),
        ),
        use_tqdm=False,
    )[0]
    result = {
        "prompt_logprobs": [
            None if entry is None else {str(token): lp.logprob for token, lp in entry.items()}
            for entry in with_prompt_logprobs.prompt_logprobs
        ],
        "logprobs": [
            {str(token): lp.logprob for token, lp in entry.items()}
            for entry in with_prompt_logprobs.outputs[0].logprobs
        ],
        "structured": list(structured.outputs[0].token_ids),
        "scheduler": scheduler_cls,
        "outputs": [list(o.outputs[0].token_ids) for o in outputs],
        "seeded": list(seeded[0].outputs[0].token_ids),
    }
    with open(sys.argv[1], "w") as f:
        json.dump(result, f)
