"""docs/reference/settings.md: every setting a request or a server gives, from `kvserve.settings` (the general ones)
and each policy's declared knobs (`kvserve.policies.knobs`); which policies read a general setting is asked of the
parser itself."""

from __future__ import annotations

from typing import Any

from kvserve.config import INTERNAL_KEYS, POLICY_KEY, parse_kv_config
from kvserve.effective_defaults import builtin_values, shown
from kvserve.errors import InvalidSetting
from kvserve.policies import BASE_POLICIES, POLICIES, POLICY_NAMES, Knob, Policy
from kvserve.settings import SETTINGS, Setting
from kvserve.tools.markdown import table
from kvserve.tools.reference.common import banner, cell, code

PROBE_BUDGET = 1024  # the budget each policy is asked with whether it reads a setting


def reads(setting: Setting, cls: type[Policy]) -> bool:
    """Whether `cls` reads `setting`: the parser takes its probe value, or the HTTP front end serves it for `cls`."""
    if setting.front_end is not None and setting.front_end(cls):
        return True
    if setting.probe is None:
        return setting.front_end is None
    try:
        parse_kv_config({"kv_policy": cls.name, "kv_budget": PROBE_BUDGET, setting.key: setting.probe}, defaults={})
    except InvalidSetting:
        return False
    return True


def readers(setting: Setting) -> str:
    names = [cls.name for cls in BASE_POLICIES if reads(setting, cls)]
    if len(names) == len(BASE_POLICIES):
        return "all"
    return ", ".join(code(name) for name in names) or "none (not a policy's setting)"


def general_range(setting: Setting) -> str:
    if setting.key == "kv_policy":
        return "a policy name (below)"
    if setting.key == "kv_checkpoint_policy":
        return "an evicting policy name"
    if setting.choices:
        return ", ".join(code(choice) for choice in setting.choices)
    if setting.kind == "bool":
        return "`true`, `false`"
    return value_range(setting.minimum, setting.maximum, characters=setting.kind == "str")


def value_range(minimum: Any, maximum: Any, *, characters: bool = False, odd: bool = False) -> str:
    if characters:
        return f"at most {maximum} characters" if maximum is not None else "any"
    parts = []
    if minimum is not None and maximum is not None:
        parts.append(f"{minimum} to {maximum}")
    elif minimum is not None:
        parts.append(f">= {minimum}")
    elif maximum is not None:
        parts.append(f"<= {maximum}")
    if odd:
        parts.append("odd")
    return ", ".join(parts) or "any"


def request_default(setting: Setting) -> str:
    """A request's value when neither it nor the server names one (`vllm serve`, or `kvserve serve` after a request
    that names another policy, for the policy's own)."""
    if setting.policy_default:
        values = sorted({shown(getattr(cls, setting.policy_default)) for cls in BASE_POLICIES})
        per_policy = ", ".join(
            f"{code(cls.name)} {shown(getattr(cls, setting.policy_default))}"
            for cls in BASE_POLICIES
            if len(values) > 1 and getattr(cls, setting.policy_default) != getattr(Policy, setting.policy_default)
        )
        own = shown(getattr(Policy, setting.policy_default))
        return f"the policy's own: {own}" + (f"; {per_policy}" if per_policy else "")
    if setting.default is None:
        return "required" if setting.key == "kv_budget" else "none"
    return code(shown(setting.default))


def general_rows() -> list[list[str]]:
    builtin = builtin_values()
    rows = []
    for setting in SETTINGS:
        served = code(shown(builtin[setting.key])) if setting.server else "(not a server default)"
        rows.append(
            [
                code(setting.key),
                code(setting.header) if setting.request else "",
                code(setting.key) if setting.request else "",
                code(setting.flag) if setting.server else "",
                code(setting.key) if setting.server else "",
                cell(setting.kind),
                served,
                cell(request_default(setting)),
                cell(general_range(setting)),
                cell(readers(setting)),
                cell(setting.help),
            ]
        )
    return rows


def knob_range(knob: Knob) -> str:
    if knob.choices:
        return ", ".join(code(choice) for choice in knob.choices)
    return value_range(knob.minimum, knob.maximum, characters=knob.kind is str, odd=knob.odd)


def knob_rows() -> list[list[str]]:
    rows = []
    for cls in BASE_POLICIES:
        for knob in cls.knobs().values():
            rows.append(
                [
                    code(cls.name),
                    code(knob.key),
                    code(knob.header),
                    code("--" + knob.key.replace("_", "-")),
                    f"{code(knob.key)} or {code(f'{POLICY_KEY}.{cls.name}.{knob.key}')}",
                    knob.kind.__name__,
                    code(shown(knob.default)),
                    cell(knob_range(knob)),
                    cell(knob.help),
                ]
            )
    return rows


def page() -> str:
    variants = sorted(name for name in POLICIES if "+" in name)
    general = table(
        [
            "setting",
            "header",
            "body key",
            "`kvserve serve` flag",
            "config key",
            "type",
            "default (`kvserve serve`)",
            "default (no server default)",
            "range / choices",
            "policies that read it",
            "meaning",
        ],
        general_rows(),
    )
    knobs = table(
        ["policy", "setting", "header", "flag", "config key", "type", "default", "range / choices", "meaning"],
        knob_rows(),
    )
    internal = ", ".join(code(key) for key in INTERNAL_KEYS)
    return "\n".join(
        [
            banner("Settings", "`kvserve/settings.py` and each policy's declared knobs (`kvserve/policies/`)"),
            'A request names a setting as a header (`x-kv-budget: 256`), as a top-level body key (`"kv_budget": '
            "256`, what OpenAI clients send as `extra_body`) or in `vllm_xargs`; the same setting given twice with "
            "different values is a 400. A server gives defaults with `kvserve serve --kv-*` flags or a YAML file "
            "(`--kv-config`, examples in `configs/`; flags win); a request overrides them. An invalid value is a "
            "400 whose `param` names the setting. `vllm serve` with kvserve installed takes the same request keys "
            "and headers, without server defaults: the column *no server default*. A model's calibrated profile "
            "(`kvserve calibrate`) replaces `kvserve serve`'s built-in defaults unless the command line gives "
            "eviction defaults.",
            "",
            "## General settings",
            "",
            general,
            "",
            "## Each policy's own settings",
            "",
            "A policy's own settings given at the top level of a server's defaults belong to the server's "
            f"`kv_policy`; `{POLICY_KEY}: {{POLICY: {{kv_...: value}}}}` in the config file gives another policy "
            "its own (and `kv_span`). A request naming a setting its policy does not declare is a 400. "
            f"The `+caote` and `+fastcaote` variants take their base's: {', '.join(code(v) for v in variants)}.",
            "",
            knobs,
            "",
            "## Policies",
            "",
            f"`kv_policy` takes: {', '.join(code(name) for name in POLICY_NAMES)} (`full`: no eviction).",
            "",
            "## Set by kvserve itself",
            "",
            f"{internal}: kvserve's HTTP front end sets these on the engine requests it makes (a document's "
            "reconstruction, a lookahead's question); a client request naming one is a 400.",
            "",
        ]
    )
