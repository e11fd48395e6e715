"""The kernels on a GPU: the fused decode kernel (`python -m kvserve_kernels.bench --out ...`) against itself
without statistics and against a plain PyTorch path, and the compiled kernel tests. GPUs are lent to some sessions
only; the page shows the newest run per device and dtype."""

from __future__ import annotations

from pathlib import Path

from kvserve.tools.markdown import table
from kvserve.tools.report.sources import DataDir, Source

# the H200 runs of `kvserve_kernels.bench` (2026-11-27, kvserve 0.17, and 2026-12-04, 0.27: one file, two runs) in the
# dtype the models serve in; their float16 twin and the H100 runs (2026-11-24, 0.1: older kernels) stay in docs/eval
RUNS = ("kernels/h200-bf16.json",)


def _cell(values: list, fmt: str) -> str:
    shown = [(v if isinstance(v, str) else format(v, fmt)) if v is not None else "-" for v in values]
    return " / ".join(dict.fromkeys(shown)) if len(set(shown)) == 1 else " / ".join(shown)


def decode_table(source: Source) -> str:
    runs = source.data["runs"]
    rows = []
    for index, row in enumerate(runs[0]):
        same = [run[index] for run in runs]
        rows.append(
            [
                ", ".join(map(str, row["shape"])),
                _cell([r["plain_ms"] for r in same], ".3f"),
                _cell([100 * r["plain_peak_fraction"] if r["plain_peak_fraction"] else None for r in same], ".0f"),
                _cell([100 * r["h2o_overhead"] for r in same], "+.0f") + "%",
                _cell([100 * r["fused_overhead"] for r in same], "+.0f") + "%",
                _cell([f"{r['torch_over_plain']:.0f}x" if r["torch_over_plain"] else None for r in same], ""),
            ]
        )
    headers = ["shape (requests, tokens, query heads, KV heads, head dim, block)", "plain ms", "% of peak bandwidth"]
    return table([*headers, "H2O sums overhead", "all statistics overhead", "PyTorch / plain"], rows)


def section(data: DataDir, plots: Path, plot_link: str) -> str:
    parts = [
        "## The kernels on a GPU",
        "Median of `triton.testing.do_bench`, L2 flushed; bandwidth: K and V bytes read over time against the data "
        "sheet's peak. `plain`: the decode kernel alone; overheads: with H2O's column sums, or with every statistic "
        "(H2O's, TOVA's, MAT's). A repeated run's cells show each run (first / second).",
    ]
    for name in RUNS:
        source = data.load(name)
        parts += [f"### {source.data['device']}, {source.data['dtype']}", decode_table(source)]
        tests = source.data.get("tests")
        if tests:
            # the run's note (what failed first and where it was fixed) is history: it stays in the file
            parts.append(
                f"Kernel tests compiled on this device: {tests['passed']} passed in {tests['seconds']} s "
                f"(`{tests['command']}`)."
            )
        parts.append(source.caption())
    return "\n\n".join(parts)
