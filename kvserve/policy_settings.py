"""The general settings whose meaning depends on the policy (`kv_allocation`, `kv_span`, `kv_evict_when`): each is
refused with the reason where the request's policy cannot use it, and a server default that does not fit the
policy is dropped; and which policy a request gets when it names none (`requested_policy`). Part of
`parse_kv_config` (kvserve/config.py)."""

from __future__ import annotations

from typing import Any

from kvserve.errors import InvalidSetting
from kvserve.policies import POLICY_NAMES, Policy, ScoredPolicy
from kvserve.policies.allocation import ALLOCATIONS
from kvserve.policies.knobs import parse_int

# When a request first compacts: `eager` at the end of its prompt (and every block of new tokens after), `pressure`
# only once the pool is short of blocks (kvserve/vllm/scheduler.py); until then it is served, cached and published
# like a `full` request.
EVICT_WHEN = ("eager", "pressure")


# A request with `kv_checkpoint=C` that names no policy compacts its prefix before any question is known, where the
# query-agnostic KVzip keeps the most (docs/benchmarks.md, "Before the question: what kv_checkpoint keeps"): the
# built-in `kv_checkpoint_policy` (a server default only; a request names its policy with kv_policy). `turns` is not
# before the question (each turn compacts where its prompt ends, its question voting), so it keeps the server's
# kv_policy. An operator who names an eviction kv_policy (--kv-policy, --kv-config) without a checkpoint policy has
# checkpoints served by that policy; a server without one (`vllm serve`, `--kv-policy full`) serves them with KVzip.
CHECKPOINT_POLICY_KEY = "kv_checkpoint_policy"
BUILTIN_CHECKPOINT_POLICY = "kvzip"


def requested_checkpoint(request: dict[str, Any], defaults: dict[str, Any]) -> str:
    """The request's kv_checkpoint, else the server's, as text ("0" or "": none; "turns"; else a token count)."""
    return str(request.get("kv_checkpoint", defaults.get("kv_checkpoint", 0))).strip().lower()


def requested_policy(request: dict[str, Any], defaults: dict[str, Any]) -> Any:
    """The policy a request is served with: its own kv_policy; else, when it compacts at every C tokens (its
    kv_checkpoint or the server's, a count other than 0), the server's kv_checkpoint_policy, or without one the
    server's eviction policy, or without one KVzip; else the server's kv_policy (full without one)."""
    if "kv_policy" in request:
        return request["kv_policy"]
    server_policy = defaults.get("kv_policy", "full")
    if requested_checkpoint(request, defaults) not in ("0", "", "turns"):
        fallback = BUILTIN_CHECKPOINT_POLICY if server_policy == "full" else server_policy
        return defaults.get(CHECKPOINT_POLICY_KEY, fallback)
    return server_policy


def check_checkpoint_policy(defaults: dict[str, Any]) -> None:
    """The server's kv_checkpoint_policy, if any, is an eviction policy."""
    policy = defaults.get(CHECKPOINT_POLICY_KEY)
    if policy is not None and (policy not in POLICY_NAMES or policy == "full"):
        names = ", ".join(name for name in POLICY_NAMES if name != "full")
        raise InvalidSetting(CHECKPOINT_POLICY_KEY, f"must be an eviction policy ({names}), got {policy!r}")


def evict_when_of(request: dict[str, Any], defaults: dict[str, Any], cls: type[Policy], every_chunk: bool) -> str:
    """kv_evict_when, refused where deferring cannot apply; a server default that cannot is dropped."""
    evict_when = request.get("kv_evict_when", defaults.get("kv_evict_when", "eager"))
    if evict_when not in EVICT_WHEN:
        raise InvalidSetting("kv_evict_when", f"must be one of {', '.join(EVICT_WHEN)}, got {evict_when!r}")
    if evict_when == "eager":
        return evict_when
    why = None
    if every_chunk:
        why = "kv_evict_every_chunk compacts while the prompt is computed, which pressure would postpone"
    elif cls.ragged:
        why = f"{cls.name}'s gates mask the prompt as it is computed; they cannot wait for pressure"
    elif cls.own_counts:
        why = f"{cls.name} gives its heads their roles at the end of the prompt"
    elif cls.reconstructs:
        why = f"{cls.name} compresses its document once, where the document's reconstruction ends"
    if why is None:
        return evict_when
    if "kv_evict_when" in request:
        raise InvalidSetting("kv_evict_when", f"pressure does not apply: {why}")
    return "eager"


def allocation_and_span(
    request: dict[str, Any],
    defaults: dict[str, Any],
    own: dict[str, Any],
    policy: Policy,
    budget: int | None,
    protected: int,
) -> tuple[str, int]:
    """kv_allocation and kv_span, refused (with the reason) where the policy, with its settings, cannot use them."""
    cls = type(policy)
    allocation = request.get("kv_allocation", defaults.get("kv_allocation", cls.default_allocation))
    if allocation not in ALLOCATIONS:
        raise InvalidSetting("kv_allocation", f"must be one of {', '.join(ALLOCATIONS)}, got {allocation!r}")
    span = parse_int("kv_span", request.get("kv_span", own.get("kv_span", cls.default_span)))
    if span < 1:
        raise InvalidSetting("kv_span", f"must be >= 1, got {span}")
    # a server default that does not fit this request's policy is dropped, as default knobs of another policy are
    requested = {key for key in ("kv_allocation", "kv_span") if key in request}
    if cls.ragged:
        if "kv_allocation" in requested and allocation != "uniform":
            raise InvalidSetting(
                "kv_allocation",
                f"{cls.name} decides each head's count with its gate; an allocation of the budget does not apply",
            )
        if "kv_span" in requested and span != 1:
            raise InvalidSetting("kv_span", f"{cls.name} flags tokens with its gate, it has no scores to sum")
        return "uniform", 1
    counts_by = (
        f"{cls.name} gives each head its count from its trained roles"
        if cls.own_counts
        else f"{cls.name} with kv_threshold keeps in each head what passes the threshold"
    )
    if policy.decides_counts() and allocation != "uniform":
        if "kv_allocation" in requested:
            raise InvalidSetting("kv_allocation", f"{counts_by}; an allocation of the budget does not apply")
        allocation = "uniform"
    if policy.decides_counts() and not cls.own_counts and span != 1:
        if "kv_span" in requested:
            raise InvalidSetting("kv_span", f"{counts_by}, entry by entry; spans do not apply")
        span = 1
    scored = issubclass(cls, ScoredPolicy)
    if not scored and allocation in ("heads", "global"):
        if "kv_allocation" in requested:
            raise InvalidSetting(
                "kv_allocation",
                f"{allocation} ranks entries by one score per token across heads, "
                f"and {cls.name} selects by a fixed rule, not by scores; with {cls.name} use uniform "
                "or pyramid",
            )
        allocation = "uniform"
    if not scored and span != 1:
        if "kv_span" in requested:
            raise InvalidSetting(
                "kv_span", f"spans sum per-token scores, and {cls.name} selects by a fixed rule, not by scores"
            )
        span = 1
    if budget is not None and span > budget - protected and "kv_span" not in requested:
        span = 1  # a default span that this request's small budget leaves no room for is dropped, not refused
    if budget is not None and span > budget - protected:
        raise InvalidSetting(
            "kv_span",
            f"{span} leaves no whole span in the {budget - protected} entries the budget "
            f"has beside the {protected} {cls.name} always keeps",
        )
    return allocation, span
