"""Per-request eviction settings: parsing, validation, and server-wide defaults.

A request names its settings as `vllm_xargs` keys (`kv_policy`, `kv_budget`, `kv_<knob>`) or as `x-kv-*` headers
that the server maps onto those keys. Every entry point (HTTP middleware, vLLM's input processor, the engine) parses
through `parse_kv_config`, so a value is either valid everywhere or rejected before it reaches the engine.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from kvserve.policies import POLICIES, POLICY_NAMES, Policy

# Server-wide defaults travel to every vLLM process (API server, engine core, worker) in this variable.
DEFAULTS_ENV = "KVSERVE_DEFAULTS"
KEY_PREFIX = "kv_"
GENERAL_KEYS = ("kv_policy", "kv_budget", "kv_evict_every_chunk")


class KVConfigError(ValueError):
    """An invalid eviction setting; `field` is the request key at fault."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True)
class KVConfig:
    policy: str = "full"
    budget: int | None = None
    evict_every_chunk: bool = False
    knobs: tuple[tuple[str, Any], ...] = field(default_factory=tuple)

    @property
    def evicts(self) -> bool:
        return self.policy != "full"

    @property
    def ragged(self) -> bool:
        """The policy decides per head how many entries to keep (Attention-Gate); the budget, if any, caps them."""
        return self.evicts and POLICIES[self.policy].budget_optional

    def make_policy(self) -> Policy:
        return POLICIES[self.policy](**dict(self.knobs))

    def as_xargs(self) -> dict[str, Any]:
        """The request keys that reproduce this config (used for defaults and response headers)."""
        out: dict[str, Any] = {"kv_policy": self.policy}
        if self.budget is not None:
            out["kv_budget"] = self.budget
        if self.evict_every_chunk:
            out["kv_evict_every_chunk"] = True
        out.update({KEY_PREFIX + name: value for name, value in self.knobs})
        return out


def knob_keys() -> set[str]:
    return {KEY_PREFIX + name for cls in POLICIES.values() for name in cls.knobs}


def _parse_int(key: str, value: Any) -> int:
    if isinstance(value, bool):
        raise KVConfigError(key, f"must be an integer, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and value.strip().lstrip("+-").isdigit():
        return int(value.strip())
    raise KVConfigError(key, f"must be an integer, got {value!r}")


def _parse_bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "1", "yes", "false", "0", "no"):
        return value.strip().lower() in ("true", "1", "yes")
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise KVConfigError(key, f"must be true or false, got {value!r}")


def server_defaults() -> dict[str, Any]:
    raw = os.environ.get(DEFAULTS_ENV)
    if not raw:
        return {}
    try:
        defaults = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise KVConfigError(DEFAULTS_ENV, f"is not valid JSON: {exc}") from exc
    if not isinstance(defaults, dict):
        raise KVConfigError(DEFAULTS_ENV, "must be a JSON object")
    return defaults


def parse_kv_config(request_args: dict[str, Any] | None, defaults: dict[str, Any] | None = None) -> KVConfig:
    """Merge server defaults with a request's `kv_*` keys and validate the result.

    Request keys that do not fit the chosen policy are errors; default knobs that belong to another policy are
    dropped (a server default for StreamingLLM's sinks must not break a request that asks for SnapKV).
    """
    defaults = server_defaults() if defaults is None else defaults
    request = {k: v for k, v in (request_args or {}).items() if k.startswith(KEY_PREFIX)}
    allowed = set(GENERAL_KEYS) | knob_keys()
    for key in request:
        if key not in allowed:
            raise KVConfigError(key, f"unknown eviction setting; allowed keys: {', '.join(sorted(allowed))}")

    policy = request.get("kv_policy", defaults.get("kv_policy", "full"))
    if not isinstance(policy, str) or policy not in POLICY_NAMES:
        raise KVConfigError("kv_policy", _unsupported_combination(policy)
                            or f"unknown policy {policy!r}; allowed: {', '.join(POLICY_NAMES)}")
    if policy == "full":
        stray = [k for k in request if k not in ("kv_policy",)]
        if stray:
            raise KVConfigError(stray[0], "has no effect with kv_policy=full (no eviction)")
        return KVConfig()

    cls = POLICIES[policy]
    foreign = [k for k in request if k in knob_keys() and k[len(KEY_PREFIX) :] not in cls.knobs]
    if foreign:
        raise KVConfigError(foreign[0], f"is not a setting of {policy}; its settings: {_knob_list(cls)}")

    knobs: dict[str, Any] = {}
    for name, knob in cls.knobs.items():
        key = KEY_PREFIX + name
        raw = request.get(key, defaults.get(key, knob.default))
        knobs[name] = _parse_knob(key, raw, knob)

    budget: int | None = None
    if "kv_budget" in request or "kv_budget" in defaults:
        budget = _parse_int("kv_budget", request.get("kv_budget", defaults.get("kv_budget")))
    elif not cls.budget_optional:
        raise KVConfigError("kv_budget", f"is required with kv_policy={policy} (tokens kept per layer and KV head)")
    policy_obj = cls(**knobs)
    protected = policy_obj.protected_tokens()
    if budget is not None and budget <= protected:
        raise KVConfigError(
            "kv_budget", f"must be greater than the {protected} tokens {policy} always keeps, got {budget}"
        )
    every_chunk = _parse_bool(
        "kv_evict_every_chunk", request.get("kv_evict_every_chunk", defaults.get("kv_evict_every_chunk", False))
    )
    return KVConfig(policy=policy, budget=budget, evict_every_chunk=every_chunk, knobs=tuple(knobs.items()))


def _unsupported_combination(policy: Any) -> str | None:
    """Why `<base>+caote` is refused for a base that exists but has no per-token score to rescore."""
    if not isinstance(policy, str) or "+" not in policy:
        return None
    base, _, meta = policy.partition("+")
    if base not in POLICIES or meta not in ("caote", "fastcaote"):
        return None
    rescorable = sorted({name.partition("+")[0] for name in POLICIES if "+" in name})
    why = ("it merges evicted entries into kept ones, and CAOTE's error of evicting a token does not model a merge"
           if base == "ems" else "it selects by a fixed rule (positions; MAT's anchors by logit rank per layer), "
           "not by one score per token")
    return (f"{policy!r} is not a supported combination: {meta} rescores a base policy's per-token scores, and "
            f"{base} cannot be rescored ({why}); {meta} applies to: {', '.join(rescorable)}")


def _parse_float(key: str, value: Any) -> float:
    if isinstance(value, bool):
        raise KVConfigError(key, f"must be a number, got {value!r}")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise KVConfigError(key, f"must be a number, got {value!r}") from None
    if number != number or number in (float("inf"), float("-inf")):
        raise KVConfigError(key, f"must be a finite number, got {value!r}")
    return number


def _parse_knob(key: str, raw: Any, knob: Any) -> Any:
    if knob.kind in (int, float):
        value = _parse_int(key, raw) if knob.kind is int else _parse_float(key, raw)
        if knob.minimum is not None and value < knob.minimum:
            raise KVConfigError(key, f"must be >= {knob.minimum}, got {value}")
        if knob.maximum is not None and value > knob.maximum:
            raise KVConfigError(key, f"must be <= {knob.maximum}, got {value}")
        if knob.odd and value % 2 == 0:
            raise KVConfigError(key, f"must be odd, got {value}")
        return value
    if not isinstance(raw, str) or (knob.choices and raw not in knob.choices):
        raise KVConfigError(key, f"must be one of {', '.join(knob.choices or ())}, got {raw!r}")
    return raw


def _knob_list(cls: type[Policy]) -> str:
    return ", ".join(KEY_PREFIX + name for name in cls.knobs) or "(none)"


def check_against_model(config: KVConfig, model: str, max_model_len: int) -> None:
    """The checks that need the served model: a budget no sequence can reach, a gate the model does not have.

    Run by the HTTP middleware (so a streamed request gets a 400, not an error event after its 200) and by vLLM's
    input validation (offline use)."""
    if config.evicts and config.budget is not None and config.budget > max_model_len:
        # a budget no sequence can reach is a mistake, not a way to turn eviction off (policy full does that)
        raise KVConfigError("kv_budget", f"{config.budget} is above max_model_len ({max_model_len})")
    if config.policy == "attention_gate":
        from kvserve.gates.registry import NoGateError, gate_entry

        try:
            gate_entry(model)
        except NoGateError as exc:
            raise KVConfigError("kv_policy", str(exc)) from exc
