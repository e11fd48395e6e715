"""The vLLM boundary's own contracts, with no engine: the table of vLLM points and its start-up check, the settings
written once at vLLM's input validation and read by the engine core, and the step messages on vLLM's objects."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from kvserve.config import SETTINGS_KEY, KVConfig, parse_kv_config, settings_from
from kvserve.errors import InvalidSetting
from kvserve.messages import StepPlan, StepReport
from kvserve.vllm import points
from kvserve.vllm.carriers import attach_plan, plan_of, report_of, with_report


def test_every_point_matches_the_installed_vllm():
    import vllm

    points.check(points.POINTS, vllm.__version__)
    assert len({point.name for point in points.POINTS}) == len(points.POINTS)
    assert {point.how for point in points.POINTS} == {"wrapped", "overridden", "called"}


def test_a_point_that_moved_stops_kvserve_naming_it_and_the_version():
    good = points.POINTS[0]
    changed = points.Point("scheduler_choice", good.target, "(self, extra)", "wrapped", "here")
    gone = points.Point("gone", "vllm.v1.core.sched.scheduler:Scheduler.no_such_method", "(self)", "called", "here")
    with pytest.raises(RuntimeError) as error:
        points.check([good, changed, gone], "9.9.9")
    message = str(error.value)
    assert "vLLM 9.9.9" in message and "2 of the vLLM functions" in message
    assert "scheduler_choice" in message and "written for (self, extra)" in message
    assert "gone (vllm.v1.core.sched.scheduler:Scheduler.no_such_method): not found" in message


SENTINEL = object()


def test_signatures_are_written_without_annotations_or_object_defaults():
    import enum

    class Kind(enum.Enum):
        A = 1

    def function(a: int, b=None, *rest, c: str = "x", kind=Kind.A, thing=SENTINEL, **more) -> None: ...

    def keyword_only(a, *, b): ...

    assert points.signature_of(function) == "(a, b=None, *rest, c='x', kind=Kind.A, thing=..., **more)"
    assert points.signature_of(keyword_only) == "(a, *, b)"


@pytest.mark.parametrize(
    "asked",
    [
        {"kv_policy": "snapkv", "kv_budget": 256, "kv_span": 8},
        {"kv_policy": "tova", "kv_budget": 64, "kv_checkpoint": "turns"},
        {"kv_policy": "streamingllm", "kv_budget": 96, "kv_sink_tokens": 4},
        {"kv_policy": "expected_attention", "kv_budget": 512, "kv_evict_when": "pressure"},
        {"kv_policy": "attention_gate", "kv_tau": 0.3},
        {},
    ],
)
def test_settings_travel_to_the_engine_core_as_validated(asked):
    config = parse_kv_config(asked, defaults={})
    wire = json.loads(json.dumps(config.to_wire()))  # as plain values across processes (tuples become lists)
    params = SimpleNamespace(extra_args={**asked, SETTINGS_KEY: wire})
    assert settings_from(params) == config
    assert repr(settings_from(params)) == repr(config)  # checkpoint keys hash the settings' repr


def test_the_engine_core_reads_no_settings_a_request_was_not_validated_with():
    assert settings_from(SimpleNamespace(extra_args={"kv_policy": "snapkv", "kv_budget": 64})) == KVConfig()
    assert settings_from(None) == KVConfig()
    with pytest.raises(InvalidSetting) as error:
        settings_from(SimpleNamespace(extra_args={SETTINGS_KEY: {"policy": "snapkv"}}))
    assert error.value.field == SETTINGS_KEY


def test_a_request_is_parsed_once_by_the_front_end_checks(monkeypatch):
    import contextvars

    from kvserve import model_support

    parsed = []
    real = model_support.parse_kv_config
    monkeypatch.setattr(model_support, "parse_kv_config", lambda args: parsed.append(args) or real(args, {}))
    model = SimpleNamespace(
        model="m", max_model_len=2048, hf_text_config=SimpleNamespace(), get_total_num_hidden_layers=lambda: 2
    )
    model.is_attention_free = model.is_hybrid = model.use_mla = model.is_encoder_decoder = False
    engine = model_support.ServedEngine(model, block_size=32)
    asked = {"kv_policy": "snapkv", "kv_budget": "256", "max_tokens": 4}

    def one_http_request(args: dict) -> tuple[KVConfig, KVConfig]:
        checked = model_support.served_settings(args, engine, remember=True)  # the HTTP middleware
        return checked, model_support.served_settings(dict(args), engine)  # vLLM's input validation, later

    checked, validated = contextvars.copy_context().run(one_http_request, asked)
    assert validated is checked and len(parsed) == 1
    contextvars.copy_context().run(one_http_request, asked)  # the next request: parsed again, in its own context
    assert len(parsed) == 2
    model_support.served_settings(asked, engine)  # offline: no middleware, the validation parses
    model_support.served_settings(asked, engine)
    assert len(parsed) == 4
    with pytest.raises(InvalidSetting):
        model_support.served_settings({"kv_policy": "snapkv", "kv_budget": "4096"}, engine)  # > max_model_len


def test_step_messages_ride_on_vllms_step_objects():
    output = SimpleNamespace()
    assert plan_of(output) == StepPlan()
    plan = StepPlan(admitted={"r": KVConfig()})
    attach_plan(output, plan)
    assert plan_of(output) is plan
    shared = SimpleNamespace(sampled=[])
    assert with_report(shared, StepReport()) is shared  # nothing to say: the output as it was
    report = StepReport(failures={"r": "boom"})
    marked = with_report(shared, report)
    assert report_of(marked) is report and report_of(shared) == StepReport()  # never a shared constant


def test_every_vllm_method_kvserve_overrides_is_in_the_table():
    from kvserve.vllm.attention import KVServeAttentionImpl
    from kvserve.vllm.backend import KVServeAttentionBackend, KVServeAttentionMetadataBuilder
    from kvserve.vllm.kernel_attention import KVServeKernelAttentionImpl
    from kvserve.vllm.kv_cache_manager import EvictingFullAttentionManager
    from kvserve.vllm.scheduler import EvictingScheduler

    listed = {point.target.partition(":")[2] for point in points.POINTS if point.how == "overridden"}
    missing = []
    for subclass in (
        EvictingScheduler,
        EvictingFullAttentionManager,
        KVServeAttentionImpl,
        KVServeKernelAttentionImpl,
        KVServeAttentionMetadataBuilder,
        KVServeAttentionBackend,
    ):
        base = subclass.__mro__[1]
        for name in vars(subclass):
            if callable(getattr(subclass, name)) and hasattr(base, name) and name not in ("__init_subclass__",):
                owner = next(cls for cls in base.__mro__ if name in vars(cls))
                if f"{owner.__name__}.{name}" not in listed and f"{base.__name__}.{name}" not in listed:
                    missing.append(f"{subclass.__name__}.{name}")
    assert missing == []


def _fresh_process(setup: str, then: str) -> str:
    """Runs `setup` then `then` in a new Python process (the plugin patches once per process); its output."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", setup + "\n" + then], capture_output=True, text=True, timeout=300, env=_without_warned()
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout + done.stderr


def _without_warned() -> dict:
    import os

    from kvserve.vllm.patches import INACTIVE_ENV

    return {key: value for key, value in os.environ.items() if key != INACTIVE_ENV}


MOVED_POINT = """
import dataclasses
from kvserve.vllm import points
points.POINTS = tuple(
    dataclasses.replace(p, signature="(self, moved)") if p.name == "scheduler_choice" else p for p in points.POINTS
)
"""
OTHER_VERSION = "import vllm\nvllm.__version__ = '0.33.1'"
OTHER_PLATFORM = "from vllm.platforms import current_platform\ncurrent_platform.is_cpu = lambda: False"
APPLY = """
from vllm.config.scheduler import SchedulerConfig
from kvserve.vllm import patches
original = SchedulerConfig.get_scheduler_cls
patches.apply()
patches._applied = False
patches.apply()  # another load of the plugin in the same process tree says nothing more
assert SchedulerConfig.get_scheduler_cls is original, "patched although inactive"
print("NOT PATCHED")
"""


@pytest.mark.parametrize(
    ("setup", "named"),
    [(MOVED_POINT, "scheduler_choice"), (OTHER_VERSION, "found 0.33.1"), (OTHER_PLATFORM, "CPU platform only")],
    ids=["moved point", "other vLLM release", "other platform"],
)
def test_where_kvserve_cannot_evict_the_plugin_stays_inactive_and_says_why_once(setup, named):
    """vLLM loads the plugin in every process: where kvserve cannot evict (a moved point, another release, a GPU
    platform) it patches nothing, so vanilla vLLM serves, and warns once with the reason."""
    printed = _fresh_process(setup, APPLY)
    assert "NOT PATCHED" in printed
    assert printed.count("kvserve is installed but inactive") == 1 and named in printed


def test_kvserve_serve_refuses_to_start_where_it_cannot_evict():
    printed = _fresh_process(
        OTHER_VERSION,
        "from kvserve.server import launch\ntry:\n    launch.main(['--port', '0'])\nexcept SystemExit as e:\n"
        "    print('EXIT', e)",
    )
    assert "EXIT kvserve serve: eviction is not available here" in printed and "found 0.33.1" in printed


def test_the_engine_core_serves_unreadable_settings_without_eviction_instead_of_failing():
    from kvserve.vllm.scheduler import EvictingScheduler

    def request(wire) -> SimpleNamespace:
        return SimpleNamespace(request_id="r", sampling_params=SimpleNamespace(extra_args={SETTINGS_KEY: wire}))

    assert EvictingScheduler._settings_of(None, request({"policy": "snapkv"})) == KVConfig()
    config = parse_kv_config({"kv_policy": "tova", "kv_budget": 64}, defaults={})
    assert EvictingScheduler._settings_of(None, request(config.to_wire())) == config
