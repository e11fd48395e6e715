"""The README's first screen works as pasted and shows eviction: its curl command and its OpenAI-client call, run
against the real server (the test's server listens on another port than the README's 8000; nothing else is
changed)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlparse

import pytest

README = Path(__file__).parent.parent / "README.md"
FIRST_SCREEN_LINES = 40


def first_screen_blocks(language: str) -> list[str]:
    head = "\n".join(README.read_text().splitlines()[:FIRST_SCREEN_LINES])
    return re.findall(rf"```{language}\n(.*?)```", head, re.S)


def on_test_server(snippet: str, server: str) -> str:
    assert "localhost:8000" in snippet
    return snippet.replace("localhost:8000", urlparse(server).netloc)


def test_first_screen_curl_works_as_pasted(server):
    """The curl on the first screen evicts: its headers say what was applied, its usage block what was evicted."""
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    [block] = [b for b in first_screen_blocks("bash") if "curl " in b]
    done = subprocess.run(["bash", "-c", on_test_server(block, server)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    head, _, body = done.stdout.replace("\r\n", "\n").partition("\n\n")
    headers = dict(line.lower().split(": ", 1) for line in head.splitlines()[1:])
    assert headers["x-kv-policy-applied"] == "snapkv" and headers["x-kv-budget-applied"] == "64"
    response = json.loads(body)
    assert response["choices"][0]["text"]
    assert response["usage"]["kv_tokens_evicted"] > 0
    assert response["usage"]["prompt_tokens"] > 1000  # the prompt the README says it sends


def test_first_screen_openai_call_works_as_pasted(server):
    [block] = [b for b in first_screen_blocks("python") if "OpenAI(" in b]
    done = subprocess.run(
        [sys.executable, "-c", on_test_server(block, server)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    evicted = re.search(r"kv_tokens_evicted=(\d+)", done.stdout)
    assert "completion_tokens" in done.stdout and evicted and int(evicted.group(1)) > 0, done.stdout
