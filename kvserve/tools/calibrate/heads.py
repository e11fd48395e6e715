"""DuoAttention head roles from a few forward passes: the cheap route to a model's retrieval heads.

DuoAttention ("DuoAttention: Efficient Long-Context LLM Inference with Retrieval and Streaming Heads", Xiao et al.
2024, arXiv:2410.10819) trains one gate per KV head by gradient descent so that the heads whose streaming
replacement would change the model's answer keep full attention. That needs a backward pass through the whole model
per step: about 10 minutes for the 135M default model on 2 cores, hours for a 0.5B one. Here each head is judged by
what the paper's objective penalises, measured directly instead of learnt: on synthetic retrieval samples (passkeys in
prose, `kvserve.tools.training.retrieval`), at the positions where the model recites the passkeys, how much the head's
own contribution to the residual stream changes when its attention is restricted to the streaming window (sinks and
recent tokens), relative to the size of that stream. A head that reads the passkeys from far back changes a lot; a
head that looks at sinks and neighbours does not change at all. It is a per-head first-order reading of the
distillation loss (every other head left full), from one forward pass per sample, in the spirit of retrieval heads
found from attention patterns ("Retrieval Head Mechanistically Explains Long-Context Factuality", arXiv:2404.15574)
and of KVzip's head-level scores from a few forward passes (arXiv:2505.23416).

The gates are the scores scaled to [0, 1] (the largest is 1): `HeadRoles.retrieval(f)` then makes the f x L x H
highest-scoring heads retrieval heads, as with trained gates.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from pydoc_data.topics import topics

import torch

from kvserve.duo.roles import HeadRoles
from kvserve.tools.training.corpus import load_corpus, load_tokenizer
from kvserve.tools.training.llama import PlainLlama, masked_softmax, streaming_keep_matrix
from kvserve.tools.training.retrieval import retrieval_sample, vocabulary


def streaming_change(model: PlainLlama, ids: torch.Tensor, answer_start: int, sinks: int, recent: int) -> torch.Tensor:
    """[L, H_kv]: per KV head, the mean over the answer positions of |change of the head's output| ^ 2 / |stream| ^ 2
    when the head attends only to its streaming window. Query heads sharing a KV head add up."""
    shape = model.shape
    group = shape.num_heads // shape.num_kv_heads
    n = ids.shape[1]
    window = streaming_keep_matrix(n, sinks, recent)
    answer = slice(answer_start - 1, n - 1)  # the position before each answer token predicts it
    change = torch.zeros(shape.num_layers, shape.num_kv_heads)

    def observe(layer: int, attention: torch.Tensor, values: torch.Tensor, hidden: torch.Tensor) -> None:
        full = attention[0, :, answer]  # [Hq, a, n]
        # the softmax over the window's keys: what the head would weigh as a streaming head
        streaming = masked_softmax(torch.log(full.clamp_min(1e-30)), window[answer].expand_as(full))
        delta = torch.einsum("hqk,khd->qhd", full - streaming, values[0])  # [a, Hq, D]
        out_proj = model._w(layer, "self_attn.o_proj").view(shape.hidden, shape.num_heads, shape.head_dim)
        written = torch.einsum("qhd,ehd->qhe", delta, out_proj)  # each query head's change to the stream
        relative = written.pow(2).sum(-1) / hidden[0, answer].pow(2).sum(-1, keepdim=True)  # [a, Hq]
        change[layer] = relative.mean(0).view(shape.num_kv_heads, group).sum(-1)

    with torch.no_grad():
        model(ids, observe=observe)
    return change


def measured_roles(
    model_dir: Path,
    samples: int = 8,
    seq_len: int = 768,
    sinks: int = 16,
    recent: int = 64,
    keys: int = 4,
    seed: int = 0,
    progress: Callable[[int], None] | None = None,
    model: PlainLlama | None = None,
) -> HeadRoles:
    """Head roles of the model in `model_dir` from `samples` forward passes over synthetic retrieval samples
    (`model`: the reference model of `model_dir`, if the caller loaded it already)."""
    model = model if model is not None else PlainLlama(model_dir)
    tokenizer = load_tokenizer(model_dir)
    corpus = load_corpus(model_dir, seed=seed)
    words = vocabulary(" ".join(topics[name] for name in corpus.train_docs))
    rng = random.Random(seed)
    total = torch.zeros(model.shape.num_layers, model.shape.num_kv_heads)
    for index in range(samples):
        drawn = retrieval_sample(tokenizer, corpus.train, words, seq_len, rng, keys=keys)
        total += streaming_change(model, torch.tensor([drawn.ids]), drawn.answer_start, sinks, recent)
        if progress is not None:
            progress(index + 1)
    gates = total / total.max().clamp_min(1e-12)
    return HeadRoles(Path(model_dir).name, gates, sinks, recent)


RECIPE = {
    "method": "retrieval heads measured, not trained (kvserve/tools/calibrate/heads.py): per KV head, the relative "
    "change of its contribution to the residual stream at the answer positions of synthetic passkey retrieval when its "
    "attention is restricted to the streaming window; gates = scores / max",
    "data": "synthetic passkey retrieval: word sequences hidden in pydoc_data.topics prose, recited at the end",
}
