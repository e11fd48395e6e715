"""The gate: AG(X) = G(MHA'(X) + gamma, tau), one small causal attention per layer ("In-context KV-Cache Eviction for
LLMs via Attention-Gate", Zeng et al. 2024, arXiv:2410.12876, Eq. 5-6).

Input: the layer's queries BEFORE RoPE, flattened over heads ([n, num_q_heads * head_dim]). That is X W_q, a linear
image of the normalised hidden states X the paper feeds the gate (for the default model W_q is square, 576 x 576), and
it is what the serving attention backend can see: it un-rotates the queries it is handed with the model's own RoPE
table (`Rotary.unrotate`), so the gate runs inside vLLM's attention pass with no extra hook. MHA' has `heads` heads of
`head_dim` and an output projection to one logit per KV head (the model uses GQA: the gate decides per KV head
directly). MHA' is causal, so a token's flag depends only on its prefix and the gate runs chunk by chunk during chunked
prefill (`past` carries its K'/V').
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class GatePast:
    """The gate's own keys and values of the tokens seen so far: [B, heads, m, head_dim] each."""

    keys: torch.Tensor
    values: torch.Tensor


@dataclass(frozen=True)
class GateHyper:
    """Hyperparameters fixed at training time and stored with the weights."""

    heads: int = 2
    head_dim: int = 16
    tau: float = 0.5  # keep a token if sigmoid(logit + gamma) > tau
    gamma: float = 2.0  # initial bias towards keeping (Attention-Gate paper, CPT setting)
    # A fallback the gates are trained with, not part of the paper's method: StreamingLLM's guard (attention sinks
    # and a recent window, arXiv:2309.17453). No gate evicts the first `sink_tokens` tokens, and a query always sees
    # the `recent` tokens before it (so the prompt's last `recent` tokens stay). Files without these fields load 0.
    sink_tokens: int = 0
    recent: int = 0


class LayerGate(nn.Module):
    """One layer's Attention-Gate network (the `attention_gate` policy runs one per layer): a small attention over
    the layer's input whose logits flag, per token and KV head, whether its K/V is kept."""

    def __init__(self, in_dim: int, num_kv_heads: int, hyper: GateHyper) -> None:
        super().__init__()
        width = hyper.heads * hyper.head_dim
        self.hyper = hyper
        self.query = nn.Linear(in_dim, width, bias=False)
        self.key = nn.Linear(in_dim, width, bias=False)
        self.value = nn.Linear(in_dim, width, bias=False)
        self.out = nn.Linear(width, num_kv_heads)
        for linear in (self.query, self.key, self.value, self.out):
            nn.init.xavier_uniform_(linear.weight)  # the paper's initialisation
        nn.init.zeros_(self.out.bias)

    def forward(self, x: torch.Tensor, past: GatePast | None = None) -> tuple[torch.Tensor, GatePast]:
        """x [B, n, in_dim] -> keep logits [B, n, num_kv_heads] (before gamma), and the past for the next chunk."""
        batch, n, _ = x.shape
        heads, dim = self.hyper.heads, self.hyper.head_dim
        x = F.layer_norm(x.float(), x.shape[-1:])  # query scales differ a lot between layers; the gate sees shapes

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, n, heads, dim).transpose(1, 2)

        q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
        if past is not None:
            k = torch.cat([past.keys, k], dim=2)
            v = torch.cat([past.values, v], dim=2)
        # causal, after the past; PyTorch's fused attention (1/sqrt(dim) scaling) never stores the [n, n] scores
        if past is None:
            mixed = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            seen = k.shape[2] - n
            visible = torch.arange(k.shape[2])[None, :] <= torch.arange(n)[:, None] + seen
            mixed = F.scaled_dot_product_attention(q, k, v, attn_mask=visible)
        logits = self.out(mixed.transpose(1, 2).reshape(batch, n, heads * dim))
        return logits, GatePast(k, v)

    def keep_probability(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(logits + self.hyper.gamma)

    def flags(
        self, logits: torch.Tensor, positions: torch.Tensor | None = None, tau: float | None = None
    ) -> torch.Tensor:
        """Hard keep flags (bool), the serving decision: sigmoid(logit + gamma) > tau (default: the trained tau), and
        always for the first `sink_tokens` positions (logits [..., n, H]; `positions` [n], default 0..n-1)."""
        flags = self.keep_probability(logits) > (self.hyper.tau if tau is None else tau)
        if self.hyper.sink_tokens:
            if positions is None:
                positions = torch.arange(logits.shape[-2])
            flags = flags | (positions < self.hyper.sink_tokens)[:, None]
        return flags


def straight_through(probability: torch.Tensor, tau: float) -> torch.Tensor:
    """Hard 0/1 flags forward, the sigmoid's gradient backward (Attention-Gate paper, section 3.4)."""
    hard = (probability > tau).to(probability.dtype)
    # (p - p.detach()) is exactly 0, so the forward value is exactly 0/1 ((hard + p) - p can round to 1 - ulp)
    return hard + (probability - probability.detach())
