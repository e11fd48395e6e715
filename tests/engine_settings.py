"""Engine settings shared by the in-process kvserve engine and the vanilla-vLLM subprocess, and the prompts both run."""

from __future__ import annotations

import json
import os
from collections import OrderedDict

from kvserve.model import ensure_default_model

BLOCK_SIZE = 32
NUM_BLOCKS = 80  # a small pool (2,560 tokens): capacity and preemption tests need it to run out
# What `kvserve serve` without MODEL calls the default model (the name clients send, not the folder it lives in).
SERVED_MODEL = "SmolLM2-135M-Instruct"
CHUNK_WHEN_SHARED = 128  # a prompt is prefilled in one chunk when alone, in 128-token chunks beside another request


def engine_kwargs() -> dict:
    return dict(
        model=str(ensure_default_model()),
        dtype="float32",
        enforce_eager=True,
        block_size=BLOCK_SIZE,
        max_model_len=2048,
        max_num_batched_tokens=1024,
        long_prefill_token_threshold=CHUNK_WHEN_SHARED,
        num_gpu_blocks_override=NUM_BLOCKS,
        seed=0,
    )


def keep_finished_states(runner, limit: int = 32) -> OrderedDict:
    """The eviction state of the last `limit` finished requests, by internal request id, as the worker forgets them
    (the engine itself keeps none): tests compare what a finished request kept against references."""
    from kvserve.vllm.worker import requests_of

    book = requests_of(runner)
    finished: OrderedDict = OrderedDict()
    finish = book.finish

    def finish_and_keep(req_id: str) -> None:
        state = book.requests.get(req_id)
        finish(req_id)
        if state is not None:
            finished[req_id] = state
            while len(finished) > limit:
                finished.popitem(last=False)

    book.finish = finish_and_keep
    return finished


def find_state(tables, request_id: str):
    """A request's eviction state by its external id (vLLM's internal id may add a suffix) in any of `tables`."""
    for table in tables:
        for internal_id, state in table.items():
            if internal_id == request_id or internal_id.startswith(f"{request_id}-"):
                return state
    raise KeyError(request_id)


def in_process_env() -> None:
    """Engine core and worker in this process, so tests can read the scheduler's and worker's state."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def equivalence_prompts(tokenizer) -> list[list[int]]:
    from kvserve.tools.eval.haystack import haystack

    question = tokenizer.encode(" In one sentence, what is this text about? It is about", add_special_tokens=False)
    return [
        haystack(tokenizer, 300, seed=1) + question,
        haystack(tokenizer, 90, seed=2) + question,
        tokenizer.encode("The three primary colors are", add_special_tokens=False),
    ]


EQUIVALENCE_MAX_TOKENS = 48


# Seeded sampling (vLLM's `seed`): a prompt longer than CHUNK_WHEN_SHARED and shorter than max_num_batched_tokens, so
# it is prefilled in one chunk alone and in several beside another request.
SEEDED_SAMPLING = dict(seed=1, temperature=0.8, top_p=0.95, max_tokens=24, ignore_eos=True)


def seeded_prompt(tokenizer) -> list[int]:
    from kvserve.tools.eval.haystack import haystack

    return haystack(tokenizer, 600, seed=11)


# Features vanilla serves that an evicting request must serve alike (tests/test_vanilla_features.py): prompt and sampled
# logprobs on the first equivalence prompt, a JSON-schema answer on a prompt long enough to evict.
FEATURE_MAX_TOKENS = 8
ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"topic": {"type": "string", "maxLength": 24}, "pages": {"type": "integer"}},
    "required": ["topic", "pages"],
    "additionalProperties": False,
}


def json_prompt(tokenizer) -> list[int]:
    from kvserve.tools.eval.haystack import haystack

    ask = " Describe this text as JSON with its topic and a number of pages:"
    return haystack(tokenizer, 300, seed=5) + tokenizer.encode(ask, add_special_tokens=False)


# Speculative decoding (tests/test_speculative.py): n-gram prompt lookup on prompts whose answer repeats them, so
# drafts are proposed and accepted often.
SPECULATIVE_CONFIG = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
SPECULATIVE_MAX_TOKENS = 72


def quoting_prompts(tokenizer) -> list[list[int]]:
    from kvserve.tools.eval.haystack import haystack

    text = haystack(tokenizer, 200, seed=1)
    repeat = tokenizer.encode(" Repeat the text above word for word:", add_special_tokens=False)
    counting = tokenizer.encode("one two three four one two three four one two", add_special_tokens=False)
    return [text + repeat + text[:16], haystack(tokenizer, 120, seed=2) + repeat, counting]


def speculation_salt(kv: dict) -> str:
    """Each setting's requests under a salt of their own: they miss the prefix cache on both sides of the comparison."""
    return "speculation " + json.dumps(kv, sort_keys=True)


def kept_lists(state) -> dict:
    """What a finished request's lists held: how many compactions, and per layer each head's kept positions at the
    last one (a function of every compaction before it)."""
    layers = {
        str(index): None if layer.kept_positions is None else layer.kept_positions.tolist()
        for index, layer in sorted(state.layers.items())
    }
    return {"compactions": state.compactions, "positions": layers}


# The session's HTTP server (tests/conftest.py) and the servers that must match it (vanilla's side of the
# compatibility matrix, the data-parallel pair): float32, since vLLM on CPU would serve this fp32 checkpoint in bf16
# and the references are fp32; a prefill chunk of 128 tokens, since perplexity tests need eviction between chunks;
# a tool-call parser, without which vLLM refuses every `tool_choice` but "none" (SmolLM2's template knows no tools,
# so hermes's `<tool_call>` tags are what a free answer would need; named and required choices are forced by a schema).
SERVER_CHUNK = 128
SERVER_ARGS = ["--max-model-len", "2048", "--block-size", "32", "--enforce-eager", "--dtype", "float32"]
SERVER_ARGS += [
    "--max-num-batched-tokens",
    str(SERVER_CHUNK),
    "--enable-auto-tool-choice",
    "--tool-call-parser",
    "hermes",
]


def fitting_window(kv: dict) -> dict:
    """`kv` with a 16-entry window where its policy's default one (KVzap's 128) would not fit its `kv_budget`."""
    from kvserve.policies import POLICIES

    return {**kv, "kv_window": 16} if POLICIES[kv["kv_policy"]]().protected_tokens() >= kv["kv_budget"] else kv
