"""Train DuoAttention's head gates ("DuoAttention: Efficient Long-Context LLM Inference with Retrieval and Streaming
Heads", Xiao et al. 2024, arXiv:2410.10819, Section 3.2) for a Llama-architecture model on this CPU.

One gate alpha per (layer, KV head), in [0, 1], mixes the head's full causal attention with streaming attention
(the first `sinks` and the `recent` newest keys): out = alpha x full + (1 - alpha) x streaming. The model is frozen.
The loss is the paper's: a distillation term, the distance between the last layer's hidden states of the mixed
model and the full model at the positions of a retrieval answer (here divided by the full model's squared norm there,
so that lambda does not depend on the model's scale), plus lambda x the mean gate (an L1 penalty: every gate that
the answer does not need goes to 0). Gates start at 1 and are clipped to [0, 1] after every step. Data: synthetic
passkey retrieval over documentation prose (`kvserve/tools/training/retrieval.py`).

    python -m kvserve.tools.training.roles            # the shipped roles: 80 steps of 768 tokens, ~10 minutes on 2
    cores

writes `kvserve/duo/roles/<model>.json` (gates, window, recipe) and `docs/duo/training.jsonl` (every step, and at
the end the held-out distillation error of the trained roles against random roles of the same retrieval fractions).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from pydoc_data.topics import topics

import torch

from kvserve.duo.roles import ROLES_DIR, HeadRoles
from kvserve.model import ensure_default_model
from kvserve.tools.training.corpus import load_corpus, load_tokenizer
from kvserve.tools.training.llama import PlainLlama
from kvserve.tools.training.retrieval import retrieval_sample, vocabulary

DOCS = Path(__file__).resolve().parents[2] / "docs" / "duo"


def distillation(model: PlainLlama, ids: torch.Tensor, answer_start: int, teacher: torch.Tensor, mix, window):
    """Squared distance of the mixed model's last hidden states to the full model's (`teacher`) over the answer's
    positions (the position before each answer token predicts it), relative to the teacher's squared norm."""
    hidden = model(ids, head_mix=mix, streaming=window).hidden[0, answer_start - 1 : -1]
    return (hidden - teacher).pow(2).sum(-1).mean() / teacher.pow(2).sum(-1).mean()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m kvserve.tools.training.roles", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None, help="model directory (default: the default model)")
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--seq-len", type=int, default=768, help="tokens per training sample")
    p.add_argument("--lr", type=float, default=0.02, help="the paper's learning rate")
    p.add_argument("--penalty", type=float, default=0.05, help="lambda: weight of the mean gate (L1)")
    p.add_argument("--sinks", type=int, default=16, help="a streaming head's first tokens")
    p.add_argument("--recent", type=int, default=64, help="a streaming head's newest tokens")
    p.add_argument("--keys", type=int, default=4, help="passkeys per sample")
    p.add_argument("--held-out", type=int, default=4, help="held-out samples for the final comparison")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=None, help="roles file (default: kvserve/duo/roles/<model>.json)")
    p.add_argument("--log", type=Path, default=DOCS / "training.jsonl")
    return p.parse_args(argv)


def train(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    started = time.time()
    model_dir = Path(args.model or ensure_default_model())
    model = PlainLlama(model_dir)
    shape = model.shape
    tokenizer = load_tokenizer(model_dir)
    corpus = load_corpus(model_dir, seed=args.seed)
    words = vocabulary(" ".join(topics[name] for name in corpus.train_docs))  # passkey words from the same prose
    window = (args.sinks, args.recent)
    gates = torch.ones(shape.num_layers, shape.num_kv_heads, requires_grad=True)
    optimizer = torch.optim.Adam([gates], lr=args.lr)
    args.log.parent.mkdir(parents=True, exist_ok=True)
    log = args.log.open("w")

    def emit(record: dict) -> None:
        log.write(json.dumps(record) + "\n")
        log.flush()

    def sample(source: random.Random):
        drawn = retrieval_sample(tokenizer, corpus.train, words, args.seq_len, source, keys=args.keys)
        ids = torch.tensor([drawn.ids])
        with torch.no_grad():
            teacher = model(ids).hidden[0, drawn.answer_start - 1 : -1]
        return ids, drawn.answer_start, teacher

    recipe = {
        "method": "DuoAttention (arXiv:2410.10819): per-KV-head gate mixing full and streaming attention, model "
        "frozen; loss = relative squared distance of the last hidden states at the answer positions to the full "
        "model's + penalty x mean gate; gates clipped to [0, 1]",
        "model": model_dir.name,
        "data": "synthetic passkey retrieval: word sequences hidden in pydoc_data.topics prose (train split of "
        f"{len(corpus.train_docs)} topics), {args.keys} passkeys of 6 words per sample, recited at the end",
        "steps": args.steps,
        "seq_len": args.seq_len,
        "lr": args.lr,
        "optimizer": "Adam",
        "penalty": args.penalty,
        "sink_tokens": args.sinks,
        "recent": args.recent,
        "seed": args.seed,
        "threads": args.threads,
        "torch": torch.__version__,
    }
    emit({"kind": "start", "recipe": recipe})
    for step in range(1, args.steps + 1):
        tick = time.time()
        ids, answer_start, teacher = sample(rng)
        distill = distillation(model, ids, answer_start, teacher, gates, window)
        penalty = gates.mean()
        loss = distill + args.penalty * penalty
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        with torch.no_grad():
            gates.clamp_(0.0, 1.0)
        emit(
            {
                "kind": "step",
                "step": step,
                "loss": round(loss.item(), 6),
                "distill": round(distill.item(), 6),
                "mean_gate": round(penalty.item(), 4),
                "gates_above_half": int((gates > 0.5).sum()),
                "sec": round(time.time() - tick, 2),
            }
        )
    roles = HeadRoles(model_dir.name, gates.detach().clone(), args.sinks, args.recent)
    comparison = compare_to_random(model, roles, [sample(random.Random(f"held-out/{i}")) for i in range(args.held_out)])
    final = {"kind": "final", "train_seconds": round(time.time() - started, 1), "held_out": comparison}
    emit(final)
    log.close()
    out = args.out or ROLES_DIR / f"{model_dir.name}.json"
    roles.save(out, {**recipe, "train_seconds": final["train_seconds"], "held_out": comparison})
    return final


@torch.no_grad()
def compare_to_random(model: PlainLlama, roles: HeadRoles, samples, fractions=(0.25, 0.5), draws: int = 2) -> list:
    """Held-out distillation error with the trained roles binarised (top fraction retrieval, the rest streaming)
    against random roles of the same fraction: the evidence that training found the heads that matter."""
    window = (roles.sink_tokens, roles.recent)
    rows = []
    for fraction in fractions:
        trained = roles.retrieval(fraction).float()
        shuffled = [
            trained.flatten()[torch.randperm(trained.numel(), generator=torch.Generator().manual_seed(d))].view_as(
                trained
            )
            for d in range(draws)
        ]

        def error(mix):
            return sum(
                distillation(model, ids, start, teacher, mix, window).item() for ids, start, teacher in samples
            ) / len(samples)

        rows.append(
            {
                "retrieval_fraction": fraction,
                "trained_roles": round(error(trained), 5),
                "random_roles": round(sum(error(mix) for mix in shuffled) / draws, 5),
                "all_streaming": round(error(torch.zeros_like(trained)), 5) if fraction == fractions[0] else None,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    print(json.dumps(train(parse_args(argv)), indent=1))


if __name__ == "__main__":
    main()
