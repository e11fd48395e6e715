"""The package's shape, read from its source: only the vLLM boundary imports vLLM, no import cycles, no module imports
a layer above its own, no serving file over 400 lines; and docs/architecture.md, the map of it, held to the source:
its layers are these, its lists of vLLM points are the boundary's table, every function it names exists, and every
section the code points to is on it. Each check also runs on a made-up breach, so it can fail."""

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
    ("kvserve.policies", "kvserve.gates", "kvserve.duo", "kvserve.kvzap", "kvserve.profile"),
    (
        "kvserve.config",
        "kvserve.policy_settings",
        "kvserve.document_settings",
        "kvserve.model_support",
        "kvserve.messages",
        "kvserve.effective_defaults",
        "kvserve.settings",
    ),
    ("kvserve.core", "kvserve.worker"),
    ("kvserve.server",),
    ("kvserve.vllm",),
    ("kvserve.plugin", "kvserve.server.launch"),  # what vLLM loads, and the process `kvserve serve` becomes
    ("kvserve.tools",),
    ("kvserve.cli",),  # the command line: `kvserve serve` and the tools' commands
    ("kvserve.tools.reference",),  # the generated references, which read every declaration, the command line's too
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
    """Classes, functions, methods (`Class.method` and `method` both) and module-level names a module defines."""
    names = set()
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(target.id for target in targets if isinstance(target, ast.Name))
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


PAGE = PACKAGE.parent / "docs" / "architecture.md"


def section(page: str, heading: str) -> str:
    """The text of a `## heading` section, up to the next `## ` heading."""
    start = page.index(f"\n## {heading}\n")
    end = page.find("\n## ", start + 1)
    return page[start : end if end != -1 else len(page)]


def test_the_architecture_page_follows_a_request_through_functions_that_exist():
    page = PAGE.read_text()
    path = section(page, "The path of one request")
    assert len(re.findall(r"`kvserve/[\w/]+\.py:[\w.]+`", path)) >= 20
    assert "kvserve/core/compaction.py" in page[: page.index("## The code, by layer")]  # named on the first screen
    assert unknown_references(page) == []
    made_up = "kvserve/core/compaction.py:no_such_rule"
    assert unknown_references(f"`{made_up}`") == [made_up]


def page_layers(page: str) -> list[set[str]]:
    """Per row of the page's layer table, lowest first: the kvserve modules and packages its second column names."""
    rows = [line for line in section(page, "The code, by layer").splitlines() if line.startswith("| ")][2:]
    layers = []
    for row in rows:
        paths = re.findall(r"`(kvserve/[\w/]*?)(?:\.py|/)`", row.split(" | ")[1])
        layers.append({path.replace("/", ".") for path in paths})
    return layers


def test_the_architecture_page_lists_the_layers_this_test_enforces():
    expected = [set(members) - {"kvserve"} for members in LAYERS]
    page = PAGE.read_text()
    assert page_layers(page) == expected
    moved = page.replace("`kvserve/errors.py`, ", "", 1).replace(
        "| `kvserve/cli.py` |", "| `kvserve/cli.py`, `kvserve/errors.py` |"
    )
    assert page_layers(moved) != expected


def page_points(page: str) -> dict[str, set[str]]:
    """The vLLM points the page's boundary section lists, by how kvserve uses them: the first column of the
    **Wrapped** table, and the snake_case names of the **Overridden** and **Called** lists."""
    boundary = section(page, "Where vLLM is touched")
    wrapped = boundary[boundary.index("**Wrapped**") : boundary.index("**Overridden**")]
    overridden = boundary[boundary.index("**Overridden**") : boundary.index("**Called**")]
    called = boundary[boundary.index("**Called**") :]
    first_cells = [line.split(" | ")[0] for line in wrapped.splitlines() if line.startswith("| `")]
    return {
        "wrapped": {name for cell in first_cells for name in re.findall(r"`(\w+)`", cell)},
        "overridden": set(re.findall(r"`([a-z][a-z0-9_]*)`", overridden)),
        "called": set(re.findall(r"`([a-z][a-z0-9_]*)`", called)),
    }


def declared_points() -> dict[str, set[str]]:
    from kvserve.vllm.points import POINTS

    return {how: {point.name for point in POINTS if point.how == how} for how in ("wrapped", "overridden", "called")}


def test_the_architecture_page_lists_every_vllm_point_as_the_boundary_declares_it():
    page = PAGE.read_text()
    assert page_points(page) == declared_points()
    missing = page.replace("`partial_hit`", "partial hits")
    assert page_points(missing)["overridden"] == declared_points()["overridden"] - {"partial_hit"}
    made_up = page.replace("| `update_states` |", "| `update_states`, `no_such_point` |")
    assert page_points(made_up)["wrapped"] == declared_points()["wrapped"] | {"no_such_point"}


def test_each_overridden_point_is_listed_under_its_subclass():
    """A bullet of the **Overridden** list names the subclasses whose methods its points are (`Point.by`)."""
    from kvserve.vllm.points import POINTS

    boundary = section(PAGE.read_text(), "Where vLLM is touched")
    bullets = boundary[boundary.index("**Overridden**") : boundary.index("**Called**")].split("\n- ")[1:]
    by_name = {point.name: point for point in POINTS if point.how == "overridden"}
    wrong = []
    for bullet in bullets:
        classes = set(re.findall(r"`([A-Z]\w+)`", bullet))
        for name in re.findall(r"`([a-z][a-z0-9_]*)`", bullet):
            if not set(re.split(r",\s*", by_name[name].by)) <= classes:
                wrong.append(f"{name} ({by_name[name].by})")
    assert wrong == []
    assert set(re.findall(r"`([a-z][a-z0-9_]*)`", "\n".join(bullets))) == set(by_name)


def slug(heading: str) -> str:
    """A heading's anchor as mkdocs and GitHub make it: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def missing_sections(sources: dict[str, str], page: str) -> list[str]:
    """References from the code to a section of architecture.md (`architecture.md#anchor`, or `"Section" in
    docs/architecture.md`) that the page has no heading for."""
    headings = {line.lstrip("#").strip() for line in page.splitlines() if line.startswith("#")}
    anchors = {slug(heading) for heading in headings}
    wrong = []
    for name, source in sources.items():
        text = " ".join(source.split())
        for anchor in re.findall(r"architecture\.md#([\w-]+)", text):
            if anchor not in anchors:
                wrong.append(f"{name}: #{anchor}")
        for title in re.findall(r'"([^"]+)" in docs/architecture\.md', text):
            if title not in headings:
                wrong.append(f"{name}: {title!r}")
    return wrong


def test_every_section_the_code_points_to_is_on_the_architecture_page(sources):
    page = PAGE.read_text()
    assert missing_sections(sources, page) == []
    made_up = {"kvserve.leak": '# see "Design decisions" in docs/architecture.md, and architecture.md#no-such-part\n'}
    assert missing_sections(made_up, page) == ["kvserve.leak: #no-such-part", "kvserve.leak: 'Design decisions'"]


def quoted_shares_and_ratios(page: str) -> list[str]:
    return re.findall(r"(?<![\w.])\d+(?:\.\d+)?(?:%|x\b)", page)


def test_the_architecture_page_quotes_no_measurement():
    """The map of the code names the benchmarks page's sections instead of copying their shares and ratios."""
    assert quoted_shares_and_ratios(PAGE.read_text()) == []
    assert quoted_shares_and_ratios("H2O decodes at 1.09x `full`'s cost, keeping 95% of its score") == ["1.09x", "95%"]
