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

    def commanded_runs(self) -> list[dict]:
        """The runs that wrote the file (a record with a note only relabels rows: no run)."""
        return [run for run in self.runs if "command" in run]

    def latest_command(self) -> str | None:
        """The command of the latest run, as run today; the last recorded of that day's runs."""
        runs = self.commanded_runs()
        if not runs:
            return None
        newest = max(run["date"] for run in runs)
        return as_run_today([run for run in runs if run["date"] == newest][-1]["command"])

    def caption(self) -> str:
        """Markdown under a table: the file, each machine with the dates it ran there, and the command of the latest
        run. A file written by many runs shows one command, not each (57 of them under one table were most of the
        page's words), and no run's notes (what was done when: history): both stay in the file's record of runs."""
        runs = self.commanded_runs()
        lines = [f"Data: `{self.name}`.", *machine_lines({self.name: runs})]
        commands = list(dict.fromkeys(run["command"] for run in runs))
        latest = self.latest_command()
        if latest is not None:
            record = f"`{self.name.removesuffix('.jsonl')}.runs.jsonl`" if self.name.endswith(".jsonl") else "the file"
            summary = "command" if len(commands) == 1 else f"latest of {len(commands)} commands (all in {record})"
            lines += ["", f"<details><summary>{summary}</summary>", "", "```", latest, "```", "", "</details>"]
        return "\n".join(lines)


def machine_lines(runs_by_file: dict[str, list[dict]]) -> list[str]:
    """`Machine: <machine>; <first date>[ to <last date>].` per machine the files' runs used; where several files ran
    on more than one machine, each line names the files that ran there."""
    dates: dict[str, dict[str, list[str]]] = {}
    for name, runs in runs_by_file.items():
        for run in runs:
            dates.setdefault(describe_machine(run["machine"]), {}).setdefault(name, []).append(run["date"])
    lines = []
    for machine, files in dates.items():
        when = [date for file_dates in files.values() for date in file_dates]
        first, last = min(when), max(when)
        named = len(dates) > 1 and len(runs_by_file) > 1
        which = f" ({', '.join(f'`{Path(name).name}`' for name in files)})" if named else ""
        lines.append(f"Machine: {machine}; {first if first == last else f'{first} to {last}'}{which}.")
    return lines


def captions(sources: list[Source]) -> str:
    """One caption for the files of one table or section: the files, each machine with the dates of the files' runs
    there, and each file's latest command in the files' order, folded together. A caption per file repeated the
    machine and the fold for every file (a fifth of the page's words); every run stays in the files' records."""
    if len(sources) == 1:
        return sources[0].caption()
    lines = ["Data: " + ", ".join(f"`{source.name}`" for source in sources) + "."]
    lines += machine_lines({source.name: source.commanded_runs() for source in sources})
    commands = [command for source in sources if (command := source.latest_command()) is not None]
    if commands:
        summary = "latest commands, in the files' order"
        lines += ["", f"<details><summary>{summary}</summary>", "", "```", *commands, "```", "", "</details>"]
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
