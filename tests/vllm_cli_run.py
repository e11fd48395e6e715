"""Background run for tests/test_vllm_cli.py: vLLM's own `vllm serve` in kvserve's environment serves with kvserve's
plugin active. Starts it on the default model, sends one request that asks for eviction and one that does not, and
writes what came back (status, kvserve's applied headers, usage) to the JSON file named by argv[1].

    python tests/vllm_cli_run.py OUT.json
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import httpx

from kvserve.model import ensure_default_model
from kvserve.tools.bench.servers import running_server

# the test server's settings (tests/conftest.py), so that the prompt's token count is the same there
ARGS = ["--max-model-len", "2048", "--block-size", "32", "--enforce-eager", "--dtype", "float32"]
PROMPT = " ".join(str(number) for number in range(1, 301)) + " What comes next?"  # the README's, ~1,100 tokens


def ask(base: str, model: str, headers: dict[str, str]) -> dict:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    response = httpx.post(base + "/v1/completions", json=body, headers=headers, timeout=600)
    return {
        "status": response.status_code,
        "applied": {key: value for key, value in response.headers.items() if key.startswith("x-kv-")},
        "usage": response.json().get("usage") if response.status_code == 200 else response.text,
    }


def main(out: str) -> None:
    model = str(ensure_default_model())
    log = Path(tempfile.mkdtemp(prefix="kvserve-vllm-serve-")) / "server.log"
    # vLLM on CPU reserves a share of the machine's memory for its cache unless told a size (kvserve serve says 4 GiB)
    with running_server("vllm-cli", model, ARGS, log, env={"VLLM_CPU_KVCACHE_SPACE": "1"}) as base:
        result = {
            "evicting": ask(base, model, {"x-kv-policy": "streamingllm", "x-kv-budget": "64"}),
            "plain": ask(base, model, {}),
        }
    # every kvserve line: the start-up summary lists each policy before the model's support line, so a count cut
    # would drop the line the test reads whenever a policy is added
    result["kvserve_log_lines"] = [line for line in log.read_text().splitlines() if "kvserve" in line]
    Path(out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
