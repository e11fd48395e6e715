"""The memory allocator of the serving processes: tcmalloc where it is installed, else glibc with a fixed mmap
threshold.

Scoring makes large temporaries of a different size every step (they grow with the cache). glibc's adaptive mmap
threshold then serves them from the heap, which fragments: a worker's memory grew with every long h2o request. A
fixed 1 MiB threshold cures that but costs throughput (every large temporary is a fresh, zeroed mmap; measured:
docs/benchmarks.md, section "Memory over long evicting requests"). vLLM's CPU documentation recommends preloading
tcmalloc, which does neither (Debian: `libtcmalloc-minimal4`). `kvserve serve` and the benchmarks' servers (vanilla
too) get the environment from here; `KVSERVE_ALLOCATOR=glibc` keeps glibc.
"""

from __future__ import annotations

import ctypes.util
import os
from pathlib import Path

from kvserve.environment import declared

ALLOCATOR_ENV = declared("KVSERVE_ALLOCATOR")
GLIBC_MMAP_THRESHOLD = 1 << 20
TCMALLOC_PATHS = (
    "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",  # Debian / Ubuntu: libtcmalloc-minimal4
    "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib64/libtcmalloc_minimal.so.4",  # Fedora / RHEL: gperftools-libs
    "/usr/lib/libtcmalloc_minimal.so.4",
)


def find_tcmalloc() -> str | None:
    for path in TCMALLOC_PATHS:
        if Path(path).exists():
            return path
    name = ctypes.util.find_library("tcmalloc_minimal")
    return name if name and Path(name).is_absolute() else None


def allocator_env(env: dict[str, str] | os._Environ) -> tuple[dict[str, str], str]:
    """The variables to add to `env` for a server process, and one line saying which allocator and why."""
    preload = env.get("LD_PRELOAD", "")
    if "tcmalloc" in preload:
        return {}, f"allocator: tcmalloc (already in LD_PRELOAD={preload})"
    choice = env.get(ALLOCATOR_ENV, "auto")
    if choice not in ("auto", "tcmalloc", "glibc"):
        raise SystemExit(f"kvserve: {ALLOCATOR_ENV} must be auto, tcmalloc or glibc, not {choice!r}")
    library = find_tcmalloc() if choice != "glibc" else None
    if library is not None:
        return {"LD_PRELOAD": f"{library} {preload}".strip()}, f"allocator: tcmalloc ({library})"
    if choice == "tcmalloc":
        raise SystemExit(f"kvserve: {ALLOCATOR_ENV}=tcmalloc but libtcmalloc_minimal.so.4 is not installed")
    added = {} if "MALLOC_MMAP_THRESHOLD_" in env else {"MALLOC_MMAP_THRESHOLD_": str(GLIBC_MMAP_THRESHOLD)}
    why = (
        "as asked"
        if choice == "glibc"
        else "tcmalloc not found: `apt-get install libtcmalloc-minimal4` for more throughput"
    )
    threshold = added.get("MALLOC_MMAP_THRESHOLD_", env.get("MALLOC_MMAP_THRESHOLD_"))
    return added, f"allocator: glibc with MALLOC_MMAP_THRESHOLD_={threshold} against fragmentation ({why})"
