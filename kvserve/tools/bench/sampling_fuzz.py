"""The OpenAI sampling surface, fuzzed: what `kvserve bench load` adds to its requests besides the eviction settings.

Each valid request draws a few of the parameters below (seeded), with values vLLM accepts; each invalid one breaks
one of them in a way vLLM must answer with a 4xx that names the field. What a parameter must do to the response is
checked (`check_response`): n choices, logprobs where asked, the prompt echoed, no stop string in the text, JSON
where a JSON format finished, the output length.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

STOP_STRINGS = (" the", ".", "\n", " and", ",")


@dataclass(frozen=True)
class Draw:
    """What a case knows when it draws a parameter."""

    chat: bool
    max_tokens: int
    stream: bool = False
    aborted: bool = False  # closed by the client mid-stream: it must still be running then

    def allows(self, name: str) -> bool:
        return not (
            (self.chat and name in COMPLETIONS_ONLY)
            or (self.aborted and name in SHORTENING)
            or (self.stream and name in NOT_STREAMED)
        )


def _logprobs(rng: random.Random, draw: Draw) -> dict[str, Any]:
    if draw.chat:
        return {"logprobs": True, "top_logprobs": rng.randint(0, 5)}
    return {"logprobs": rng.randint(0, 5)}


def _structured(rng: random.Random, draw: Draw) -> dict[str, Any]:
    kind = rng.choice(["json_object", "json_schema", "choice", "regex"])
    if kind == "json_object":
        return {"response_format": {"type": "json_object"}}
    if kind == "json_schema":
        schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
        return {"response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}}
    if kind == "choice":
        return {"structured_outputs": {"choice": ["yes", "no", "maybe"]}}
    return {"structured_outputs": {"regex": "[0-9]{1,4}"}}


# name -> draw(rng, draw) -> body keys. `max_tokens_1` and `ignore_eos` change the case's own keys.
VALID: dict[str, Callable[[random.Random, Draw], dict[str, Any]]] = {
    "seed": lambda rng, d: {"seed": rng.randrange(2**31)},
    "n": lambda rng, d: {"n": rng.randint(1, 3)},
    "temperature": lambda rng, d: {"temperature": rng.choice([0.0, 0.3, 0.8, 1.5])},
    "top_p": lambda rng, d: {"top_p": rng.choice([0.3, 0.9, 1.0])},
    "top_k": lambda rng, d: {"top_k": rng.choice([0, 1, 5, 50])},
    "min_p": lambda rng, d: {"min_p": rng.choice([0.0, 0.05, 0.2])},
    "stop": lambda rng, d: {"stop": rng.sample(STOP_STRINGS, rng.randint(1, 3))},
    "logprobs": _logprobs,
    "prompt_logprobs": lambda rng, d: {"prompt_logprobs": rng.choice([0, 1, 3])},
    "max_tokens_1": lambda rng, d: {"max_tokens": 1},
    "ignore_eos": lambda rng, d: {"ignore_eos": False},  # requests default to ignore_eos true (a known length)
    "presence_penalty": lambda rng, d: {"presence_penalty": round(rng.uniform(-2, 2), 2)},
    "frequency_penalty": lambda rng, d: {"frequency_penalty": round(rng.uniform(-2, 2), 2)},
    "repetition_penalty": lambda rng, d: {"repetition_penalty": round(rng.uniform(0.8, 1.5), 2)},
    "logit_bias": lambda rng, d: {
        "logit_bias": {str(rng.randrange(1000)): round(rng.uniform(-100, 100), 1) for _ in range(rng.randint(1, 3))}
    },
    "echo": lambda rng, d: {"echo": True},
    "min_tokens": lambda rng, d: {"min_tokens": rng.randint(1, d.max_tokens)},
    "structured_output": _structured,
}
COMPLETIONS_ONLY = {"echo", "stream_echo_logprobs_n"}  # chat's `echo` repeats the last message, another feature
SHORTENING = {"max_tokens_1", "stop", "ignore_eos", "structured_output"}  # not for a request closed mid-stream
NOT_STREAMED = {"prompt_logprobs"}  # vLLM refuses it on a stream (a 400)


# name -> (body keys, the names of the field a 400 may name)
INVALID: dict[str, tuple[dict[str, Any], tuple[str, ...]]] = {
    "bad_n": ({"n": 0}, ("n",)),
    "bad_temperature": ({"temperature": -1.0}, ("temperature",)),
    "bad_top_p": ({"top_p": 1.5}, ("top_p",)),
    "bad_top_k": ({"top_k": -5}, ("top_k",)),
    "bad_min_p": ({"min_p": 2.0}, ("min_p",)),
    "bad_logprobs": ({"logprobs": 50}, ("logprobs",)),  # completions; chat: see invalid_body
    "bad_prompt_logprobs": ({"prompt_logprobs": -3}, ("prompt_logprobs",)),
    "bad_presence_penalty": ({"presence_penalty": 5.0}, ("presence_penalty",)),
    "bad_repetition_penalty": ({"repetition_penalty": 0.0}, ("repetition_penalty",)),
    "bad_logit_bias": ({"logit_bias": {"10000000": 5}}, ("logit_bias",)),
    "bad_max_tokens": ({"max_tokens": 0}, ("max_tokens",)),
    "bad_min_tokens": ({"min_tokens": 10_000}, ("min_tokens",)),
    "bad_stop": ({"stop": list(STOP_STRINGS)}, ("stop",)),  # at most 4
    "bad_seed": ({"seed": "abc"}, ("seed",)),
    "bad_regex": ({"structured_outputs": {"regex": "[0-9"}}, ("structured_outputs", "regex")),
    "bad_json_schema": (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}}},
        ("response_format", "json_schema", "type"),
    ),
    "removed_guided_regex": ({"guided_regex": "[0-9]+"}, ("guided_regex",)),
    # valid OpenAI, but vLLM 0.32 breaks it mid-stream: kvserve answers 400 (completions only, always streamed)
    "stream_echo_logprobs_n": ({"echo": True, "logprobs": 1, "n": 2, "temperature": 1.0, "stream": True}, ("echo",)),
}


def invalid_body(name: str, chat: bool) -> tuple[dict[str, Any], tuple[str, ...]]:
    body, fields = INVALID[name]
    if name == "bad_logprobs" and chat:
        return {"logprobs": True, "top_logprobs": 50}, ("top_logprobs", "logprobs")
    return body, fields


class Dealer:
    """Deals parameter names round-robin (shuffled once), so a run covers all of them; a name a request cannot take
    waits for the next request that can."""

    def __init__(self, rng: random.Random) -> None:
        self.order = rng.sample(list(VALID), len(VALID))
        self.position = 0

    def deal(self, draw: Draw) -> str | None:
        for offset in range(len(self.order)):
            name = self.order[(self.position + offset) % len(self.order)]
            if draw.allows(name):
                self.order.insert(self.position, self.order.pop((self.position + offset) % len(self.order)))
                self.position = (self.position + 1) % len(self.order)
                return name
        return None


def draw_valid(rng: random.Random, draw: Draw, first: str | None, extra: int) -> dict[str, dict[str, Any]]:
    """`first` (dealt by a `Dealer`, so every parameter is covered) and `extra` more."""
    names = [n for n in VALID if draw.allows(n)]
    chosen = [first] if first in names else []
    chosen += rng.sample([n for n in names if n not in chosen], extra)
    drawn: dict[str, dict[str, Any]] = {}
    for name in chosen:
        max_tokens = 1 if "max_tokens_1" in drawn else draw.max_tokens
        drawn[name] = VALID[name](rng, Draw(draw.chat, max_tokens, draw.stream, draw.aborted))
    if "max_tokens_1" in drawn and "min_tokens" in drawn:
        drawn["min_tokens"] = {"min_tokens": 1}
    if drawn.get("n", {}).get("n", 1) > 1:  # vLLM: n > 1 needs random sampling
        drawn["n"]["temperature"] = 0.8
        if drawn.get("temperature", {}).get("temperature") == 0.0:
            drawn["temperature"]["temperature"] = 0.8
    if draw.stream and "echo" in drawn and "logprobs" in drawn and drawn.get("n", {}).get("n", 1) > 1:
        del drawn["echo"]  # kvserve refuses the combination (vLLM 0.32 breaks it mid-stream): see INVALID
    if "structured_output" in drawn:  # with ignore_eos, vLLM lets the model go on past a completed grammar
        drawn["structured_output"]["ignore_eos"] = False
    return drawn


def names_the_field(fields: tuple[str, ...], param: str | None, message: str) -> bool:
    """vLLM names the field in `param` (pydantic's as `body.<field>`) or, for some checks, only in the message."""
    if param is not None and param.removeprefix("body.").split(".")[0] in fields:
        return True
    return any(field in message for field in fields)


# ---------------------------------------------------------------------------------------------------- checking


def output_token_bounds(body: dict[str, Any]) -> tuple[int, int]:
    """(least, most) completion tokens over all choices: exact when nothing can end a choice early."""
    n, max_tokens = body.get("n", 1), body["max_tokens"]
    structured = "response_format" in body or "structured_outputs" in body
    if structured:  # a completed grammar ends the output, min_tokens or not
        return n, n * max_tokens
    can_end_early = not body.get("ignore_eos", False) or body.get("stop")
    least = n * (body.get("min_tokens", 1) if can_end_early else max_tokens)
    return least, n * max_tokens


def check_response(body: dict[str, Any], response: dict[str, Any], prompt_text: str) -> str | None:
    """What is wrong with a (non-streamed) 200 for this request body, or None."""
    chat = "messages" in body
    choices = response.get("choices") or []
    n = body.get("n", 1)
    if sorted(c.get("index") for c in choices) != list(range(n)):
        return f"n={n}: choices {[c.get('index') for c in choices]}"
    usage = response.get("usage") or {}  # (its completion_tokens: the caller checks output_token_bounds)
    if "kv_tokens_evicted" not in usage:
        return "usage has no kv_tokens_evicted"
    if "prompt_logprobs" in body:
        returned = response.get("prompt_logprobs") if chat else choices[0].get("prompt_logprobs")
        if not returned or len(returned) != usage.get("prompt_tokens"):
            return "prompt_logprobs missing or not one per prompt token"
    for choice in choices:
        problem = _check_choice(body, choice, prompt_text, chat)
        if problem:
            return problem
    return None


def _check_choice(body: dict[str, Any], choice: dict[str, Any], prompt_text: str, chat: bool) -> str | None:
    text = (choice.get("message") or {}).get("content") if chat else choice.get("text")
    text = text or ""
    if body.get("echo") and not chat:
        if not text.startswith(prompt_text[:64]):
            return "echo: the text does not start with the prompt"
        text = text[len(prompt_text) :]
    if body.get("logprobs") is not None and body.get("logprobs") is not False:
        logprobs = choice.get("logprobs")
        entries = (logprobs or {}).get("content") if chat else (logprobs or {}).get("tokens")
        if not entries:
            return "logprobs asked for, none returned"
        if chat and any(len(e.get("top_logprobs", [])) != body.get("top_logprobs", 0) for e in entries):
            return f"top_logprobs: not {body.get('top_logprobs', 0)} per token"
    if body.get("stop") and "min_tokens" not in body and any(s in text for s in body["stop"]):
        return "a stop string is in the output"
    finished = choice.get("finish_reason") == "stop"
    if finished and ("response_format" in body or "json" in body.get("structured_outputs", {})):
        try:
            json.loads(text)
        except ValueError:
            return "structured output: finished, but the text is not JSON"
    choices_allowed = body.get("structured_outputs", {}).get("choice")
    if finished and choices_allowed and text not in choices_allowed:
        return f"structured output: {text!r} is not one of the choices"
    return None
