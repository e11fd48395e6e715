"""The reference pages (docs/reference/) are what the code declares: the committed pages equal a fresh generation,
and each page's rows match the declarations they come from (settings, policy knobs, the commands' parsers, the
metrics registry, the environment variables), so a knob, flag, series or variable without its row fails."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pytest

from kvserve import effective_defaults
from kvserve.config import INTERNAL_KEYS, knob_keys
from kvserve.effective_defaults import shown
from kvserve.environment import VARIABLES, declared
from kvserve.policies import BASE_POLICIES, SnapKV, knob
from kvserve.settings import GENERAL_KEYS, SETTINGS, Setting
from kvserve.tools.reference import cli, environment, metrics
from kvserve.tools.reference import settings as settings_page
from kvserve.tools.reference.__main__ import OUT, differences, generate, main


@pytest.fixture(scope="module")
def pages() -> dict[str, str]:
    return generate()


def rows(text: str) -> list[list[str]]:
    """Each table row's cells (header and separator rows included; the tests look rows up by their cells)."""
    return [[cell.strip() for cell in line.strip("|").split(" | ")] for line in text.splitlines() if line[:2] == "| "]


def test_the_committed_pages_are_a_fresh_generation(pages):
    assert differences(pages, OUT) == "", "run: python -m kvserve.tools.reference -o docs/reference"


def test_check_exits_with_the_difference(pages, tmp_path, capsys):
    for name, text in pages.items():
        (tmp_path / name).write_text(text)
    main(["-o", str(tmp_path), "--check"])  # equal: passes
    (tmp_path / "metrics.md").write_text(pages["metrics.md"].replace("| counter |", "| gauge |", 1))
    with pytest.raises(SystemExit, match="differ"):
        main(["-o", str(tmp_path), "--check"])
    assert "+| `kvserve:" in capsys.readouterr().out


def test_every_general_setting_has_its_row(pages):
    table = {row[0]: row for row in rows(pages["settings.md"])}
    for setting in SETTINGS:
        row = table[f"`{setting.key}`"]
        assert row[1] == (f"`{setting.header}`" if setting.request else "")
        assert row[3] == (f"`{setting.flag}`" if setting.server else "")
        assert row[5] == setting.kind
    assert "`kv_session`" in table  # the guide's old table left it out
    # every key the parser takes is on the page: general ones, knobs, and those only kvserve sets
    for key in (*GENERAL_KEYS, *knob_keys(), *INTERNAL_KEYS):
        assert f"`{key}`" in pages["settings.md"], key


def test_every_policy_knob_has_its_row_with_its_default(pages):
    table = {(row[0], row[1]): row for row in rows(pages["settings.md"])}
    for cls in BASE_POLICIES:
        for setting in cls.knobs().values():
            row = table[(f"`{cls.name}`", f"`{setting.key}`")]
            assert row[2] == f"`{setting.header}`" and row[6] == f"`{shown(setting.default)}`"
            assert row[8] == " ".join(setting.help.split())


@dataclass(frozen=True, kw_only=True)
class _NewPolicy(SnapKV):
    name: ClassVar[str] = "new_policy"
    reach: int = knob(3, "a knob added after the page was written", minimum=1)


def test_a_new_knob_or_setting_changes_the_page(monkeypatch):
    committed = (OUT / "settings.md").read_text()
    monkeypatch.setattr(settings_page, "BASE_POLICIES", (*BASE_POLICIES, _NewPolicy))
    page = settings_page.page()
    assert "| `new_policy` | `kv_reach` | `x-kv-reach` |" in page and page != committed
    monkeypatch.setattr(settings_page, "BASE_POLICIES", BASE_POLICIES)
    added = (*SETTINGS, Setting("kv_new", "int", "a new setting"))
    monkeypatch.setattr(settings_page, "SETTINGS", added)
    monkeypatch.setattr(effective_defaults, "SETTINGS", added)
    assert "| `kv_new` | `x-kv-new` |" in settings_page.page()


def test_which_policies_read_a_setting_is_the_parsers_answer():
    by_key = {setting.key: setting for setting in SETTINGS}
    readers = {cls.name for cls in BASE_POLICIES if settings_page.reads(by_key["kv_span"], cls)}
    assert "snapkv" in readers and "streamingllm" not in readers  # spans sum scores; StreamingLLM has none
    assert not any(settings_page.reads(by_key["kv_session"], cls) for cls in BASE_POLICIES)


def test_every_command_and_flag_is_on_its_page(pages):
    from kvserve.cli import SUBCOMMANDS

    found = cli.commands()
    assert {command.split()[1] for command, _ in found} == set(SUBCOMMANDS)
    for command, parser in found:
        page = pages[cli.page_of(command)]
        section = page.split(f"## `{command}`\n", 1)[1].split("\n## ", 1)[0]
        for action in parser._actions:
            for option in action.option_strings:
                if option not in ("-h", "--help"):
                    assert f"`{option}`" in section, (command, option)


def test_serve_lists_kvserves_flags_only(pages):
    serve = pages["cli.md"].split("## `kvserve serve`\n", 1)[1].split("\n## ", 1)[0]
    assert "`--kv-budget`" in serve and "`--max-model-len`" not in serve and "docs.vllm.ai" in pages["cli.md"]
    budget = next(row for row in rows(serve) if row[0] == "`--kv-budget`")
    assert budget[1] == "`1024`"  # the default its help shows, though argparse's is None


def test_every_series_has_its_row_and_renames_are_marked(pages):
    table = {row[0]: row for row in rows(pages["metrics.md"])}
    deprecated = getattr(metrics.metrics, "DEPRECATED_METRICS", {})
    for series in vars(metrics.metrics._series()).values():
        name = metrics.served_name(series)
        if name in deprecated:
            continue
        row = table[f"`{name}`"]
        assert row[1].split()[0] == series._type
        assert row[2] == ", ".join(f"`{label}`" for label in series._labelnames)
    for old, new in deprecated.items():
        assert table[f"`{old}`"][3] == f"deprecated: use `{new}`"


def test_every_environment_variable_the_code_names_is_declared(pages):
    sources = environment.package_sources()
    assert environment.undeclared(sources) == {}
    assert environment.unused(sources) == []
    table = {row[0] for row in rows(pages["environment.md"])}
    assert {f"`{variable.name}`" for variable in VARIABLES} <= table


def test_an_undeclared_variable_is_found():
    breach = {
        "kvserve/leak.py": "import os\nNEW_ENV = 'KVSERVE_NEW'\nos.environ.get('HOME_DIR')\nos.environ['PATH']\n",
        "kvserve/other.py": "from vllm import envs\nif envs.VLLM_SOMETHING:\n    pass\n",
    }
    assert environment.undeclared(breach) == {
        "HOME_DIR": ["kvserve/leak.py"],
        "KVSERVE_NEW": ["kvserve/leak.py"],
        "VLLM_SOMETHING": ["kvserve/other.py"],
    }
    with pytest.raises(KeyError, match="not declared"):
        declared("KVSERVE_NEW")
