"""kvserve reaches vLLM's API server through the entry point vLLM documents (`vllm serve`), never one vLLM marks
deprecated: what kvserve imports or runs with `-m` is checked against vLLM's own source, and `kvserve serve --help`
runs with every DeprecationWarning shown, none of them vLLM's."""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvserve.server import launch

PACKAGE = Path(__file__).parent.parent / "kvserve"
VLLM_MODULE = re.compile(r"vllm(\.\w+)+")


def deprecated_on_use(module: str) -> bool:
    """vLLM marks the module deprecated: a DeprecationWarning raised at its import (its top level) or when run with
    `python -m` (its `if __name__ == "__main__":` block)."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        return False
    tree = ast.parse(Path(spec.origin).read_text())
    reached = []  # the statements that run on import or under `-m`
    for node in tree.body:
        if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
            reached.extend(node.body)
        elif not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            reached.append(node)
    for statement in reached:
        for call in ast.walk(statement):
            if isinstance(call, ast.Call) and ast.unparse(call.func).endswith("warn"):
                if "DeprecationWarning" in ast.unparse(call):
                    return True
    return False


def vllm_modules_kvserve_uses() -> dict[str, set[str]]:
    """vLLM module -> the kvserve files that import it or name it (a `-m` argument, a module looked up by name)."""
    used: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and VLLM_MODULE.fullmatch(node.value):
                names = [node.value]
            for name in names:
                if name == "vllm" or name.startswith("vllm."):
                    used.setdefault(name, set()).add(str(path.relative_to(PACKAGE.parent)))
    return used


def test_the_check_finds_what_vllm_deprecates():
    assert deprecated_on_use("vllm.entrypoints.openai.api_server")  # deprecated on import and under -m
    assert not deprecated_on_use("vllm.entrypoints.cli.main")


def test_kvserve_uses_no_vllm_module_vllm_deprecates():
    used = vllm_modules_kvserve_uses()
    assert "vllm.entrypoints.cli.serve" in used  # the server starts through `vllm serve`'s command
    assert {name: files for name, files in used.items() if deprecated_on_use(name)} == {}


def test_help_runs_vllms_documented_command_and_no_vllm_deprecation():
    """`kvserve serve --help`, every DeprecationWarning shown (PYTHONWARNINGS reaches vLLM's help process too)."""
    import vllm

    env = dict(os.environ, PYTHONWARNINGS="always::DeprecationWarning")
    done = subprocess.run(
        [sys.executable, "-m", "kvserve.cli", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "--kv-policy" in done.stdout and "usage: vllm serve" in done.stdout
    vllm_folder = str(Path(vllm.__file__).parent)
    from_vllm = [line for line in done.stderr.splitlines() if "DeprecationWarning" in line and vllm_folder in line]
    assert from_vllm == []


def test_serve_starts_one_api_server_through_vllm_serves_command(monkeypatch):
    """launch.main hands vLLM's parsed arguments to `vllm serve`'s own command, one API server in this process."""
    from vllm.entrypoints.cli.serve import ServeSubcommand

    from kvserve.server import profile

    ran = []
    monkeypatch.setattr(launch, "refuse_where_kvserve_cannot_evict", lambda: None)
    monkeypatch.setattr(profile, "apply_profile", lambda model: None)
    monkeypatch.setattr(ServeSubcommand, "cmd", lambda self, args: ran.append(args))
    launch.main(["--model", "some/model", "--data-parallel-size", "2"])
    assert [(args.model, args.api_server_count, args.headless) for args in ran] == [("some/model", 1, False)]


@pytest.mark.parametrize("flag", ["--grpc", "--data-parallel-multi-port-external-lb"])
def test_serve_refuses_a_front_end_without_kvserves_middleware(monkeypatch, flag):
    """vLLM's gRPC server and its per-rank supervisor would serve without kvserve's middleware: named, refused."""
    from kvserve.server import profile

    monkeypatch.setattr(launch, "refuse_where_kvserve_cannot_evict", lambda: None)
    monkeypatch.setattr(profile, "apply_profile", lambda model: None)
    with pytest.raises(SystemExit, match=re.escape(flag)):
        launch.main(["--model", "some/model", flag])
