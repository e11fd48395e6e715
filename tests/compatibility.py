"""The compatibility matrix's probes: each of vLLM's per-request features, asked of a server over HTTP the way an
operator's client asks for it, and judged by what the answer must hold (two choices for n=2, an answer that parses
for a JSON schema, a tool call whose arguments match the tool's parameters, ...). The same probes run against vanilla
`vllm serve` (tests/compatibility_run.py, in the background) and against `kvserve serve` with eviction on
(tests/test_compatibility.py, on the session's server), and the outcomes are the matrix in the guide
(docs/eval/compatibility.json, rendered by `kvserve report`).

An outcome is "serves", or "refused: <the server's message>" for an answer with status 400, or "fails: <why>" for an
answer that came back but does not hold what the feature promises; beside it, the tokens the request evicted as its
usage says (kvserve's `usage.kv_tokens_evicted`; None from vanilla).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

import httpx

# kvserve's side asks for eviction per request; vanilla ignores headers it does not know. B=96 evicts most of the
# probes' prompt (258 tokens in the chat template); at B=64 the default model's answers to the tool-call probes ran
# off into digits under SnapKV's pool of 31 (with kv_kernel_size=15 they parsed): the model's answer, not the feature
EVICTING = {"x-kv-policy": "snapkv", "x-kv-budget": "96"}
EVICTING_BUDGET = EVICTING["x-kv-budget"]
PROMPT = (
    "The library keeps its maps in a room on the third floor. Each map shows a river, the towns beside it and the "
    "roads between them, drawn by hand a century ago. " * 6 + "Question: where does the library keep its maps? Answer:"
)
SCHEMA = {
    "type": "object",
    "properties": {"room": {"type": "string", "maxLength": 24}, "floor": {"type": "integer"}},
    "required": ["room", "floor"],
    "additionalProperties": False,
}
# strict: vLLM pins the arguments to the schema (without it, this model's forced call came back with the arguments
# '"find_room"' from vanilla vLLM too)
TOOL = {
    "type": "function",
    "function": {"name": "find_room", "description": "Where it is", "parameters": SCHEMA, "strict": True},
}
NAMED = {"type": "function", "function": {"name": "find_room"}}
MAX_TOKENS = 24


@dataclass(frozen=True)
class Probe:
    feature: str  # the matrix's row
    request: str  # how a client asks for it
    ask: Callable[[str, str, dict], dict] | None  # (base URL, model, headers) -> {"outcome", "evicted"}


def post(base: str, path: str, body: dict, headers: dict) -> httpx.Response:
    return httpx.post(base + path, json=body, headers=headers, timeout=600)


def outcome(response: httpx.Response, holds: Callable[[dict], str | None]) -> dict:
    """ "serves" when the answer holds what `holds` checks (it returns None, or why not), else why not."""
    if response.status_code == 400:
        error = response.json().get("error", {})
        field = f" ({error['param']})" if error.get("param") else ""
        return {"outcome": f"refused{field}: {error.get('message', response.text)}"}
    if response.status_code != 200:
        return {"outcome": f"fails: status {response.status_code}: {response.text[:300]}"}
    answer = response.json()
    why = holds(answer)
    evicted = (answer.get("usage") or {}).get("kv_tokens_evicted")
    return {"outcome": "serves" if why is None else f"fails: {why}", "evicted": evicted}


def completion(model: str, **body) -> dict:
    # ignore_eos: every answer is as long on both sides, whatever either model's first choice of an end is
    return {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, **body}


def complete(base: str, model: str, headers: dict, **body) -> httpx.Response:
    return post(base, "/v1/completions", completion(model, **body), headers)


def chat(base: str, model: str, headers: dict, **body) -> httpx.Response:
    messages = [{"role": "user", "content": PROMPT}]
    body = {"model": model, "messages": messages, "max_tokens": 64, "temperature": 0, **body}
    return post(base, "/v1/chat/completions", body, headers)


def n_choices(base: str, model: str, headers: dict) -> dict:
    def holds(answer: dict) -> str | None:
        texts = [choice["text"] for choice in answer["choices"]]
        return None if len(texts) == 2 and all(texts) else f"{len(texts)} choices"

    # no seed: vanilla vLLM 0.32 on CPU crashes its engine on a seeded prompt prefilled in chunks
    return outcome(complete(base, model, headers, n=2, temperature=0.8), holds)


def logprobs(base: str, model: str, headers: dict) -> dict:
    def holds(answer: dict) -> str | None:
        top = answer["choices"][0]["logprobs"]["top_logprobs"]
        # (an entry may hold fewer than 2 when two tokens decode to the same text: they share its key)
        return None if len(top) == MAX_TOKENS and all(top) else "top logprobs missing"

    return outcome(complete(base, model, headers, logprobs=2), holds)


def prompt_logprobs(base: str, model: str, headers: dict) -> dict:
    def holds(answer: dict) -> str | None:
        entries = answer["choices"][0].get("prompt_logprobs") or []
        return None if len(entries) > 100 and entries[0] is None and all(entries[1:]) else "prompt logprobs missing"

    return outcome(complete(base, model, headers, prompt_logprobs=1), holds)


def stop_strings(base: str, model: str, headers: dict) -> dict:
    """The greedy answer without a stop string, then with a word of it as one: the answer ends before that word."""
    whole = complete(base, model, headers)
    if whole.status_code != 200:
        return outcome(whole, lambda answer: None)
    text = whole.json()["choices"][0]["text"]
    words = [word for word in text.split() if len(word) > 2]
    if len(words) < 2:
        return {"outcome": f"fails: the answer {text!r} has no word to stop at"}
    stop = words[1]

    def holds(answer: dict) -> str | None:
        choice = answer["choices"][0]
        expected = text[: text.index(stop)]
        return None if choice["finish_reason"] == "stop" and choice["text"] == expected else f"{choice!r}"

    return outcome(complete(base, model, headers, stop=[stop]), holds)


def json_schema(base: str, model: str, headers: dict) -> dict:
    def holds(answer: dict) -> str | None:
        return matches_schema(json.loads(answer["choices"][0]["message"]["content"]))

    response_format = {"type": "json_schema", "json_schema": {"name": "room", "schema": SCHEMA}}
    return outcome(chat(base, model, headers, response_format=response_format), holds)


def matches_schema(value: dict) -> str | None:
    if set(value) == {"room", "floor"} and isinstance(value["room"], str) and isinstance(value["floor"], int):
        return None
    return f"{value!r} does not match the schema"


def tool_call(choice: dict | str) -> Callable[[str, str, dict], dict]:
    def ask(base: str, model: str, headers: dict) -> dict:
        def holds(answer: dict) -> str | None:
            calls = answer["choices"][0]["message"].get("tool_calls") or []
            if len(calls) != 1 or calls[0]["function"]["name"] != "find_room":
                return f"tool calls {calls!r}"
            return matches_schema(json.loads(calls[0]["function"]["arguments"]))

        # this tokenizer spells hermes's <tool_call> tags in many tokens: a whole call takes more than 64
        return outcome(chat(base, model, headers, tools=[TOOL], tool_choice=choice, max_tokens=128), holds)

    return ask


def beam_search(base: str, model: str, headers: dict) -> dict:
    def holds(answer: dict) -> str | None:
        texts = [choice["text"] for choice in answer["choices"]]
        return None if len(texts) == 2 and texts[0] != texts[1] else f"beams {texts!r}"

    return outcome(complete(base, model, headers, use_beam_search=True, n=2, max_tokens=8), holds)


def streaming(base: str, model: str, headers: dict) -> dict:
    body = completion(model, stream=True, stream_options={"include_usage": True})
    with httpx.stream("POST", base + "/v1/completions", json=body, headers=headers, timeout=600) as response:
        if response.status_code != 200:
            response.read()
            return outcome(response, lambda answer: None)
        events = [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")]
    if events[-1] != "[DONE]" or len(events) < MAX_TOKENS // 2:
        return {"outcome": f"fails: the stream ended {events[-3:]!r}"}
    usage = json.loads(events[-2]).get("usage") or {}
    return {"outcome": "serves", "evicted": usage.get("kv_tokens_evicted")}


PROBES = (
    Probe("`n` > 1", '`"n": 2` (sampled)', n_choices),
    Probe("logprobs", '`"logprobs": 2`', logprobs),
    Probe("prompt logprobs", '`"prompt_logprobs": 1`', prompt_logprobs),
    Probe("stop strings", '`"stop": [...]`', stop_strings),
    Probe("streaming", '`"stream": true`', streaming),
    Probe("structured outputs", '`"response_format": {"type": "json_schema", ...}`', json_schema),
    Probe("tool calls, named", '`"tool_choice": {"type": "function", ...}`', tool_call(NAMED)),
    Probe("tool calls, required", '`"tool_choice": "required"`', tool_call("required")),
    Probe("beam search", '`"use_beam_search": true, "n": 2`', beam_search),
)


# the features a server is started for (tests/compatibility_run.py), and how
STARTED = (
    Probe("LoRA adapters", '`--enable-lora --lora-modules name=path`, `"model": name`', None),
    Probe("speculative decoding, n-gram", '`--speculative-config \'{"method": "ngram", ...}\'`', None),
    Probe("speculative decoding, draft model", '`--speculative-config \'{"method": "draft_model", ...}\'`', None),
    Probe("speculative decoding, EAGLE", '`--speculative-config \'{"method": "eagle", ...}\'`', None),
    Probe("speculative decoding, EAGLE-3", '`--speculative-config \'{"method": "eagle3", ...}\'`', None),
)


def run_probes(base: str, model: str, headers: dict) -> dict[str, dict]:
    """Each probe's outcome, by feature."""
    return {probe.feature: probe.ask(base, model, headers) for probe in PROBES}
