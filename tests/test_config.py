"""Eviction settings (`parse_kv_config`): a refused setting names the request key at fault, server defaults apply
and default knobs of another policy are dropped, CAOTE over a policy without scores is refused with the reason, and
an unknown policy lists the allowed ones."""

from __future__ import annotations

import pytest

from kvserve.config import parse_kv_config
from kvserve.errors import InvalidSetting


@pytest.mark.parametrize(
    "bad,field",
    [
        ({"kv_policy": "lru", "kv_budget": 64}, "kv_policy"),
        ({"kv_policy": 5, "kv_budget": 64}, "kv_policy"),
        ({"kv_policy": "snapkv", "kv_budget": "64k"}, "kv_budget"),
        ({"kv_policy": "snapkv", "kv_budget": 1.5}, "kv_budget"),
        ({"kv_policy": "snapkv", "kv_budget": 32}, "kv_budget"),
        ({"kv_policy": "snapkv"}, "kv_budget"),
        ({"kv_policy": "streamingllm", "kv_budget": 4}, "kv_budget"),
        ({"kv_policy": "snapkv", "kv_budget": 64, "kv_window": -1}, "kv_window"),
        ({"kv_policy": "snapkv", "kv_budget": 64, "kv_kernel_size": 4}, "kv_kernel_size"),
        ({"kv_policy": "snapkv", "kv_budget": 64, "kv_pooling": "median"}, "kv_pooling"),
        ({"kv_policy": "snapkv", "kv_budget": 64, "kv_sink_tokens": 2}, "kv_sink_tokens"),
        ({"kv_policy": "streamingllm", "kv_budget": 64, "kv_evict_every_chunk": "sometimes"}, "kv_evict_every_chunk"),
        ({"kv_policy": "full", "kv_budget": 64}, "kv_budget"),
        ({"kv_polcy": "snapkv"}, "kv_polcy"),
        ({"kv_policy": "ems", "kv_budget": 64, "kv_tau": "high"}, "kv_tau"),
        ({"kv_policy": "ems", "kv_budget": 64, "kv_tau": 1.5}, "kv_tau"),
        ({"kv_policy": "ems", "kv_budget": 64, "kv_gamma": "nan"}, "kv_gamma"),
        ({"kv_policy": "mat", "kv_budget": 64, "kv_anchor_fraction": -0.1}, "kv_anchor_fraction"),
        ({"kv_policy": "h2o+caote", "kv_budget": 16}, "kv_budget"),
        ({"kv_policy": "streamingllm+caote", "kv_budget": 64}, "kv_policy"),
        ({"kv_policy": "snapkv", "kv_budget": 64, "kv_evict_when": "later"}, "kv_evict_when"),
        ({"kv_policy": "full", "kv_evict_when": "pressure"}, "kv_evict_when"),
        ({"kv_policy": "attention_gate", "kv_evict_when": "pressure"}, "kv_evict_when"),
        ({"kv_policy": "duoattention", "kv_budget": 256, "kv_evict_when": "pressure"}, "kv_evict_when"),
        (
            {"kv_policy": "h2o", "kv_budget": 64, "kv_evict_every_chunk": True, "kv_evict_when": "pressure"},
            "kv_evict_when",
        ),
    ],
)
def test_invalid_settings_name_the_field(bad, field):
    with pytest.raises(InvalidSetting) as info:
        parse_kv_config(bad, defaults={})
    assert info.value.field == field


def test_server_defaults_apply_and_foreign_default_knobs_are_dropped():
    defaults = {"kv_policy": "streamingllm", "kv_budget": 256, "kv_sink_tokens": 8}
    assert parse_kv_config({}, defaults).knobs == (("sink_tokens", 8),)
    snap = parse_kv_config({"kv_policy": "snapkv"}, defaults)
    assert snap.policy == "snapkv" and snap.budget == 256 and dict(snap.knobs)["window"] == 32
    assert parse_kv_config({"kv_policy": "full"}, defaults).evicts is False
    assert parse_kv_config({"kv_budget": "300", "kv_evict_every_chunk": "true"}, defaults).evict_every_chunk
    assert parse_kv_config({"kv_evict_when": "pressure"}, defaults).defers
    assert not parse_kv_config({}, defaults).defers
    # a server default of pressure is dropped, not refused, for a request whose policy cannot defer
    assert parse_kv_config({"kv_policy": "attention_gate"}, {"kv_evict_when": "pressure"}).evict_when == "eager"


@pytest.mark.parametrize("policy", ["ems+caote", "streamingllm+fastcaote", "mat+caote"])
def test_caote_over_a_policy_without_scores_is_refused_with_the_reason(policy):
    with pytest.raises(InvalidSetting) as error:
        parse_kv_config({"kv_policy": policy, "kv_budget": 128}, defaults={})
    assert error.value.field == "kv_policy"
    assert "not a supported combination" in error.value.message and "h2o" in error.value.message


def test_an_unknown_policy_lists_the_allowed_ones():
    with pytest.raises(InvalidSetting) as error:
        parse_kv_config({"kv_policy": "lru+caote", "kv_budget": 128}, defaults={})
    assert "unknown policy" in error.value.message and "snapkv+caote" in error.value.message


@pytest.mark.parametrize(
    "bad,why",
    [
        ({"kv_policy": "snapkv", "kv_budget": 64, "kv_allocation": "layers"}, "must be one of"),
        ({"kv_policy": "mat", "kv_budget": 64, "kv_allocation": "heads"}, "fixed rule"),
        ({"kv_policy": "ems", "kv_budget": 64, "kv_allocation": "global"}, "fixed rule"),
        ({"kv_policy": "attention_gate", "kv_allocation": "pyramid"}, "gate"),
        ({"kv_policy": "full", "kv_allocation": "heads"}, "no effect"),
    ],
)
def test_an_allocation_a_policy_cannot_use_is_refused_with_the_reason(bad, why):
    with pytest.raises(InvalidSetting) as error:
        parse_kv_config(bad, defaults={})
    assert error.value.field == "kv_allocation" and why in error.value.message


@pytest.mark.parametrize(
    "bad,why",
    [
        ({"kv_policy": "snapkv", "kv_budget": 64, "kv_span": 0}, ">= 1"),
        ({"kv_policy": "snapkv", "kv_budget": 64, "kv_span": "wide"}, "integer"),
        ({"kv_policy": "snapkv", "kv_budget": 64, "kv_span": 40}, "no whole span"),
        ({"kv_policy": "streamingllm", "kv_budget": 64, "kv_span": 4}, "fixed rule"),
        ({"kv_policy": "attention_gate", "kv_span": 4}, "gate"),
    ],
)
def test_a_span_a_policy_cannot_use_is_refused_with_the_reason(bad, why):
    with pytest.raises(InvalidSetting) as error:
        parse_kv_config(bad, defaults={})
    assert error.value.field == "kv_span" and why in error.value.message


def test_allocation_and_span_parse_and_a_default_another_policy_cannot_use_is_dropped():
    config = parse_kv_config({"kv_policy": "h2o+caote", "kv_budget": "96", "kv_allocation": "global", "kv_span": "4"})
    assert (config.allocation, config.span) == ("global", 4)
    defaults = {"kv_policy": "snapkv", "kv_budget": 256, "kv_allocation": "heads", "kv_span": 8}
    assert (parse_kv_config({}, defaults).allocation, parse_kv_config({}, defaults).span) == ("heads", 8)
    mat = parse_kv_config({"kv_policy": "mat"}, defaults)  # MAT has no scores: the server's heads/span do not apply
    assert (mat.allocation, mat.span) == ("uniform", 1)
    assert parse_kv_config({"kv_policy": "mat", "kv_allocation": "pyramid"}, defaults).allocation == "pyramid"


def test_a_server_default_span_that_a_small_budget_leaves_no_room_for_is_dropped_not_refused():
    from kvserve.cli import BUILTIN_DEFAULTS
    from kvserve.policies import POLICIES

    # the built-in default: snapkv with span 8; a request with B=36 keeps 4 entries beside SnapKV's 32-query window
    config = parse_kv_config({"kv_budget": 36}, defaults=BUILTIN_DEFAULTS)
    assert (config.policy, config.budget, config.span) == ("snapkv", 36, 1)
    assert parse_kv_config({"kv_budget": 64}, defaults=BUILTIN_DEFAULTS).span == POLICIES["snapkv"].default_span == 8
    with pytest.raises(InvalidSetting, match="kv_span"):  # asked for explicitly: still a clear 400
        parse_kv_config({"kv_budget": 36, "kv_span": 8}, defaults=BUILTIN_DEFAULTS)


def test_the_builtin_default_pools_snapkvs_votes_wider_and_only_snapkvs():
    """The server default's kernel (15, chosen by the quality suite's multi-key lookup) reaches a request that names
    snapkv or nothing, never the kernel of another policy with a knob of that name (AhaKV's mean filter)."""
    from kvserve.config import BUILTIN_DEFAULTS
    from kvserve.policies import POLICIES

    def knobs(request: dict) -> dict:
        return dict(parse_kv_config(request, defaults=BUILTIN_DEFAULTS).knobs)

    assert knobs({})["kernel_size"] == knobs({"kv_policy": "snapkv"})["kernel_size"] == POLICIES["snapkv"]().kernel_size
    assert knobs({"kv_policy": "snapkv", "kv_kernel_size": 7})["kernel_size"] == 7
    assert knobs({"kv_policy": "ahakv"})["kernel_size"] == POLICIES["ahakv"]().kernel_size
