"""`python -m kvserve.tools.bench load`: a bounded, loopback-only load test of one kvserve server.

Hundreds of requests, N at a time, drawn from a seeded mix: /v1/completions and /v1/chat/completions, streamed or
not, every registered policy family (and some `+caote`) at budgets valid for it, prompts of haystack prose of varied
lengths (many longer than the budget, so eviction runs), small outputs (`ignore_eos`: the length is known). A share
is streamed and closed by the client after a few chunks (vLLM must abort them and return their blocks); a share is
invalid in one of several ways and must get HTTP 400 whose `param` names the field.

The report counts what was served, aborted and rejected, lists every unexpected outcome by kind (a 5xx, a broken
connection, a 400 on a valid request, anything but a 400 naming the field on an invalid one, a wrong output
length), gives latency percentiles overall and per policy, and checks the end state: after a bounded settle the
server is healthy, its block pool is full again, nothing runs or waits, no request holds an evicted cache, and
eviction did run. The exit status is non-zero when any of that fails.

    # starts its own kvserve server (on core 1 with VLLM_CPU_OMP_THREADS_BIND=1) and loads it
    VLLM_CPU_OMP_THREADS_BIND=1 python -m kvserve.tools.bench load --requests 300 --concurrency 16 --out load.json
    # or load a running server (its tokenizer is read from --model)
    python -m kvserve.tools.bench load --url http://127.0.0.1:8000 --requests 100

Settings are sent explicitly (policy, budget, maybe one knob) and checked locally with `parse_kv_config` without
server defaults; a server started with a default knob of the same policy (say `--kv-window 64`) could turn a
"valid" small budget into a 400, which this command would report as unexpected.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import re
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvserve.config import parse_kv_config
from kvserve.http_client import client_limits
from kvserve.policies import POLICIES, POLICY_NAMES, Knob, representative_policies
from kvserve.provenance import command_line, provenance
from kvserve.tools.bench import sampling_fuzz
from kvserve.tools.eval.client import metric_sum

SERVED_NAME = "load"
# every registered policy once, and each meta-score (CAOTE, FastCAOTE) over one base: the mix cycles through these
POLICY_MIX = ("full", *representative_policies())


def knob_alternatives(setting: Knob) -> tuple[Any, ...]:
    """Valid values of a knob for the mix, from its declaration: its default and one other value inside its range."""
    if setting.kind is str:
        return setting.choices or (setting.default,)
    if setting.default is None:  # an optional knob, off by default: one value that turns it on
        return (setting.kind(setting.minimum if setting.minimum is not None else 0),)
    low = setting.minimum if setting.minimum is not None else setting.default / 2
    if setting.kind is float:
        return setting.default, (setting.default + low) / 2
    other = max(int(low), setting.default // 2)
    if setting.odd and other % 2 == 0:
        other += 1
    return (setting.default,) if other == setting.default else (setting.default, other)


@dataclass(frozen=True)
class Mix:
    """The shape of a run: how many requests of which kinds, and how big."""

    requests: int = 300
    invalid_share: float = 0.1
    abort_share: float = 0.1
    chat_share: float = 0.4
    stream_share: float = 0.4
    knob_share: float = 0.3  # valid requests that also set one of their policy's knobs
    xargs_share: float = 0.3  # valid requests that send their settings in the body, not as headers
    prompt_lengths: tuple[int, ...] = (32, 96, 192, 384, 768)
    budgets: tuple[int, ...] = (48, 64, 96, 128, 256, 512)
    max_tokens: tuple[int, int] = (8, 32)
    abort_max_tokens: int = 32  # aborted requests must still be running when the client closes
    sampling_share: float = 0.8  # valid requests that also carry fuzzed sampling parameters
    sampling_extra: tuple[int, int] = (0, 3)  # how many parameters beside the one dealt round-robin
    seed: int = 0


@dataclass
class Case:
    """One planned request and what its answer must be."""

    index: int
    kind: str  # "valid", "abort" (streamed, closed by the client after `abort_after` chunks) or "invalid"
    chat: bool
    stream: bool
    policy: str  # the policy asked for; for an invalid case the name of the way it is invalid
    headers: list[tuple[str, str]]  # a list: a duplicated header must stay duplicated
    xargs: dict[str, Any]
    prompt_tokens: int
    max_tokens: int
    abort_after: int = 0
    expect_param: str | None = None  # invalid cases: the field the 400 must name
    sampling: dict[str, dict[str, Any]] = field(default_factory=dict)  # fuzzed parameter name -> its body keys
    expect_fields: tuple[str, ...] = ()  # invalid sampling cases: the names a 400 may use for the field


@dataclass
class Outcome:
    index: int
    kind: str
    policy: str
    result: str  # "ok", "aborted", "rejected" (the expected 400) or "unexpected"
    status: int | None
    detail: str = ""  # unexpected: its kind; rejected: the param named
    latency: float = 0.0
    ttft: float | None = None
    output_tokens: int = 0
    chat: bool = False
    stream: bool = False
    params: list[str] = field(default_factory=list)  # the sampling parameters it carried (or broke)


# ---------------------------------------------------------------------------------------------------- planning


def _as_headers(xargs: dict[str, Any]) -> list[tuple[str, str]]:
    return [("x-kv-" + key[3:].replace("_", "-"), str(value)) for key, value in xargs.items()]


def _protected(policy: str, knobs: dict[str, Any]) -> int:
    return POLICIES[policy](**{key.removeprefix("kv_"): value for key, value in knobs.items()}).protected_tokens()


def valid_settings(rng: random.Random, policy: str, mix: Mix, max_model_len: int) -> dict[str, Any]:
    """Policy, a budget above what it protects, maybe one knob; checked with the server's own parser."""
    if policy == "full":
        return {"kv_policy": "full"}
    knobs: dict[str, Any] = {}
    settings = list(POLICIES[policy].knobs().values())
    if settings and rng.random() < mix.knob_share:
        setting = rng.choice(settings)
        knobs[setting.key] = rng.choice(knob_alternatives(setting))
    protected = _protected(policy, knobs)
    # a policy that protects more than every budget of the mix (KVzap's 128-entry window) gets the least beyond it
    budgets = [b for b in mix.budgets if protected < b <= max_model_len] or [protected + min(mix.budgets)]
    xargs = {"kv_policy": policy, "kv_budget": rng.choice(budgets), **knobs}
    parse_kv_config(xargs, defaults={})  # raises if the plan itself is wrong: that is a bug here, not the server's
    return xargs


def _invalid_cases(max_model_len: int) -> dict[str, Callable[[random.Random], tuple[list, dict, str]]]:
    """Each way of being invalid: (headers, vllm_xargs, the field the 400 must name)."""

    def too_small(rng: random.Random) -> tuple[list, dict, str]:
        policy = rng.choice([p for p in POLICY_MIX if p != "full"])
        return [("x-kv-policy", policy), ("x-kv-budget", str(_protected(policy, {})))], {}, "kv_budget"

    return {
        "unknown_policy": lambda rng: ([("x-kv-policy", "lru"), ("x-kv-budget", "64")], {}, "kv_policy"),
        "unknown_key": lambda rng: ([("x-kv-colour", "blue")], {}, "kv_colour"),
        "non_numeric_budget": lambda rng: ([("x-kv-policy", "snapkv"), ("x-kv-budget", "many")], {}, "kv_budget"),
        "non_numeric_budget_body": lambda rng: ([], {"kv_policy": "h2o", "kv_budget": "ten"}, "kv_budget"),
        "budget_too_small": too_small,
        "budget_above_max_model_len": lambda rng: (
            [("x-kv-policy", "streamingllm"), ("x-kv-budget", str(max_model_len + rng.randint(1, 512)))],
            {},
            "kv_budget",
        ),
        "knob_of_another_policy": lambda rng: (
            [("x-kv-policy", "streamingllm"), ("x-kv-budget", "64"), ("x-kv-window", "8")],
            {},
            "kv_window",
        ),
        "even_kernel": lambda rng: (
            [("x-kv-policy", "snapkv"), ("x-kv-budget", "64"), ("x-kv-kernel-size", "4")],
            {},
            "kv_kernel_size",
        ),
        "duplicate_header": lambda rng: (
            [("x-kv-policy", "snapkv"), ("x-kv-budget", "64"), ("x-kv-budget", "128")],
            {},
            "x-kv-budget",
        ),
        "oversized_header": lambda rng: ([("x-kv-policy", "a" * 300)], {}, "x-kv-policy"),
        "header_body_conflict": lambda rng: (
            [("x-kv-budget", "300")],
            {"kv_policy": "snapkv", "kv_budget": 200},
            "kv_budget",
        ),
    }


def plan(mix: Mix, max_model_len: int) -> list[Case]:
    """The seeded list of requests: kinds shuffled; policies, invalid kinds and the first sampling parameter of each
    fuzzed request dealt round-robin (all covered)."""
    rng = random.Random(mix.seed)
    missing = [p for p in POLICY_MIX if p not in POLICY_NAMES]
    if missing:
        raise ValueError(f"policies not in the registry: {missing}")
    invalid_kinds = _invalid_cases(max_model_len)
    n_invalid = round(mix.requests * mix.invalid_share)
    n_abort = round(mix.requests * mix.abort_share)
    kinds = ["invalid"] * n_invalid + ["abort"] * n_abort + ["valid"] * (mix.requests - n_invalid - n_abort)
    rng.shuffle(kinds)
    policies = itertools.cycle(rng.sample(POLICY_MIX, len(POLICY_MIX)))
    invalid_names = list(invalid_kinds) + list(sampling_fuzz.INVALID)
    invalid_names = itertools.cycle(rng.sample(invalid_names, len(invalid_names)))
    dealer = sampling_fuzz.Dealer(rng)
    cases = []
    for index, kind in enumerate(kinds):
        chat = rng.random() < mix.chat_share
        prompt_tokens = rng.choice(mix.prompt_lengths)
        if kind == "invalid":
            cases.append(_invalid_case(rng, index, chat, next(invalid_names), invalid_kinds, prompt_tokens, mix))
            continue
        policy = next(policies)
        settings = valid_settings(rng, policy, mix, max_model_len)
        in_body = rng.random() < mix.xargs_share
        headers, xargs = ([], settings) if in_body else (_as_headers(settings), {})
        if kind == "abort":
            case = Case(
                index,
                kind,
                chat,
                True,
                policy,
                headers,
                xargs,
                prompt_tokens,
                mix.abort_max_tokens,
                abort_after=rng.randint(0, 3),
            )
        else:
            case = Case(
                index,
                kind,
                chat,
                rng.random() < mix.stream_share,
                policy,
                headers,
                xargs,
                prompt_tokens,
                rng.randint(*mix.max_tokens),
            )
        if rng.random() < mix.sampling_share:
            draw = sampling_fuzz.Draw(chat, case.max_tokens, case.stream, aborted=kind == "abort")
            # only requests whose response is checked take the dealt (covering) parameter; an aborted one draws freely
            first = dealer.deal(draw) if kind == "valid" else None
            case.sampling = sampling_fuzz.draw_valid(rng, draw, first, rng.randint(*mix.sampling_extra))
            case.max_tokens = case.sampling.get("max_tokens_1", {}).get("max_tokens", case.max_tokens)
        cases.append(case)
    return cases


def _invalid_case(
    rng: random.Random, index: int, chat: bool, name: str, invalid_kinds: dict, prompt_tokens: int, mix: Mix
) -> Case:
    stream = rng.random() < mix.stream_share
    if name in sampling_fuzz.INVALID:  # valid eviction settings, one broken sampling parameter
        chat = chat and name not in sampling_fuzz.COMPLETIONS_ONLY
        body, fields = sampling_fuzz.invalid_body(name, chat)
        return Case(
            index,
            "invalid",
            chat,
            stream,
            name,
            [],
            {},
            prompt_tokens,
            mix.max_tokens[0],
            expect_param=fields[0],
            sampling={name: body},
            expect_fields=fields,
        )
    headers, xargs, param = invalid_kinds[name](rng)
    return Case(
        index, "invalid", chat, stream, name, headers, xargs, prompt_tokens, mix.max_tokens[0], expect_param=param
    )


def prompt_texts(tokenizer, cases: list[Case], seed: int) -> dict[int, str]:
    """Haystack prose per case (a different passage each, so no prefix cache shortcut between them)."""
    from kvserve.tools.eval.haystack import haystack

    return {
        c.index: tokenizer.decode(haystack(tokenizer, c.prompt_tokens, seed=seed * 100_000 + c.index)) for c in cases
    }


# ---------------------------------------------------------------------------------------------------- sending


def request_body(case: Case, model: str, text: str) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": case.max_tokens, "temperature": 0, "ignore_eos": True}
    for keys in case.sampling.values():
        body.update(keys)
    if case.chat:
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    if case.stream:
        body.update(stream=True, stream_options={"include_usage": True})
    if case.xargs:
        body["vllm_xargs"] = case.xargs
    return body


def _error_of(payload: bytes) -> tuple[str | None, str]:
    """(param, message) of an OpenAI-format error body; (None, the start of the text) otherwise."""
    try:
        error = json.loads(payload)["error"]
        return error.get("param"), str(error.get("message", ""))
    except (ValueError, KeyError, TypeError, AttributeError):
        return None, payload[:80].decode(errors="replace")


def _short(message: str) -> str:
    """A message reduced to a stable kind: numbers and quoted values out, so equal failures group together."""
    return re.sub(r"\d+", "N", re.sub(r"'[^']*'", "'...'", message))[:80]


def judge_error(case: Case, status: int, payload: bytes, outcome: Outcome) -> Outcome:
    param, message = _error_of(payload)
    named = (
        sampling_fuzz.names_the_field(case.expect_fields, param, message)
        if case.expect_fields
        else param == case.expect_param
    )
    if case.kind == "invalid" and status == 400 and named:
        outcome.result, outcome.detail = "rejected", case.expect_param
    elif case.kind == "invalid":
        outcome.result = "unexpected"
        outcome.detail = f"invalid {case.policy}: {status} param={param} (want 400 param={case.expect_param})"
    else:
        named = f" param={param}" if param else ""
        outcome.result, outcome.detail = "unexpected", f"{status}{named} {_short(message)}"
    return outcome


def _content(chunk: dict[str, Any]) -> str:
    choice = (chunk.get("choices") or [{}])[0]
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


async def _streamed_error(response: httpx.Response, case: Case) -> str:
    """On a 200 for an invalid streamed request, what the stream says: vLLM may send a 400's error as an event."""
    if not case.stream:
        return ""
    async for line in response.aiter_lines():
        if line.startswith("data: {"):
            error = json.loads(line[len("data: ") :]).get("error")
            return f" with an error event param={error.get('param')}" if isinstance(error, dict) else ""
    return ""


async def read_stream(response: httpx.Response, case: Case, outcome: Outcome, start: float) -> Outcome:
    """Reads SSE events; an abort case returns after `abort_after` content chunks, which closes the connection."""
    chunks = 0
    if case.kind == "abort" and case.abort_after == 0:
        outcome.result = "aborted"  # closed before any token: the request is queued or in prefill
        return outcome
    async for line in response.aiter_lines():
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            outcome.result = "ok"
            return outcome
        event = json.loads(line[len("data: ") :])
        if "error" in event:  # vLLM reports an engine failure inside a 200 stream
            outcome.result, outcome.detail = "unexpected", f"stream error {_short(str(event['error']))}"
            return outcome
        if _content(event):
            chunks += 1
            if outcome.ttft is None:
                outcome.ttft = time.perf_counter() - start
        if event.get("usage"):
            outcome.output_tokens = event["usage"]["completion_tokens"]
        if case.kind == "abort" and chunks >= case.abort_after:
            outcome.result = "aborted"
            return outcome
    outcome.result, outcome.detail = "unexpected", "stream ended without [DONE]"
    return outcome


async def send(client: httpx.AsyncClient, base: str, model: str, case: Case, text: str) -> Outcome:
    """One request, judged against what its case must get."""
    path = "/v1/chat/completions" if case.chat else "/v1/completions"
    outcome = Outcome(
        case.index,
        case.kind,
        case.policy,
        "unexpected",
        None,
        chat=case.chat,
        stream=case.stream,
        params=list(case.sampling),
    )
    body = request_body(case, model, text)
    start = time.perf_counter()
    async with client.stream("POST", base + path, json=body, headers=case.headers) as response:
        outcome.status = response.status_code
        if response.status_code != 200:
            judge_error(case, response.status_code, await response.aread(), outcome)
        elif case.kind == "invalid":
            streamed = await _streamed_error(response, case)
            outcome.detail = f"invalid {case.policy}: 200{streamed} (want 400 param={case.expect_param})"
        elif response.headers.get("x-kv-policy-applied") != case.policy:
            outcome.detail = f"applied {response.headers.get('x-kv-policy-applied')}, asked {case.policy}"
        elif case.stream:
            await read_stream(response, case, outcome, start)
        else:
            payload = json.loads(await response.aread())
            outcome.output_tokens = (payload.get("usage") or {}).get("completion_tokens", 0)
            problem = sampling_fuzz.check_response(body, payload, text)
            outcome.result, outcome.detail = ("unexpected", problem) if problem else ("ok", "")
    outcome.latency = time.perf_counter() - start
    least, most = sampling_fuzz.output_token_bounds(body)
    if outcome.result == "ok" and not least <= outcome.output_tokens <= most:
        outcome.result, outcome.detail = "unexpected", "wrong output length"
    return outcome


async def send_bounded(
    client: httpx.AsyncClient, base: str, model: str, case: Case, text: str, timeout: float
) -> Outcome:
    """`send` under a total time limit; a transport failure or the limit is an unexpected outcome, not a crash."""
    start = time.perf_counter()
    try:
        return await asyncio.wait_for(send(client, base, model, case, text), timeout)
    except (httpx.HTTPError, TimeoutError, json.JSONDecodeError) as exc:
        return Outcome(
            case.index,
            case.kind,
            case.policy,
            "unexpected",
            None,
            f"client {type(exc).__name__}",
            latency=time.perf_counter() - start,
            chat=case.chat,
            stream=case.stream,
            params=list(case.sampling),
        )


async def drive(
    base: str,
    model: str,
    cases: list[Case],
    texts: dict[int, str],
    concurrency: int,
    max_seconds: float,
    request_timeout: float,
) -> tuple[list[Outcome], bool, float]:
    """`concurrency` workers take the next case until none is left or `max_seconds` passed (no new ones after)."""
    queue = iter(cases)
    outcomes: list[Outcome] = []
    deadline = time.monotonic() + max_seconds
    hit = False

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal hit
        for case in queue:  # a shared iterator: each case goes to exactly one worker
            if time.monotonic() > deadline:
                hit = True
                return
            outcomes.append(await send_bounded(client, base, model, case, texts[case.index], request_timeout))

    limits = client_limits(max_connections=concurrency + 4)
    start = time.perf_counter()
    async with httpx.AsyncClient(timeout=request_timeout, limits=limits) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    return sorted(outcomes, key=lambda o: o.index), hit, time.perf_counter() - start


# ---------------------------------------------------------------------------------------------------- end state


# all zero once every request has finished and returned its blocks (usage 0: the block pool is full again)
IDLE_GAUGES = (
    "vllm:kv_cache_usage_perc",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "kvserve:requests_with_evicted_cache",
)


def _gauge(text: str, name: str) -> float:
    return metric_sum(text, name)


def settle(base: str, settle_s: float) -> tuple[int | None, str]:
    """Polls (bounded) until the server is idle with its pool full again; returns /health's status and /metrics.

    A server that no longer answers gives (None, ""): the end-state checks then fail instead of the script crashing.
    """
    deadline = time.monotonic() + settle_s
    while True:
        try:
            health: int | None = httpx.get(base + "/health", timeout=10).status_code
            text = httpx.get(base + "/metrics", timeout=10).text
        except httpx.HTTPError:
            health, text = None, ""
        idle = bool(text) and all(_gauge(text, name) == 0 for name in IDLE_GAUGES)
        if (health == 200 and idle) or time.monotonic() > deadline:
            return health, text
        time.sleep(0.5)


def end_state(health: int | None, before: str, after: str) -> dict[str, Any]:
    def delta(name: str) -> float:
        return metric_sum(after, name) - metric_sum(before, name)

    checks = {"health_200": health == 200}
    checks.update({f"{name} == 0": bool(after) and _gauge(after, name) == 0 for name in IDLE_GAUGES})
    checks["kvserve:evictions_total grew"] = delta("kvserve:evictions_total") > 0
    checks["kvserve:policy_errors_total unchanged"] = delta("kvserve:policy_errors_total") == 0
    return {
        "checks": checks,
        "values": {name: _gauge(after, name) for name in IDLE_GAUGES},
        "evictions": delta("kvserve:evictions_total"),
        "tokens_evicted": delta("kvserve:tokens_evicted_total"),
        "blocks_freed": delta("kvserve:blocks_freed_total"),
        "preemptions": delta("vllm:num_preemptions_total"),
    }


# ---------------------------------------------------------------------------------------------------- report


def percentiles(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    if len(values) == 1:
        return {"p50": values[0], "p90": values[0], "p99": values[0], "n": 1}
    q = statistics.quantiles(values, n=100, method="inclusive")
    return {"p50": q[49], "p90": q[89], "p99": q[98], "n": len(values)}


def summarize(cases: list[Case], outcomes: list[Outcome], wall: float, hit: bool, end: dict) -> dict[str, Any]:
    ok = [o for o in outcomes if o.result == "ok"]
    unexpected = Counter(o.detail for o in outcomes if o.result == "unexpected")
    by_index = {c.index: c for c in cases}
    invalid = [
        {
            "index": o.index,
            "kind": o.policy,
            "status": o.status,
            "detail": o.detail,
            "expected_param": by_index[o.index].expect_param,
            "rejected_as_expected": o.result == "rejected",
        }
        for o in outcomes
        if o.kind == "invalid"
    ]
    policies = sorted({o.policy for o in ok}, key=POLICY_MIX.index)
    latency = {
        "all": percentiles([o.latency for o in ok]),
        **{p: percentiles([o.latency for o in ok if o.policy == p]) for p in policies},
    }
    ttft = {
        "all": percentiles([o.ttft for o in ok if o.stream and o.ttft is not None]),
        **{p: percentiles([o.ttft for o in ok if o.policy == p and o.stream and o.ttft is not None]) for p in policies},
    }
    by_param: dict[str, Counter] = {}
    for o in outcomes:
        for name in o.params:
            by_param.setdefault(name, Counter())[o.result] += 1
    report = {
        "planned": len(cases),
        "sent": len(outcomes),
        "ok": len(ok),
        "aborted": sum(o.result == "aborted" for o in outcomes),
        "rejected_as_expected": sum(o.result == "rejected" for o in outcomes),
        "invalid_planned_sent": len(invalid),
        "unexpected": dict(unexpected),
        "max_seconds_hit": hit,
        "wall_s": wall,
        "output_tokens": sum(o.output_tokens for o in ok),
        "output_tokens_per_s": sum(o.output_tokens for o in ok) / wall if wall else 0.0,
        "latency_s": latency,
        "ttft_s": ttft,
        "invalid": invalid,
        "end_state": end,
        "by_parameter": {name: dict(by_param[name]) for name in sorted(by_param)},
        "outcomes": [asdict(o) for o in outcomes],
    }
    report["passed"] = not unexpected and all(end["checks"].values())
    return report


def _fmt(stats: dict[str, float] | None) -> str:
    return " | ".join(f"{stats[k]:.3f}" for k in ("p50", "p90", "p99")) if stats else "- | - | -"


def render(report: dict[str, Any]) -> str:
    lines = [
        f"requests planned {report['planned']}, sent {report['sent']}, completed OK {report['ok']}, "
        f"aborted by client {report['aborted']}, rejected with the expected 400 "
        f"{report['rejected_as_expected']}/{report['invalid_planned_sent']}, unexpected "
        f"{sum(report['unexpected'].values())}",
        f"wall {report['wall_s']:.1f} s, max-seconds hit: {report['max_seconds_hit']}, output tokens "
        f"{report['output_tokens']} ({report['output_tokens_per_s']:.1f}/s)",
        "",
    ]
    lines += ["unexpected outcomes by kind:"] + [f"  {n} x {kind}" for kind, n in report["unexpected"].items()]
    if not report["unexpected"]:
        lines.append("  none")
    kinds = Counter((i["kind"], i["rejected_as_expected"]) for i in report["invalid"])
    lines += ["", "invalid requests (kind: rejected with 400 naming the field / sent):"]
    for kind in sorted({k for k, _ in kinds}):
        lines.append(f"  {kind}: {kinds[(kind, True)]}/{kinds[(kind, True)] + kinds[(kind, False)]}")
    lines += [
        "",
        "sampling parameters (requests that carried or broke each; outcomes):",
        "| parameter | requests | ok | aborted | rejected (400 naming it) | unexpected |",
        "|---|---|---|---|---|---|",
    ]
    for name, counts in report["by_parameter"].items():
        lines.append(
            f"| {name} | {sum(counts.values())} | {counts.get('ok', 0)} | {counts.get('aborted', 0)} | "
            f"{counts.get('rejected', 0)} | {counts.get('unexpected', 0)} |"
        )
    lines += [
        "",
        "| policy | n | latency p50 | p90 | p99 (s) | streamed n | TTFT p50 | p90 | p99 (s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, stats in report["latency_s"].items():
        ttft = report["ttft_s"].get(name)
        lines.append(
            f"| {name} | {stats['n'] if stats else 0} | {_fmt(stats)} | {ttft['n'] if ttft else 0} | {_fmt(ttft)} |"
        )
    end = report["end_state"]
    lines += ["", "end state (after settle):"] + [f"  [{'ok' if v else 'FAIL'}] {k}" for k, v in end["checks"].items()]
    lines.append(
        f"  evictions {end['evictions']:.0f}, tokens evicted {end['tokens_evicted']:.0f}, blocks freed "
        f"{end['blocks_freed']:.0f}, preemptions {end['preemptions']:.0f}"
    )
    lines.append(f"\n{'PASSED' if report['passed'] else 'FAILED'}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------- entry points


def server_info(base: str) -> tuple[str, int]:
    """The served model name and its max_model_len, from /v1/models."""
    card = httpx.get(base + "/v1/models", timeout=30).json()["data"][0]
    return card["id"], int(card["max_model_len"])


def run_load(
    base: str,
    tokenizer_path: str,
    mix: Mix,
    concurrency: int = 16,
    max_seconds: float = 1200,
    request_timeout: float = 600,
    settle_s: float = 30,
) -> dict[str, Any]:
    """The whole load test against a running server at `base`; returns the report."""
    from transformers import AutoTokenizer

    model, max_model_len = server_info(base)
    cases = plan(mix, max_model_len)
    texts = prompt_texts(AutoTokenizer.from_pretrained(tokenizer_path), cases, mix.seed)
    before = httpx.get(base + "/metrics", timeout=30).text
    outcomes, hit, wall = asyncio.run(drive(base, model, cases, texts, concurrency, max_seconds, request_timeout))
    health, after = settle(base, settle_s)
    return summarize(cases, outcomes, wall, hit, end_state(health, before, after))


def main(argv: list[str] | None = None) -> None:
    from kvserve.model import default_model_dir

    parser = argparse.ArgumentParser(
        prog="kvserve bench load", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--url", help="a running server (default: start a kvserve server for this run)")
    parser.add_argument("--model", default=str(default_model_dir()), help="model (served, and its tokenizer)")
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-seconds", type=float, default=1200, help="no new requests after this many seconds")
    parser.add_argument("--request-timeout", type=float, default=600, help="total seconds one request may take")
    parser.add_argument("--settle-seconds", type=float, default=30, help="how long to wait for the idle end state")
    # fp32 on every CPU: the same dtype and cache layout ("vec") wherever the load test runs
    parser.add_argument(
        "--server-args",
        default="--max-model-len 2048 --block-size 32 --enforce-eager --dtype float32 --max-num-batched-tokens 256",
        help="engine flags of the server this command starts",
    )
    parser.add_argument("--kv-space-gib", default="1", help="VLLM_CPU_KVCACHE_SPACE of the server it starts")
    parser.add_argument("--out", help="JSON file for the report")
    args = parser.parse_args(argv)

    mix = Mix(requests=args.requests, seed=args.seed)
    bounds = {
        "concurrency": args.concurrency,
        "max_seconds": args.max_seconds,
        "request_timeout": args.request_timeout,
        "settle_s": args.settle_seconds,
    }
    if args.url:
        report = run_load(args.url.rstrip("/"), args.model, mix, **bounds)
    else:
        report = _with_own_server(args, mix, bounds)
    report["args"] = vars(args)
    print(render(report), flush=True)
    if args.out:
        report["provenance"] = provenance(command_line(argv, "kvserve bench load"))
        Path(args.out).write_text(json.dumps(report, indent=1))
    sys.exit(0 if report["passed"] else 1)


def _with_own_server(args: argparse.Namespace, mix: Mix, bounds: dict[str, Any]) -> dict[str, Any]:
    """Start `kvserve serve` for the run; its log is kept (path in the report) when the run fails."""
    import shlex

    from kvserve.tools.bench.servers import running_server

    engine_args = [*shlex.split(args.server_args), "--served-model-name", SERVED_NAME]
    log_dir = Path(tempfile.mkdtemp(prefix="kvserve-load-"))
    with running_server(
        "kvserve", args.model, engine_args, log_dir / "kvserve.log", {"VLLM_CPU_KVCACHE_SPACE": args.kv_space_gib}
    ) as base:
        report = run_load(base, args.model, mix, **bounds)
    report["server_log"] = str(log_dir / "kvserve.log")
    return report


if __name__ == "__main__":
    main()
