"""Measured head roles (`kvserve/tools/calibrate/heads.py`, forward passes only) against trained ones (`roles.py`, the
paper's gradient descent) on the same held-out retrieval samples: the evidence that the cheap route finds the heads
that matter.

    python -m kvserve.tools.training.measured_roles              # the default model, against its shipped roles

prints and writes `docs/eval/duo/measured-vs-trained.json`: per retrieval fraction, the held-out distillation error
(the paper's loss, `roles.distillation`) with the trained roles, the measured roles and random roles of the same
fraction; how many retrieval heads the two choose alike; the rank correlation of their gates; and the seconds each
route took.
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
from kvserve.provenance import command_line, provenance
from kvserve.tools.calibrate.heads import measured_roles
from kvserve.tools.training.corpus import load_corpus, load_tokenizer
from kvserve.tools.training.llama import PlainLlama
from kvserve.tools.training.retrieval import retrieval_sample, vocabulary
from kvserve.tools.training.roles import distillation

OUT = Path(__file__).resolve().parents[3] / "docs" / "eval" / "duo" / "measured-vs-trained.json"


def ranks(values: torch.Tensor) -> torch.Tensor:
    return torch.argsort(torch.argsort(values.flatten())).float()


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    ra, rb = ranks(a), ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()))


@torch.no_grad()
def compare(
    model: PlainLlama, model_dir: Path, trained: HeadRoles, measured: HeadRoles, held_out: int, seq_len: int
) -> list[dict]:
    tokenizer = load_tokenizer(model_dir)
    corpus = load_corpus(model_dir, seed=0)
    words = vocabulary(" ".join(topics[name] for name in corpus.train_docs))
    samples = []
    for index in range(held_out):  # the same held-out draws as roles.py's final comparison
        drawn = retrieval_sample(tokenizer, corpus.train, words, seq_len, random.Random(f"held-out/{index}"))
        ids = torch.tensor([drawn.ids])
        samples.append((ids, drawn.answer_start, model(ids).hidden[0, drawn.answer_start - 1 : -1]))
    window = (trained.sink_tokens, trained.recent)

    def error(mix: torch.Tensor) -> float:
        return round(
            sum(distillation(model, ids, start, teacher, mix, window).item() for ids, start, teacher in samples)
            / len(samples),
            5,
        )

    rows = []
    for fraction in (0.125, 0.25, 0.5):
        chosen_trained, chosen_measured = trained.retrieval(fraction), measured.retrieval(fraction)
        shuffled = chosen_trained.flatten()[
            torch.randperm(chosen_trained.numel(), generator=torch.Generator().manual_seed(0))
        ]
        rows.append(
            {
                "retrieval_fraction": fraction,
                "trained_roles": error(chosen_trained.float()),
                "measured_roles": error(chosen_measured.float()),
                "random_roles": error(shuffled.view_as(chosen_trained).float()),
                "heads_in_common": int((chosen_trained & chosen_measured).sum()),
                "retrieval_heads": int(chosen_trained.sum()),
            }
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kvserve.tools.training.measured_roles", description=__doc__)
    parser.add_argument("--model", type=Path, default=None, help="model directory (default: the default model)")
    parser.add_argument("--samples", type=int, default=8, help="retrieval samples the measurement reads")
    parser.add_argument("--seq-len", type=int, default=768)
    parser.add_argument("--held-out", type=int, default=4)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    model_dir = Path(args.model or ensure_default_model())
    trained_file = ROLES_DIR / f"{model_dir.name}.json"
    trained = HeadRoles.load(trained_file)
    started = time.time()
    model = PlainLlama(model_dir)  # inside the timing: the measurement's cost includes loading the model
    measured = measured_roles(
        model_dir,
        samples=args.samples,
        seq_len=args.seq_len,
        sinks=trained.sink_tokens,
        recent=trained.recent,
        model=model,
    )
    seconds = round(time.time() - started, 1)
    record = {
        "model": model_dir.name,
        "measured_seconds": seconds,
        "measured_samples": args.samples,
        "trained_seconds": json.loads(trained_file.read_text())["recipe"].get("train_seconds"),
        "gate_rank_correlation": round(spearman(trained.gates, measured.gates), 3),
        "held_out": compare(model, model_dir, trained, measured, args.held_out, args.seq_len),
        "provenance": provenance(command_line(argv, "python -m kvserve.tools.training.measured_roles")),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
