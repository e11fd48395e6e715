"""A Llama model's shape as its Hugging Face config gives it: what the gates of `attention_gate` are built for, read
the same way by the served policy and by the gates' training model."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LlamaShape:
    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_eps: float

    @classmethod
    def from_config(cls, config: dict) -> LlamaShape:
        rope = config.get("rope_parameters") or {}
        if (rope.get("rope_type") or "default") != "default" or config.get("rope_scaling"):
            raise ValueError("kvserve's gate reference implements Llama's default RoPE only")
        return cls(
            num_layers=config["num_hidden_layers"],
            hidden=config["hidden_size"],
            num_heads=config["num_attention_heads"],
            num_kv_heads=config["num_key_value_heads"],
            head_dim=config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
            rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
            rms_eps=float(config["rms_norm_eps"]),
        )
