"""Drafters for the default model, built once into kvserve's cache folder from its weights; nothing is downloaded.

- `repeated_heads_twin`: a draft model of another KV-cache shape that computes what the default model computes: the
  default model with each KV head repeated for every query head of its group (9 KV heads of 64 where the default has
  3). Attention reads the same keys and values per query head, so it drafts the target's own tokens, while vLLM gives
  its layers a cache shape of their own (one KV-cache group of mixed shapes with the target's).
- `eagle_head`, `eagle3_head`: EAGLE and EAGLE-3 heads in vLLM's layouts (`EagleLlamaForCausalLM`,
  `Eagle3LlamaForCausalLM`), trained here for a few hundred steps on pydoc's prose. They draft from the target's
  hidden states and keep a KV cache of their own: weak drafters (most drafts are rejected), and deterministic ones,
  which is all the tests need of them.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvserve.model import cache_dir, ensure_default_model


def built_once(name: str, build: Callable[[Path, Path], None]) -> Path:
    """The folder `name` under kvserve's tiny models, made by `build(default model folder, new folder)` the first
    time: complete or absent, never half-written; a process that finds another building it waits for that one."""
    folder = cache_dir() / "tiny-models" / name
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.with_name(f"{name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or when its process dies
        if not (folder / "model.safetensors").exists():
            partial = folder.with_name(f"{name}.partial-{os.getpid()}")
            shutil.rmtree(partial, ignore_errors=True)
            build(Path(ensure_default_model()), partial)
            partial.rename(folder)
    return folder


def repeated_heads_twin() -> Path:
    return built_once("default-repeated-kv-heads", _repeat_kv_heads)


def _repeat_kv_heads(source: Path, folder: Path) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    config = json.loads((source / "config.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    group = heads // kv_heads
    weights = load_file(source / "model.safetensors")
    for name, weight in weights.items():
        if name.endswith(("k_proj.weight", "v_proj.weight", "k_proj.bias", "v_proj.bias")):
            per_head = weight.reshape(kv_heads, -1, *weight.shape[1:])
            weights[name] = per_head.repeat_interleave(group, dim=0).reshape(-1, *weight.shape[1:]).contiguous()
    config["num_key_value_heads"] = heads
    shutil.copytree(source, folder)
    save_file(
        {name: w.to(torch.float32) if w.is_floating_point() else w for name, w in weights.items()},
        folder / "model.safetensors",
        metadata={"format": "pt"},
    )
    (folder / "config.json").write_text(json.dumps(config, indent=2))


def eagle_head() -> Path:
    return built_once("default-eagle-head", _train_eagle_head)


PROSE_TOKENS, TRAINING_STEPS, LENGTH = 16384, 200, 256  # about 2 min a head on a 2-core AVX2 machine


@dataclass
class Prose:
    """The default model (float32) run over pydoc's prose in rows of LENGTH tokens, and what a head's training reads
    of it: the rows' hidden states at `layers` as transformers numbers them (0 the embeddings, k the input of layer
    k, the last the final norm's output), and the positions, causal mask and RoPE of a row less its last token."""

    target: Any
    tokens: Any
    states: list
    positions: Any
    causal: Any
    rotary: Any

    def embedded(self, rows):
        """The target's embeddings of `rows`' tokens after the first (token p+1 beside position p)."""
        import torch

        with torch.no_grad():
            return self.target.model.embed_tokens(self.tokens[rows, 1:])


def _target_on_prose(source: Path, layers: tuple[int, ...]) -> Prose:
    import pydoc_data.topics

    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(source)
    target = LlamaForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    text = "\n".join(pydoc_data.topics.topics.values())
    ids = tokenizer(text[: PROSE_TOKENS * 6], add_special_tokens=False)["input_ids"][:PROSE_TOKENS]
    tokens = torch.tensor(ids[: len(ids) // LENGTH * LENGTH]).view(-1, LENGTH)
    with torch.no_grad():
        runs = []
        for row in tokens.split(1):
            states = target.model(input_ids=row, output_hidden_states=True).hidden_states
            runs.append([states[layer] for layer in layers])
    states = [torch.cat(layer) for layer in zip(*runs, strict=True)]
    positions = torch.arange(LENGTH - 1)[None]
    causal = torch.full((LENGTH - 1,) * 2, float("-inf")).triu(1)[None, None]
    return Prose(target, tokens, states, positions, causal, target.model.rotary_emb(states[-1], positions))


def _fit(parameters: list, loss_of, rows: int) -> None:
    """TRAINING_STEPS of AdamW on `loss_of(batch)`, a batch of 4 of the `rows` rows drawn at random each step."""
    import torch

    optimizer = torch.optim.AdamW(parameters, lr=1e-3)
    for _ in range(TRAINING_STEPS):
        loss_of(torch.randint(0, rows, (4,))).backward()
        optimizer.step()
        optimizer.zero_grad()


def _greedy_loss(target, out, wanted_hidden):
    """Cross-entropy of the head's logits `out` against the target's greedy tokens (from its final hidden states
    `wanted_hidden`), on 128 positions (the whole vocabulary at every position would take ten times as long)."""
    import torch

    sample = torch.randint(0, out.shape[0] * out.shape[1], (128,))
    with torch.no_grad():
        greedy = target.lm_head(wanted_hidden.flatten(0, 1)[sample]).argmax(-1)
    return torch.nn.functional.cross_entropy(target.lm_head(out.flatten(0, 1)[sample]), greedy)


def _save_head(source: Path, folder: Path, weights: dict) -> None:
    """A one-layer head's folder: the default model's config with one layer, its tokenizer, `weights` (vLLM shares
    the target's embeddings and LM head with a head that has none)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(source / name, folder / name)
    config = json.loads((source / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}, indent=2))
    weights = {name: weight.detach().contiguous() for name, weight in weights.items()}
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})


def _train_eagle_head(source: Path, folder: Path) -> None:
    """vLLM's EAGLE head for Llama (EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty,
    arXiv:2401.15077): at position p, `fc(concat(embed(token p+1), h_p))` through one decoder layer
    without its input norm, then the target's own LM head (no final norm), where h_p is the target's last hidden
    state (after its final norm). Trained to give h_{p+1} (EAGLE's feature regression, scaled to unit spread) and
    the target's greedy token p+2."""
    import torch
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    prose = _target_on_prose(source, (-1,))
    target, (hidden,) = prose.target, prose.states
    config = target.config
    layer = LlamaDecoderLayer(config, layer_idx=0)
    layer.input_layernorm = torch.nn.Identity()  # vLLM's EAGLE layer 0 has none
    fc = torch.nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
    with torch.no_grad():
        for name, weight in layer.named_parameters():
            if not name.endswith("layernorm.weight"):
                weight.normal_(0, 0.02)
        fc.weight.zero_()
        fc.weight[:, config.hidden_size :].copy_(torch.eye(config.hidden_size))  # starts as h_p itself
    spread = hidden.std()

    def loss_of(rows):
        features = fc(torch.cat([prose.embedded(rows), hidden[rows, :-1]], dim=-1))
        out = layer(
            features, attention_mask=prose.causal, position_ids=prose.positions, position_embeddings=prose.rotary
        )
        out = out[0] if isinstance(out, tuple) else out
        wanted = hidden[rows, 1:]
        regression = torch.nn.functional.smooth_l1_loss(out / spread, wanted / spread)
        return regression + 0.1 * _greedy_loss(target, out, wanted)

    _fit([*layer.parameters(), *fc.parameters()], loss_of, len(prose.tokens))
    weights = {"fc.weight": fc.weight}  # vLLM prefixes "model."
    for name, weight in layer.state_dict().items():
        if not name.startswith("input_layernorm"):
            weights[f"layers.0.{name}"] = weight
    _save_head(source, folder, weights)


def eagle3_head() -> Path:
    return built_once("default-eagle3-head", _train_eagle3_head)


def _train_eagle3_head(source: Path, folder: Path) -> None:
    """vLLM's EAGLE-3 head for Llama (EAGLE-3: Scaling up Inference Acceleration of Large Language Models via
    Training-Time Test, arXiv:2503.01840): at position p, x = fc(the target's hidden states entering layers 2, L/2
    and L-3, concatenated); one decoder layer whose attention reads concat(input_norm(embed(token p+1)),
    hidden_norm(x)) with x as its residual; the head's final norm; the target's LM head. Trained on the target's
    greedy token p+2."""
    import torch
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm

    layers = json.loads((source / "config.json").read_text())["num_hidden_layers"]
    prose = _target_on_prose(source, (2, layers // 2, layers - 3, -1))  # vLLM's default layers, then the last
    target, (*aux, hidden) = prose.target, prose.states
    aux, config = torch.cat(aux, dim=-1), target.config
    size = config.hidden_size
    attention = LlamaAttention(config, layer_idx=0)
    for name in ("q_proj", "k_proj", "v_proj"):  # they read the embedding and the hidden state side by side
        setattr(attention, name, torch.nn.Linear(2 * size, getattr(attention, name).out_features, bias=False))
    mlp = LlamaMLP(config)
    norm_names = ("input_layernorm", "hidden_norm", "post_attention_layernorm")
    norms = torch.nn.ModuleDict({name: LlamaRMSNorm(size, eps=config.rms_norm_eps) for name in norm_names})
    final_norm = LlamaRMSNorm(size, eps=config.rms_norm_eps)
    fc = torch.nn.Linear(3 * size, size, bias=False)
    with torch.no_grad():
        for module in (attention, mlp, fc):
            for weight in module.parameters():
                weight.normal_(0, 0.02)

    def loss_of(rows):
        x = fc(aux[rows, :-1])
        read = torch.cat([norms["input_layernorm"](prose.embedded(rows)), norms["hidden_norm"](x)], dim=-1)
        attended = attention(read, position_embeddings=prose.rotary, attention_mask=prose.causal)[0]
        residual = attended + x
        out = final_norm(mlp(norms["post_attention_layernorm"](residual)) + residual)
        return _greedy_loss(target, out, hidden[rows, 1:])

    modules = (attention, mlp, norms, final_norm, fc)
    _fit([weight for module in modules for weight in module.parameters()], loss_of, len(prose.tokens))
    weights = {"fc.weight": fc.weight, "norm.weight": final_norm.weight}  # vLLM reads "midlayer." as layer 0
    weights |= {f"midlayer.self_attn.{name}": weight for name, weight in attention.state_dict().items()}
    weights |= {f"midlayer.mlp.{name}": weight for name, weight in mlp.state_dict().items()}
    weights |= {f"midlayer.{name}": weight for name, weight in norms.state_dict().items()}
    _save_head(source, folder, weights)
