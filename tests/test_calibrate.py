"""`kvserve calibrate` and the profiles `kvserve serve` uses: the recommendation rule against its definition, a profile
found / used / overridden / refused (corrupt, foreign, another model, another kvserve version), and the command end
to end on a tiny model of the test matrix, whose profile then serves duoattention and attention_gate and sets the
server's default (that run is in the background: tests/calibrate_run.py)."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import subprocess
import sys
from itertools import product
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from background import Run
from calibrate_run import RECOMMENDED

from kvserve import __version__
from kvserve.config import DEFAULTS_ENV
from kvserve.profile import (
    PROFILE_ENV,
    PROFILES_ENV,
    Profile,
    ProfileError,
    ProfileRoles,
    fingerprint,
    read_profile,
)
from kvserve.server.profile import CHOICE_ENV, TARGET_ENV, USER_DEFAULTS_ENV, apply_profile
from kvserve.tools.bench.tiny_models import tiny_model
from kvserve.tools.calibrate import check
from kvserve.tools.calibrate.check import CheckPlan, SettingResult, case_count, expected_requests, recommend
from kvserve.tools.calibrate.command import SERVED_PER_REFERENCE, estimate, requests_left

TESTS = Path(__file__).parent
RECORDED = TESTS.parent / "docs" / "eval" / "qwen05" / "calibrate.json"


def result(policy: str, budget: int, correct: int, answered: int = 10, complete: bool = True) -> SettingResult:
    return SettingResult(f"{policy}/span8", policy, budget, 8, {}, answered, correct, complete)


def test_recommendation_is_the_least_memory_setting_reaching_each_target():
    results = [
        result("snapkv", 128, 8),
        result("snapkv", 256, 10),
        result("tova", 128, 9),
        result("tova", 256, 10),
        result("h2o", 128, 3, answered=4, complete=False),  # stopped early: never recommended
    ]
    order = ["snapkv", "tova", "h2o"]
    chosen = recommend(results, (0.8, 0.9, 0.95), order)
    for target, setting in chosen.items():  # the definition, checked over every result
        reaching = [r for r in results if r.complete and r.share >= float(target)]
        assert setting["kv_budget"] == min(r.budget for r in reaching)
        best_share = max(r.share for r in reaching if r.budget == setting["kv_budget"])
        assert setting["share"] == best_share
    # a tie in budget and share goes to the earlier policy of the plan
    tied = recommend([result("tova", 128, 9), result("snapkv", 128, 9)], (0.9,), order)
    assert tied["0.9"]["kv_policy"] == "snapkv"
    assert recommend(results, (1.0,), order)["1"]["kv_budget"] == 256
    assert recommend([result("snapkv", 128, 5)], (0.9,), order) == {"0.9": None}


def test_a_plan_runs_each_policys_budgets_in_ascending_order():
    plan = CheckPlan(policies=("snapkv", "streamingllm"), budgets=(512, 128, 256), spans=(8,))
    settings = plan.settings()
    assert [(s.policy, s.budget, s.span) for s in settings] == [
        (p, b, 8 if p == "snapkv" else 1) for p, b in product(("snapkv", "streamingllm"), (128, 256, 512))
    ]
    assert plan.requests() == (1 + len(settings)) * len(plan.tasks) * len(plan.lengths) * plan.samples


class SimulatedPlan(CheckPlan):
    """A plan whose cases need no tokenizer: the simulation below only reads their keys."""

    def cases(self, tokenizer) -> list:
        return [SimpleNamespace(key=("t", 100, index, 0)) for index in range(case_count(self))]


def test_expected_requests_is_the_mean_of_the_checks_own_stopping_rule(monkeypatch):
    """`expected_requests` against `run_check` itself: each setting answers with its own miss rate drawn uniformly
    (the expectation's assumption), and the requests the server answers, averaged over many checks, are the
    expectation (the full cache answers every case right)."""
    plan = SimulatedPlan(tasks=("a", "b"), samples=4, policies=("snapkv", "streamingllm"), budgets=(64, 128, 256))
    rng = random.Random(0)
    miss_rate: dict = {}

    def answer(server, setting, case) -> dict:
        if setting.policy == "full":
            miss_rate.clear()  # a new check: new settings
        rate = miss_rate.setdefault(setting, rng.random()) if setting.policy != "full" else 0.0
        row = {"policy": setting.label, "budget": setting.budget, "task": "t", "length": 100, "index": case.key[2]}
        return {**row, "seed": 0, "score": float(rng.random() >= rate)}

    monkeypatch.setattr(check, "answer", answer)
    monkeypatch.setattr(check, "append_row", lambda path, row: None)  # every simulated check starts afresh
    checks, served = 4000, []
    for _ in range(checks):
        run_check_served = []
        check.run_check(None, plan, None, Path("/nonexistent"), served=run_check_served.append)
        served.append(len(run_check_served))
    mean = sum(served) / checks
    assert abs(mean - expected_requests(plan)) < 0.03 * expected_requests(plan), (mean, expected_requests(plan))
    assert expected_requests(plan) < plan.requests()
    assert expected_requests(plan, kept=0) == case_count(plan)  # nothing kept: every setting is skipped


def recorded_plan(record: dict) -> CheckPlan:
    return CheckPlan(**{key: tuple(v) if isinstance(v, list) else v for key, v in record["check"]["plan"].items()})


def test_the_estimate_of_the_recorded_qwen_calibration_is_within_2x_of_its_time():
    """The recorded Qwen2.5-Coder-0.5B calibration, fed its own measured time per request (its seconds over the
    requests it sent, counted from its results), estimated from its plan: within 2x of the time it took, where the
    upper bound of requests was not."""
    record = json.loads(RECORDED.read_text())
    measured, plan = record["check"], recorded_plan(record)
    sent = measured["cases"] + sum(result["answered"] for result in measured["results"])
    per_request = measured["seconds"] / sent  # roles and start-up included: an upper bound of a request's time
    # the probe's time per token that predicts that served request (the estimate's own relation, inverted)
    per_token = per_request / (sum(plan.lengths) / len(plan.lengths) * SERVED_PER_REFERENCE)
    args = argparse.Namespace(roles_samples=measured["roles_samples"], gates=False, gate_steps=0, kvzap=False)
    estimated = sum(estimate(args, plan, per_token).values())
    assert 0.5 <= estimated / measured["seconds"] <= 2, (estimated, measured["seconds"])
    assert 0.5 <= expected_requests(plan) / sent <= 2
    upper_bound = estimated + (plan.requests() - expected_requests(plan)) * per_request
    assert upper_bound / measured["seconds"] > 2  # what the estimate said before: this test tells them apart


def test_the_revised_estimate_counts_the_requests_still_expected():
    plan = CheckPlan(tasks=("passkey",), samples=4, policies=("snapkv",), budgets=(64, 128))
    full = [{"policy": "full", "score": score} for score in (1.0, 1.0, 0.0, 1.0)]
    assert requests_left(plan, full) == expected_requests(plan, kept=3) - 4  # the full cache answered 3 of 4
    assert requests_left(plan, full[:2]) == expected_requests(plan) - 2  # how many it answers: not known yet
    answered = full + [{"policy": "snapkv/span8", "score": 1.0}] * 20
    assert requests_left(plan, answered) == 0  # more than expected already: none left, not fewer than none


def make_profile(model_dir: Path, recommended: dict | None, layers: int = 4, heads: int = 2) -> Profile:
    gates = torch.rand(layers, heads, generator=torch.Generator().manual_seed(0))
    profile = Profile(model_dir.name, fingerprint(model_dir), ProfileRoles(gates, 16, 64), {"method": "t"})
    profile.check = {"recommended": {"0.95": recommended, "0.9": recommended}, "results": []}
    return profile


@pytest.fixture
def model_dir() -> Path:
    return tiny_model("qwen2")


def test_a_profile_is_found_and_its_recommendation_becomes_the_default(tmp_path, monkeypatch, model_dir):
    monkeypatch.setenv(PROFILES_ENV, str(tmp_path))
    path = tmp_path / f"{model_dir.name}.json"
    make_profile(model_dir, RECOMMENDED).save(path)
    env = {CHOICE_ENV: "auto", USER_DEFAULTS_ENV: "0", DEFAULTS_ENV: json.dumps({"kv_policy": "snapkv"})}
    apply_profile(str(model_dir), env)
    assert env[PROFILE_ENV] == str(path)
    assert json.loads(env[DEFAULTS_ENV]) == {k: v for k, v in RECOMMENDED.items() if k.startswith("kv_")}
    assert read_profile(path).roles.gates.shape == (4, 2)


def test_eviction_defaults_on_the_command_line_win_over_the_profile(tmp_path, monkeypatch, model_dir):
    monkeypatch.setenv(PROFILES_ENV, str(tmp_path))
    make_profile(model_dir, RECOMMENDED).save(tmp_path / f"{model_dir.name}.json")
    given = json.dumps({"kv_policy": "snapkv", "kv_budget": 300})
    env = {CHOICE_ENV: "auto", USER_DEFAULTS_ENV: "1", DEFAULTS_ENV: given}
    apply_profile(str(model_dir), env)
    assert env[DEFAULTS_ENV] == given and PROFILE_ENV in env  # roles still served; the default is the user's
    env = {CHOICE_ENV: "none", USER_DEFAULTS_ENV: "0", DEFAULTS_ENV: given, PROFILE_ENV: "stale"}
    apply_profile(str(model_dir), env)
    assert env[DEFAULTS_ENV] == given and PROFILE_ENV not in env
    env = {CHOICE_ENV: "auto", USER_DEFAULTS_ENV: "0", DEFAULTS_ENV: given, TARGET_ENV: "0.99"}
    make_profile(model_dir, None).save(tmp_path / f"{model_dir.name}.json")  # no setting reaches the target
    apply_profile(str(model_dir), env)
    assert env[DEFAULTS_ENV] == given


def test_duoattention_roles_come_from_the_served_profile(tmp_path, monkeypatch, model_dir):
    from kvserve import profile as profiles
    from kvserve.duo.roles import HeadRoles as Roles

    monkeypatch.delenv(PROFILE_ENV, raising=False)
    with pytest.raises(ValueError, match="kvserve calibrate"):  # no shipped roles for the tiny model
        Roles.for_model(str(model_dir), 2)
    path = tmp_path / "profile.json"
    made = make_profile(model_dir, None)
    made.save(path)
    monkeypatch.setenv(PROFILE_ENV, str(path))
    profiles._served_profile.cache_clear()
    assert torch.equal(Roles.for_model(str(model_dir), 2).gates, read_profile(path).roles.gates)
    with pytest.raises(ValueError, match="holds roles for 2 KV heads"):
        Roles.for_model(str(model_dir), 3)
    assert profiles.served_profile("another-model") is None  # a profile serves only its own model


def test_the_kvzap_surrogate_comes_from_the_served_profile_and_only_for_its_model(tmp_path, monkeypatch, model_dir):
    from kvserve import profile as profiles
    from kvserve.kvzap import registry
    from kvserve.kvzap.surrogate import Surrogate, SurrogateSet, model_identity

    monkeypatch.delenv(PROFILE_ENV, raising=False)
    registry.checked_surrogates.cache_clear()
    with pytest.raises(registry.NoSurrogateError, match="kvserve calibrate"):  # none shipped for the tiny model
        registry.checked_surrogates(str(model_dir))
    config = json.loads((model_dir / "config.json").read_text())
    inputs = config["hidden_size"]  # query heads x head size (the tiny models' queries span the hidden size)
    layers = [Surrogate(inputs, config["num_key_value_heads"], None) for _ in range(config["num_hidden_layers"])]
    path, surrogate_file = tmp_path / "profile.json", tmp_path / "profile.kvzap-linear.safetensors"
    SurrogateSet("linear", model_identity(model_dir), layers).save(surrogate_file)
    made = make_profile(model_dir, None)
    made.kvzap = {"file": surrogate_file.name, "kind": "linear"}
    made.save(path)
    monkeypatch.setenv(PROFILE_ENV, str(path))
    profiles._served_profile.cache_clear()
    try:
        served = registry.checked_surrogates(str(model_dir))
        assert len(served.layers) == config["num_hidden_layers"] and served.model == model_identity(model_dir)
        other = {**model_identity(model_dir), "q_proj_digest": "0" * 16}  # the same shape, other weights
        SurrogateSet("linear", other, layers).save(surrogate_file)
        registry.checked_surrogates.cache_clear()
        with pytest.raises(registry.NoSurrogateError, match="differ in q_proj_digest"):
            registry.checked_surrogates(str(model_dir))
    finally:
        registry.checked_surrogates.cache_clear()
        profiles._served_profile.cache_clear()


@pytest.mark.parametrize(
    "damage", ["corrupt", "foreign", "other model", "other weights", "other version", "bad roles", "bad setting"]
)
def test_a_bad_profile_is_refused_naming_the_file_and_the_reason(tmp_path, monkeypatch, model_dir, damage):
    monkeypatch.setenv(PROFILES_ENV, str(tmp_path))
    path = tmp_path / f"{model_dir.name}.json"
    make_profile(model_dir, RECOMMENDED).save(path)
    record = json.loads(path.read_text())
    reason = {
        "corrupt": "not a kvserve profile",
        "foreign": "not a kvserve profile",
        "other model": "made for model 'llama'",
        "other weights": "config.json or weight files differ",
        "other version": "made by kvserve 0.0.1",
        "bad roles": "not a kvserve profile",
        "bad setting": "needs a numeric share",
    }[damage]
    if damage == "corrupt":
        path.write_text(path.read_text()[:40])
    elif damage == "foreign":
        path.write_text(json.dumps({"model": model_dir.name, "gates": []}))
    else:
        if damage == "other model":
            record["model"] = "llama"
        elif damage == "other weights":
            record["fingerprint"]["config_sha256"] = "0" * 64
        elif damage == "other version":
            record["kvserve"] = "0.0.1"
        elif damage == "bad roles":
            record["roles"]["gates"][0][0] = 7.0
        else:  # a recommendation without the share it kept: refused at start-up, not a KeyError later
            del next(iter(record["check"]["recommended"].values()))["share"]
        path.write_text(json.dumps(record))
    env = {CHOICE_ENV: "auto", USER_DEFAULTS_ENV: "0", DEFAULTS_ENV: "{}"}
    with pytest.raises(SystemExit) as refusal:
        apply_profile(str(model_dir), env)
    assert str(path) in str(refusal.value) and reason in str(refusal.value)
    assert PROFILE_ENV not in env
    if damage in ("corrupt", "foreign", "bad roles", "bad setting"):
        with pytest.raises(ProfileError):
            read_profile(path)


def background_runs() -> list[Run]:
    # two server starts and a calibration (~3-5 min): beside the in-process engine's tests, not in their way
    argv = [sys.executable, str(TESTS / "calibrate_run.py"), "{out}"]
    return [Run("calibrated", argv, {"VLLM_CPU_KVCACHE_SPACE": "1"}, timeout_s=1800)]  # 1 GiB: a tiny model's cache


@pytest.fixture(scope="module")
def calibrated(background) -> dict:
    (result,) = background.results("calibrated")
    return result


def test_calibrate_end_to_end_on_a_tiny_model(calibrated, tmp_path):
    """The command on the tiny Qwen2 model (query/key/value biases): the estimate before it starts and the revised
    one from the server's first answers, measured roles of the model's shape, the check's rows through its own
    server, (two steps of) an Attention-Gate, KVzap's surrogate, the profile in the profiles folder. The tiny model's
    noise answers no case, so the check recommends nothing and says why."""
    run = calibrated["calibrate"]
    assert run["returncode"] == 0, run["stderr"]
    assert "about" in run["stderr"] and "min on this machine" in run["stderr"]  # the estimate, before it starts
    assert "revised: about" in run["stderr"] and "min left" in run["stderr"]  # and once the server answered
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(calibrated["profile_json"]))
    profile = read_profile(path)
    model_dir = Path(calibrated["model_dir"])
    config = json.loads((model_dir / "config.json").read_text())
    assert profile.roles.gates.shape == (config["num_hidden_layers"], config["num_key_value_heads"])
    assert float(profile.roles.gates.max()) == 1.0 and profile.kvserve == __version__
    assert profile.fingerprint == fingerprint(model_dir)
    assert profile.check["estimated_seconds"] > 0 and profile.check["revised_estimated_seconds"] > 0
    rows = run["rows"]
    assert {row["policy"] for row in rows} == {"full"} and len(rows) == 2
    assert profile.check["full_answers"] == sum(row["score"] >= 1 for row in rows)
    assert profile.check["recommended"] == {"0.9": None, "0.95": None} and "why_none" in profile.check
    gate_file = Path(calibrated["gate_file"])
    assert gate_file.exists() and profile.gates["sha256"] == hashlib.sha256(gate_file.read_bytes()).hexdigest()
    # KVzap's surrogate beside it, loadable for this model, its held-out fit recorded
    from kvserve.tools.training.kvzap import SurrogateSet

    kvzap_file = Path(calibrated["kvzap_file"])
    assert profile.kvzap["sha256"] == hashlib.sha256(kvzap_file.read_bytes()).hexdigest()
    surrogates = SurrogateSet.load(kvzap_file, model_dir)
    assert len(surrogates.layers) == config["num_hidden_layers"] and profile.kvzap["kind"] == surrogates.kind
    assert set(profile.kvzap["fit"]) == {"r2", "spearman"} and len(surrogates.fit) == len(surrogates.layers)


def test_serve_finds_the_calibrated_profile_and_serves_from_it(calibrated):
    """`kvserve serve MODEL` with no profile flag: it finds the profile, logs it and its recommended setting (set by
    hand: the tiny model's check recommends nothing), a plain request gets that setting, and duoattention and
    attention_gate serve from the profile's roles and gates (without a profile the tiny model has none: HTTP 400)."""
    assert "serve" in calibrated, calibrated["calibrate"]["stderr"]
    served = calibrated["serve"]
    assert f"profile {calibrated['profile']}" in served["log"] and "server default from the profile" in served["log"]
    answers = served["answers"]
    for name, applied in (("plain", RECOMMENDED["kv_policy"]), ("duoattention", None), ("attention_gate", None)):
        answer = answers[name]
        assert answer["status"] == 200, answer["text"]
        assert answer["applied"] == (applied or name)
    usage = answers["plain"]["usage"]
    assert usage["kv_tokens_evicted"] == usage["prompt_tokens"] - RECOMMENDED["kv_budget"]


def test_calibrate_refuses_an_architecture_its_reference_model_does_not_run(tmp_path):
    phi3 = tiny_model("phi3")  # fused projections, another RoPE: not what the reference model implements
    env = dict(os.environ, **{PROFILES_ENV: str(tmp_path)})
    done = subprocess.run(
        [sys.executable, "-m", "kvserve.cli", "calibrate", str(phi3), "--quiet"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode != 0
    assert "runs Llama and Qwen2 checkpoints, not 'phi3'" in done.stderr
    assert not (tmp_path / "phi3.json").exists()


def test_calibrate_refuses_an_unknown_policy_before_anything_runs(tmp_path, model_dir):
    env = dict(os.environ, **{PROFILES_ENV: str(tmp_path)})
    done = subprocess.run(
        [sys.executable, "-m", "kvserve.cli", "calibrate", str(model_dir), "--policies", "snapkv,nosuch"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode != 0 and "unknown policy 'nosuch'" in done.stderr
    assert list(tmp_path.iterdir()) == []
