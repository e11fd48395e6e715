"""A plain PyTorch Llama forward (and Qwen2's: Llama with query/key/value biases) over a Hugging Face checkpoint,
with Attention-Gates: training and the offline
reference for the served `attention_gate` policy. No vLLM, no transformers model code: every operation is here.

Attention follows "In-context KV-Cache Eviction for LLMs via Attention-Gate", Zeng et al. 2024, arXiv:2410.12876, Eq.
4/7: query s sees key t if t = s, or t < s and t's keep flag is 1 for that KV head. The mask is applied multiplicatively
to exp(scores), so the keep flags can carry a straight-through gradient (forward: exact 0/1 masking; backward: d/d flag
of the normalised weights), with no large additive constants.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from kvserve.gates.module import GatePast, straight_through
from kvserve.gates.shape import LlamaShape
from kvserve.policies.rotary import Rotary


def masked_softmax(scores: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """softmax over the kept keys only; `keep` (0/1, possibly with a straight-through gradient) multiplies exp."""
    hard = keep.detach() > 0.5
    peak = scores.detach().masked_fill(~hard, float("-inf")).amax(dim=-1, keepdim=True)
    # Masked keys may score far above the kept maximum (attention sinks: measured up to +38). Capping them at the kept
    # maximum changes nothing forward (kept scores are <= peak; masked weights are multiplied by exactly 0) but bounds
    # the straight-through gradient of a masked key at that of the strongest kept key: with a cap of +30 a few sink
    # tokens gave gradients of e^30 and dominated every training step (gate gradient norm 2.6e4 vs 40).
    weights = torch.exp((scores - peak).clamp(max=0.0)) * keep
    return weights / weights.sum(dim=-1, keepdim=True)


def gate_keep_matrix(flags: torch.Tensor, recent: int = 0) -> torch.Tensor:
    """flags [B, n, H] -> keep [B, H, n (query), n (key)] of Eq. 7: 1 on the diagonal, flag_t below, 0 above; with
    a `recent` window (`GateHyper.recent`) also 1 for the `recent` keys just before each query, whatever their flag."""
    n = flags.shape[1]
    below = torch.tril(torch.ones(n, n, dtype=torch.bool), diagonal=-1)
    keep = flags.transpose(1, 2)[:, :, None, :] * below  # [B, H, 1, n] x [n, n]
    if recent:
        band = below & ~torch.tril(torch.ones(n, n, dtype=torch.bool), diagonal=-recent - 1)
        keep = torch.where(band, torch.ones_like(keep), keep)
    return keep + torch.eye(n, dtype=flags.dtype)


def streaming_keep_matrix(n: int, sinks: int, recent: int) -> torch.Tensor:
    """[n (query), n (key)] 0/1: what a streaming head sees (DuoAttention, StreamingLLM): the first `sinks` keys and
    the `recent` newest up to the query itself, causally."""
    query, key = torch.arange(n)[:, None], torch.arange(n)[None, :]
    return ((key <= query) & ((key < sinks) | (key > query - recent))).float()


@dataclass
class GatedOutput:
    logits: torch.Tensor  # [B, n, vocab]
    keep_probability: list[torch.Tensor]  # per layer, [B, n, H_kv]
    flags: list[torch.Tensor]  # per layer, [B, n, H_kv] (0/1 floats; straight-through when training)
    hidden: torch.Tensor | None = None  # [B, n, hidden] the last layer's normalised output (before the LM head)


class PlainLlama(torch.nn.Module):
    """Frozen Llama weights; `forward(ids, gates)` runs the model with the gates' masks."""

    def __init__(self, model_dir: str | Path) -> None:
        super().__init__()
        model_dir = Path(model_dir)
        config = json.loads((model_dir / "config.json").read_text())
        model_type = config.get("model_type", "llama")
        if model_type not in ("llama", "qwen2"):  # what every operation below implements
            raise ValueError(f"the reference model runs Llama and Qwen2 checkpoints, not {model_type!r}")
        self.shape = LlamaShape.from_config(config)
        weights: dict[str, torch.Tensor] = {}
        for path in sorted(model_dir.glob("*.safetensors")):
            weights.update(load_file(path))
        self.weights = {name.removeprefix("model."): w.float() for name, w in weights.items()}
        self.weights.setdefault("lm_head.weight", self.weights["embed_tokens.weight"])  # tied embeddings
        for tensor in self.weights.values():
            tensor.requires_grad_(False)

    def _w(self, layer: int, name: str) -> torch.Tensor:
        return self.weights[f"layers.{layer}.{name}.weight"]

    def _project(self, x: torch.Tensor, layer: int, name: str) -> torch.Tensor:
        """x @ W^T, plus the bias where the checkpoint has one (Qwen2's query, key and value projections)."""
        bias = self.weights.get(f"layers.{layer}.{name}.bias")
        out = x @ self._w(layer, name).T
        return out if bias is None else out + bias

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.shape.rms_eps) * weight

    def forward(
        self,
        input_ids: torch.Tensor,
        gates=None,
        train_gates: bool = False,
        forced_keep: torch.Tensor | None = None,
        visible: list[torch.Tensor] | None = None,
        head_mix: torch.Tensor | None = None,
        streaming: tuple[int, int] = (0, 0),
        observe=None,
    ) -> GatedOutput:
        """input_ids [B, n]. Without gates: the plain causal model. `forced_keep` [n] (bool): positions always kept
        regardless of the gate (decode-time tokens, which the gate does not judge). `visible`, without gates: per
        layer [H_kv, n (query), n (key)] bool, which keys each query of each KV head sees (any keep rule, per head).
        `head_mix` [L, H_kv] in [0, 1] (DuoAttention's gates): each KV head's attention is head_mix x full causal
        attention + (1 - head_mix) x streaming attention over `streaming` = (sinks, recent) keys.
        `observe(layer, attention, values, hidden)`, if given, sees each layer's attention weights [B, Hq, n, n],
        values [B, n, Hq, D] (repeated per query head) and the residual stream entering the layer [B, n, hidden]."""
        s = self.shape
        batch, n = input_ids.shape
        positions = torch.arange(n)
        rotary = Rotary.default(s.head_dim, s.rope_theta, n)  # Llama's plain RoPE (from_config refuses scaled ones)
        hidden = F.embedding(input_ids, self.weights["embed_tokens.weight"])
        probabilities, all_flags = [], []
        for layer in range(s.num_layers):
            x = self._rms(hidden, self.weights[f"layers.{layer}.input_layernorm.weight"])
            q = self._project(x, layer, "self_attn.q_proj").view(batch, n, s.num_heads, s.head_dim)
            k = self._project(x, layer, "self_attn.k_proj").view(batch, n, s.num_kv_heads, s.head_dim)
            v = self._project(x, layer, "self_attn.v_proj").view(batch, n, s.num_kv_heads, s.head_dim)
            if gates is None:
                flags = torch.ones(batch, n, s.num_kv_heads)
            else:
                gate = gates[layer]
                logits, _ = gate(q.reshape(batch, n, -1))
                probability = gate.keep_probability(logits)
                flags = (
                    straight_through(probability, gate.hyper.tau)
                    if train_gates
                    else (probability > gate.hyper.tau).float()
                )
                forced = positions < gate.hyper.sink_tokens
                if forced_keep is not None:
                    forced = forced | forced_keep
                flags = torch.where(forced[None, :, None], torch.ones_like(flags), flags)
                probabilities.append(probability)
                all_flags.append(flags)
            q = rotary.rotate(q.transpose(0, 1), positions).transpose(0, 1)  # positions lead: [n, B, heads, D]
            k = rotary.rotate(k.transpose(0, 1), positions).transpose(0, 1)
            group = s.num_heads // s.num_kv_heads
            if visible is not None:
                keep = visible[layer][None].float().repeat_interleave(group, dim=1)
            else:
                recent = gates.hyper.recent if gates is not None else 0
                keep = gate_keep_matrix(flags, recent).repeat_interleave(group, dim=1)  # [B, Hq, n, n]
            scores = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(group, dim=2)) / s.head_dim**0.5
            attention = masked_softmax(scores, keep)
            if head_mix is not None:  # outputs are linear in the weights: mixing weights mixes the outputs
                mix = head_mix[layer].repeat_interleave(group)[None, :, None, None]
                stream = masked_softmax(scores, streaming_keep_matrix(n, *streaming))
                attention = mix * attention + (1 - mix) * stream
            values = v.repeat_interleave(group, dim=2)
            if observe is not None:
                observe(layer, attention, values, hidden)
            mixed = torch.einsum("bhqk,bkhd->bqhd", attention, values)
            hidden = hidden + mixed.reshape(batch, n, -1) @ self._w(layer, "self_attn.o_proj").T
            x = self._rms(hidden, self.weights[f"layers.{layer}.post_attention_layernorm.weight"])
            gated = F.silu(x @ self._w(layer, "mlp.gate_proj").T) * (x @ self._w(layer, "mlp.up_proj").T)
            hidden = hidden + gated @ self._w(layer, "mlp.down_proj").T
        hidden = self._rms(hidden, self.weights["norm.weight"])
        return GatedOutput(hidden @ self.weights["lm_head.weight"].T, probabilities, all_flags, hidden)

    @torch.no_grad()
    def greedy(self, prompt_ids: list[int], max_tokens: int, gates=None) -> tuple[list[int], list[torch.Tensor]]:
        """Greedy decoding, the gate judging prompt tokens only (decode-time tokens are always kept, as in the
        Attention-Gate paper). Returns the tokens and each layer's prompt keep flags [n_prompt, H_kv]. Recomputes the
        whole sequence per token (the gate is causal, so prompt flags do not change): slow, but it shares no code with
        serving."""
        tokens = list(prompt_ids)
        flags: list[torch.Tensor] = []
        recent = gates.hyper.recent if gates is not None else 0
        for _ in range(max_tokens):
            # decode tokens, and the prompt's last `recent` (every later query's window held them), are kept
            forced = torch.arange(len(tokens)) >= len(prompt_ids) - recent
            out = self.forward(torch.tensor([tokens]), gates, forced_keep=forced)
            if not flags and gates is not None:
                flags = [f[0, : len(prompt_ids)].bool() for f in out.flags]
            tokens.append(int(out.logits[0, -1].argmax()))
        return tokens[len(prompt_ids) :], flags


__all__ = [
    "GatePast",
    "GatedOutput",
    "LlamaShape",
    "PlainLlama",
    "gate_keep_matrix",
    "masked_softmax",
    "streaming_keep_matrix",
]
