"""The repository itself: nothing tracked points at the machine it was made on."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# absolute paths of a developer's or CI's machine; the images' own user (/home/kvserve) is part of the product
MACHINE_PATH = re.compile(r"(?<![\w.])(/root/|/Users/[^/\s]+/|/home/(?!kvserve\b)[^/\s]+/|/work/|/tmp/pytest-)")


def tracked_text_files() -> list[Path]:
    names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.split(b"\0")
    files = []
    for name in filter(None, names):
        path = ROOT / name.decode()
        if path.is_file() and b"\0" not in path.read_bytes()[:8192]:  # binary files (weights, PNGs) aside
            files.append(path)
    return files


def test_no_tracked_file_holds_a_machine_path():
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    here = {str(ROOT), str(Path.home())}
    found = []
    for path in tracked_text_files():
        if path == Path(__file__).resolve():  # this file spells the patterns out
            continue
        text = path.read_text(errors="replace")
        for number, line in enumerate(text.splitlines(), 1):
            if MACHINE_PATH.search(line) or any(prefix + "/" in line for prefix in here if len(prefix) > 1):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:120]}")
    assert not found, "machine paths in tracked files:\n" + "\n".join(found[:20])


def test_the_scan_finds_a_machine_path():
    for line in ('"out": "/work/main/kvserve/gates/x.safetensors"', "cache at /root/.cache/kvserve", "/home/ci/x"):
        assert MACHINE_PATH.search(line), line
    for line in ("-v kvserve-models:/home/kvserve/.cache/kvserve", "docs/gates/training.jsonl", "a/work/b"):
        assert not MACHINE_PATH.search(line), line
