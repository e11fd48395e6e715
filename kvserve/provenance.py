"""Where and how a result was measured: the machine, the date, the exact command and kvserve's version.

Every benchmark and evaluation command records this beside its data (`kvserve.tools.bench`: a "provenance" key in its
JSON;
`kvserve eval`: one line per run in `<out>.runs.jsonl`), and the benchmarks page (`kvserve report`) prints it under
each table, so a number is never read without the machine it ran on. Timings from different machines are not
comparable: the CPUs this project runs on differ in their bf16 support (AMX tiles, AVX512-BF16, AVX2 only).
"""

from __future__ import annotations

import datetime as dt
import os
import platform
import shlex
import sys
from pathlib import Path

from kvserve.cpu_dtype import cpu_flags

# The CPU features that decide vLLM's CPU path and kvserve's default dtype (kvserve.cpu_dtype), in that order.
CPU_FLAGS = ("amx_bf16", "amx_tile", "avx512_bf16", "avx512f", "avx2")


def cpu_model() -> str:
    """The CPU's model name as lscpu prints it (from /proc/cpuinfo), or the platform's processor string."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def present_flags() -> list[str]:
    """Those of `CPU_FLAGS` the CPU has (read by `kvserve.cpu_dtype.cpu_flags`, which picks the default dtype)."""
    have = cpu_flags()
    return [flag for flag in CPU_FLAGS if flag in have]


def machine() -> dict:
    """{cpu, cpu_flags, cores, gpu}: gpu is the CUDA device's name, or None."""
    gpu = None
    torch = sys.modules.get("torch")  # only ask CUDA where torch is loaded anyway (importing it costs seconds)
    if torch is not None and torch.cuda.is_available():
        gpu = torch.cuda.get_device_name(0)
    return {"cpu": cpu_model(), "cpu_flags": present_flags(), "cores": os.cpu_count(), "gpu": gpu}


def command_line(argv: list[str] | None = None, program: str = "kvserve") -> str:
    """The command as a user would type it again: `program` and the arguments, shell-quoted. A model folder that
    `kvserve setup-model` made is written as that command (`"$(kvserve setup-model NAME)"`), so the line runs on
    another machine and a result file names no home folder."""
    from kvserve.catalog import DEFAULT_NAME, SLICED_MODELS, model_dir
    from kvserve.model import default_model_dir

    arguments = sys.argv[1:] if argv is None else argv
    folders = {str(model_dir(model)): name for name, model in SLICED_MODELS.items()}
    folders[str(default_model_dir())] = DEFAULT_NAME
    portable = [_portable(argument, folders) for argument in arguments]
    return " ".join([*map(shlex.quote, shlex.split(program)), *portable])


def _portable(argument: str, folders: dict[str, str]) -> str:
    """`argument` shell-quoted, or the setup-model command of the model folder it names (`folders`: folder -> name)."""
    flag, equals, value = argument.rpartition("=") if argument.startswith("--") else ("", "", argument)
    name = folders.get(value.rstrip("/"))
    if name is None:
        return shlex.quote(argument)
    return (
        f'{shlex.quote(flag + equals)}"$(kvserve setup-model {name})"' if equals else f'"$(kvserve setup-model {name})"'
    )


def provenance(command: str) -> dict:
    """What a result file records about its run."""
    from kvserve import __version__

    return {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d"),
        "command": command,
        "machine": machine(),
        "kvserve": __version__,
    }


def describe_machine(record: dict) -> str:
    """One line for a table's caption: 'AMD EPYC, 2 cores (avx512_bf16, avx512f, avx2; no AMX)' or the GPU."""
    if record.get("gpu"):
        return record["gpu"]
    flags = record.get("cpu_flags") or []
    listed = f"{', '.join(flags)}{'' if 'amx_bf16' in flags else '; no AMX'}" if flags else "flags not recorded"
    return f"{record.get('cpu') or 'CPU model not recorded'}, {record.get('cores') or '?'} cores ({listed})"
