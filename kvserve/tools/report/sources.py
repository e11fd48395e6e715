"""Result files and what they record about their runs.

A benchmark's JSON carries its runs under "provenance" (one record, or a list when a file was assembled from
several runs); an evaluation's JSON-lines file has them in `<name>.runs.jsonl` beside it (`kvserve eval` appends a
line per run). A record: {date, command, machine: {cpu, cpu_flags, cores, gpu}, kvserve, note?}; a record with a
date and a note only says what was done to the file's rows afterwards (a relabelling), and runs nothing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from kvserve.provenance import describe_machine
from kvserve.tools.eval.__main__ import runs_file

# Modules that moved since a result file recorded its command: (as recorded, as run today). The page shows the
# command a reader can copy; the file keeps what was run.
MOVED_COMMANDS = (
    ("python -m kvserve.bench ", "kvserve bench "),
    ("python -m kvserve.eval ", "kvserve eval "),
)


def as_run_today(command: str) -> str:
    """A recorded command as it is run today (see MOVED_COMMANDS); unchanged where nothing it names moved."""
    for recorded, today in MOVED_COMMANDS:
        command = command.replace(recorded, today)
    return command


@dataclass(frozen=True)
class Source:
    """One result file: its path as the page names it, its content, and the runs that wrote it."""

    name: str  # relative to the repository, e.g. docs/eval/suite/tasks.jsonl
    data: dict | list
    runs: list[dict]

    def caption(self) -> str:
        """Markdown under a table: the file, then each run's machine, date and command (runs on the same machine
        and date share a line)."""
        lines = [f"Data: `{self.name}`."]
        by_machine: dict[tuple[str, str], list[str]] = {}
        notes = []
        for run in self.runs:
            if "command" not in run:  # a note on the rows, not a run
                notes.append(f"{run['date']}: {run['note']}")
                continue
            key = (describe_machine(run["machine"]), run["date"])
            command = as_run_today(run["command"])
            by_machine.setdefault(key, []).append(command)
            if command != run["command"]:
                notes.append("Recorded under a module's old name (kvserve.bench, kvserve.eval); shown as run now.")
            if run.get("note"):
                notes.append(run["note"])
        for (machine, date), commands in by_machine.items():
            distinct = list(dict.fromkeys(commands))  # each distinct command once, in run order
            lines.append(f"Machine: {machine}; {date}.")
            lines.append("")
            # folded: a table's commands (57 of them under one) come after what it says, not before
            summary = "command" if len(distinct) == 1 else f"{len(distinct)} commands"
            lines.append(f"<details><summary>{summary}</summary>")
            lines += ["", "```", *distinct, "```", "", "</details>"]
        lines.extend(dict.fromkeys(notes))
        return "\n".join(lines)


class DataDir:
    """The result files under one folder (docs/eval), loaded on demand; `root` is what names are relative to."""

    def __init__(self, folder: Path, root: Path | None = None) -> None:
        self.folder = Path(folder)
        self.root = Path(root) if root is not None else self.folder.parent.parent

    def name(self, path: Path) -> str:
        try:
            return str(path.resolve().relative_to(self.root.resolve()))
        except ValueError:
            return str(path)

    def load(self, relative: str) -> Source:
        path = self.folder / relative
        if not path.exists():
            raise FileNotFoundError(f"kvserve report: {path} is missing (the page is built from it)")
        if path.suffix == ".jsonl":
            data: dict | list = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            sidecar = runs_file(path)
            runs = (
                [json.loads(line) for line in sidecar.read_text().splitlines() if line.strip()]
                if sidecar.exists()
                else []
            )
        else:
            data = json.loads(path.read_text())
            recorded = data.get("provenance") if isinstance(data, dict) else None
            runs = recorded if isinstance(recorded, list) else [recorded] if recorded else []
        if not runs:
            raise ValueError(f"kvserve report: {path} records no run (machine, date, command); the page needs them")
        return Source(self.name(path), data, runs)
