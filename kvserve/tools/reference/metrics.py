"""docs/reference/metrics.md: kvserve's Prometheus series, read off the series the engine registers
(`kvserve.metrics`): name as `/metrics` serves it, type, labels and help; a renamed series' old name is marked
deprecated (`DEPRECATED_METRICS`, old name -> new name)."""

from __future__ import annotations

from kvserve import metrics
from kvserve.tools.markdown import table
from kvserve.tools.reference.common import banner, cell, code

HISTOGRAM_SAMPLES = ("_bucket", "_sum", "_count")


def served_name(series) -> str:
    """The name `/metrics` shows: a counter's with `_total` (prometheus_client adds it), others as declared."""
    return series._name + "_total" if series._type == "counter" else series._name


def rows() -> list[list[str]]:
    deprecated: dict[str, str] = getattr(metrics, "DEPRECATED_METRICS", {})
    found = []
    for series in vars(metrics._series()).values():
        name = served_name(series)
        if name in deprecated:  # (a series not yet renamed)
            continue
        samples = f" ({', '.join(code(name + suffix) for suffix in HISTOGRAM_SAMPLES)})"
        kind = series._type + (samples if series._type == "histogram" else "")
        labels = ", ".join(code(label) for label in series._labelnames)
        found.append((name, [code(name), kind, labels, cell(series._documentation)]))
    by_name = dict(found)
    for old, new in deprecated.items():
        like = by_name.get(new)
        kind, labels = (like[1], like[2]) if like is not None else ("", "")
        found.append((old, [code(old), kind, labels, f"deprecated: use {code(new)}"]))
    return [row for _, row in sorted(found)]


def page() -> str:
    return "\n".join(
        [
            banner("Metrics", "the series `kvserve/metrics.py` registers"),
            "The API server's `/metrics` serves these beside vLLM's `vllm:*` series. Every series carries vLLM's "
            '`engine` label (the data-parallel engine that counted it, `"0"` without data parallelism): '
            "`sum without (engine) (...)` is the server's total. A deprecated name is served with the same values "
            "for one release after its rename.",
            "",
            table(["name", "type", "labels", "meaning"], rows()),
            "",
        ]
    )
