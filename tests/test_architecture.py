"""The package's shape, read from its source: only the vLLM boundary imports vLLM, no import cycles, no module imports
a layer above its own, no serving file over 400 lines. Each check also runs on a made-up breach, so it can fail."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "kvserve"

# Layers, lowest first: a module may import its own layer and those below. Within the engine, the core side and the
# worker side do not import each other.
LAYERS: tuple[tuple[str, ...], ...] = (
    (
        "kvserve",  # __init__: the version
        "kvserve.errors",
        "kvserve.metrics",
        "kvserve.phases",
        "kvserve.cpu_dtype",
        "kvserve.allocator",
        "kvserve.parallelism",
        "kvserve.provenance",
        "kvserve.model",
    ),
    ("kvserve.policies", "kvserve.gates", "kvserve.duo", "kvserve.profile"),
    (
        "kvserve.config",
        "kvserve.policy_settings",
        "kvserve.document_settings",
        "kvserve.model_support",
        "kvserve.messages",
        "kvserve.effective_defaults",
    ),
    ("kvserve.core", "kvserve.worker"),
    ("kvserve.server",),
    ("kvserve.vllm",),
    ("kvserve.plugin", "kvserve.server.launch"),  # what vLLM loads, and the process `kvserve serve` becomes
    ("kvserve.tools",),
    ("kvserve.cli",),  # the command line: `kvserve serve` and the tools' commands
)
APART = ("kvserve.core", "kvserve.worker")
# Serving modules that may import vLLM beside the boundary: the launcher execs vLLM's own server.
VLLM_ALLOWED = ("kvserve.vllm", "kvserve.server.launch", "kvserve.tools")
MAX_SERVING_LINES = 400


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in PACKAGE.rglob("*.py")}


def imports_of(source: str) -> set[str]:
    """Every module an import statement names, at any depth (a function's lazy import counts too)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def graph(sources: dict[str, str]) -> dict[str, set[str]]:
    """kvserve module -> the kvserve modules it imports (a name that is an attribute resolves to its module)."""
    names = set(sources)
    edges = {}
    for name, source in sources.items():
        targets = set()
        for imported in imports_of(source):
            while imported and imported not in names:
                imported = imported.rpartition(".")[0]
            if imported and imported != name and imported.startswith("kvserve"):
                targets.add(imported)
        edges[name] = targets
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in edges.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in edges:
        if node not in index:
            visit(node)
    return found


def layer_of(name: str) -> tuple[int, str]:
    """(layer, the package or module that places it) of a kvserve module: its longest listed prefix."""
    best = None
    for level, members in enumerate(LAYERS):
        for member in members:
            if (name == member or name.startswith(member + ".")) and (best is None or len(member) > len(best[1])):
                best = (level, member)
    if best is None:
        raise AssertionError(f"{name} is in no layer of tests/test_architecture.py")
    return best


def upward_imports(edges: dict[str, set[str]]) -> list[str]:
    wrong = []
    for name, targets in edges.items():
        level, home = layer_of(name)
        for target in targets:
            target_level, target_home = layer_of(target)
            if target_level > level:
                wrong.append(f"{name} (layer {level}) imports {target} (layer {target_level})")
            elif target_level == level and {home, target_home} == set(APART):
                wrong.append(f"{name} imports {target}: the core side and the worker side stay apart")
    return wrong


def vllm_importers(sources: dict[str, str]) -> list[str]:
    return sorted(
        name
        for name, source in sources.items()
        if any(imported == "vllm" or imported.startswith("vllm.") for imported in imports_of(source))
        and not any(name == allowed or name.startswith(allowed + ".") for allowed in VLLM_ALLOWED)
    )


@pytest.fixture(scope="module")
def sources() -> dict[str, str]:
    return {name: path.read_text() for name, path in modules().items()}


def test_only_the_boundary_imports_vllm(sources):
    assert vllm_importers(sources) == []
    breach = dict(sources, **{"kvserve.core.leak": "def f():\n    from vllm.v1.request import Request\n"})
    assert vllm_importers(breach) == ["kvserve.core.leak"]


def test_no_import_cycles(sources):
    assert cycles(graph(sources)) == []
    looped = dict(sources, **{"kvserve.config": sources["kvserve.config"] + "\nimport kvserve.core.record\n"})
    assert any("kvserve.config" in group for group in cycles(graph(looped)))


def test_no_module_imports_a_layer_above_it(sources):
    assert upward_imports(graph(sources)) == []
    upward = dict(sources, **{"kvserve.policies.leak": "from kvserve.core.compaction import entries_to_keep\n"})
    assert upward_imports(graph(upward)) == [
        "kvserve.policies.leak (layer 1) imports kvserve.core.compaction (layer 3)"
    ]
    across = dict(sources, **{"kvserve.core.leak": "from kvserve.worker.pages import HeadPages\n"})
    assert upward_imports(graph(across)) == [
        "kvserve.core.leak imports kvserve.worker.pages: the core side and the worker side stay apart"
    ]


def test_no_serving_file_is_over_400_lines():
    long = {
        name: len(path.read_text().splitlines())
        for name, path in modules().items()
        if not name.startswith("kvserve.tools") and len(path.read_text().splitlines()) > MAX_SERVING_LINES
    }
    assert long == {}


def defined_names(source: str) -> set[str]:
    """Classes, functions and methods defined in a module (`Class.method` and `method` both)."""
    names = set()
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        if isinstance(node, ast.ClassDef):
            for member in node.body:
                if isinstance(member, ast.FunctionDef | ast.AsyncFunctionDef):
                    names.update({member.name, f"{node.name}.{member.name}"})
    return names


def unknown_references(text: str) -> list[str]:
    """`kvserve/x.py:name` references in a text whose file or name does not exist."""
    wrong = []
    for path, name in re.findall(r"`(kvserve/[\w/]+\.py):([\w.]+)`", text):
        file = PACKAGE.parent / path
        if not file.exists() or name not in defined_names(file.read_text()):
            wrong.append(f"{path}:{name}")
    return wrong


def test_the_architecture_page_follows_a_request_through_functions_that_exist():
    page = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    path = page[page.index("## The path of one request") : page.index("## The files")]
    assert len(re.findall(r"`kvserve/[\w/]+\.py:[\w.]+`", path)) >= 20
    assert "kvserve/core/compaction.py" in page[: page.index("## The code, by layer")]  # named on the first screen
    assert unknown_references(page) == []
    made_up = "kvserve/core/compaction.py:no_such_rule"
    assert unknown_references(f"`{made_up}`") == [made_up]
