"""kvserve's Prometheus series, created in the engine-core and worker processes.

With `PROMETHEUS_MULTIPROC_DIR` set (`kvserve serve` sets it), prometheus_client writes them to files that the API
server's `/metrics` collects beside vLLM's `vllm:*` series.

Every series carries vLLM's own `engine` label: the data-parallel engine (`--data-parallel-size`) whose processes
counted it, `"0"` without data parallelism. The collector sums each label set over the processes that wrote it (the
workers of an engine's tensor-parallel ranks and pipeline stages count disjoint things), so one engine's series is
its own and `sum without (engine) (...)` is the server's total, nothing counted twice.

Names follow Prometheus's naming rules (a counter's samples end in `_total`, a unit is the name's last word before
it, in base units). A series renamed to follow them is still served under its old name, with the same values, for
one release: `DEPRECATED_METRICS` maps each old name to its new one (names as `/metrics` shows them).
"""

from __future__ import annotations

from functools import cache

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase

KEPT_RATIO_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
# eviction steps take from well under a millisecond (one short request) to seconds (thousands of tokens, 30 layers)
COMPACTION_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


ENGINE_LABEL = "engine"

# old name -> new name, both as served; the old series goes in the release after the one that renamed it
DEPRECATED_METRICS: dict[str, str] = {
    "kvserve:kv_cache_bytes_freed_total": "kvserve:kv_cache_freed_bytes_total",  # the unit ends the name
    "kvserve:kv_pages_total": "kvserve:kv_pages_capacity",  # a gauge: `_total` is a counter's suffix
}
DEPRECATED_HELP = "deprecated: use {new}. "


class _Series:
    """Every series, declared once per process (prometheus_client refuses a name registered twice)."""

    def __init__(self) -> None:
        self.tokens_evicted = Counter(
            "kvserve:tokens_evicted",
            "Tokens removed from requests' KV caches (each layer and KV head drops this many)",
            ["policy", ENGINE_LABEL],
        )
        self.blocks_freed = Counter(
            "kvserve:blocks_freed", "KV-cache blocks returned to vLLM's pool by eviction", ["policy", ENGINE_LABEL]
        )
        self.bytes_freed = Counter(
            "kvserve:kv_cache_freed_bytes",
            "KV-cache memory returned to vLLM's pool by eviction (blocks freed x bytes per block over all layers)",
            ["policy", ENGINE_LABEL],
        )
        self.kept_ratio = Histogram(
            "kvserve:kept_token_ratio",
            "Per finished request of an evicting policy: cache entries held at the end / tokens of the sequence",
            ["policy", ENGINE_LABEL],
            buckets=KEPT_RATIO_BUCKETS,
        )
        self.policy_errors = Counter(
            "kvserve:policy_errors", "Requests failed because their eviction policy raised", ["policy", ENGINE_LABEL]
        )
        self.evictions = Counter(
            "kvserve:evictions", "Compaction steps (one per request and step that evicts)", ["policy", ENGINE_LABEL]
        )
        self.evicted_requests = Gauge(
            "kvserve:requests_with_evicted_cache",
            "Requests currently holding a compacted (evicted) KV cache",
            [ENGINE_LABEL],
            multiprocess_mode="livesum",
        )
        # vLLM's vllm:kv_cache_usage_perc counts whole blocks; a block of an evicting request may be partly free
        self.pages_in_use = Gauge(
            "kvserve:kv_pages_in_use",
            "Head pages (block_size tokens of one layer and KV head) holding live KV entries",
            [ENGINE_LABEL],
            multiprocess_mode="livesum",
        )
        self.pages_capacity = Gauge(
            "kvserve:kv_pages_capacity",
            "Head pages in vLLM's KV-cache pool (blocks x layers x KV heads)",
            [ENGINE_LABEL],
            multiprocess_mode="livesum",
        )
        # Attention-Gate: eviction ratio per layer and KV head = 1 - kept / judged (every head judges every token)
        self.gate_tokens_judged = Counter(
            "kvserve:gate_tokens_judged",
            "Prompt tokens judged by Attention-Gate (each layer and KV head judges each)",
            [ENGINE_LABEL],
        )
        self.gate_tokens_kept = Counter(
            "kvserve:gate_tokens_kept", "Prompt tokens Attention-Gate kept", ["layer", "kv_head", ENGINE_LABEL]
        )
        self.kept_entries = Counter(
            "kvserve:kept_entries",
            "Entries kept by compactions, summed over the layer's KV heads (where kv_allocation put the memory)",
            ["layer", "allocation", ENGINE_LABEL],
        )
        self.prefix_blocks_published = Counter(
            "kvserve:prefix_blocks_published",
            "KV-cache blocks evicting requests published to vLLM's prefix cache (complete blocks, before compacting)",
            [ENGINE_LABEL],
        )
        self.prefix_publish_fallbacks = Counter(
            "kvserve:prefix_publish_fallbacks",
            "Evicting requests that stopped publishing to the prefix cache: the pool had no room for the copy a "
            "compaction needs, so they compacted in place",
            [ENGINE_LABEL],
        )
        self.checkpoints_published = Counter(
            "kvserve:checkpoints_published",
            "Prompt checkpoints (kv_checkpoint) whose compacted lists entered the prefix cache",
            [ENGINE_LABEL],
        )
        self.checkpoint_hits = Counter(
            "kvserve:checkpoint_hits",
            "Requests that started from a published prompt checkpoint instead of computing its prefix",
            [ENGINE_LABEL],
        )
        self.deferred_compactions = Counter(
            "kvserve:deferred_compactions",
            "First compactions of kv_evict_when=pressure requests, run because the pool was short of blocks",
            [ENGINE_LABEL],
        )
        self.compaction_seconds = Histogram(
            "kvserve:compaction_seconds",
            "Worker time of one request's eviction step: scoring and compacting every layer, outside vLLM's attention",
            ["policy", ENGINE_LABEL],
            buckets=COMPACTION_BUCKETS,
        )

        self.engine_seconds = Counter(
            "kvserve:engine_seconds",
            "Engine time by phase: schedule, worker (whole step), and inside it attention, statistics, compaction, "
            "pages (kvserve/phases.py); the model's layers are worker minus the last four",
            ["phase", ENGINE_LABEL],
        )


class Metrics:
    """kvserve's series as this process's engine writes them: each attribute is the series of the same name in
    `_Series` with the engine label given, bound once (`.labels(...)` takes the series' other labels, if any). A
    series with no other label is created here, so it is on `/metrics` at 0 from start-up (as an unlabelled series
    would be) rather than from its first increment."""

    def __init__(self, engine: str) -> None:
        twins = _deprecated_twins()
        for name, series in vars(_series()).items():
            bound = _bound(series, engine)
            twin = twins.get(served_name(series))
            setattr(self, name, bound if twin is None else _Mirrored(bound, _bound(twin, engine)))

    def record_compaction(self, policy: str, tokens: int, blocks: int, bytes_per_block: int) -> None:
        self.tokens_evicted.labels(policy=policy).inc(tokens)
        self.blocks_freed.labels(policy=policy).inc(blocks)
        self.bytes_freed.labels(policy=policy).inc(blocks * bytes_per_block)
        self.evictions.labels(policy=policy).inc()


def _bound(series: MetricWrapperBase, engine: str):
    """The series for `engine`: its child where the engine is its only label, else one that adds the engine."""
    if tuple(series._labelnames) == (ENGINE_LABEL,):
        return series.labels(engine=engine)
    return _EngineSeries(series, engine)


class _Mirrored:
    """A renamed series and its deprecated twin, written together, so the old name serves the same values."""

    def __init__(self, *targets) -> None:
        self._targets = targets

    def labels(self, **labels: str) -> _Mirrored:
        return _Mirrored(*(target.labels(**labels) for target in self._targets))

    def inc(self, amount: float = 1) -> None:
        for target in self._targets:
            target.inc(amount)

    def dec(self, amount: float = 1) -> None:
        for target in self._targets:
            target.dec(amount)

    def set(self, value: float) -> None:
        for target in self._targets:
            target.set(value)

    def observe(self, value: float) -> None:
        for target in self._targets:
            target.observe(value)


class _EngineSeries:
    def __init__(self, series, engine: str) -> None:
        self._series = series
        self._engine = engine

    def labels(self, **labels: str):
        return self._series.labels(engine=self._engine, **labels)


_engine = "0"


def set_engine(index: int) -> None:
    """This process counts for data-parallel engine `index` (vLLM's `data_parallel_index`, its `engine` label)."""
    global _engine
    _engine = str(index)
    _metrics(_engine)


@cache
def _series() -> _Series:
    return _Series()


def served_name(series: MetricWrapperBase) -> str:
    """The name `/metrics` shows: prometheus_client declares a counter without the `_total` its samples carry."""
    return series._name + "_total" if series._type == "counter" else series._name


def registered_series() -> list[MetricWrapperBase]:
    """Every kvserve series this process declares, deprecated twins included."""
    return [*vars(_series()).values(), *_deprecated_twins().values()]


@cache
def _deprecated_twins() -> dict[str, MetricWrapperBase]:
    """New served name -> the same series declared under its old name (DEPRECATED_METRICS)."""
    by_name = {served_name(series): series for series in vars(_series()).values()}
    twins = {}
    for old, new in DEPRECATED_METRICS.items():
        series = by_name[new]
        kind = type(series)
        options = {}
        if kind is Gauge:
            options["multiprocess_mode"] = series._multiprocess_mode
        elif kind is Histogram:
            options["buckets"] = series._upper_bounds
        declared = old.removesuffix("_total") if kind is Counter else old
        help_text = DEPRECATED_HELP.format(new=new) + series._documentation
        twins[new] = kind(declared, help_text, list(series._labelnames), **options)
    return twins


@cache
def _metrics(engine: str) -> Metrics:
    return Metrics(engine)


def metrics() -> Metrics:
    return _metrics(_engine)


def read_new_metric_files_as_empty() -> None:
    """prometheus_client creates a process's metric file empty and sizes it a moment later (`MmapedDict.__init__`);
    a `/metrics` scrape that read it in between raised `struct.error` and answered nothing at all (seen: a worker of a
    tensor-parallel kvserve server, while the bench scraped; prometheus/client_python issue 1199). After this, a file
    of fewer than 4 bytes reads as one with nothing recorded yet, as a sized file of zeros already does; a file that
    has its size reads as before. Installed in every vLLM process by the plugin (the API server collects)."""
    from prometheus_client.mmap_dict import MmapedDict

    read = MmapedDict.read_all_values_from_file
    if getattr(read, "reads_new_files_as_empty", False):
        return

    def read_all_values_from_file(filename: str):
        with open(filename, "rb") as head:
            if len(head.read(4)) < 4:  # being created: sized next, nothing written yet
                return iter(())
        return read(filename)

    read_all_values_from_file.reads_new_files_as_empty = True
    read_all_values_from_file.unguarded = read  # prometheus_client's own reader (the test compares with it)
    MmapedDict.read_all_values_from_file = staticmethod(read_all_values_from_file)
