"""Answers `--help` for many commands in one process (tests/test_doc_commands.py): a request is one JSON line on
stdin, the argv as a list (`kvserve ...`, `vllm ...`, `python -m MODULE ...`); the answer one JSON line, [exit status,
stdout + stderr], on the stdout this process started with. One Python start-up and one import of kvserve and vLLM
serve ~30 commands, where a process each took 2-20 s. Each command runs as its program would: the same `main`, its
output captured at the file descriptors (a subprocess it starts is captured too), a SystemExit's message printed as
Python does."""

from __future__ import annotations

import json
import os
import runpy
import sys
import tempfile
import traceback


def run(argv: list[str]) -> None:
    program, *words = argv
    if os.path.basename(program) == "kvserve":
        from kvserve.cli import main

        sys.argv = [program, *words]
        main(words)
    elif os.path.basename(program) == "vllm":
        from vllm.entrypoints.cli.main import main as vllm_main

        sys.argv = [program, *words]
        vllm_main()
    elif words[:1] == ["-m"]:
        sys.argv = [words[1], *words[2:]]
        runpy.run_module(words[1], run_name="__main__", alter_sys=True)
    else:
        raise SystemExit(f"help_worker: not a kvserve, vllm or `python -m` command: {argv}")


def exit_status(code: object) -> int:
    """What the interpreter exits with for SystemExit(code), printing a message as it does."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def answer(argv: list[str]) -> tuple[int, str]:
    with tempfile.TemporaryFile() as captured:
        sys.stdout.flush()
        sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        os.dup2(captured.fileno(), 1)
        os.dup2(captured.fileno(), 2)
        try:
            run(argv)
            status = 0
        except SystemExit as exit:
            status = exit_status(exit.code)
        except Exception:
            traceback.print_exc()
            status = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
        captured.seek(0)
        return status, captured.read().decode(errors="replace")


def main() -> None:
    channel = os.fdopen(os.dup(1), "w")  # the answers' own descriptor: fd 1 is each command's while it runs
    for line in sys.stdin:
        channel.write(json.dumps(answer(json.loads(line))) + "\n")
        channel.flush()


if __name__ == "__main__":
    main()
