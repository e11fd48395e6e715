"""Every command the docs print runs as printed: the README and every page of the site (the user's guide, the
generated references and the benchmarks page's folded commands included).

Each command line in a shell code block, and each inline code span that starts with a program, is checked against
what is installed today: `kvserve SUB [SUB2]`, `vllm SUB [SUB2]`, `python -m MODULE [SUB]` and `make TARGET` must
exist (a module must import as a spec, a subcommand must answer `--help`), and every `--flag` must be one that
command's `--help` lists (for `kvserve serve`, kvserve's flags and vLLM's, which it passes on). Other programs
(curl, docker, seq) are not checked. A module that moves, a subcommand renamed or a flag dropped then fails here,
naming the page and the command, instead of failing a user who copied it.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from doc_pages import site_pages

ROOT = Path(__file__).parent.parent
PAGES = [ROOT / "README.md", *site_pages()]
BIN = Path(sys.executable).parent
SHELL_FENCES = {"", "bash", "sh", "shell", "console"}
CHECKED = ("kvserve", "vllm", "python", "python3", "make")
SUBCOMMANDS = {  # program -> the commands with subcommands of their own
    "kvserve": {"eval", "bench"},
    "vllm": {"bench"},
    "kvserve.tools.eval": set(),
    "kvserve.tools.bench": set(),
}
WORD = re.compile(r"^[a-z][a-z0-9_-]*$")
FLAG = re.compile(r"^--[a-z0-9][a-z0-9-]*(=.*)?$")


def doc_commands(text: str) -> list[str]:
    """Command lines of a markdown page: shell code blocks' lines (continuations joined) and inline code spans that
    start with a checked program (after any VAR=value)."""
    commands = []
    fenced = r"^[ \t]*```(\w*)[^\n]*\n(.*?)^[ \t]*```"
    for fence, body in re.findall(fenced, text, flags=re.S | re.M):
        if fence in SHELL_FENCES:
            commands += [line.strip() for line in body.replace("\\\n", " ").splitlines()]
    prose = re.sub(fenced, "", text, flags=re.S | re.M)
    program = r"(?:\w+=\S+ )*(?:\.venv/bin/)?(?:kvserve|vllm|python3?|make)\b"
    commands += re.findall(rf"^ {{4}}({program}.*)$", prose, flags=re.M)  # indented code blocks (the README's top)
    commands += re.findall(rf"`({program} [^`\n]+)`", prose)
    return [line for line in commands if line and not line.startswith("#")]


def segments(line: str) -> list[list[str]]:
    """The simple commands of a line (split at |, &&, ;), each without leading VAR=value and `.venv/bin/`, and
    without a trailing comment; [] where the shell could not parse it (a fragment of a longer line)."""
    try:
        lexer = shlex.shlex(line, posix=True, punctuation_chars="|&;")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        tokens = list(lexer)
    except ValueError:
        return []
    found, current = [], []
    for token in [*tokens, ";"]:
        if token in ("|", "||", "&&", ";", "&"):
            while current and re.match(r"^\w+=", current[0]):
                current.pop(0)
            if current:
                current[0] = current[0].removeprefix(".venv/bin/").removeprefix("$(PY)")
                found.append(current)
            current = []
        else:
            current.append(token)
    return [command for command in found if command[0] in CHECKED]


class Dead(Exception):
    """A command that would not run as printed: what is missing."""


class HelpWorker:
    """One process answering every kvserve, vllm and `python -m` command's `--help` (tests/help_worker.py), started
    when first asked; None where it died answering, and the next question starts another."""

    def __init__(self) -> None:
        self.process: subprocess.Popen | None = None

    def ask(self, argv: tuple[str, ...]) -> tuple[int, str] | None:
        if self.process is None or self.process.poll() is not None:
            worker = [sys.executable, str(ROOT / "tests" / "help_worker.py")]
            self.process = subprocess.Popen(worker, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
        try:
            self.process.stdin.write(json.dumps(list(argv)) + "\n")
            self.process.stdin.flush()
            line = self.process.stdout.readline()
        except BrokenPipeError:
            line = ""
        if not line:
            self.process.kill()
            self.process.wait()
            return None
        status, text = json.loads(line)
        return status, text

    def close(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.stdin.close()
            self.process.wait(timeout=60)


HELP_WORKER = HelpWorker()


@pytest.fixture(scope="module", autouse=True)
def _help_worker():
    yield
    HELP_WORKER.close()


@functools.cache
def help_text(*argv: str) -> tuple[int, str]:
    """(exit status, stdout + stderr) of `argv --help` (vLLM's CLI lists every flag only under --help=all). kvserve's,
    vLLM's and `python -m` commands are answered by one worker process. `kvserve serve --help` is kvserve's parser, then
    `vllm serve --help=all` (kvserve/cli.py `print_help`), which flags_of adds: only the parser's part is asked."""
    flag = "--help=all" if argv[0].endswith("vllm") else "--help"
    if argv[1:] == ("serve",) and argv[0].endswith("kvserve"):
        from kvserve.cli import SUBCOMMANDS, _serve_parser

        if "serve" in SUBCOMMANDS:
            return 0, _serve_parser().format_help()
    answered = HELP_WORKER.ask((*argv, flag))
    if answered is not None:
        return answered
    return run_alone((*argv, flag))  # the worker died answering


def run_alone(argv: tuple[str, ...]) -> tuple[int, str]:
    """(exit status, stdout + stderr) of `argv` in a process of its own, as a user runs it."""
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=ROOT)
    return done.returncode, done.stdout + done.stderr


def flags_of(argv: tuple[str, ...]) -> str:
    """The help text that lists the flags `argv` accepts."""
    status, text = help_text(*argv)
    if status != 0:
        raise Dead(f"`{' '.join(argv)} --help` failed:\n{text[-2000:]}")
    if argv[1:2] == ("serve",) and argv[0].endswith("kvserve"):  # every flag kvserve does not own goes to vLLM
        text += flags_of((str(BIN / "vllm"), "serve"))
    if argv[1:] == ("-m", "kvserve.server.launch"):
        text = flags_of((str(BIN / "vllm"), "serve"))
    return text


def resolve(command: list[str]) -> tuple[tuple[str, ...], list[str]]:
    """(the argv whose --help describes the command, the rest of its words); Dead where the program,
    module, subcommand or target does not exist."""
    program, *words = command
    if program == "make":
        targets = re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), flags=re.M)
        missing = [word for word in words if WORD.match(word) and word not in targets]
        if missing:
            raise Dead(f"no make target {missing}")
        return (), []
    if program in ("python", "python3"):
        if words[:1] != ["-m"]:
            return (), []  # only `python -m MODULE` is checked
        module, *words = words[1:]
        if importlib.util.find_spec(module) is None:
            raise Dead(f"no module {module}")
        argv, key = (sys.executable, "-m", module), module
    else:
        argv, key = (str(BIN / program),), program
    if words and WORD.match(words[0]) and (key in SUBCOMMANDS or program == "vllm"):
        argv, words = (*argv, words[0]), words[1:]
        if argv[-1] in SUBCOMMANDS.get(key, ()) and words and WORD.match(words[0]):
            argv, words = (*argv, words[0]), words[1:]
        status, text = help_text(*argv)
        if status != 0:
            raise Dead(f"`{' '.join(argv[len(argv) - 2 :])}` is not a command:\n{text[-1500:]}")
    return argv, words


MODEL_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*$")  # a name, not a folder (no /) or a substitution ($(...))


def unknown_models(argv: tuple[str, ...], words: list[str]) -> list[str]:
    """`kvserve setup-model NAME` and `kvserve calibrate NAME` name a model kvserve knows (`kvserve.catalog`)."""
    from kvserve.catalog import MODEL_NAMES

    if argv[-1] not in ("setup-model", "calibrate") or not words or not MODEL_NAME.match(words[0]):
        return []
    if words[0].isupper():  # a placeholder (`kvserve calibrate MODEL`)
        return []
    return [] if words[0] in MODEL_NAMES else [f"kvserve {argv[-1]}: no model {words[0]!r} ({', '.join(MODEL_NAMES)})"]


def problems(line: str) -> list[str]:
    found = []
    for command in segments(line):
        try:
            argv, words = resolve(command)
            if not argv:
                continue
            found += unknown_models(argv, words)
            flags = {word.split("=")[0] for word in words if FLAG.match(word)}  # not "--x y" (a quoted value)
            listed = flags_of(argv) if flags else ""
            unknown = sorted(flag for flag in flags if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", listed))
            if unknown:
                found.append(f"{' '.join(command[:3])}: no flag {', '.join(unknown)}")
        except Dead as error:
            found.append(f"{' '.join(command[:3])}: {error}")
    return found


def test_the_pages_print_commands_at_all():
    """The extraction finds what the pages hold (a broken fence pattern would make the next test pass vacuously)."""
    found = {str(page.relative_to(ROOT)): doc_commands(page.read_text()) for page in PAGES}
    assert any(line.startswith("make serve") for line in found["README.md"]), found["README.md"]
    assert sum("kvserve bench" in line for line in found["docs/benchmarks.md"]) >= 10
    assert any("vllm bench serve" in line for line in found["docs/tools.md"]), found["docs/tools.md"]
    assert any("kvserve serve" in line for line in found["docs/guide/serving.md"]), found["docs/guide/serving.md"]


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_command_a_page_prints_exists_as_printed(page):
    lines = doc_commands(page.read_text())
    failures = [f"{line[:120]}\n    -> {problem}" for line in lines for problem in problems(line)]
    assert not failures, f"{page.relative_to(ROOT)}:\n" + "\n".join(failures)


@pytest.mark.parametrize(
    "line, problem",
    [
        ("python -m kvserve.bench capacity --prompts 4", "no module kvserve.bench"),
        ("kvserve bench capacity --no-such-flag 1", "no flag --no-such-flag"),
        ("kvserve eval nosuchtask --url x", "is not a command"),
        ("make nosuchtarget", "no make target"),
        ("kvserve serve --kv-policy snapkv --max-model-len 4096 --no-such-vllm-flag", "no flag --no-such-vllm-flag"),
    ],
)
def test_the_check_fails_a_dead_command(line, problem):
    """The checker can fail: each kind of dead command is caught (and a live one passes, in the page tests)."""
    assert any(problem in found for found in problems(line)), problems(line)


def test_kvserve_help_lists_every_command_and_each_answers_help():
    """`kvserve --help` lists each eval command (from eval's own parser) and each bench command (from bench's
    dispatch tables), and every one it lists exists: its `--help` exits 0 (the check above)."""
    from kvserve.tools.bench.__main__ import COMMANDS, SERVER_PAIR_COMMANDS
    from kvserve.tools.eval.__main__ import build_parser

    shown = subprocess.run([str(BIN / "kvserve"), "--help"], capture_output=True, text=True, check=True).stdout
    listed = re.findall(r"kvserve (eval|bench) ([a-z-]+)", shown)
    evals = build_parser()._subparsers._group_actions[0].choices
    assert {name for kind, name in listed if kind == "eval"} == set(evals)
    assert {name for kind, name in listed if kind == "bench"} == {*COMMANDS, *SERVER_PAIR_COMMANDS}
    for command in ("serve", "report", "setup-model", "calibrate"):
        assert f"kvserve {command} " in shown
    dead = [f"kvserve {kind} {name}: {found}" for kind, name in listed for found in problems(f"kvserve {kind} {name}")]
    assert dead == []


# A route a page names in code: `/v1/...`, or one of the server's own (vLLM's and kvserve's).
ROUTE = re.compile(r"`(?:(GET|POST) )?(/v1/[a-z0-9_/.-]+|/health|/metrics|/version|/tokenize|/detokenize|/ping)`")


def doc_routes() -> dict[tuple[str, str], list[str]]:
    """(method, path) -> the pages naming it (GET where a page names no method)."""
    routes: dict[tuple[str, str], list[str]] = {}
    for page in PAGES:
        for method, path in ROUTE.findall(page.read_text()):
            routes.setdefault((method or "GET", path), []).append(str(page.relative_to(ROOT)))
    return routes


def test_every_route_a_page_names_is_served(server):
    """Issue 66: the guide said kvserve "adds no routes of its own" while it served `POST /v1/kvserve/compress`. Each
    route the pages name answers on the real server with something other than 404/405 (a POST with an empty body
    gets its 400 or 422, not "no such route"), and the route kvserve adds is among them."""
    import httpx

    from kvserve.server.paths import COMPRESS_PATH

    routes = doc_routes()
    assert ("POST", COMPRESS_PATH) in routes and ("GET", "/metrics") in routes
    missing = []
    for (method, path), pages in sorted(routes.items()):
        if method == "GET" and path in ("/v1/completions", "/v1/chat/completions", COMPRESS_PATH):
            method = "POST"  # named without a method in prose; served as POST
        response = httpx.request(method, server + path, json={} if method == "POST" else None, timeout=120)
        if response.status_code in (404, 405):
            missing.append(f"{method} {path} ({', '.join(sorted(set(pages)))}): {response.status_code}")
    assert missing == []


@pytest.mark.parametrize(
    "line",
    [
        "kvserve setup-model qwen2.5-coder-0.5b",
        "kvserve calibrate /path/to/model",
        "kvserve setup-model",
        "kvserve calibrate MODEL --gates",
    ],
)
def test_the_check_passes_known_models_and_folders(line):
    assert problems(line) == []


def test_the_check_fails_an_unknown_model_name():
    from kvserve.catalog import MODEL_NAMES

    [problem] = problems("kvserve setup-model llama-9b")
    assert problem == f"kvserve setup-model: no model 'llama-9b' ({', '.join(MODEL_NAMES)})"


@pytest.mark.parametrize(
    "argv",
    [
        ("kvserve", "bench", "capacity"),
        ("kvserve", "eval", "nosuchtask"),
        ("python", "-m", "kvserve.tools.eval"),
    ],
)
def test_the_help_worker_answers_as_the_command_run_alone(argv):
    """The worker's answer (one process for many commands) is what the command prints run on its own: the same exit
    status and the same flags, for a command that exists and one that does not. (vLLM's, 20 s alone, is checked by
    the pages' own commands: `kvserve serve`'s flags are vLLM's, and test_the_check_fails_a_dead_command's.)"""
    program = sys.executable if argv[0] == "python" else str(BIN / argv[0])
    argv = (program, *argv[1:], "--help")
    alone_status, alone_text = run_alone(argv)
    status, text = HELP_WORKER.ask(argv)
    assert status == alone_status
    flags = re.compile(r"--[a-z][a-z0-9-]*")
    assert set(flags.findall(text)) == set(flags.findall(alone_text))
