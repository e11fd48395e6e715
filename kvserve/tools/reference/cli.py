"""docs/reference/cli.md: every `kvserve` command's flags, read off the argparse parsers the commands themselves build.

Each command builds its parser inside its own `main` (`kvserve.cli.SUBCOMMANDS`); run here with the parsing step
replaced by one that hands the parser back, so the page holds exactly the flags, defaults and help the command
parses, without running it.
"""

from __future__ import annotations

import argparse
import importlib
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from kvserve.tools.markdown import table
from kvserve.tools.reference.common import banner, cell, code, machine_free

VLLM_SERVE_DOCS = "https://docs.vllm.ai/en/latest/cli/serve.html"
DEFAULT_SAID = re.compile(r"\(default:? ([^;,()]+)")


class _Parsed(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


@contextmanager
def _handing_back() -> Iterator[None]:
    parse = argparse.ArgumentParser.parse_known_args

    def hand_back(self: argparse.ArgumentParser, args=None, namespace=None):
        raise _Parsed(self)

    argparse.ArgumentParser.parse_known_args = hand_back
    try:
        yield
    finally:
        argparse.ArgumentParser.parse_known_args = parse


def parser_of(main: Callable[[list[str]], object]) -> argparse.ArgumentParser:
    """The parser `main([])` parses its arguments with (nothing after that runs)."""
    with _handing_back():
        try:
            main([])
        except _Parsed as parsed:
            return parsed.parser
    raise RuntimeError(f"{main.__module__}.{main.__name__} parsed no arguments")


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def commands() -> list[tuple[str, argparse.ArgumentParser]]:
    """(`kvserve ...` command line, its parser) for every command and subcommand."""
    from kvserve.cli import SUBCOMMANDS, command_function
    from kvserve.tools.bench.__main__ import COMMANDS as BENCH_COMMANDS
    from kvserve.tools.eval.__main__ import DELEGATED

    found = []
    for name in SUBCOMMANDS:
        parser = parser_of(command_function(name))
        nested = subparsers(parser)
        if not nested:
            found.append((f"kvserve {name}", parser))
        for sub, subparser in nested.items():
            if sub in DELEGATED and name == "eval":
                subparser = parser_of(importlib.import_module(DELEGATED[sub]).main)
            found.append((f"kvserve {name} {sub}", subparser))
        if name == "bench":
            for sub, (module, _) in BENCH_COMMANDS.items():
                found.append((f"kvserve bench {sub}", parser_of(importlib.import_module(module).main)))
    return found


def shown_default(action: argparse.Action, text: str) -> str:
    """The flag's default; for one whose parser default is None (`kvserve serve`'s --kv-*, so that a config file's
    value wins over no flag), the default its help says (`--help` shows it, from the settings' declarations)."""
    if action.required:
        return "required"
    if action.default is None or action.default is argparse.SUPPRESS:
        said = list(dict.fromkeys(DEFAULT_SAID.findall(text)))
        if len(said) > 1:
            return "the policy's own (see meaning)"
        return code(said[0]) if said else ""
    if isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction):
        return code(str(action.default).lower())
    return code(machine_free(str(action.default)))


def flag_rows(parser: argparse.ArgumentParser) -> list[list[str]]:
    formatter = parser._get_formatter()
    rows = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
            continue
        if action.option_strings:
            name = ", ".join(code(option) for option in action.option_strings)
        else:
            choices = f" ({', '.join(map(str, action.choices))})" if action.choices else ""
            name = code(action.metavar or action.dest) + choices
        text = formatter._expand_help(action) if action.help else ""
        rows.append([name, shown_default(action, text), cell(machine_free(text))])
    return rows


# the commands with subcommands of their own get a page each; the others share cli.md
OWN_PAGES = {"eval": "cli-eval.md", "bench": "cli-bench.md"}


def page_of(command: str) -> str:
    return OWN_PAGES.get(command.split()[1], "cli.md")


def pages() -> dict[str, str]:
    """cli.md (with `kvserve serve`) and a page for each command in OWN_PAGES."""
    intro = (
        "`kvserve --help` lists the commands. `kvserve serve` takes the flags below and passes every other flag to "
        f"vLLM's OpenAI API server unchanged: those are vLLM's ([`vllm serve`]({VLLM_SERVE_DOCS})). A `--kv-*` "
        "setting's type, range and the policies that read it are in [Settings](settings.md). "
        + " ".join(f"`kvserve {name}`: [{page}]({page})." for name, page in OWN_PAGES.items())
    )
    titles = {"cli.md": ("Command line", intro)}
    titles |= {page: (f"Command line: kvserve {name}", "") for name, page in OWN_PAGES.items()}
    sections: dict[str, list[str]] = {
        page: [banner(title, "the commands' own argparse parsers (`kvserve/cli.py`, `kvserve/tools/`)")]
        + ([text, ""] if text else [])
        for page, (title, text) in titles.items()
    }
    for command, parser in commands():
        rows = flag_rows(parser)
        body = table(["flag", "default", "meaning"], rows) if rows else "(no flags)"
        sections[page_of(command)] += [f"## `{command}`", "", body, ""]
    return {page: "\n".join(lines) for page, lines in sections.items()}
