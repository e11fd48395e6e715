"""docs/reference/environment.md: the environment variables kvserve reads or sets (`kvserve.environment`), and the
check that the code names no other: every string constant shaped like one of kvserve's, vLLM's or the allocator's
variables, every constant read or written through an `environ`, and every `envs.NAME` (vLLM's) in kvserve/ and
kernels/ must be declared."""

from __future__ import annotations

import ast
import re

from kvserve.environment import BY_NAME, VARIABLES
from kvserve.tools.markdown import table
from kvserve.tools.reference.common import REPOSITORY, banner, cell, code

SOURCES = (REPOSITORY / "kvserve", REPOSITORY / "kernels")
# the variables' families: a constant of this shape is an environment variable's name wherever it stands
SHAPE = re.compile(r"(KVSERVE|VLLM|PROMETHEUS|MALLOC|LD|OMP|TORCH|HF|CUDA|TRANSFORMERS)_[A-Z0-9_]+")
ENVIRON_METHODS = ("get", "pop", "setdefault", "__getitem__")
WHO = {
    "user": "you may set it",
    "kvserve": "kvserve sets it for its own processes",
    "kvserve if unset": "`kvserve serve` sets it unless given",
}


def names_in(source: str) -> set[str]:
    """The environment variable names a module's code uses (see the module's doc)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and SHAPE.fullmatch(node.value):
            found.add(node.value)
        elif isinstance(node, ast.Subscript) and _is_environ(node.value) and isinstance(node.slice, ast.Constant):
            found.add(str(node.slice.value))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ENVIRON_METHODS
            and _is_environ(node.func.value)
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            found.add(str(node.args[0].value))
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "envs":
            found.add(node.attr)  # vllm.envs.NAME
        elif isinstance(node, ast.Call) and _called(node) == "getenv" and node.args:
            if isinstance(node.args[0], ast.Constant):
                found.add(str(node.args[0].value))
    return found


def _is_environ(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or (
        isinstance(node, ast.Name) and node.id == "environ"
    )


def _called(node: ast.Call) -> str:
    return node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")


def package_sources() -> dict[str, str]:
    """Every Python file of kvserve/ and kernels/ but the declaration itself, by its path in the repository."""
    declaration = REPOSITORY / "kvserve" / "environment.py"
    return {
        str(path.relative_to(REPOSITORY)): path.read_text()
        for root in SOURCES
        for path in sorted(root.rglob("*.py"))
        if path != declaration
    }


def undeclared(sources: dict[str, str]) -> dict[str, list[str]]:
    """Variable name -> the files that use it without its being declared in kvserve/environment.py."""
    found: dict[str, list[str]] = {}
    for path, source in sources.items():
        for name in sorted(names_in(source) - set(BY_NAME)):
            found.setdefault(name, []).append(path)
    return found


def unused(sources: dict[str, str]) -> list[str]:
    """Declared variables that no file names at all (a declaration outliving its code)."""
    text = "\n".join(sources.values())
    return [variable.name for variable in VARIABLES if variable.name not in text]


def page() -> str:
    rows = [
        [code(variable.name), cell(variable.default), WHO[variable.who], cell(variable.meaning)]
        for variable in VARIABLES
    ]
    return "\n".join(
        [
            banner("Environment variables", "`kvserve/environment.py`"),
            "Every variable kvserve reads or sets (vLLM's own are in "
            "[vLLM's documentation](https://docs.vllm.ai/en/latest/configuration/env_vars.html)).",
            "",
            table(["variable", "default", "who sets it", "meaning"], rows),
            "",
        ]
    )
