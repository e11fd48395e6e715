"""The README's first screen works as pasted: its curl command and its OpenAI-client call, run against the real
server (the test's server listens on another port than the README's 8000; nothing else is changed)."""

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
FIRST_SCREEN_LINES = 45


def first_screen_blocks(language: str) -> list[str]:
    head = "\n".join(README.read_text().splitlines()[:FIRST_SCREEN_LINES])
    return re.findall(rf"```{language}\n(.*?)```", head, re.S)


def on_test_server(snippet: str, server: str) -> str:
    assert "localhost:8000" in snippet
    return snippet.replace("localhost:8000", urlparse(server).netloc)


def test_first_screen_curl_works_as_pasted(server):
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    [block] = [b for b in first_screen_blocks("bash") if b.lstrip().startswith("curl")]
    done = subprocess.run(["bash", "-c", on_test_server(block, server)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    body = json.loads(done.stdout)
    assert body["choices"][0]["text"]
    assert body["usage"]["kv_tokens_evicted"] == 0  # a 6-token prompt is far under the budget: nothing to evict


def test_first_screen_openai_call_works_as_pasted(server):
    [block] = [b for b in first_screen_blocks("python") if "OpenAI(" in b]
    done = subprocess.run(
        [sys.executable, "-c", on_test_server(block, server)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "completion_tokens" in done.stdout and "kv_tokens_evicted" in done.stdout
