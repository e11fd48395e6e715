"""Where the engine's time goes, by phase, as the Prometheus counter `kvserve:engine_seconds_total{phase}`.

- `schedule`: the scheduler's `schedule()` (vLLM's plus kvserve's compaction plan);
- `worker`: the worker's whole step (`execute_model` + `sample_tokens`); the phases below are inside it;
- `attention`: vLLM's CPU attention ops (cache write and attention) through kvserve's backend;
- `statistics`: what policies measure and accumulate after attention (scores, window queries, gates);
- `compaction`: choosing the kept entries and moving them (`Policy.select` and the page moves);
- `pages`: page-list bookkeeping before and after the forward (appends, tables, releasing blocks).

The model's own layers are `worker` minus the other four. Times add up in plain floats during a step and are
published once per step (`publish`), so timing a layer costs no more than a clock read.
"""

from __future__ import annotations

import time

PHASES = ("schedule", "worker", "attention", "statistics", "compaction", "pages")
INSIDE_WORKER = ("attention", "statistics", "compaction", "pages")  # kvserve's and vLLM attention's, within `worker`
_pending = dict.fromkeys(PHASES, 0.0)


def seconds(phase: str) -> float:
    """Seconds added to `phase` since the last `publish`."""
    return _pending[phase]


def add(phase: str, elapsed: float) -> None:
    _pending[phase] += elapsed


class timed:  # noqa: N801 - used as `with phases.timed(phase):`, like a function
    """Adds the block's seconds to `phase`, however it ends. A class, not a generator context manager: it runs
    several times per layer of every step, and a generator's set-up cost was visible in a rank's profile."""

    __slots__ = ("phase", "start")

    def __init__(self, phase: str) -> None:
        self.phase = phase

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, *exc_info: object) -> None:
        _pending[self.phase] += time.perf_counter() - self.start


def publish() -> None:
    """Add the pending seconds to the counter and start again."""
    from kvserve.metrics import metrics

    counter = metrics().engine_seconds
    for phase, seconds in _pending.items():
        if seconds:
            counter.labels(phase=phase).inc(seconds)
            _pending[phase] = 0.0


def model_seconds(phase_seconds: dict[str, float]) -> float:
    """The model's own layers' seconds in a run's `phase_seconds`: the worker's less the phases inside it."""
    return phase_seconds["worker"] - sum(phase_seconds[phase] for phase in INSIDE_WORKER)
