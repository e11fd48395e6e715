"""The HTTP side of evaluation: one OpenAI-compatible server, the eviction setting sent as kvserve's headers.

Works against vanilla vLLM too for the `full` setting: vanilla ignores the `x-kv-*` headers. (kvserve must get
`x-kv-policy: full`, or its server-wide default policy would apply.)
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx

from kvserve.http_client import client_limits


@dataclass(frozen=True)
class Setting:
    """One row of a results table: a policy at a budget (`full` has none), with its allocation and span."""

    policy: str
    budget: int | None
    evict_every_chunk: bool = False
    allocation: str = "uniform"
    span: int = 1
    knobs: tuple[tuple[str, str], ...] = ()  # (knob name, value) pairs sent as the knobs' headers
    # the label of a setting whose entries kept on each case set this one's budget on that case (equal memory per
    # case, e.g. against attention_gate, whose gates decide how much to keep); `budget` is then None
    match: str | None = None
    evict_when: str = "eager"  # kv_evict_when
    checkpoint: int | str = 0  # kv_checkpoint: tokens between checkpoints, or "turns" (0: none)
    lookahead: int = 0  # kv_lookahead: the prompt's last tokens whose queries vote first (0: none)

    @property
    def label(self) -> str:
        """The row's name in results and tables: the policy with its knobs as given on the command line, then a
        non-uniform allocation, a span above 1, deferred eviction and prompt checkpoints (`snapkv/heads/span8`,
        `snapkv/pressure`, `snapkv/checkpoint256`, `duoattention:retrieval_fraction=0.25`)."""
        policy = ":".join([self.policy] + [f"{name}={value}" for name, value in self.knobs])
        policy += f"@{self.match}" if self.match else ""
        parts = [policy] + [self.allocation] * (self.allocation != "uniform") + [f"span{self.span}"] * (self.span > 1)
        parts += [self.evict_when] * (self.evict_when != "eager")
        if self.checkpoint:
            parts.append("checkpoint-turns" if self.checkpoint == "turns" else f"checkpoint{self.checkpoint}")
        parts += [f"lookahead{self.lookahead}"] * (self.lookahead > 0)
        return "/".join(parts)

    def compresses_documents(self) -> bool:
        """Its policy scores a document by its reconstruction (KVzip): each case's document is compressed with
        `POST /v1/kvserve/compress` before its question is asked; with `kv_checkpoint` the server compresses the
        prompt's prefix itself instead (`kvserve/server/checkpoint_documents.py`)."""
        from kvserve.policies import POLICIES

        return not self.checkpoint and self.policy in POLICIES and POLICIES[self.policy].reconstructs

    def kv_args(self) -> dict[str, str]:
        """The `kv_*` request keys the server reads from these headers (its own header parsing)."""
        from kvserve.server.request_keys import headers_to_xargs

        return headers_to_xargs(
            [(name.encode("latin-1"), value.encode("latin-1")) for name, value in self.headers().items()]
        )

    def headers(self) -> dict[str, str]:
        headers = {"x-kv-policy": self.policy}
        for name, value in self.knobs:
            headers["x-kv-" + name.replace("_", "-")] = value
        if self.budget is not None:
            headers["x-kv-budget"] = str(self.budget)
        if self.evict_every_chunk:
            headers["x-kv-evict-every-chunk"] = "true"
        if self.evict_when != "eager":
            headers["x-kv-evict-when"] = self.evict_when
        if self.lookahead:
            headers["x-kv-lookahead"] = str(self.lookahead)
        if self.policy != "full":  # always sent: the row's label must hold whatever the server's defaults are
            headers["x-kv-allocation"] = self.allocation
            headers["x-kv-span"] = str(self.span)
            headers["x-kv-checkpoint"] = str(self.checkpoint)
        return headers


async def stream_chunks(
    client: httpx.AsyncClient, url: str, path: str, body: dict, setting: Setting, headers: dict | None = None
) -> AsyncIterator[dict]:
    """POST a streaming request with the setting's headers (and `headers`: a session's, say) and yield each
    server-sent event's JSON chunk (the benchmarks time the first text and read the usage of the last one)."""
    sent = {**setting.headers(), **(headers or {})}
    async with client.stream("POST", url + path, json=body, headers=sent) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{url} answered {response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                yield json.loads(line[len("data: ") :])


def label_of(kv: dict) -> str:
    """kv_* settings (a server default, a profile's recommendation) as the results label of the same setting, the
    way `kvserve eval` names what it sends: `{"kv_policy": "snapkv", "kv_kernel_size": 7}` -> `snapkv:kernel_size=7/
    span8`. A knob at its policy's default and the policy's default span go unnamed (a request that names the policy
    alone gets them); its other knobs are the kv_* keys besides the general ones (and the server's
    kv_checkpoint_policy), in the order given."""
    from kvserve.config import CHECKPOINT_POLICY_KEY, GENERAL_KEYS
    from kvserve.policies import POLICIES

    cls = POLICIES.get(kv["kv_policy"])
    defaults = {setting.key: setting.default for setting in cls.knobs().values()} if cls else {}
    knobs = tuple(
        (key.removeprefix("kv_"), str(value))
        for key, value in kv.items()
        if key.startswith("kv_")
        and key not in (*GENERAL_KEYS, CHECKPOINT_POLICY_KEY)
        and not (key in defaults and str(value) == str(defaults[key]))
    )
    return Setting(
        kv["kv_policy"],
        kv.get("kv_budget"),
        allocation=kv.get("kv_allocation", "uniform"),
        span=int(kv.get("kv_span", cls.default_span if cls else 1)),
        knobs=knobs,
    ).label


def parse_policy(text: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    """`name` or `name:knob=value:knob=value` (a policy with some of its knobs set) -> (name, knobs); ValueError
    naming the unknown policy or knob, or the bad value."""
    from kvserve.policies import POLICIES
    from kvserve.policies.knobs import knobs_of

    name, *assignments = text.split(":")
    if name == "full":
        if assignments:
            raise ValueError(f"{text!r}: full has no knobs")
        return name, ()
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r} (known: full, {', '.join(sorted(POLICIES))})")
    declared = knobs_of(POLICIES[name])
    knobs = []
    for assignment in assignments:
        knob_name, sep, value = assignment.partition("=")
        if not sep or knob_name not in declared:
            raise ValueError(
                f"{text!r}: {assignment!r} is not knob=value with a knob of {name} "
                f"({', '.join(declared) or 'it has none'})"
            )
        declared[knob_name].parse(value)  # raises on a value the server would refuse
        knobs.append((knob_name, value))
    return name, tuple(knobs)


def settings(
    policies: list[str],
    budgets: list[int],
    evict_every_chunk: bool = False,
    allocations: tuple[str, ...] = ("default",),
    spans: tuple[int, ...] = (1,),
    match: str | None = None,
    checkpoint: int = 0,
) -> list[Setting]:
    """`full` once (the reference row), a policy that sets its own counts (attention_gate) once without a budget,
    every other policy at every budget, allocation and span it can use (score-based policies take every allocation
    and span; the others `uniform` and `pyramid` at span 1; a policy that sets its own counts per head only
    `uniform`). A policy may carry knobs: `duoattention:retrieval_fraction=0.25` (see `parse_policy`). With `match`
    (a setting's label), each budgeted policy runs once per allocation and span at the budget that setting kept on
    each case, instead of at `budgets`. `checkpoint`: every budgeted policy's kv_checkpoint. The allocation `default`
    is each policy's own (`global` for kvzip, `uniform` for the others), named in the row's label."""
    from kvserve.policies import POLICIES, ScoredPolicy

    parsed = [parse_policy(text) for text in policies]

    def own(policy: str) -> tuple[str, ...]:
        return tuple(dict.fromkeys(POLICIES[policy].default_allocation if a == "default" else a for a in allocations))

    def unbudgeted(policy: str) -> bool:
        return policy == "full" or POLICIES[policy].ragged

    def usable(policy: str, allocation: str, span: int) -> bool:
        cls = POLICIES[policy]
        if cls.own_counts:
            return allocation == "uniform"
        return issubclass(cls, ScoredPolicy) or (allocation in ("uniform", "pyramid") and span == 1)

    for policy, _ in parsed:  # a policy none of whose combinations runs is an error, not an empty row
        if not unbudgeted(policy) and not any(usable(policy, a, s) for a in own(policy) for s in spans):
            raise ValueError(
                f"{policy}: none of allocations {', '.join(own(policy))} with spans {', '.join(map(str, spans))} "
                "applies (it selects by a fixed rule, not by scores: uniform or pyramid at span 1)"
            )
    once = [Setting(p, None, evict_every_chunk and p != "full", knobs=k) for p, k in parsed if unbudgeted(p)]
    return once + [
        Setting(p, b, evict_every_chunk, allocation, span, knobs, match, checkpoint=checkpoint)
        for p, knobs in parsed
        if not unbudgeted(p)
        for b in ([None] if match else budgets)
        for allocation in own(p)
        for span in spans
        if usable(p, allocation, span)
    ]


def metric_sum(text: str, name: str) -> float:
    """Sum of a series' samples over all label sets in Prometheus text (0 when the series is absent)."""
    pattern = rf"^{re.escape(name)}(?:\{{[^}}]*\}})? ([0-9.e+-]+|NaN)$"
    return sum(float(v) for v in re.findall(pattern, text, re.M) if v != "NaN")


class Server:
    def __init__(self, url: str, model: str | None = None, timeout: float = 900) -> None:
        self.url = url.rstrip("/")
        self.http = httpx.Client(timeout=timeout, limits=client_limits())
        self.model = model or self.http.get(self.url + "/v1/models").json()["data"][0]["id"]

    def metrics_text(self) -> str:
        return self.http.get(self.url + "/metrics").text

    def blocks_freed(self) -> float:
        return metric_sum(self.metrics_text(), "kvserve:blocks_freed_total")

    def gate_counts(self) -> tuple[float, dict[tuple[int, int], float]]:
        """Attention-Gate's counters: prompt tokens judged, and tokens kept per (layer, KV head)."""
        text = self.metrics_text()
        kept = {}
        for labels, value in re.findall(r"^kvserve:gate_tokens_kept_total\{([^}]*)\} ([0-9.e+-]+)$", text, re.M):
            named = dict(re.findall(r'(\w+)="([^"]*)"', labels))
            key = (int(named["layer"]), int(named["kv_head"]))
            kept[key] = kept.get(key, 0.0) + float(value)  # summed over data-parallel engines
        return metric_sum(text, "kvserve:gate_tokens_judged_total"), kept

    def complete(self, setting: Setting, prompt: str | list[int], **body) -> dict:
        response = self.http.post(
            self.url + "/v1/completions",
            headers=setting.headers(),
            json={"model": self.model, "prompt": prompt, "temperature": 0, **body},
        )
        if response.status_code != 200:
            raise RuntimeError(f"{self.url} answered {response.status_code}: {response.text[:500]}")
        check_applied(self.url, setting, response.headers)
        return response.json()

    def compress(self, setting: Setting, document: str | list[int]) -> dict:
        """`POST /v1/kvserve/compress` of `document` with the setting's headers: its answer (`kv`: what the questions
        send)."""
        response = self.http.post(
            self.url + "/v1/kvserve/compress", headers=setting.headers(), json={"model": self.model, "prompt": document}
        )
        if response.status_code != 200:
            raise RuntimeError(f"{self.url} answered {response.status_code}: {response.text[:500]}")
        return response.json()


def check_applied(url: str, setting: Setting, headers: httpx.Headers) -> None:
    """A row records the setting it asked for, so refuse an answer served with another: a server's default budget
    reaches a request that names none (attention_gate's gates then keep at most that many recent entries), which
    the row would record as no budget. Vanilla vLLM applies nothing and says so by sending no header."""
    policy = headers.get("x-kv-policy-applied")
    if policy is None or headers.get("x-kv-document") == "none":
        return  # (a kv_checkpoint prefix no longer than the budget: nothing to compress, served in full by design)
    budget = headers.get("x-kv-budget-applied")
    asked = None if setting.budget is None else str(setting.budget)
    if budget != asked and setting.policy != "full":
        raise RuntimeError(
            f"{url} served {setting.policy} (budget {asked or 'none'}) as {policy} with budget {budget or 'none'}: "
            "the server's defaults filled in what the request left out. Serve with `--kv-policy full` (no default "
            "budget) to run a policy without a budget, or name the budget (--budgets)"
        )


def load_rows(path: str) -> list[dict]:
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []


def append_row(path: str, row: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def gate_keep_ratios(server: Server, before: tuple[float, dict[tuple[int, int], float]]) -> list[float] | None:
    """Per layer, the share of prompt tokens the gate kept (mean over KV heads) since `before`; None if the gate
    judged nothing (not an attention_gate request)."""
    judged, kept = server.gate_counts()
    judged -= before[0]
    if judged <= 0:
        return None
    by_layer: dict[int, list[float]] = {}
    for (layer, _), value in kept.items():
        by_layer.setdefault(layer, []).append((value - before[1].get((layer, _), 0.0)) / judged)
    return [round(sum(shares) / len(shares), 4) for _, shares in sorted(by_layer.items())]
