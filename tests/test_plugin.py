"""Plugin entry point, version pin, shipped configs and the CLI's handling of server defaults."""

from __future__ import annotations

import argparse
import re
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import yaml

from kvserve import REQUIRED_VLLM_VERSION
from kvserve.cli import BUILTIN_DEFAULTS, defaults_from_args
from kvserve.config import parse_kv_config, requested_policy
from kvserve.errors import InvalidSetting
from kvserve.policies import POLICIES, POLICY_NAMES
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
    assert parse_kv_config({}, defaults_from_args(namespace(kv_config=path))).evicts


def test_default_config_file_matches_builtin_default():
    """`--kv-config configs/default.yaml` serves what no flag at all serves: the same settings for a request that
    names nothing, and kvzip for one with checkpoints."""
    from_file, builtin = defaults_from_args(namespace(kv_config=CONFIGS / "default.yaml")), dict(BUILTIN_DEFAULTS)
    assert yaml.safe_load((CONFIGS / "default.yaml").read_text()).keys() >= builtin.keys()
    assert parse_kv_config({}, from_file) == parse_kv_config({}, builtin)
    for request in ({"kv_checkpoint": 512}, {"kv_checkpoint": "turns"}, {"kv_checkpoint": 0}):
        assert requested_policy(request, from_file) == requested_policy(request, builtin)


def test_checkpoints_default_to_the_checkpoint_policy_unless_the_operator_names_a_policy():
    """A request with kv_checkpoint=C that names no policy gets kv_checkpoint_policy (built in: kvzip); one naming a
    policy keeps it; kv_checkpoint 0 is no checkpoint, turns the server's kv_policy. An operator's --kv-policy
    without --kv-checkpoint-policy serves checkpoints with that policy; a request cannot set kv_checkpoint_policy
    (400 naming it)."""
    builtin = defaults_from_args(namespace())
    assert requested_policy({"kv_checkpoint": 256}, builtin) == BUILTIN_DEFAULTS["kv_checkpoint_policy"] == "kvzip"
    assert requested_policy({"kv_checkpoint": 256, "kv_policy": "keydiff"}, builtin) == "keydiff"
    assert requested_policy({"kv_checkpoint": "0"}, builtin) == requested_policy({}, builtin) == "snapkv"
    assert requested_policy({}, {**builtin, "kv_checkpoint": 512}) == "kvzip"  # the server's checkpoints too
    # turns compacts where each turn's prompt ends, its question voting: not before the question
    assert requested_policy({"kv_checkpoint": "turns"}, builtin) == "snapkv"
    named = defaults_from_args(namespace(kv_policy="tova", kv_budget="512"))
    assert requested_policy({"kv_checkpoint": 256}, named) == "tova"
    chosen = defaults_from_args(namespace(kv_policy="tova", kv_budget="512", kv_checkpoint_policy="keydiff"))
    assert requested_policy({"kv_checkpoint": 256}, chosen) == "keydiff"
    for bad in ("full", "lru"):
        with pytest.raises(SystemExit, match="kv_checkpoint_policy"):
            defaults_from_args(namespace(kv_checkpoint_policy=bad))
    with pytest.raises(InvalidSetting) as refused:
        parse_kv_config({"kv_checkpoint_policy": "kvzip"}, builtin)
    assert refused.value.field == "kv_checkpoint_policy"


def namespace(**kv):
    base = {"kv_config": None, "kv_policy": None, "kv_budget": None}
    return argparse.Namespace(**{**base, **kv})


def test_cli_flags_override_the_config_file():
    defaults = defaults_from_args(namespace(kv_config=CONFIGS / "streamingllm-512.yaml", kv_budget="300"))
    assert parse_kv_config({}, defaults).budget == 300
    assert parse_kv_config({}, defaults).policy == "streamingllm"


def test_a_knob_flag_alone_tunes_the_builtin_policy():
    defaults = defaults_from_args(argparse.Namespace(kv_config=None, kv_policy=None, kv_budget=None, kv_window="64"))
    assert parse_kv_config({}, defaults) == parse_kv_config({}, {**BUILTIN_DEFAULTS, "kv_window": 64})


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


def test_the_docs_document_every_policy_and_setting():
    """The serving page's policy table names every policy (a row each, with its paper), and the README, a five-minute
    read, links the generated settings reference, which holds every setting (its own tests compare it to the code)."""
    from kvserve.policies import POLICY_NAMES

    serving = (CONFIGS.parent / "docs" / "guide" / "serving.md").read_text()
    readme = (CONFIGS.parent / "README.md").read_text()
    assert "docs/reference/settings.md" in readme and "../reference/settings.md" in serving
    policy_section = serving.split("## Choose a policy", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([a-z0-9_<>]+)`", policy_section, flags=re.M)
    assert {name.split("+")[0] for name in POLICY_NAMES} == set(rows) - {"<base>"}


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


def test_a_config_files_knobs_reach_only_its_own_policy(tmp_path):
    """A file's kv_window for SnapKV (configs/default.yaml once held 32) used to become Expected Attention's window,
    and configs/streamingllm-512.yaml's kv_sink_tokens (4) DuoAttention's sinks (trained with 16)."""
    config = tmp_path / "snapkv.yaml"
    config.write_text("kv_policy: snapkv\nkv_budget: 1024\nkv_window: 48\n")
    snapkv_file = defaults_from_args(namespace(kv_config=config))
    own = dict(parse_kv_config({"kv_policy": "expected_attention", "kv_budget": 512}, {}).knobs)["window"]
    assert dict(parse_kv_config({"kv_policy": "expected_attention"}, snapkv_file).knobs)["window"] == own == 64
    assert dict(parse_kv_config({}, snapkv_file).knobs)["window"] == 48  # the file's own policy takes it
    streaming_file = defaults_from_args(namespace(kv_config=CONFIGS / "streamingllm-512.yaml"))
    duo = parse_kv_config({"kv_policy": "duoattention"}, streaming_file)
    assert dict(duo.knobs)["sink_tokens"] == 16 and duo.budget == 512  # the budget is every policy's


def test_naming_a_score_based_policy_gives_it_the_span_the_suite_chose():
    """`kvserve serve --kv-policy snapkv --kv-budget 512` ran span 1: the built-in span 8 applied only when no policy
    was named."""
    defaults = defaults_from_args(namespace(kv_policy="snapkv", kv_budget="512"))
    assert parse_kv_config({}, defaults).span == 8
    for policy, span in (("tova", 8), ("h2o+caote", 8), ("streamingllm", 1), ("mat", 1)):
        assert parse_kv_config({"kv_policy": policy, "kv_budget": 256}, defaults={}).span == span, policy
    assert parse_kv_config({"kv_policy": "tova", "kv_budget": 256, "kv_span": 1}, defaults={}).span == 1


def test_a_policies_section_sets_other_policies_own_defaults_and_is_checked_at_start_up(tmp_path):
    config = tmp_path / "defaults.yaml"
    config.write_text("kv_policy: snapkv\nkv_budget: 512\npolicies:\n  tova: {kv_span: 4}\n  h2o: {kv_recent: 16}\n")
    defaults = defaults_from_args(namespace(kv_config=config))
    assert parse_kv_config({"kv_policy": "tova"}, defaults).span == 4
    assert parse_kv_config({"kv_policy": "tova+caote"}, defaults).span == 4  # a CAOTE variant takes its base's
    assert dict(parse_kv_config({"kv_policy": "h2o"}, defaults).knobs)["recent"] == 16
    assert parse_kv_config({}, defaults).span == 8 and parse_kv_config({"kv_policy": "ahakv"}, defaults).span == 8
    for wrong, says in (
        ("  tova: {kv_budget: 64}\n", "applies to every policy"),
        ("  nope: {kv_span: 4}\n", "'nope'"),
        ("  streamingllm: {kv_window: 8}\n", "kv_window"),
    ):
        config.write_text("kv_policy: snapkv\nkv_budget: 512\npolicies:\n" + wrong)
        with pytest.raises(SystemExit, match=says):
            defaults_from_args(namespace(kv_config=config))


def test_start_up_says_what_each_policy_gets():
    from kvserve.effective_defaults import effective_defaults

    lines = effective_defaults(defaults_from_args(namespace(kv_config=CONFIGS / "streamingllm-512.yaml")))
    assert lines[0] == "streamingllm (default): budget 512, span 1, allocation uniform, sink_tokens 4"
    duo = next(line for line in lines if line.startswith("duoattention:"))
    assert "span 8" in duo and "sink_tokens 16" in duo
    assert len(lines) == len({name for name in POLICY_NAMES if "+" not in name and name != "full"})
    # under `vllm serve` (no server defaults) each policy's own settings, the budget being each request's
    vllm_serve = effective_defaults({})
    assert vllm_serve[0] == "full (default): no eviction"
    snapkv = next(line for line in vllm_serve if line.startswith("snapkv:"))
    policy = POLICIES["snapkv"]()  # its own knobs, as the class declares them
    own = f"span 8, allocation uniform, window {policy.window}, kernel_size {policy.kernel_size}, pooling avg"
    assert snapkv == f"snapkv: budget the request's kv_budget, {own}"


EVICTING = sorted(name for name in POLICY_NAMES if name != "full")


@pytest.mark.parametrize("policy", EVICTING)
def test_a_policy_gets_the_same_settings_however_it_is_named(policy, tmp_path, monkeypatch):
    """Issue 66: SnapKV pooled over 15 as the server default but over 7 when named (`--kv-policy snapkv`, a request,
    `vllm serve`). A policy's own settings are its class's, whichever way it is named: the server's default policy
    (flag or config file), a request naming it on `kvserve serve`'s built-in defaults, and one under `vllm serve`,
    which has no server defaults (the plugin reads them from DEFAULTS_ENV, absent there)."""
    from kvserve.config import DEFAULTS_ENV

    monkeypatch.delenv(DEFAULTS_ENV, raising=False)
    config = tmp_path / "defaults.yaml"
    config.write_text(f"kv_policy: {policy}\nkv_budget: 512\n")
    request = {"kv_policy": policy, "kv_budget": 512}
    named = {
        "--kv-policy": parse_kv_config({}, defaults_from_args(namespace(kv_policy=policy, kv_budget="512"))),
        "--kv-config": parse_kv_config({}, defaults_from_args(namespace(kv_config=config))),
        "request to kvserve serve": parse_kv_config(request, defaults_from_args(namespace())),
        "request to vllm serve": parse_kv_config(request),  # defaults from the (empty) environment
    }
    assert named["--kv-policy"].policy == policy
    for how, config_named in named.items():
        assert config_named == named["--kv-policy"], how


def test_checkpoint_requests_get_kvzip_under_vllm_serve_too(monkeypatch):
    """A request with kv_checkpoint=C naming no policy: kvzip on `kvserve serve` (its kv_checkpoint_policy) and under
    `vllm serve` or `--kv-policy full` (no eviction policy named), the operator's policy where one is named. (The
    HTTP front end serves kvzip's checkpoints as a compressed prefix: kvserve/server/checkpoint_documents.py.)"""
    from kvserve.config import DEFAULTS_ENV, env_defaults

    monkeypatch.delenv(DEFAULTS_ENV, raising=False)
    request = {"kv_checkpoint": 512, "kv_budget": 512}
    assert requested_policy(request, defaults_from_args(namespace())) == "kvzip"
    assert requested_policy(request, env_defaults()) == "kvzip"  # vllm serve: no server defaults
    assert requested_policy(request, defaults_from_args(namespace(kv_policy="full"))) == "kvzip"
    assert requested_policy(request, defaults_from_args(namespace(kv_policy="tova", kv_budget="256"))) == "tova"
    assert requested_policy({"kv_checkpoint": "turns"}, env_defaults()) == "full"


def test_a_metric_file_being_created_reads_as_empty_and_the_other_files_are_collected(tmp_path, monkeypatch):
    """prometheus_client creates a process's file empty and sizes it a moment later; a scrape in between failed
    whole (struct.error). With the plugin's guard the empty file counts nothing and the other files still count."""
    import struct

    from prometheus_client import CollectorRegistry
    from prometheus_client.mmap_dict import MmapedDict, mmap_key
    from prometheus_client.multiprocess import MultiProcessCollector

    from kvserve.metrics import read_new_metric_files_as_empty

    # prometheus_client's own reader for the test (the plugin may have installed the guard in this process already);
    # whatever the class held is put back after it
    reader = MmapedDict.read_all_values_from_file
    monkeypatch.setattr(MmapedDict, "read_all_values_from_file", staticmethod(getattr(reader, "unguarded", reader)))
    written = MmapedDict(str(tmp_path / "counter_100.db"))
    written.write_value(mmap_key("kvserve:x", "kvserve:x_total", (), (), "x"), 5.0, 0.0)
    written.close()
    (tmp_path / "counter_101.db").write_bytes(b"")  # another process's file, not sized yet
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(tmp_path))
    with pytest.raises(struct.error):
        list(registry.collect())
    read_new_metric_files_as_empty()
    read_new_metric_files_as_empty()  # a second install keeps one guard
    samples = {sample.name: sample.value for metric in registry.collect() for sample in metric.samples}
    assert samples == {"kvserve:x_total": 5.0}
