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


def test_the_plugin_checks_the_table_before_it_patches_anything():
    """In a fresh process (the plugin patches once per process): a point written for other parameters stops
    `apply()` with its name and the installed version, and nothing is patched."""
    import subprocess
    import sys

    script = """
import dataclasses, vllm
from vllm.config.scheduler import SchedulerConfig
from kvserve.vllm import patches, points
original = SchedulerConfig.get_scheduler_cls
points.POINTS = tuple(
    dataclasses.replace(p, signature="(self, moved)") if p.name == "scheduler_choice" else p for p in points.POINTS
)
try:
    patches.apply()
except RuntimeError as error:
    assert SchedulerConfig.get_scheduler_cls is original, "patched before the check"
    print("REFUSED", vllm.__version__, error)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    import vllm

    refused = done.stdout[done.stdout.index("REFUSED") :]
    assert f"REFUSED {vllm.__version__}" in refused and "scheduler_choice" in refused and "(self, moved)" in refused


def test_the_engine_core_serves_unreadable_settings_without_eviction_instead_of_failing():
    from kvserve.vllm.scheduler import EvictingScheduler

    def request(wire) -> SimpleNamespace:
        return SimpleNamespace(request_id="r", sampling_params=SimpleNamespace(extra_args={SETTINGS_KEY: wire}))

    assert EvictingScheduler._settings_of(None, request({"policy": "snapkv"})) == KVConfig()
    config = parse_kv_config({"kv_policy": "tova", "kv_budget": 64}, defaults={})
    assert EvictingScheduler._settings_of(None, request(config.to_wire())) == config
