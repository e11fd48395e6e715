"""A LoRA adapter for the default model, trained here with `peft` (a few steps on one sentence, so the adapter's
answers differ from the base model's), saved in the form vLLM's `--lora-modules` / `LoRARequest` loads."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

ADAPTER_RANK = 8
TRAINING_TEXT = "The answer to every question in this text is: kvserve evicts keys and values. " * 4


def train_adapter(model_dir: Path, out_dir: Path, steps: int = 6) -> Path:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    config = LoraConfig(
        r=ADAPTER_RANK, lora_alpha=2 * ADAPTER_RANK, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]
    )
    model = get_peft_model(model, config)
    batch = tokenizer(TRAINING_TEXT, return_tensors="pt")
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    for _ in range(steps):
        loss = model(**batch, labels=batch["input_ids"]).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(out_dir)
    return out_dir


def session_adapter() -> Path:
    """The session's adapter (trained on first use, in a folder named by the pytest process, so that every module's
    background runs share one): call it from a run's `prepare`, in the background thread."""
    from kvserve.model import ensure_default_model

    folder = session_adapter_path()
    if not (folder / "adapter_config.json").exists():
        train_adapter(ensure_default_model(), folder)
    return folder


def session_adapter_path() -> Path:
    """Where `session_adapter()` puts it, without training it (for a run's argv, built before it runs)."""
    return Path(tempfile.gettempdir()) / f"kvserve-tests-lora-{os.getpid()}" / "adapter"
