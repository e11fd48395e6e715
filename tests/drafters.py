"""A draft model of another KV-cache shape that computes what the default model computes: the default model with
each KV head repeated for every query head of its group (9 KV heads of 64 where the default has 3). Attention
reads the same keys and values per query head, so it drafts the target's own tokens, while vLLM gives its layers a
cache shape of their own (one KV-cache group of mixed shapes with the target's). Built once into kvserve's cache
folder from the default model's weights; nothing is downloaded."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from kvserve.model import cache_dir, ensure_default_model


def repeated_heads_twin() -> Path:
    import torch
    from safetensors.torch import load_file, save_file

    folder = cache_dir() / "tiny-models" / "default-repeated-kv-heads"
    if (folder / "model.safetensors").exists():
        return folder
    source = Path(ensure_default_model())
    config = json.loads((source / "config.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    group = heads // kv_heads
    weights = load_file(source / "model.safetensors")
    for name, weight in weights.items():
        if name.endswith(("k_proj.weight", "v_proj.weight", "k_proj.bias", "v_proj.bias")):
            per_head = weight.reshape(kv_heads, -1, *weight.shape[1:])
            weights[name] = per_head.repeat_interleave(group, dim=0).reshape(-1, *weight.shape[1:]).contiguous()
    config["num_key_value_heads"] = heads
    partial = folder.with_name(f"{folder.name}.partial-{os.getpid()}")  # two test sessions may build it at once
    shutil.copytree(source, partial)
    save_file(
        {name: w.to(torch.float32) if w.is_floating_point() else w for name, w in weights.items()},
        partial / "model.safetensors",
        metadata={"format": "pt"},
    )
    (partial / "config.json").write_text(json.dumps(config, indent=2))
    try:
        partial.rename(folder)  # complete or absent, never half-written
    except OSError:  # another process renamed its complete copy there first: use that one
        shutil.rmtree(partial, ignore_errors=True)
    return folder
