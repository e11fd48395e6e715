"""kvserve's series follow Prometheus's naming rules (https://prometheus.io/docs/practices/naming/), read from the
registry with each series' own type; a renamed series is served under its deprecated name at the same values."""

from __future__ import annotations

import re

import pytest
from prometheus_client import REGISTRY

from kvserve.metrics import DEPRECATED_HELP, DEPRECATED_METRICS, ENGINE_LABEL, _metrics, registered_series, served_name

PREFIX = "kvserve:"
# Prometheus's base units (the naming page's table) and the scaled or relative ones it says not to use instead
BASE_UNITS = {"seconds", "bytes", "ratio", "meters", "grams", "volts", "amperes", "joules", "celsius"}
SCALED_UNITS = {
    "milliseconds", "microseconds", "nanoseconds", "minutes", "hours", "days", "ms", "us", "ns",
    "kilobytes", "megabytes", "gigabytes", "kib", "mib", "gib", "kb", "mb", "gb", "bits", "percent", "perc",
}  # fmt: skip


def naming_problems(name: str, kind: str) -> list[str]:
    """What breaks Prometheus's naming rules in a served name of a series of type `kind` (empty: nothing)."""
    problems = []
    if not re.fullmatch(r"kvserve:[a-z][a-z0-9_]*", name):
        problems.append("not kvserve: followed by lower-case snake_case")
    words = name.removeprefix(PREFIX).split("_")
    if kind == "counter":
        if words[-1] != "total" or words[-2:] == ["total", "total"]:
            problems.append("a counter's name ends in one _total")
        words = words[:-1]
    elif words[-1] == "total":
        problems.append(f"a {kind}'s name does not end in _total (a counter's suffix)")
    for index, word in enumerate(words):
        if word in SCALED_UNITS:
            problems.append(f"{word}: not a base unit")
        elif word in BASE_UNITS and index != len(words) - 1:
            problems.append(f"{word}: the unit ends the name" + (" (before _total)" if kind == "counter" else ""))
    return problems


def test_the_rules_catch_what_they_are_for():
    assert naming_problems("kvserve:kv_pages_total", "gauge")
    assert naming_problems("kvserve:kv_cache_bytes_freed_total", "counter")
    assert naming_problems("kvserve:evictions", "counter")
    assert naming_problems("kvserve:step_milliseconds", "histogram")
    assert naming_problems("kvserve:engine_seconds_total", "counter") == []
    assert naming_problems("kvserve:kept_token_ratio", "histogram") == []


def test_every_kvserve_series_follows_the_naming_rules():
    """Each kvserve series in the registry, by its type there; only a deprecated alias may break a rule."""
    _metrics("naming")  # declares every series
    served = {}
    for family in REGISTRY.collect():
        if family.name.startswith(PREFIX):
            served[served_name_of(family)] = family.type
    assert served.keys() >= {served_name(series) for series in registered_series()}
    broken = {name: naming_problems(name, kind) for name, kind in served.items() if naming_problems(name, kind)}
    assert broken.keys() == DEPRECATED_METRICS.keys(), broken
    for old, new in DEPRECATED_METRICS.items():
        assert new in served and served[new] == served[old], f"{old} -> {new}: a series of the same type"
        assert naming_problems(new, served[new]) == []


def served_name_of(family) -> str:
    """prometheus_client names a counter's family without the `_total` its samples carry."""
    return family.name + "_total" if family.type == "counter" else family.name


@pytest.mark.parametrize("old", sorted(DEPRECATED_METRICS))
def test_a_deprecated_name_serves_the_same_values_and_says_what_replaced_it(old):
    new = DEPRECATED_METRICS[old]
    series = {served_name(s): s for s in registered_series()}
    assert series[old]._documentation.startswith(DEPRECATED_HELP.format(new=new))
    assert tuple(series[old]._labelnames) == tuple(series[new]._labelnames)
    engine = f"alias-{old}"
    bound = _metrics(engine)
    bound.record_compaction("snapkv", tokens=40, blocks=3, bytes_per_block=4096)
    bound.record_compaction("h2o", tokens=8, blocks=1, bytes_per_block=4096)
    bound.pages_capacity.set(1234)
    bound.pages_capacity.set(960)  # a gauge's latest value, not a sum
    values = {name: samples_of(name, engine) for name in (old, new)}
    assert values[old] == values[new] != {}


def samples_of(name: str, engine: str) -> dict[tuple, float]:
    """Each sample of the served series `name` with this engine label: its other labels -> its value."""
    found = {}
    for family in REGISTRY.collect():
        for sample in family.samples:
            if sample.name == name and sample.labels.get(ENGINE_LABEL) == engine:
                found[tuple(sorted(sample.labels.items()))] = sample.value
    return found
