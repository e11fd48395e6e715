"""`kvserve calibrate` and the profiles `kvserve serve` uses: the recommendation rule against its definition, a profile
found / used / overridden / refused (corrupt, foreign, another model, another kvserve version), and the command end
to end on a tiny model of the test matrix, whose profile then serves duoattention and sets the server's default."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from itertools import product
from pathlib import Path

import httpx
import pytest
import torch

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
from kvserve.tools.bench.servers import running_server
from kvserve.tools.bench.tiny_models import tiny_model
from kvserve.tools.calibrate.check import CheckPlan, SettingResult, recommend


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


def make_profile(model_dir: Path, recommended: dict | None, layers: int = 4, heads: int = 2) -> Profile:
    gates = torch.rand(layers, heads, generator=torch.Generator().manual_seed(0))
    profile = Profile(model_dir.name, fingerprint(model_dir), ProfileRoles(gates, 16, 64), {"method": "t"})
    profile.check = {"recommended": {"0.95": recommended, "0.9": recommended}, "results": []}
    return profile


RECOMMENDED = {"kv_policy": "tova", "kv_budget": 96, "kv_span": 8, "share": 0.96, "interval": [0.8, 0.99]}


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


@pytest.mark.parametrize("damage", ["corrupt", "foreign", "other model", "other weights", "other version", "bad roles"])
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
        else:
            record["roles"]["gates"][0][0] = 7.0
        path.write_text(json.dumps(record))
    env = {CHOICE_ENV: "auto", USER_DEFAULTS_ENV: "0", DEFAULTS_ENV: "{}"}
    with pytest.raises(SystemExit) as refusal:
        apply_profile(str(model_dir), env)
    assert str(path) in str(refusal.value) and reason in str(refusal.value)
    assert PROFILE_ENV not in env
    if damage in ("corrupt", "foreign", "bad roles"):
        with pytest.raises(ProfileError):
            read_profile(path)


@pytest.mark.timeout(1800)  # two server starts and a calibration; a busy 2-core machine took 16 min
def test_calibrate_end_to_end_on_a_tiny_model_and_serve_uses_its_profile(tmp_path, model_dir):
    """The command on the tiny Qwen2 model (query/key/value biases): measured roles of the model's shape, the check's
    rows through its own server, the profile in the profiles folder; then `kvserve serve` finds it by itself,
    serves duoattention with its roles (without a profile the tiny model has none: HTTP 400) and takes its
    recommended setting as the default. The tiny model's noise answers no case, so the check recommends nothing:
    the recommendation is set by hand for the serving half. `--gates` trains (two steps of) an Attention-Gate, which
    the profile carries and the server serves."""
    env = dict(os.environ, **{PROFILES_ENV: str(tmp_path)})
    command = [sys.executable, "-m", "kvserve.cli", "calibrate", str(model_dir), "--roles-samples", "2"]
    command += ["--tasks", "passkey", "--lengths", "400", "--samples", "2", "--policies", "snapkv,duoattention"]
    command += ["--gates", "--gate-steps", "2"]
    done = subprocess.run(
        [*command, "--budgets", "64", "--quiet"], env=env, capture_output=True, text=True, timeout=1200
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "about" in done.stderr and "min on this machine" in done.stderr  # the estimate, before it starts
    path = tmp_path / f"{model_dir.name}.json"
    profile = read_profile(path)
    config = json.loads((model_dir / "config.json").read_text())
    assert profile.roles.gates.shape == (config["num_hidden_layers"], config["num_key_value_heads"])
    assert float(profile.roles.gates.max()) == 1.0 and profile.kvserve == __version__
    rows = [json.loads(line) for line in (tmp_path / f"{model_dir.name}.work" / "check.jsonl").read_text().splitlines()]
    assert {row["policy"] for row in rows} == {"full"} and len(rows) == 2
    assert profile.check["full_answers"] == sum(row["score"] >= 1 for row in rows)
    assert profile.check["recommended"] == {"0.9": None, "0.95": None} and "why_none" in profile.check
    gate_file = tmp_path / profile.gates["file"]
    assert gate_file.exists() and profile.gates["sha256"] == hashlib.sha256(gate_file.read_bytes()).hexdigest()

    record = json.loads(path.read_text())
    record["check"]["recommended"]["0.95"] = RECOMMENDED
    path.write_text(json.dumps(record))
    log = tmp_path / "serve.log"
    with running_server(
        "kvserve", str(model_dir), ["--max-model-len", "1024"], log, env={PROFILES_ENV: str(tmp_path)}
    ) as url:
        text = log.read_text()
        assert f"profile {path}" in text and "server default from the profile" in text
        prompt = "The quick brown fox jumps over the lazy dog. " * 30
        body = {"model": str(model_dir), "prompt": prompt, "max_tokens": 4}
        plain = httpx.post(url + "/v1/completions", json=body, timeout=300)
        assert plain.status_code == 200, plain.text
        assert plain.headers["x-kv-policy-applied"] == "tova"
        assert plain.json()["usage"]["kv_tokens_evicted"] == plain.json()["usage"]["prompt_tokens"] - 96
        duo = httpx.post(url + "/v1/completions", json=body, headers={"x-kv-policy": "duoattention"}, timeout=300)
        assert duo.status_code == 200, duo.text
        assert duo.headers["x-kv-policy-applied"] == "duoattention"
        gated = httpx.post(url + "/v1/completions", json=body, headers={"x-kv-policy": "attention_gate"}, timeout=300)
        assert gated.status_code == 200, gated.text  # the profile's gates (the registry has none for this model)
        assert gated.headers["x-kv-policy-applied"] == "attention_gate"


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
