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
from kvserve.tools.eval.__main__ import record_run, runs_file
from kvserve.tools.eval.client import label_of
from kvserve.tools.report.page import build

REPO = Path(__file__).resolve().parent.parent
PAGE = REPO / "docs" / "benchmarks.md"
DATA = REPO / "docs" / "eval"


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
    text = PAGE.read_text()
    tables = len(re.findall(r"^Data: `docs/eval/[^`]+`\.$", text, flags=re.M))
    assert tables >= 15
    captions = re.findall(
        r"^Data: `[^`]+`\.\nMachine: (.+); (\d{4}-\d\d-\d\d)\.\n\n<details><summary>[^<]+</summary>\n\n```\n(.+)",
        text,
        flags=re.M,
    )  # the commands folded under the table
    assert len(captions) == tables
    for machine, _, command in captions:
        assert "cores" in machine or "H100" in machine or "H200" in machine
        program = re.sub(r"^(\w+=\S+ )+", "", command)  # after environment settings
        assert re.match(r"(python3? -m kvserve(_kernels)?[. ]|kvserve )", program), command


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


def test_the_readme_quotes_no_number_outside_its_generated_results_and_reads_in_five_minutes():
    """Issue 66: the README quoted shares and ratios typed by hand that drifted from the data. Outside the generated
    block it quotes none (no N%, no N.NNx), and it stays at most 1,000 words (`wc -w`)."""
    from kvserve.tools.report import readme

    text = (REPO / "README.md").read_text()
    outside = text[: text.index(readme.START)] + text[text.index(readme.END) :]
    assert re.findall(r"\b\d+(?:\.\d+)?(?:%|x\b)", outside) == ["8x"]  # the B=512 / 4k-token ratio, arithmetic
    assert "4k-token prompt at B=512 is 8x" in outside
    assert len(text.split()) <= 1000


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


def test_the_summary_agrees_with_the_sections_it_summarises():
    """The summary's share of full and its interval for each policy and budget are the quality table's (the whole
    suite's table, or the single-needle one for a policy that ran only that), and its throughput cells are the
    capacity table's ratios."""
    page = PAGE.read_text()
    summary = page[page.index("## Summary") : page.index("On the second model")]
    whole = page[page.index("## How much quality") : page.index("### The single-needle suite")]
    single = page[page.index("### The single-needle suite") : page.index("### On an fp8")]
    rows = [line for line in summary.splitlines() if line.startswith("| `")]
    assert rows[0].startswith("| `snapkv` **(default)**")
    # the default is the suite's best setting of its policy: the row shows the setting a request gets
    assert f"`snapkv` **(default)** | {label_of(BUILTIN_DEFAULTS).removeprefix('snapkv').lstrip('/:')} |" in rows[0]
    assert {row.split("|")[3].strip() for row in rows} == {"all tasks", "single needle"}
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        policy, tasks = cells[0].split()[0], cells[2]
        section = whole if tasks == "all tasks" else single
        header = next(line for line in section.splitlines() if line.startswith("| policy | best setting |"))
        columns = [cell.strip() for cell in header.strip("|").split("|")]
        quality_row = next(line for line in section.splitlines() if line.startswith(f"| {policy} |"))
        quality_cells = [cell.strip().strip("*") for cell in quality_row.strip("|").split("|")]
        shares = [quality_cells[columns.index(f"B={budget}")] for budget in (128, 256, 512)]
        for share, cell in zip(shares, cells[3:6], strict=True):
            if share == "-":
                assert cell == "-"
                continue
            # "92% [84-100%] (0.764)" on the quality table, "92% (84-100%)" in the summary
            value, interval = share.split(" (")[0].split(" [")
            assert cell == f"{value} ({interval.rstrip(']')})", (policy, cell, share)
    # the second model's table in the summary is its section's
    second = page[page.index("On the second model") : page.index("What a request holds")]
    section = page[page.index("## A second model") : page.index("### Side by side with the default model")]
    table = [line for line in second.splitlines() if line.startswith("| ")]
    assert len(table) > 3 and all(line in section.splitlines() for line in table)
    throughput = page[page.index("### Decode-heavy at 8x") : page.index("The same benchmark across budgets")]
    assert "| `snapkv` B=188 | 9 | 8 | 110.3 | 1.98x |" in throughput and "| 1.98x (B=188) |" in summary


def test_every_share_and_ratio_architecture_md_quotes_is_in_the_data():
    """architecture.md's design notes quote measurements: each share (%) and ratio (x) stands on the generated page
    or in the gates' training record (docs/gates/findings.md, its table of recipes), so none drifts from the data."""
    quoted = re.findall(r"\b\d+(?:\.\d+)?(?:%|x\b)", (REPO / "docs" / "architecture.md").read_text())
    assert len(quoted) >= 40
    data = PAGE.read_text() + (REPO / "docs" / "gates" / "findings.md").read_text()
    assert [number for number in quoted if number not in data] == []


def test_every_share_and_ratio_the_guide_quotes_is_in_the_data():
    """The guide's shares (%), ratios (x) and measured times and sizes stand on the generated page or in the gates'
    training record, as architecture.md's do, so a number typed by hand that the data does not hold fails here."""
    guide = (REPO / "docs" / "guide.md").read_text()
    quoted = re.findall(r"\b\d+(?:\.\d+)?(?:%|x\b)", guide)
    assert len(quoted) >= 100
    data = PAGE.read_text() + (REPO / "docs" / "gates" / "findings.md").read_text()
    assert [number for number in quoted if number not in data] == []
    # measured times and sizes (a decimal: not a setting like "300 s") stand there too, as the page prints them
    measured = re.findall(r"\b(\d+\.\d+) (?:s|min|minutes|GB)\b", guide)
    assert len(measured) >= 20
    assert [number for number in measured if number not in data] == []


def test_a_multikey_answer_counts_as_right_exactly_where_the_suite_scores_it_right():
    """The hard half's answer kinds agree with the eval's own scorer on every recorded answer, and an answer that
    repeats the value's first digits and then strays is told from another number."""
    from kvserve.tools.eval.tasks import score
    from kvserve.tools.report.multikey import MISSES, MODELS, miss_kind

    for _, name in MODELS:
        for line in (DATA / name).read_text().splitlines():
            row = json.loads(line)
            assert (miss_kind(row["answer"], row["references"][0]) == MISSES[0]) == (
                score(row["answer"], row["references"]) == 1.0
            ), row
    assert miss_kind(" 4705.", "4705172") == MISSES[1] and miss_kind(" 4705179.", "4705172") == MISSES[1]
    assert miss_kind(" 1732526.", "4705172") == MISSES[2] and miss_kind(" The answer is", "4705172") == MISSES[3]


def test_what_the_docs_say_kv_checkpoint_keeps_is_what_the_data_gives():
    """The guide gives the checkpoint default's reason in one sentence built from
    docs/eval/checkpoint/ (each policy's share of full at kv_checkpoint=512 on both models); a changed result changes
    the sentence, so a copy typed by hand fails here."""
    from kvserve.tools.report.parity import checkpoint_sentence
    from kvserve.tools.report.sources import DataDir

    sentence = checkpoint_sentence(DataDir(REPO / "docs" / "eval", REPO))
    assert re.search(r"KVzip keeps \d+% of full on Qwen2.5-Coder-0.5B \(KeyDiff \d+%, SnapKV \d+%\)", sentence)
    for doc in ("docs/guide.md",):  # (the README's is in its generated results)
        text = " ".join((REPO / doc).read_text().split())  # the sentence may wrap anywhere
        assert sentence in text, f"{doc} does not say: {sentence}"
