"""The default model dtype for this CPU: bfloat16 where the CPU multiplies bf16 natively, float32 elsewhere.

vLLM's own default for a float32 checkpoint on CPU is bfloat16. That is the fast choice on CPUs with AMX tiles or
AVX512-BF16, which multiply bf16 natively, and several times slower than float32 on CPUs without either, where
bf16 is emulated. `kvserve serve` and the benchmarks pass `--dtype` from here unless the user gives one, so
kvserve and vanilla vLLM are compared in the same dtype.
"""

from __future__ import annotations

from pathlib import Path

BF16_FLAGS = ("amx_bf16", "avx512_bf16")  # /proc/cpuinfo names of native bf16 matrix / dot-product support


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The feature flags of the first CPU in /proc/cpuinfo (or in the text given)."""
    if cpuinfo is None:
        path = Path("/proc/cpuinfo")
        cpuinfo = path.read_text() if path.exists() else ""
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        if name.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def default_dtype(flags: set[str] | None = None) -> tuple[str, str]:
    """(dtype, why) for this CPU's flags."""
    flags = cpu_flags() if flags is None else flags
    native = [flag for flag in BF16_FLAGS if flag in flags]
    if native:
        return "bfloat16", f"the CPU has native bf16 ({', '.join(native)})"
    return "float32", (
        "no native bf16 on this CPU (neither amx_bf16 nor avx512_bf16): bf16 would be emulated, several times slower"
    )


def has_dtype_flag(args: list[str]) -> bool:
    return any(arg == "--dtype" or arg.startswith("--dtype=") for arg in args)


def with_default_dtype(engine_args: list[str], program: str) -> list[str]:
    """A benchmark's engine flags with `--dtype` set to this CPU's default when they name none (every server it starts
    gets the same), saying so."""
    if has_dtype_flag(engine_args):
        return engine_args
    dtype, why = default_dtype()
    print(f"{program}: --dtype {dtype} for every server: {why}", flush=True)
    return [*engine_args, "--dtype", dtype]
