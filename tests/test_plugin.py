"""Plugin entry point, version pin, shipped configs and the CLI's handling of server defaults."""

from __future__ import annotations

import argparse
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import yaml

from kvserve import REQUIRED_VLLM_VERSION
from kvserve.cli import BUILTIN_DEFAULTS, defaults_from_args
from kvserve.config import parse_kv_config
from kvserve.vllm import patches as vllm_patches

CONFIGS = Path(__file__).parent.parent / "configs"


def test_plugin_is_registered_with_vllm():
    plugins = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert plugins.get("kvserve") == "kvserve.plugin:register"


def test_wrong_vllm_version_is_refused_with_the_needed_version(monkeypatch):
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.31.2")
    with pytest.raises(RuntimeError, match=REQUIRED_VLLM_VERSION):
        vllm_patches.check_vllm_version()


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_are_valid(path):
    settings = yaml.safe_load(path.read_text())
    assert parse_kv_config(settings, defaults={}).evicts


def test_default_config_file_matches_builtin_default():
    settings = yaml.safe_load((CONFIGS / "default.yaml").read_text())
    assert parse_kv_config(settings, defaults={}) == parse_kv_config(BUILTIN_DEFAULTS, defaults={})


def namespace(**kv):
    base = {"kv_config": None, "kv_policy": None, "kv_budget": None}
    return argparse.Namespace(**{**base, **kv})


def test_cli_flags_override_the_config_file():
    defaults = defaults_from_args(namespace(kv_config=CONFIGS / "streamingllm-512.yaml", kv_budget="300"))
    assert parse_kv_config({}, defaults).budget == 300
    assert parse_kv_config({}, defaults).policy == "streamingllm"


def test_a_knob_flag_alone_tunes_the_builtin_policy():
    defaults = defaults_from_args(argparse.Namespace(kv_config=None, kv_policy=None, kv_budget=None, kv_window="64"))
    assert parse_kv_config({}, defaults) == parse_kv_config({**BUILTIN_DEFAULTS, "kv_window": 64}, defaults={})


def test_cli_rejects_an_invalid_default_at_start_up():
    with pytest.raises(SystemExit, match="kv_budget"):
        defaults_from_args(namespace(kv_policy="snapkv", kv_budget="8"))
    with pytest.raises(SystemExit, match="kv_evict_when"):
        defaults_from_args(namespace(kv_evict_when="lazily"))


def test_the_evict_when_flag_reaches_every_request_that_can_defer():
    from kvserve.cli import _serve_parser

    args, _ = _serve_parser().parse_known_args(["--kv-evict-when", "pressure"])
    defaults = defaults_from_args(args)
    assert parse_kv_config({}, defaults).defers  # the built-in snapkv defers
    assert not parse_kv_config({"kv_policy": "attention_gate"}, defaults).defers  # cannot: dropped, not refused


def test_readme_documents_every_policy_setting():
    from kvserve.policies import POLICY_NAMES, settings_table

    readme = (CONFIGS.parent / "README.md").read_text()
    assert settings_table() in readme
    for name in POLICY_NAMES:
        assert f"`{name.split('+')[0]}`" in readme


@pytest.mark.parametrize("mode", ["vllm", "kernels"])
def test_attention_mode_picks_the_backend_implementation(mode, monkeypatch):
    from kvserve.vllm.attention import KVServeAttentionImpl
    from kvserve.vllm.backend import KVServeAttentionBackend
    from kvserve.vllm.kernel_attention import KVServeKernelAttentionImpl

    monkeypatch.setenv("KVSERVE_ATTENTION", mode)
    expected = KVServeKernelAttentionImpl if mode == "kernels" else KVServeAttentionImpl
    assert KVServeAttentionBackend.get_impl_cls() is expected


def test_misspelt_attention_mode_stops_the_plugin_with_the_reason(monkeypatch):
    monkeypatch.setenv("KVSERVE_ATTENTION", "triton")
    with pytest.raises(ValueError, match="KVSERVE_ATTENTION must be one of vllm, kernels"):
        vllm_patches._register_attention_backend()
