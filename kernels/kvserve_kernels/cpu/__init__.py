"""The CPU kernel: paged attention with the eviction statistics in the same pass (`paged_attention.cpp`).

A C++ PyTorch operator compiled on first use with the compiler vLLM's CPU backend already relies on (g++ and ninja,
through `torch.utils.cpp_extension`), for the machine it runs on (`-march=native`), and cached under
`$TORCH_EXTENSIONS_DIR` (default `~/.cache/torch_extensions`): the first process builds it (about a minute), later
ones load the cached library. `available()` says whether it built; callers fall back to their PyTorch path when it
did not, and `build_error()` says why. `KVSERVE_CPU_KERNEL=0` turns it off (the PyTorch path everywhere).

The contract, which `kvserve_kernels.reference` states in PyTorch and the tests hold it to: see `paged_attention`.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

ENV = "KVSERVE_CPU_KERNEL"
SOURCE = Path(__file__).with_name("paged_attention.cpp")
LAYOUTS = {"vec": 0, "amx": 1}  # vLLM's CPU attention ISA -> the kernel's page format
DTYPES = (torch.float32, torch.bfloat16)

_lock = threading.Lock()
_state: dict[str, object] = {}


def enabled() -> bool:
    """Whether the kernel may be used at all ($KVSERVE_CPU_KERNEL, default on)."""
    value = os.environ.get(ENV, "1").strip().lower()
    if value not in ("0", "1", "false", "true", "off", "on"):
        raise ValueError(f"{ENV} must be 1 or 0, got {value!r}")
    return value in ("1", "true", "on")


def load() -> bool:
    """Build (once per machine and source) and load the operator; False, with the reason kept, when it cannot."""
    with _lock:
        if "loaded" in _state:
            return bool(_state["loaded"])
        try:
            from torch.utils import cpp_extension

            if shutil.which("ninja") is None:  # torch runs `ninja` from PATH; vLLM's CPU wheel installs it here
                os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
            cpp_extension.load(
                name="kvserve_cpu_attention",
                sources=[str(SOURCE)],
                # -fopenmp: ATen's parallel_for is OpenMP in these headers; the library then binds to the libgomp
                # torch has loaded already (same soname), so the kernel shares torch's threads and their core binding
                extra_cflags=["-O3", "-march=native", "-mprefer-vector-width=512", "-fno-math-errno", "-fopenmp"],
                extra_ldflags=["-fopenmp"],
                is_python_module=False,
                verbose=False,
            )
            _state["loaded"] = True
        except Exception as error:  # no compiler, no headers: the PyTorch path serves, and says why once
            _state["loaded"] = False
            _state["error"] = f"{type(error).__name__}: {error}"
            logger.warning("kvserve: the CPU attention kernel did not build (%s); using the PyTorch path", error)
        return bool(_state["loaded"])


def available() -> bool:
    """The kernel is enabled and built (builds it on the first call)."""
    return enabled() and load()


def build_error() -> str | None:
    return _state.get("error")  # type: ignore[return-value]


def supports(pages: torch.Tensor, layout: str) -> bool:
    """Whether the kernel reads this page view: a CPU cache of float32 or bfloat16 in the vec or amx format, with
    block and head sizes that are multiples of 16 (its vector width)."""
    block_size, head_size = pages.shape[2], pages.shape[3] // 2
    return (
        pages.device.type == "cpu"
        and pages.dtype in DTYPES
        and layout in LAYOUTS
        and block_size % 16 == 0
        and head_size % 16 == 0
        and available()
    )


def paged_attention(
    queries: torch.Tensor,
    pages: torch.Tensor,
    layout: str,
    tables: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    *,
    gain: torch.Tensor | None = None,
    valid: torch.Tensor | None = None,
    key_positions: torch.Tensor | None = None,
    query_positions: torch.Tensor | None = None,
    recent: int = 0,
    output: bool = True,
    sums: bool = True,
    first_logits: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Attention of Q queries per row over page lists, with the statistics from the same logits.

    `queries` [R, Q, G, D] (float32 or the cache's dtype) are the newest Q entries' queries of each row, oldest
    first: query i of row r sits at list index lengths[r] - Q + i and sees entries up to it. `pages` is the page view
    [P, 1, bs, 2 * D] in `layout` ("vec" or "amx"); `tables` [R, W] each row's page ids, `lengths` [R] its entries.
    Returns:
    - output [R, Q, G, D] in the queries' dtype: softmax(q . k * scale) . v (None with `output=False`, and never
      with a `gain`);
    - sums [R, max(lengths)] float32: each entry's probability summed over the row's queries and group, zero past a
      row's length; with `gain` [R, Q] each query's logits are multiplied by its gain first (AhaKV);
    - first logits [R, Q * G] float32 (query-major): each query head's q . k_0 * scale, before any gain.

    With `valid` [R, >= max(lengths)] (bool), `key_positions` (its shape, the entries' token positions) and
    `query_positions` [R, Q], a query sees, besides its own entry, only the earlier entries that are valid or lie
    within `recent` positions before it (Attention-Gate's mask, arXiv:2410.12876).
    """
    if not load():
        raise RuntimeError(f"kvserve's CPU attention kernel is not available: {build_error()}")
    queries = queries.contiguous()
    result = torch.ops.kvserve_cpu.paged_attention(
        queries,
        pages,
        LAYOUTS[layout],
        tables.long().contiguous(),
        lengths.long().contiguous(),
        float(scale),
        None if gain is None else gain.float().contiguous(),
        None if valid is None else valid.bool().contiguous(),
        None if key_positions is None else key_positions.long().contiguous(),
        None if query_positions is None else query_positions.long().contiguous(),
        int(recent),
        output,
        sums,
        first_logits,
    )
    return result[0] if output else None, result[1] if sums else None, result[2] if first_logits else None
