"""Tiny random-weight models, one per attention variant, built from `transformers` configs with no download.

They exist to check that kvserve serves every kind of model vanilla vLLM serves (tests/test_models.py) and to
measure eviction on a hybrid local/global model (`kvserve bench capacity --model tiny:gemma3`). Their text is
noise, but it is deterministic noise: greedy decoding with the same cache gives the same tokens, which is what the
tests compare. Each uses the default model's tokenizer (so prompts and chat templates work) and 4 query / 2 KV
heads of 64 dimensions.

    python -m kvserve.tools.bench.tiny_models gemma3 ./gemma3   # prints the folder (default: kvserve's cache)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

from kvserve.model import cache_dir, ensure_default_model

SLIDING_WINDOW = 128

# architecture -> (transformers model_type, settings beyond the shared ones)
ARCHITECTURES: dict[str, tuple[str, dict]] = {
    "llama": ("llama", {"num_hidden_layers": 4}),
    "qwen2": ("qwen2", {"num_hidden_layers": 4}),
    "qwen3": ("qwen3", {"num_hidden_layers": 4}),
    "phi3": ("phi3", {"num_hidden_layers": 4}),
    # every layer windowed
    "mistral": ("mistral", {"num_hidden_layers": 4, "sliding_window": SLIDING_WINDOW}),
    # hybrid: 5 sliding-window layers to 1 global (transformers' default pattern), twice
    "gemma3": ("gemma3_text", {"num_hidden_layers": 12, "sliding_window": SLIDING_WINDOW}),
    # alternating 128-token windows, learned attention sinks, mixture of experts
    "gpt_oss": (
        "gpt_oss",
        {"num_hidden_layers": 4, "sliding_window": SLIDING_WINDOW, "num_local_experts": 4, "num_experts_per_tok": 2},
    ),
    # hybrid, alternating, with logit soft-capping
    "gemma2": ("gemma2", {"num_hidden_layers": 4, "sliding_window": SLIDING_WINDOW}),
}


def build(architecture: str, folder: Path) -> Path:
    """Write a tiny random-weight model of `architecture` into `folder` (once: an existing one is reused)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if architecture not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {architecture!r}; known: {', '.join(ARCHITECTURES)}")
    folder = Path(folder)
    if (folder / "config.json").exists() and (folder / "model.safetensors").exists():
        return folder
    tokenizer = AutoTokenizer.from_pretrained(ensure_default_model())
    model_type, settings = ARCHITECTURES[architecture]
    config = AutoConfig.for_model(
        model_type,
        vocab_size=len(tokenizer),
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=4096,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
        **settings,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    partial = folder.with_name(f"{folder.name}.partial-{os.getpid()}")  # two test sessions may build it at once
    model.save_pretrained(partial, safe_serialization=True)
    tokenizer.save_pretrained(partial)
    config_path = partial / "config.json"
    written = json.loads(config_path.read_text())
    written["torch_dtype"] = "float32"
    config_path.write_text(json.dumps(written, indent=2))
    try:
        partial.rename(folder)  # complete or absent, never half-written
    except OSError:  # another process renamed its complete copy there first: use that one
        shutil.rmtree(partial, ignore_errors=True)
        if not (folder / "model.safetensors").exists():
            raise
    return folder


def tiny_model(architecture: str) -> Path:
    """The tiny model of `architecture` in kvserve's cache folder, built on first use."""
    return build(architecture, cache_dir() / "tiny-models" / architecture)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("architecture", choices=sorted(ARCHITECTURES))
    parser.add_argument("folder", type=Path, nargs="?", help="default: kvserve's cache folder")
    args = parser.parse_args()
    folder = tiny_model(args.architecture) if args.folder is None else build(args.architecture, args.folder)
    print(folder)


if __name__ == "__main__":
    main()
