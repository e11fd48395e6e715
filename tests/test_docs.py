"""docs/adding-a-policy.md works as written: its policy file and registry entry, applied to a copy of the package,
give a policy that the contract test (tests/policies/test_contract.py, unedited) finds and passes."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent
GUIDE = ROOT / "docs" / "adding-a-policy.md"


def _blocks_by_path(text: str) -> dict[str, str]:
    """The guide's code blocks whose fence names a file: ```python kvserve/policies/x.py"""
    return {path: body for path, body in re.findall(r"```python (\S+)\n(.*?)```", text, flags=re.S)}


def test_the_guide_adds_a_policy_the_contract_test_covers(tmp_path):
    blocks = _blocks_by_path(GUIDE.read_text())
    registry_path = "kvserve/policies/__init__.py"
    assert registry_path in blocks and len(blocks) == 2, list(blocks)
    (new_file,) = (path for path in blocks if path != registry_path)
    shutil.copytree(ROOT / "kvserve", tmp_path / "kvserve", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / new_file).write_text(blocks[new_file])

    registry = tmp_path / registry_path
    lines = registry.read_text().splitlines()
    new_import, *new_registry = blocks[registry_path].strip().splitlines()
    (entry,) = [i for i, line in enumerate(lines) if line.startswith("BASE_POLICIES")]
    end = entry if lines[entry].endswith(")") else lines.index(")", entry)  # the tuple, on one line or several
    lines[entry : end + 1] = new_registry
    lines.insert(max(i for i, line in enumerate(lines) if line.startswith("from kvserve.policies.")) + 1, new_import)
    registry.write_text("\n".join(lines) + "\n")

    name = re.search(r'name = "(\w+)"', blocks[new_file]).group(1)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-v",
            "-p",
            "no:cacheprovider",
            str(ROOT / "tests" / "policies" / "test_contract.py"),
            "-k",
            name,
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    passed = re.findall(r"::(\w+)\[([^\]]*)\] PASSED", done.stdout)  # (test, its parameter id: "0-keynorm", ...)
    covered = {part for _, ids in passed for part in ids.split("-") if part.startswith(name)}
    assert covered == {name, f"{name}+caote", f"{name}+fastcaote"}, done.stdout[-3000:]
    tests = {test for test, _ in passed}
    contract = set(
        re.findall(r"^def (test_\w+)", (ROOT / "tests" / "policies" / "test_contract.py").read_text(), flags=re.M)
    )
    # every contract test ran for it, except those for ragged policies and for policies with their own counts
    assert tests == contract - {t for t in contract if "ragged" in t or "own_counts" in t}, sorted(contract - tests)


def test_the_guides_sizing_table_computes_each_models_bytes_per_token_from_its_shape():
    """docs/guide/deployment.md, "Sizing the pool": a token's KV entries take 2 (keys, values) x layers x KV heads x
    head size x 2 bytes (bf16); each row's last column is that product of its own columns, and the default model's row
    is the served model's config."""
    import json

    from kvserve.model import ensure_default_model

    page = (ROOT / "docs" / "guide" / "deployment.md").read_text()
    section = page[page.index("## Sizing the pool") : page.index("\n## ", page.index("## Sizing the pool") + 1)]
    row = r"^\| (\S[^|]*?) \| (\d+) \| (\d+) \| (\d+) \| ([\d,]+) \((\d+(?:\.\d+)?) KiB\) \|$"
    rows = re.findall(row, section, re.M)
    assert len(rows) >= 6 and any("8B" in row[0] for row in rows)
    for model, layers, heads, head_size, per_token, kib in rows:
        computed = 2 * int(layers) * int(heads) * int(head_size) * 2
        assert int(per_token.replace(",", "")) == computed and float(kib) == computed / 1024, model
    config = json.loads((ensure_default_model() / "config.json").read_text())
    default = next(row for row in rows if "(default)" in row[0])
    head_size = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    assert (int(default[1]), int(default[2]), int(default[3])) == (
        config["num_hidden_layers"],
        config["num_key_value_heads"],
        head_size,
    )
