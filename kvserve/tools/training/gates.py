"""Train a model's Attention-Gates by continual pre-training ("In-context KV-Cache Eviction for LLMs via
Attention-Gate", Zeng et al. 2024, arXiv:2410.12876, section 3.4): the base model is frozen and only
the GateSet learns, with loss = LM loss + alpha * |mean(flags) - beta| (+ distill x KL(full model || gated model)
over the next-token distributions, and answer_weight x the same KL on the positions that recite the retrieval
samples' passkeys: additions for this small model, docs/gates/findings.md has the evidence for each).

The flags are straight-through (hard 0/1 forward, the sigmoid's gradient backward), so the eviction term's forward
value is the real keep ratio (mean over all layers, KV heads and tokens). Data (`kvserve.tools.training.corpus`, all
shipped with Python): windows of Python's documentation (split by document into train and held-out) and of the standard
library's docstrings, and a share of synthetic retrieval samples (passkeys hidden in that prose, recited at the end:
`kvserve.tools.training.retrieval`). The gates train with a fallback no gate overrides: the first `sink_tokens` tokens
and each query's `recent` previous tokens (`GateHyper`), served the same way. Writes the gate file (float16 safetensors
with the recipe in its metadata), its sha256 into the registry, a JSON-lines log (no machine paths) and a PNG.

    python -m kvserve.tools.training.gates          # the shipped gates' recipe (the defaults)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml

from kvserve.cpu_dtype import default_dtype
from kvserve.gates.gateset import GateSet
from kvserve.gates.module import GateHyper
from kvserve.gates.registry import registry_path
from kvserve.model import ensure_default_model
from kvserve.tools.training.corpus import (
    Corpus,
    fixed_windows,
    load_corpus,
    load_tokenizer,
    sample_batch,
    stdlib_docstrings,
)
from kvserve.tools.training.llama import PlainLlama
from kvserve.tools.training.retrieval import retrieval_sample, vocabulary

STEPS = 100
ANSWER_WEIGHT = 5.0
SEQ_LEN = 1024
EVAL_WINDOWS = 6
WEIGHTS = Path(__file__).parent / "weights"
REPO = Path(__file__).resolve().parents[2]
DEFAULT_OUT = WEIGHTS / "smollm2-135m-instruct.safetensors"
DOCS = Path(__file__).resolve().parents[2] / "docs" / "gates"


def lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy, mean over all predicted tokens."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))


def keep_mean(flags: list[torch.Tensor]) -> torch.Tensor:
    """Mean over all layers, KV heads and tokens (straight-through flags: the forward value is the keep ratio)."""
    return torch.cat([f.reshape(-1) for f in flags]).mean()


def token_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """KL(teacher || student) of the next-token distributions at each predicted position: [B, n - 1]."""
    teacher = F.log_softmax(teacher_logits[:, :-1].float(), dim=-1)
    student = F.log_softmax(student_logits[:, :-1].float(), dim=-1)
    return (teacher.exp() * (teacher - student)).sum(-1)


def distillation(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """KL(teacher || student) of the next-token distributions, mean over predicted positions."""
    return token_kl(student_logits, teacher_logits).mean()


def answer_mask(answer_starts: list[int | None], n: int) -> torch.Tensor:
    """[B, n - 1] bool: the predicted positions whose target is a recited passkey token (position t predicts t + 1);
    all False for a row without an answer (a prose window)."""
    targets = torch.arange(1, n)
    rows = [targets >= start if start is not None else torch.zeros(n - 1, dtype=torch.bool) for start in answer_starts]
    return torch.stack(rows)


@dataclass
class StepLosses:
    total: torch.Tensor
    lm: torch.Tensor  # next-token cross-entropy, gates on
    evict: torch.Tensor  # alpha * |keep - beta|
    keep: torch.Tensor  # mean straight-through flag
    kl: torch.Tensor  # KL(full || gated), mean over every predicted position
    answer_kl: torch.Tensor  # KL(full || gated), mean over the recited passkeys' positions (0 without any)


def step_losses(
    model: PlainLlama,
    gates: GateSet,
    ids: torch.Tensor,
    alpha: float,
    beta: float,
    distill: float = 0.0,
    answer_weight: float = 0.0,
    answer_starts: list[int | None] | None = None,
) -> StepLosses:
    """The losses of one batch, straight-through gates. `answer_weight` adds the KL on the positions that recite
    retrieved passkeys (`answer_starts`, per row): there a head that reads far back matters, while in prose the
    mean over a thousand positions hides it (DuoAttention's training signal, arXiv:2410.10819, section 3.2)."""
    out = model(ids, gates, train_gates=True)
    lm = lm_loss(out.logits, ids)
    keep = keep_mean(out.flags)
    evict = alpha * (keep - beta).abs()
    kl = answer_kl = torch.zeros(())
    if distill or answer_weight:
        with torch.no_grad():
            teacher = model(ids).logits
        per_token = token_kl(out.logits, teacher)
        kl = per_token.mean()
        mask = answer_mask(answer_starts or [None] * len(ids), ids.shape[1])
        if mask.any():
            answer_kl = per_token[mask].mean()
    return StepLosses(lm + evict + distill * kl + answer_weight * answer_kl, lm, evict, keep, kl, answer_kl)


@torch.no_grad()
def evaluate(model: PlainLlama, gates: GateSet | None, windows: torch.Tensor, batch: int = 2) -> dict:
    """LM loss (token-weighted over the windows) and keep ratios (overall, per layer, per layer and KV head)."""
    total, count, kept = 0.0, 0, []
    for i in range(0, len(windows), batch):
        ids = windows[i : i + batch]
        out = model(ids, gates)
        total += float(lm_loss(out.logits, ids)) * ids[:, 1:].numel()
        count += ids[:, 1:].numel()
        if gates is not None:
            kept.append(torch.stack([f.mean(dim=1) for f in out.flags], dim=1))  # [b, layers, H_kv]
    result = {"lm": total / count}
    if kept:
        per_head = torch.cat(kept).mean(dim=0)  # [layers, H_kv]
        result.update(
            keep=float(per_head.mean()),
            keep_by_layer=[round(float(k), 4) for k in per_head.mean(1)],
            keep_by_layer_head=[[round(float(k), 4) for k in row] for row in per_head],
        )
    return result


@torch.no_grad()
def evaluate_retrieval(model: PlainLlama, gates: GateSet | None, samples: list[tuple[torch.Tensor, int]]) -> dict:
    """On held-out retrieval samples (passkeys in held-out prose): the cross-entropy of the recited passkeys and the
    share of their tokens the model predicts greedily; the direct measure of what eviction costs retrieval."""
    total, hits, count = 0.0, 0, 0
    for ids, answer_start in samples:
        logits = model(ids[None], gates).logits[0, answer_start - 1 : -1].float()
        targets = ids[answer_start:]
        total += float(F.cross_entropy(logits, targets, reduction="sum"))
        hits += int((logits.argmax(-1) == targets).sum())
        count += len(targets)
    return {"answer_ce": total / count, "answer_accuracy": hits / count}


def schedule(step: int, steps: int, warmup: int) -> float:
    """Linear warm-up, then cosine decay to 10% of the peak learning rate."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def update_registry(model_name: str, gate_file: Path, sha256: str, path: Path | None = None) -> Path:
    """Set `model_name: {file, sha256}` in the registry yaml (file relative to the yaml), keeping other entries."""
    path = Path(path or registry_path())
    entries = (yaml.safe_load(path.read_text()) or {}) if path.exists() else {}
    entries[model_name] = {"file": os.path.relpath(Path(gate_file).resolve(), path.resolve().parent), "sha256": sha256}
    header = (
        "# Trained Attention-Gate files, by model folder name (the last component of vLLM's --model).\n"
        "# `file` is relative to this file. Written by `python -m kvserve.tools.training.gates`; each file's metadata\n"
        "# holds its training recipe.\n"
    )
    path.write_text(header + yaml.safe_dump(entries, sort_keys=True))
    return path


def plot(records: list[dict], final: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r for r in records if r["kind"] == "step"]
    evals = [r for r in records if r["kind"] == "eval"]
    x = [r["step"] for r in steps]

    def smooth(values: list[float], width: int = 10) -> list[float]:
        return [
            sum(values[max(0, i - width + 1) : i + 1]) / len(values[max(0, i - width + 1) : i + 1])
            for i in range(len(values))
        ]

    fig, axes = plt.subplots(1, 3, figsize=(17, 4.6))
    ax = axes[0]
    ax.plot(x, [r["lm"] for r in steps], color="tab:blue", alpha=0.25, lw=0.8)
    ax.plot(x, smooth([r["lm"] for r in steps]), color="tab:blue", label="train LM loss (gated, 10-step mean)")
    if evals:
        ax.plot(
            [r["step"] for r in evals],
            [r["held_out"]["lm"] for r in evals],
            "o-",
            color="tab:red",
            label="held-out LM loss, gates on",
        )
        ax.axhline(evals[0]["held_out_no_gates"], color="tab:red", ls="--", label="held-out LM loss, no gates")
    ax.plot(x, smooth([r["evict"] for r in steps]), color="tab:orange", label="evict loss alpha*|keep-beta|")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("losses")
    ax.legend(fontsize=8)
    ax = axes[1]
    ax.plot(x, [r["keep"] for r in steps], color="tab:green", alpha=0.3, lw=0.8)
    ax.plot(x, smooth([r["keep"] for r in steps]), color="tab:green", label="train keep ratio (10-step mean)")
    if evals:
        ax.plot(
            [r["step"] for r in evals],
            [r["held_out"]["keep"] for r in evals],
            "o-",
            color="tab:purple",
            label="held-out keep ratio",
        )
    ax.axhline(final["beta"], color="gray", ls=":", label="beta (target keep)")
    ax.set_ylim(0, 1)
    ax.set_xlabel("step")
    ax.set_title("keep ratio (mean over layers, KV heads, tokens)")
    ax.legend(fontsize=8)
    ax = axes[2]
    evicted = [1 - k for k in final["keep_by_layer"]]
    ax.bar(range(len(evicted)), evicted, color="tab:gray")
    ax.set_xlabel("layer")
    ax.set_ylabel("evicted share of tokens")
    ax.set_ylim(0, 1)
    ax.set_title(f"final eviction ratio by layer (held-out, mean {1 - final['keep']:.2f})")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def portable(path: Path) -> str:
    """A path as the log may record it: relative to the repository when inside it, else its name only (the log
    ships in the repository; no machine's absolute paths)."""
    resolved = Path(path).resolve()
    return str(resolved.relative_to(REPO)) if resolved.is_relative_to(REPO) else resolved.name


@dataclass(frozen=True)
class RetrievalSource:
    """What synthetic retrieval samples need: the tokenizer and the passkey words (the train prose's vocabulary)."""

    tokenizer: object
    words: list[str]

    @classmethod
    def for_corpus(cls, model_dir: Path, corpus: Corpus) -> RetrievalSource:
        from pydoc_data.topics import topics

        text = " ".join(topics[name] for name in corpus.train_docs if name in topics)
        return cls(load_tokenizer(model_dir), vocabulary(text))

    def held_out(self, corpus: Corpus, seq_len: int, count: int, seed: int) -> list[tuple[torch.Tensor, int]]:
        """`count` fixed samples hidden in the held-out prose (words still from the train vocabulary)."""
        rng = random.Random(seed + 1)
        samples = [retrieval_sample(self.tokenizer, corpus.held_out, self.words, seq_len, rng) for _ in range(count)]
        return [(torch.tensor(sample.ids), sample.answer_start) for sample in samples]

    def batch(self, corpus: Corpus, seq_len: int, batch: int, rng: random.Random) -> tuple[torch.Tensor, list[int]]:
        """[batch, ~seq_len] ids and each row's answer start (rows share one length: the passkeys are cut to it)."""
        samples = [retrieval_sample(self.tokenizer, corpus.train, self.words, seq_len, rng) for _ in range(batch)]
        length = min(len(sample.ids) for sample in samples)
        return torch.tensor([sample.ids[:length] for sample in samples]), [s.answer_start for s in samples]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m kvserve.tools.training.gates", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model",
        type=Path,
        default=None,
        help="Hugging Face Llama checkpoint folder (default: the default model, converted if needed)",
    )
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--seq-len", type=int, default=SEQ_LEN)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--clip", type=float, default=1.0, help="gradient-norm clipping (0: off)")
    p.add_argument("--alpha", type=float, default=5.0)
    p.add_argument("--beta", type=float, default=0.5, help="target mean keep probability")
    p.add_argument("--distill", type=float, default=1.0, help="weight of KL(full model || gated model); 0: off")
    p.add_argument(
        "--answer-weight",
        type=float,
        default=ANSWER_WEIGHT,
        help="weight of KL(full || gated) on the retrieval samples' recited passkeys; 0: off",
    )
    p.add_argument("--tau", type=float, default=0.5)
    p.add_argument("--gamma", type=float, default=2.0)
    p.add_argument("--gate-heads", type=int, default=GateHyper.heads)
    p.add_argument("--gate-head-dim", type=int, default=GateHyper.head_dim)
    p.add_argument("--sink-tokens", type=int, default=4, help="first tokens no gate evicts (0: none)")
    p.add_argument("--recent", type=int, default=64, help="previous tokens every query sees whatever the gates say")
    p.add_argument("--chat-fraction", type=float, default=0.5, help="share of samples behind the chat header")
    p.add_argument("--retrieval-fraction", type=float, default=0.5, help="share of synthetic passkey-retrieval samples")
    p.add_argument(
        "--no-stdlib-docs", action="store_true", help="train on pydoc topics only (no standard-library docstrings)"
    )
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--eval-windows", type=int, default=EVAL_WINDOWS, help="held-out windows per evaluation")
    p.add_argument(
        "--dtype",
        choices=("bfloat16", "float32"),
        default=None,
        help="autocast dtype of the frozen model's forward (default: bfloat16 where the CPU has it natively, "
        "else float32); gates, losses and the saved file stay float32 / float16",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument(
        "--registry",
        type=Path,
        default=None,
        help="registry yaml (default: KVSERVE_GATES or the package's registry.yaml)",
    )
    p.add_argument("--no-registry", action="store_true", help="do not write the registry")
    p.add_argument("--plot", type=Path, default=DOCS / "training.png")
    p.add_argument("--log", type=Path, default=DOCS / "training.jsonl")
    return p.parse_args(argv)


def train(args: argparse.Namespace, corpus: Corpus | None = None) -> dict:
    from tqdm import tqdm

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    if args.dtype is None:
        args.dtype = default_dtype()[0]
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.dtype == "bfloat16")
    rng = random.Random(args.seed)
    started = time.time()
    if args.model is None:
        args.model = ensure_default_model()
    model = PlainLlama(args.model)
    s = model.shape
    if corpus is None:
        extra = None if args.no_stdlib_docs else stdlib_docstrings()
        corpus = load_corpus(args.model, seed=args.seed, extra_train=extra)
    retrieval = RetrievalSource.for_corpus(args.model, corpus) if args.retrieval_fraction > 0 else None
    hyper = GateHyper(
        heads=args.gate_heads,
        head_dim=args.gate_head_dim,
        tau=args.tau,
        gamma=args.gamma,
        sink_tokens=args.sink_tokens,
        recent=args.recent,
    )
    gates = GateSet(s.num_layers, s.num_heads * s.head_dim, s.num_kv_heads, hyper)
    optimizer = torch.optim.AdamW(gates.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: schedule(i, args.steps, args.warmup))

    held_out = fixed_windows(corpus.held_out, corpus.header, args.seq_len, args.eval_windows)
    train_windows = fixed_windows(corpus.train, corpus.header, args.seq_len, args.eval_windows)
    held_out_plain = evaluate(model, None, held_out)["lm"]
    retrieval_held_out = retrieval.held_out(corpus, args.seq_len, args.eval_windows, args.seed) if retrieval else []
    retrieval_plain = evaluate_retrieval(model, None, retrieval_held_out) if retrieval_held_out else None
    args.log.parent.mkdir(parents=True, exist_ok=True)
    log = args.log.open("w")
    records: list[dict] = []

    def emit(record: dict) -> None:
        records.append(record)
        log.write(json.dumps(record) + "\n")
        log.flush()

    emit(
        {
            "kind": "start",
            "args": {k: portable(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "data": corpus.description(),
            "held_out_no_gates": held_out_plain,
            "held_out_retrieval_no_gates": retrieval_plain,
            "gate_parameters": sum(p.numel() for p in gates.parameters()),
        }
    )
    bar = tqdm(range(1, args.steps + 1), desc="gates", dynamic_ncols=True)
    for step in bar:
        tick = time.time()
        if retrieval is not None and rng.random() < args.retrieval_fraction:
            ids, answer_starts = retrieval.batch(corpus, args.seq_len, args.batch, rng)
        else:
            ids, answer_starts = sample_batch(corpus, args.seq_len, args.batch, rng, args.chat_fraction), None
        with autocast:
            losses = step_losses(
                model, gates, ids, args.alpha, args.beta, args.distill, args.answer_weight, answer_starts
            )
        optimizer.zero_grad(set_to_none=True)
        losses.total.backward()
        norm = torch.nn.utils.clip_grad_norm_(gates.parameters(), args.clip if args.clip > 0 else float("inf"))
        optimizer.step()
        scheduler.step()
        loss, lm, evict, keep, kl = (t.item() for t in (losses.total, losses.lm, losses.evict, losses.keep, losses.kl))
        emit(
            {
                "kind": "step",
                "step": step,
                "loss": loss,
                "lm": lm,
                "evict": evict,
                "keep": keep,
                "kl": kl,
                "answer_kl": losses.answer_kl.item() if answer_starts else None,
                "grad_norm": norm.item(),
                "lr": optimizer.param_groups[0]["lr"],
                "sec": round(time.time() - tick, 2),
            }
        )
        bar.set_postfix(lm=f"{lm:.3f}", evict=f"{evict:.3f}", keep=f"{keep:.3f}")
        if step % args.eval_every == 0 or step == args.steps:
            result = evaluate(model, gates, held_out)
            found = evaluate_retrieval(model, gates, retrieval_held_out) if retrieval_held_out else None
            emit(
                {
                    "kind": "eval",
                    "step": step,
                    "held_out": result,
                    "held_out_no_gates": held_out_plain,
                    "held_out_retrieval": found,
                }
            )
            bar.write(
                f"step {step}: held-out LM {result['lm']:.4f} (no gates {held_out_plain:.4f}), "
                f"keep {result['keep']:.3f}"
                + (
                    f", passkey tokens {found['answer_accuracy']:.3f} ({retrieval_plain['answer_accuracy']:.3f})"
                    if found
                    else ""
                )
            )
    train_seconds = time.time() - started

    # the final numbers are those of the shipped (float16) file, re-loaded
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".tmp.safetensors")
    gates.save(tmp, {})
    shipped = GateSet.load(tmp)
    tmp.unlink()
    final_held_out = evaluate(model, shipped, held_out)
    final_train = evaluate(model, shipped, train_windows)
    final_retrieval = evaluate_retrieval(model, shipped, retrieval_held_out) if retrieval_held_out else None
    train_plain = evaluate(model, None, train_windows)["lm"]
    last = [r for r in records if r["kind"] == "step"][-20:]
    final = {
        "held_out_lm_gates": round(final_held_out["lm"], 4),
        "held_out_lm_no_gates": round(held_out_plain, 4),
        "train_lm_gates": round(final_train["lm"], 4),
        "train_lm_no_gates": round(train_plain, 4),
        "train_lm_last20_steps": round(sum(r["lm"] for r in last) / len(last), 4),
        "train_evict_last20_steps": round(sum(r["evict"] for r in last) / len(last), 4),
        "held_out_retrieval_gates": final_retrieval,
        "held_out_retrieval_no_gates": retrieval_plain,
        "keep": round(final_held_out["keep"], 4),
        "train_keep": round(final_train["keep"], 4),
        "keep_by_layer": final_held_out["keep_by_layer"],
        "keep_by_layer_head": final_held_out["keep_by_layer_head"],
    }
    recipe = {
        "method": "Attention-Gate continual pre-training (arXiv:2410.12876): base model frozen, gates only; "
        "loss = LM + alpha*|mean(straight-through flags) - beta| + distill*KL(full || gated) "
        "+ answer_weight*KL(full || gated) on the retrieval samples' recited passkeys",
        "model": args.model.name,
        "data": corpus.description(),
        "sample": f"{args.seq_len}-token sequences: {args.retrieval_fraction:.0%} synthetic passkey retrieval "
        "(kvserve.tools.training.retrieval), the rest windows at seeded random offsets of the train stream, "
        f"{args.chat_fraction:.0%} of those behind the chat-template header",
        "distill": args.distill,
        "answer_weight": args.answer_weight,
        "dtype": f"{args.dtype} autocast of the forward passes",
        "sink_tokens": args.sink_tokens,
        "recent": args.recent,
        "steps": args.steps,
        "seq_len": args.seq_len,
        "batch": args.batch,
        "lr": args.lr,
        "schedule": f"linear warm-up {args.warmup} steps, cosine to 10%",
        "optimizer": "AdamW",
        "weight_decay": args.weight_decay,
        "clip": args.clip,
        "alpha": args.alpha,
        "beta": args.beta,
        "tau": args.tau,
        "gamma": args.gamma,
        "gate_heads": args.gate_heads,
        "gate_head_dim": args.gate_head_dim,
        "seed": args.seed,
        "threads": args.threads,
        "train_seconds": round(train_seconds, 1),
        "eval": f"{args.eval_windows} fixed windows per split",
        "final": final,
        "torch": torch.__version__,
    }
    sha256 = gates.save(args.out, recipe)
    os.chmod(args.out, 0o644)  # a shipped artifact, readable by the serving user
    registry = None
    if not args.no_registry:
        registry = update_registry(args.model.name, args.out, sha256, args.registry)
    summary = {
        "kind": "final",
        "sha256": sha256,
        "out": portable(args.out),
        "registry": portable(registry) if registry is not None else None,
        "train_seconds": round(train_seconds, 1),
        "beta": args.beta,
        **final,
    }
    emit(summary)
    log.close()
    if args.plot:
        plot(records, {**final, "beta": args.beta}, args.plot)
    return summary


def main(argv: list[str] | None = None) -> None:
    summary = train(parse_args(argv))
    print(json.dumps({k: v for k, v in summary.items() if k != "keep_by_layer_head"}, indent=1))


if __name__ == "__main__":
    main()
