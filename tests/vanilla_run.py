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
        EQUIVALENCE_MAX_TOKENS,
        SEEDED_SAMPLING,
        engine_kwargs,
        equivalence_prompts,
        in_process_env,
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
    result = {
        "scheduler": scheduler_cls,
        "outputs": [list(o.outputs[0].token_ids) for o in outputs],
        "seeded": list(seeded[0].outputs[0].token_ids),
    }
    with open(sys.argv[1], "w") as f:
        json.dump(result, f)
