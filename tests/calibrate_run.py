"""Background run for tests/test_calibrate.py: `kvserve calibrate` end to end on the tiny Qwen2 model of the test
matrix (query/key/value biases), then `kvserve serve` on the same model finding the profile by itself. Writes what
the test checks (the command's exit and stderr, the profile's path and the work folder's rows, the server's log and
three answers) to the JSON file named by argv[1]; the test asserts on it.

The tiny model's noise answers no case, so the check recommends nothing: the serving half sets the recommendation by
hand (RECOMMENDED) before the server starts.

    python tests/calibrate_run.py OUT.json
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

from kvserve.profile import PROFILES_ENV
from kvserve.tools.bench.servers import running_server
from kvserve.tools.bench.tiny_models import tiny_model

RECOMMENDED = {"kv_policy": "tova", "kv_budget": 96, "kv_span": 8, "share": 0.96, "interval": [0.8, 0.99]}
PROMPT = "The quick brown fox jumps over the lazy dog. " * 30


def calibrate(model_dir: Path, profiles: Path) -> dict:
    command = [sys.executable, "-m", "kvserve.cli", "calibrate", str(model_dir), "--roles-samples", "2"]
    command += ["--tasks", "passkey", "--lengths", "400", "--samples", "2", "--policies", "snapkv,duoattention"]
    command += ["--gates", "--gate-steps", "2", "--kvzap", "--kvzap-texts", "4", "--budgets", "64", "--quiet"]
    env = dict(os.environ, **{PROFILES_ENV: str(profiles)})
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1200)
    rows = profiles / f"{model_dir.name}.work" / "check.jsonl"
    return {
        "returncode": done.returncode,
        "stderr": done.stderr[-6000:],
        "rows": [json.loads(line) for line in rows.read_text().splitlines()] if rows.exists() else [],
    }


def serve(model_dir: Path, profiles: Path, profile: Path) -> dict:
    record = json.loads(profile.read_text())
    record["check"]["recommended"]["0.95"] = RECOMMENDED
    profile.write_text(json.dumps(record))
    log = profiles / "serve.log"
    answers = {}
    env = {PROFILES_ENV: str(profiles)}
    with running_server("kvserve", str(model_dir), ["--max-model-len", "1024"], log, env) as url:
        body = {"model": str(model_dir), "prompt": PROMPT, "max_tokens": 4}
        for name in ("plain", "duoattention", "attention_gate"):
            headers = {} if name == "plain" else {"x-kv-policy": name}
            answers[name] = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=300)
    return {
        "log": "\n".join(line for line in log.read_text().splitlines() if line.startswith("kvserve")),
        "answers": {
            name: {
                "status": response.status_code,
                "text": response.text[-2000:],
                "applied": response.headers.get("x-kv-policy-applied"),
                "usage": response.json().get("usage") if response.status_code == 200 else None,
            }
            for name, response in answers.items()
        },
    }


def main(out: str) -> None:
    model_dir = tiny_model("qwen2")
    profiles = Path(tempfile.mkdtemp(prefix="kvserve-calibrate-run-"))
    profile = profiles / f"{model_dir.name}.json"
    result = {"model_dir": str(model_dir), "profile": str(profile), "calibrate": calibrate(model_dir, profiles)}
    if result["calibrate"]["returncode"] == 0 and profile.exists():
        result["profile_json"] = json.loads(profile.read_text())  # as calibrate wrote it, before the hand edit
        gates = result["profile_json"].get("gates") or {}
        result["gate_file"] = str(profiles / gates["file"]) if gates.get("file") else None
        kvzap = result["profile_json"].get("kvzap") or {}
        result["kvzap_file"] = str(profiles / kvzap["file"]) if kvzap.get("file") else None
        result["serve"] = serve(model_dir, profiles, profile)
    Path(out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
