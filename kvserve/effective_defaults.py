"""What each policy gets from a server's defaults, as start-up logs it (`kvserve.vllm.api_server`): the same lines
under `kvserve serve` and `vllm serve`, since a policy's own settings are its class's however it is named; and the
built-in defaults as `kvserve serve --help` and docs/reference/settings.md show them (`builtin_values`)."""

from __future__ import annotations

from typing import Any

from kvserve.config import BUILTIN_DEFAULTS, parse_kv_config
from kvserve.errors import InvalidSetting
from kvserve.policies import POLICIES
from kvserve.settings import SETTINGS


def effective_defaults(defaults: dict) -> list[str]:
    """One line per policy: the settings a request that names only that policy gets from these server defaults (the
    server's default policy first), which start-up logs. CAOTE variants take their base's."""
    server_policy = defaults.get("kv_policy", "full")
    names = [server_policy] + sorted(name for name in POLICIES if "+" not in name and name != "full")
    lines = []
    # without a server budget (`vllm serve`) each request gives its own: shown as such, the rest parsed as it would be
    budget = {} if "kv_budget" in defaults else {"kv_budget": 1 << 30}
    for name in dict.fromkeys(names):
        shown = f"{name} (default)" if name == server_policy else name
        if name == "full":
            lines.append(f"{shown}: no eviction")
            continue
        try:
            config = parse_kv_config({"kv_policy": name, **budget}, defaults=defaults)
        except InvalidSetting as exc:
            lines.append(f"{name}: not servable without further settings ({exc})")
            continue
        shown_budget = "the request's kv_budget" if budget else config.budget
        settings = [f"budget {shown_budget}", f"span {config.span}", f"allocation {config.allocation}"]
        settings += [f"{knob} {value}" for knob, value in config.knobs]
        lines.append(f"{shown}: {', '.join(settings)}")
    return lines


def builtin_values() -> dict[str, Any]:
    """What `kvserve serve` without --kv-* (and without a model profile's recommendation) gives a request that names
    nothing, per server-settable general key: the built-in defaults as the parser resolves them, so `--help` shows
    what the server applies, not a copy of it."""
    config = parse_kv_config({}, defaults=BUILTIN_DEFAULTS)
    return {
        setting.key: getattr(config, setting.field)
        if setting.field
        else BUILTIN_DEFAULTS.get(setting.key, setting.default)
        for setting in SETTINGS
        if setting.server
    }


def shown(value: Any) -> str:
    """A default as `--help` and the references print it."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)
