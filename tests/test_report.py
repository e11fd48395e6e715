"""The benchmarks page is generated from the committed result files (`kvserve report`), the runs are recorded with
their machine, date and command, and the version is reported where users look for it."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvserve import __version__
from kvserve.config import BUILTIN_DEFAULTS
from kvserve.provenance import command_line, describe_machine, provenance
from kvserve.tools.bench.__main__ import CEILING
from kvserve.tools.eval.__main__ import record_run, runs_file
from kvserve.tools.eval.client import label_of
from kvserve.tools.report.page import build
from kvserve.tools.report.sources import Source

REPO = Path(__file__).resolve().parent.parent
PAGE = REPO / "docs" / "benchmarks.md"
DATA = REPO / "docs" / "eval"


def guide_pages() -> list[Path]:
    """The user's guide: its pages by task (docs/guide/*.md)."""
    pages = sorted((REPO / "docs" / "guide").glob("*.md"))
    assert pages, "no user's guide (docs/guide/*.md)"
    return pages


def test_the_committed_page_is_what_the_data_gives(tmp_path):
    rebuilt = build(DATA, PAGE, root=REPO, plots=tmp_path)
    assert rebuilt == PAGE.read_text(), (
        "docs/benchmarks.md is stale: run `kvserve report docs/eval -o docs/benchmarks.md`"
    )
    for link in re.findall(r"!\[[^]]*\]\(([^)]+)\)", rebuilt):
        assert (PAGE.parent / link).exists(), f"the page links a missing plot: {link}"
        assert (tmp_path / Path(link).name).exists(), f"the build did not draw {link}"


def test_a_changed_number_in_the_data_changes_the_page(tmp_path):
    """The page is generated, not pasted: a throughput in the chat result file shows up in the rebuilt page."""
    data = tmp_path / "docs" / "eval"
    shutil.copytree(DATA, data)
    chat = data / "chat" / "chat.json"
    record = json.loads(chat.read_text())
    vanilla = next(r for r in record["results"] if r["server"] == "vanilla")
    before = build(data, tmp_path / "docs" / "benchmarks.md", root=tmp_path, plots=tmp_path / "plots")
    vanilla["output_tokens_per_s"] = 12345.6
    chat.write_text(json.dumps(record))
    after = build(data, tmp_path / "docs" / "benchmarks.md", root=tmp_path, plots=tmp_path / "plots")
    assert "12345.6" in after and "12345.6" not in before


def test_a_result_file_without_its_run_is_refused(tmp_path):
    data = tmp_path / "docs" / "eval"
    shutil.copytree(DATA, data)
    crash = data / "crash.json"
    record = json.loads(crash.read_text())
    del record["provenance"]
    crash.write_text(json.dumps(record))
    with pytest.raises(ValueError, match="crash.json records no run"):
        build(data, tmp_path / "docs" / "benchmarks.md", root=tmp_path, plots=tmp_path / "plots")


def test_every_table_names_its_machine_date_and_command():
    """Under each table (or the tables of one section): its files, each machine with its dates, and each file's
    latest command, folded; a caption's commands are as many as its files, in their order."""
    text = PAGE.read_text()
    data_lines = re.findall(r"^Data: (`docs/eval/[^`]+`(?:, `docs/eval/[^`]+`)*)\.$", text, flags=re.M)
    assert len(data_lines) >= 15
    captions = re.findall(
        r"^Data: ((?:`[^`]+`(?:, )?)+)\.\n"
        r"((?:Machine: [^\n]+; \d{4}-\d\d-\d\d(?: to \d{4}-\d\d-\d\d)?(?: \([^\n]+\))?\.\n)+)"
        r"\n<details><summary>[^<]+</summary>\n\n```\n(.+?)\n```",
        text,
        flags=re.M | re.S,
    )  # the latest command of each file folded under the table
    assert len(captions) == len(data_lines)
    for files, machines, commands in captions:
        for machine in re.findall(r"^Machine: (.+?); \d{4}", machines, flags=re.M):
            assert "cores" in machine or "H100" in machine or "H200" in machine
        named = re.findall(r"`([^`]+)`", files)
        lines = commands.splitlines()
        assert len(lines) == len(named), (named, lines)  # one command per file, in the files' order
        for command in lines:
            program = re.sub(r"^(\w+=\S+ )+", "", command)  # after environment settings
            assert re.match(r"(python3? -m kvserve(_kernels)?[. ]|kvserve )", program), command


def test_one_caption_for_several_files_names_which_ran_where():
    """Files of one section share a caption: each machine once with the dates of its runs, naming the files that ran
    there only when the machines differ, and each file's latest command in the files' order."""
    from kvserve.tools.report.sources import captions

    def run(cpu: str, date: str, out: str) -> dict:
        machine = {"cpu": cpu, "cpu_flags": ["avx2"], "cores": 2, "gpu": None}
        return {"date": date, "command": f"kvserve bench capacity --out {out}", "machine": machine}

    first = Source("docs/eval/a.json", {}, [run("EPYC", "2026-11-01", "a.json"), run("EPYC", "2026-11-03", "a.json")])
    second = Source("docs/eval/b.json", {}, [run("EPYC", "2026-11-02", "b.json")])
    elsewhere = Source("docs/eval/c.json", {}, [run("Xeon", "2026-11-04", "c.json")])
    same = captions([first, second]).splitlines()
    assert same[:2] == [
        "Data: `docs/eval/a.json`, `docs/eval/b.json`.",
        "Machine: EPYC, 2 cores (avx2; no AMX); 2026-11-01 to 2026-11-03.",
    ]
    assert same[-5:-3] == ["kvserve bench capacity --out a.json", "kvserve bench capacity --out b.json"]
    mixed = captions([first, elsewhere]).splitlines()
    assert mixed[1:3] == [
        "Machine: EPYC, 2 cores (avx2; no AMX); 2026-11-01 to 2026-11-03 (`a.json`).",
        "Machine: Xeon, 2 cores (avx2; no AMX); 2026-11-04 (`c.json`).",
    ]
    assert captions([first]) == first.caption()


def test_the_page_has_no_repeated_heading():
    """Each section once (a section listed twice in page.SECTIONS printed its heading twice), and no heading twice
    under one parent heading: a reader (and the table of contents) tells every heading from its siblings. The same
    model's name may head a subsection in several sections."""
    page = PAGE.read_text()

    def siblings(text: str, level: int) -> list[tuple[str, str]]:
        """The headings of `level` directly in `text`, each with its own text up to the next one."""
        parts = re.split(rf"^{'#' * level} (.+)$", text, flags=re.M)
        return list(zip(parts[1::2], parts[2::2], strict=True))

    def check(text: str, level: int) -> None:
        found = siblings(text, level)
        titles = [title for title, _ in found]
        assert len(titles) == len(set(titles)), sorted({t for t in titles if titles.count(t) > 1})
        for _, body in found:
            if level < 4:
                check(body, level + 1)

    check(page, 2)


def test_an_eval_run_is_recorded_beside_its_results(tmp_path):
    out = tmp_path / "tasks.jsonl"
    record_run(out, ["tasks", "--policies", "snapkv", "--out", str(out)])
    record_run(out, ["tasks", "--policies", "tova", "--out", str(out)])
    runs = [json.loads(line) for line in runs_file(out).read_text().splitlines()]
    assert runs_file(out).name == "tasks.runs.jsonl"
    assert [r["command"].split()[4] for r in runs] == ["snapkv", "tova"]
    assert runs[0]["command"].startswith("kvserve eval tasks")
    assert runs[0]["kvserve"] == __version__ and runs[0]["machine"]["cores"] >= 1


def test_provenance_names_this_machine():
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    record = provenance("kvserve bench capacity")
    flags = record["machine"]["cpu_flags"]
    assert ("amx_bf16" in flags) == (" amx_bf16" in cpuinfo)
    assert ("avx2" in flags) == (" avx2" in cpuinfo)
    described = describe_machine(record["machine"])
    assert record["machine"]["cpu"] in described and ("no AMX" in described) == ("amx_bf16" not in flags)


def test_recorded_command_names_setup_model_folders_by_the_command_that_makes_them():
    from kvserve.model import default_model_dir

    folder = str(default_model_dir())
    arguments = ["bench", "capacity", "--model", folder, f"--tokenizer={folder}/", "--kvserve-args", "--kv-profile a"]
    line = command_line(arguments, program="printf '%s\\n'")
    assert folder not in line and '"$(kvserve setup-model smollm2-135m)"' in line
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    printed = subprocess.run(["bash", "-c", line], capture_output=True, text=True, check=True, env=env).stdout
    assert printed.splitlines() == [*arguments[:4], f"--tokenizer={folder}", *arguments[5:]]


def test_version_is_one_semver_reported_by_the_cli_and_listed_in_the_changelog():
    assert re.fullmatch(r"\d+\.\d+\.\d+", __version__)
    printed = subprocess.run(
        [sys.executable, "-m", "kvserve.cli", "--version"], capture_output=True, text=True, check=True
    ).stdout
    assert printed.startswith(f"kvserve {__version__} ")
    changelog = (REPO / "CHANGELOG.md").read_text()
    versions = re.findall(r"^## \[(\d+\.\d+\.\d+)\] - \d{4}-\d\d-\d\d$", changelog, flags=re.M)
    assert versions and versions[0] == __version__, "CHANGELOG.md's newest section must be the package's version"
    ordered = [tuple(map(int, v.split("."))) for v in versions]
    assert ordered == sorted(ordered, reverse=True)


def test_the_readme_results_are_what_the_data_gives():
    """The README's results (one small table per model) are the block `kvserve report` builds from docs/eval."""
    from kvserve.tools.report import readme
    from kvserve.tools.report.sources import DataDir

    text = (REPO / "README.md").read_text()
    assert readme.update(REPO / "README.md", DataDir(DATA, REPO)) == text, (
        "README.md's results are stale: run `kvserve report docs/eval -o docs/benchmarks.md`"
    )
    block = text[text.index(readme.START) : text.index(readme.END)]
    assert block.count("| `snapkv` (server default) |") == 2  # a table per model
    assert "tasks, 1k-4k tokens)" in block and "tasks, 4k tokens)" in block  # each share says its task set


def test_the_readmes_default_row_shows_the_defaults_own_setting_and_names_any_other():
    """The server default's row is the default's own setting, even where another setting of its policy scores more;
    where the default's setting did not run at the row's budgets, the best one that did is shown under its label."""
    from kvserve.tools.eval.suite import Suite
    from kvserve.tools.report import readme

    default, other = readme.DEFAULT_LABEL, f"{readme.DEFAULT_POLICY}:kernel_size=7/span8"

    def rows(label: str, budget: int | None, correct: int) -> list[dict]:
        return [
            {"policy": label, "budget": budget, "task": "passkey", "length": 1000, "score": float(i < correct)}
            for i in range(4)
        ]

    full = rows("full", None, 4)
    both = Suite.from_rows(full + rows(default, 256, 2) + rows(other, 256, 4))
    cells = both.judged_cells(readme.FLOOR)
    assert readme.quality(both, cells, readme.DEFAULT_POLICY, (256,)).startswith("50% (")
    only_other = Suite.from_rows(full + rows(other, 256, 3))
    assert readme.quality(only_other, cells, readme.DEFAULT_POLICY, (256,)).startswith(f"`{other}`: 75% (")


def test_a_changed_number_in_the_data_changes_the_readme(tmp_path):
    from kvserve.tools.report import readme
    from kvserve.tools.report.sources import DataDir

    data = tmp_path / "docs" / "eval"
    shutil.copytree(DATA, data)
    before = readme.results_block(DataDir(data, tmp_path))
    capacity = data / "qwen05" / "capacity-decode-heavy.json"
    record = json.loads(capacity.read_text())
    vanilla = next(r for r in record["results"] if r["server"] == "vanilla")
    snapkv = next(r for r in record["results"] if r["server"] == "kvserve" and r["policy"] == "snapkv")
    vanilla["output_tokens_per_s"] /= 10
    capacity.write_text(json.dumps(record))
    after = readme.results_block(DataDir(data, tmp_path))
    tenfold = f"{snapkv['output_tokens_per_s'] / vanilla['output_tokens_per_s']:.2f}x (B={snapkv['budget']})"
    assert tenfold in after and tenfold not in before
    with pytest.raises(ValueError, match="no results block"):
        readme.with_results("# a README without markers\n", after)


def test_the_guides_compatibility_matrix_is_what_its_file_gives(tmp_path):
    """The guide's matrix is the block `kvserve report` builds from docs/eval/compatibility.json (which
    tests/test_compatibility.py holds to what the probes observe), a row per feature in the file's order."""
    from kvserve.tools.report import compatibility
    from kvserve.tools.report.sources import DataDir

    guide = REPO / compatibility.GUIDE
    assert compatibility.update(guide, DataDir(DATA, REPO)) == guide.read_text(), (
        f"{compatibility.GUIDE}'s matrix is stale: run `kvserve report docs/eval -o docs/benchmarks.md`"
    )
    data = tmp_path / "docs" / "eval"
    shutil.copytree(DATA, data)
    matrix = json.loads((data / compatibility.MATRIX).read_text())
    matrix["rows"][0]["kvserve"] = "refused (n): a changed outcome"
    (data / compatibility.MATRIX).write_text(json.dumps(matrix))
    block = compatibility.block(DataDir(data, tmp_path))
    assert f"| {matrix['rows'][0]['feature']} | {matrix['rows'][0]['request']} |" in block
    assert "refused (n): a changed outcome |" in block
    assert block.count("\n| ") == len(matrix["rows"]) + 2  # the header, its rule and a row per feature


def test_the_summary_agrees_with_the_sections_it_summarises():
    """The summary's share of full and its interval for each policy and budget are the quality table's, and its
    throughput cell for the default is the decode-heavy table's ratio."""
    page = PAGE.read_text()
    summary = page[page.index("## Summary") : page.index("## On kvpress")]
    whole = page[page.index("## How much quality") : page.index("### The single-needle suite")]
    rows = [line for line in summary.splitlines() if line.startswith("| `")]
    assert rows[0].startswith("| `snapkv` **(default)**")
    # the default is the suite's best setting of its policy: the row shows the setting a request gets
    assert f"`snapkv` **(default)** | {label_of(BUILTIN_DEFAULTS).removeprefix('snapkv').lstrip('/:')} |" in rows[0]
    header = next(line for line in whole.splitlines() if line.startswith("| policy | best setting |"))
    columns = [cell.strip() for cell in header.strip("|").split("|")]
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        policy = cells[0].split()[0]
        quality_row = next(line for line in whole.splitlines() if line.startswith(f"| {policy} |"))
        quality_cells = [cell.strip().strip("*") for cell in quality_row.strip("|").split("|")]
        shares = [quality_cells[columns.index(f"B={budget}")] for budget in (128, 256, 512)]
        for share, cell in zip(shares, cells[2:5], strict=True):
            if share == "-":
                assert cell == "-"
                continue
            # "92% [84-100%] (0.764)" on the quality table, "92% (84-100%)" in the summary
            value, interval = share.split(" (")[0].split(" [")
            assert cell == f"{value} ({interval.rstrip(']')})", (policy, cell, share)
    throughput = page[page.index("### Decode-heavy at 8x") : page.index("The same benchmark across budgets")]
    default_row = next(line for line in throughput.splitlines() if line.startswith("| `snapkv` B=188 |"))
    against_vanilla = default_row.split("|")[5].strip()
    assert f"| {against_vanilla} (B=188) |" in rows[0]


def test_the_page_opens_with_its_figures_and_stays_within_its_budget(tmp_path):
    """The figures a reader decides by come first (after the header), each drawn by this build; every section that
    has a figure opens with it; the page is at most 10,000 words."""
    from kvserve.tools.report import headline

    page = build(DATA, PAGE, root=REPO, plots=tmp_path)
    sections = page.split("\n## ")
    assert sections[1].startswith(headline.TITLE.removeprefix("## "))
    opening = re.findall(r"!\[[^]]*\]\(([^)]+)\)", sections[1])
    assert [Path(link).name for link in opening] == ["ruler4k-qwen05.png", headline.THROUGHPUT_PNG, "long-prompts.png"]
    drawn = {path.name for path in tmp_path.glob("*.png")}
    linked = {Path(link).name for link in re.findall(r"!\[[^]]*\]\(([^)]+)\)", page)}
    assert drawn == linked, "every PNG drawn is on the page and every PNG on the page is drawn"
    assert drawn == {path.name for path in (PAGE.parent / PAGE.stem).glob("*.png")}, "docs/benchmarks/ is stale"
    for part in re.split(r"\n#{2,4} ", page)[1:]:  # each section's own text, up to the next heading
        body = part.split("\n\n")
        if body[0] != headline.TITLE.removeprefix("## ") and any(paragraph.startswith("![") for paragraph in body):
            assert body[1].startswith("!["), f"the section {body[0]!r} does not open with its figure"


def test_the_page_is_at_most_ten_thousand_words():
    """As `wc -w` counts, outside the collapsed <details> blocks (each table's command, the RULER per-task scores):
    a reader opens those on demand, and they grow with the data while the prose does not. Both counts are bounded:
    the whole page, blocks included, stays under half as much again."""
    page = PAGE.read_text()
    read = re.sub(r"<details>.*?</details>", "", page, flags=re.S)
    assert len(read.split()) <= 10_000
    assert len(page.split()) <= 15_000


def test_what_the_docs_say_kv_checkpoint_keeps_is_what_the_data_gives():
    """The guide gives the checkpoint default's reason in one sentence built from
    docs/eval/checkpoint/ (each policy's share of full at kv_checkpoint=512 on both models); a changed result changes
    the sentence, so a copy typed by hand fails here."""
    from kvserve.tools.report.parity import checkpoint_sentence
    from kvserve.tools.report.sources import DataDir

    sentence = checkpoint_sentence(DataDir(REPO / "docs" / "eval", REPO))
    assert re.search(r"KVzip keeps \d+% of full on Qwen2.5-Coder-0.5B \(KeyDiff \d+%, SnapKV \d+%\)", sentence)
    # (the README's is in its generated results); the sentence may wrap anywhere. Where the guide gives the reason
    # (it may point to the page instead), it is this sentence: a copy typed by hand, once the data moves, fails here.
    text = " ".join(" ".join(page.read_text().split()) for page in guide_pages())
    if "KVzip keeps" in text:
        assert sentence in text, f"the guide ({', '.join(map(str, guide_pages()))}) does not say: {sentence}"


def capacity_result(vanilla: float, ceiling: float, kvserve: float, name: str) -> Source:
    args = {"prompts": 4, "prompt_tokens": 1000, "max_tokens": 24, "num_blocks": 8, "block_size": 128}
    results = [
        {"server": "vanilla", "policy": "full", "budget": None, "output_tokens_per_s": vanilla},
        {"server": CEILING, "policy": "full", "budget": None, "output_tokens_per_s": ceiling},
        {"server": "kvserve", "policy": "snapkv", "budget": 128, "output_tokens_per_s": kvserve},
        {"server": "kvserve", "policy": "snapkv", "budget": 128, "output_tokens_per_s": 1.0, "ranks": 2},
    ]
    return Source(name, {"args": args, "results": results}, [])


def test_the_throughput_figure_draws_each_server_with_bands_from_repeated_runs(tmp_path):
    """Three made-up runs of one workload: vanilla's line from its pool to the ceiling's, the ceiling's line, kvserve's
    point, each the runs' mean with a 95% band; a model with one run has no band and says so; rows at 2 ranks are
    another workload's."""
    from kvserve.tools.report.figures import throughput_plot, throughput_points
    from kvserve.tools.report.intervals import mean_interval

    runs = [capacity_result(10 + i, 40 + i, 45 + 2 * i, f"run{i}.json") for i in range(3)]
    repeated = throughput_points(runs)
    once = throughput_points(runs[:1])
    # each run over its own vanilla (the machine divides out); the 2-rank row is left out
    assert repeated["kvserve snapkv B=128"] == (1024, [45 / 10, 47 / 11, 49 / 12])
    assert repeated["vanilla vLLM"] == (1024, [1.0, 1.0, 1.0])
    assert repeated["ceiling"][0] == 4 * 8 * 128  # every request whole: 4 x 8 blocks of 128
    png = tmp_path / "throughput.png"
    panels = throughput_plot([("A", repeated), ("B", once)], png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    banded, single = (dict(zip(*ax.get_legend_handles_labels()[::-1], strict=True)) for ax in panels)
    assert set(banded) == {
        "vanilla vLLM (3 runs, 95% band)",
        "ceiling: vanilla, a pool for every request (4,096 tokens) (3 runs, 95% band)",
        "kvserve snapkv B=128 (3 runs, 95% band)",
    }
    assert all(label.endswith("(one run: no band)") for label in single)
    vanilla_line = next(line for line in panels[0].get_lines() if line.get_label().startswith("vanilla"))
    ceiling_ratios = [40 / 10, 41 / 11, 42 / 12]
    assert list(vanilla_line.get_xdata()) == [1024, 4096]
    assert list(vanilla_line.get_ydata()) == pytest.approx([1, mean_interval(ceiling_ratios)[0]])
    bands = [[c for c in ax.collections if type(c).__name__ == "FillBetweenPolyCollection"] for ax in panels]
    assert len(bands[0]) == 2 and len(panels[0].patches) == 1  # vanilla's and kvserve's bands, the ceiling's span
    assert len(panels[1].collections) == 0 and len(panels[1].patches) == 0  # one run: no band
    low, high = bands[0][0].get_paths()[0].get_extents().intervaly
    # vanilla's band: from its own (no spread: 1 in every run) at its pool to the ceiling's at the ceiling's pool
    assert (low, high) == pytest.approx((1, mean_interval(ceiling_ratios)[2]))
    with pytest.raises(ValueError, match="not run0.json's workload"):
        other = capacity_result(1, 2, 3, "other.json")
        other.data["args"]["num_blocks"] = 9
        throughput_points([runs[0], other])


def test_the_ttft_figure_draws_a_band_over_each_lengths_cases_and_none_for_one_case(tmp_path):
    from kvserve.tools.report.figures import ttft_plot

    rows = [
        {"policy": policy, "budget": budget, "length": length, "ttft_s": seconds}
        for policy, budget, scale in (("full", None, 2.0), ("keydiff", 1024, 1.0))
        for length, cases in ((4000, 3), (8000, 3), (32000, 1))
        for seconds in [scale * length / 1000 + case for case in range(cases)]
    ]
    png = tmp_path / "ttft.png"
    ax = ttft_plot(rows, png, "test")
    assert png.exists()
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert set(lines) == {"full", "keydiff B=1024, every chunk"}
    assert list(lines["full"].get_xdata()) == [4000, 8000, 32000]
    assert list(lines["full"].get_ydata()) == [9.0, 17.0, 64.0]  # each length's mean over its cases
    assert len(ax.collections) == 2 and "one case at 32,000 tokens: no band" in ax.get_title()
