"""`kvserve serve --help` shows every --kv-* flag's default, the one the server applies: the settings' declarations
resolved by the parser (`kvserve.effective_defaults.builtin_values`), each knob's declared default, and these
declarations agree with what the parser and `kvserve serve` do."""

from __future__ import annotations

import pytest

from kvserve.cli import _serve_parser, defaults_from_args
from kvserve.config import BUILTIN_DEFAULTS, parse_kv_config
from kvserve.effective_defaults import builtin_values, shown
from kvserve.errors import InvalidSetting
from kvserve.policies import BASE_POLICIES, POLICIES
from kvserve.server.affinity import MAX_SESSION
from kvserve.server.profile import DEFAULT_TARGET
from kvserve.server.request_keys import headers_to_xargs
from kvserve.settings import BY_KEY, SETTINGS
from kvserve.settings import MAX_SESSION as DECLARED_MAX_SESSION


def flat(text: str) -> str:
    return " ".join(text.split())


def expected_defaults() -> dict[str, list[str]]:
    """--kv-* flag -> the `(default ...)` texts its help must hold."""
    builtin = builtin_values()
    expected = {"--kv-config": ["default none"], "--kv-profile": ["default auto"]}
    expected["--kv-target"] = [f"default {DEFAULT_TARGET}"]
    expected |= {s.flag: [f"default {shown(builtin[s.key])}"] for s in SETTINGS if s.server}
    for name, cls in POLICIES.items():
        for setting in cls.knobs().values():
            if "+" not in name:
                flag = "--" + setting.key.replace("_", "-")
                expected.setdefault(flag, []).append(f"{setting.help} (default {shown(setting.default)})")
    return expected


def test_every_kv_flag_shows_its_default():
    parser = _serve_parser()
    text = flat(parser.format_help())
    flags = {option for action in parser._actions for option in action.option_strings if option.startswith("--kv-")}
    expected = expected_defaults()
    assert flags == set(expected)  # a new --kv-* flag needs its default here
    for action in parser._actions:
        for option in action.option_strings:
            if option in expected:
                help_text = flat(action.help)
                assert help_text in text
                for default in expected[option]:
                    assert flat(default) in help_text, (option, default)


def test_the_help_shows_what_kvserve_serve_applies():
    args, _ = _serve_parser().parse_known_args([])
    defaults = defaults_from_args(args)
    assert defaults == BUILTIN_DEFAULTS
    config = parse_kv_config({}, defaults=defaults)
    builtin = builtin_values()
    for setting in SETTINGS:
        if setting.server and setting.field:
            assert builtin[setting.key] == getattr(config, setting.field), setting.key


@pytest.mark.parametrize("cls", BASE_POLICIES, ids=lambda cls: cls.name)
def test_the_declared_defaults_are_the_parsers(cls):
    """A request naming only its policy (and a budget) on a server without defaults gets the declared defaults."""
    config = parse_kv_config({"kv_policy": cls.name, "kv_budget": 1024}, defaults={})
    for setting in SETTINGS:
        if not setting.field or setting.key in ("kv_policy", "kv_budget"):
            continue
        declared = getattr(cls, setting.policy_default) if setting.policy_default else setting.default
        assert getattr(config, setting.field) == declared, setting.key


def test_the_declared_headers_are_the_servers():
    headers = [(s.header.encode(), b"1") for s in SETTINGS if s.request]
    assert headers_to_xargs(headers) == {s.key: "1" for s in SETTINGS if s.request}
    # vLLM router's session header names the same session, once or beside an x-kv-session that agrees
    assert headers_to_xargs([(b"X-Session-ID", b"s1")]) == {"kv_session": "s1"}
    assert headers_to_xargs([(b"x-kv-session", b"s1"), (b"x-session-id", b"s1")]) == {"kv_session": "s1"}
    with pytest.raises(InvalidSetting, match="different sessions"):
        headers_to_xargs([(b"x-session-id", b"s1"), (b"x-kv-session", b"s2")])
    assert BY_KEY["kv_session"].maximum == DECLARED_MAX_SESSION == MAX_SESSION


@pytest.mark.parametrize(
    "setting",
    [s for s in SETTINGS if s.field and s.request and (s.minimum, s.maximum) != (None, None)],
    ids=lambda s: s.key,
)
def test_the_declared_ranges_are_the_parsers(setting):
    """The reference prints each setting's range from its declaration while the parser checks its own bounds: a
    value just outside the declared range is refused naming the setting (SnapKV reads every ranged setting)."""

    base = {"kv_policy": "snapkv", "kv_budget": 1024}
    outside = [bound - 1 for bound in [setting.minimum] if bound is not None]
    outside += [bound + 1 for bound in [setting.maximum] if bound is not None]
    for value in outside:
        with pytest.raises(InvalidSetting) as refused:
            parse_kv_config({**base, setting.key: value}, defaults={})
        assert refused.value.field == setting.key, value
