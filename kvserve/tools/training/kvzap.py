"""KVzap's surrogate ("KVzap: Fast, Adaptive, and Faithful KV Cache Pruning", NVIDIA 2026, arXiv:2601.07891),
trained for one model: per layer, a small model that predicts each KV head's log KVzip+ score of a token from what
the layer's attention sees of that token, so the score is known as the entry is written (prefill chunks and decode)
instead of from a second pass over the document.

Targets (KVzip+, the paper's refinement of "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction",
arXiv:2505.23416): the context, then kvserve's KVzip instruction, then the context again; entry k of KV head h scores
max over the reconstruction queries t and the query heads g of h's group of

    attention_g(t -> k) / ||x_t|| * ||W_o,g v_k||

(x_t the layer's normalised input at t, W_o,g query head g's slice of the output projection), and the target is its
log. Inputs: the layer's queries before RoPE, flattened over heads ([Hq * D]), which kvserve's attention backend holds
for every token it writes. They are x W_q (+ Qwen2's bias), a linear image of the hidden states the paper's
surrogate reads; where W_q is square and invertible (the default model, Qwen2.5-Coder-0.5B) the two are the same
model class, and `as_kvpress` composes a surrogate with W_q into kvpress's form (`KVzapPress`, hidden states in).

Models: `linear` (ridge regression, closed form) and `mlp` (one hidden layer with GELU, Adam), fitted per layer on
the tokens of a local prose corpus and scored on held-out texts (R^2 and Spearman's rank correlation per layer).
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from kvserve.kvzap.surrogate import Surrogate, SurrogateSet, model_identity
from kvserve.policies.kvzip import REPEAT_INSTRUCTION
from kvserve.tools.training.llama import PlainLlama

KINDS = ("linear", "mlp")
FILE_NAME = "kvzap.safetensors"
LOG_FLOOR = 1e-9  # scores below it (an entry no reconstruction query reads) are clamped before the log


@dataclass
class LayerSamples:
    """One layer's training pairs: inputs [N, Hq * D] (queries before RoPE), targets [N, H_kv] (log KVzip+)."""

    inputs: list[torch.Tensor] = field(default_factory=list)
    targets: list[torch.Tensor] = field(default_factory=list)

    def stacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.cat(self.inputs), torch.cat(self.targets)


@torch.no_grad()
def kvzip_plus_targets(model: PlainLlama, context: list[int], instruction: list[int]) -> list[tuple]:
    """Per layer, (inputs [n, Hq * D], log KVzip+ targets [n, H_kv]) for the n context tokens."""
    shape = model.shape
    n = len(context)
    ids = torch.tensor([context + instruction + context])
    group = shape.num_heads // shape.num_kv_heads
    found: list[tuple] = []

    def observe(layer: int, attention: torch.Tensor, values: torch.Tensor, hidden: torch.Tensor) -> None:
        x = model._rms(hidden[0], model.weights[f"layers.{layer}.input_layernorm.weight"])  # [T, hidden]
        queries = model._project(x, layer, "self_attn.q_proj")[:n]  # [n, Hq * D], before RoPE
        o_proj = model._w(layer, "self_attn.o_proj").view(-1, shape.num_heads, shape.head_dim)  # [hidden, Hq, D]
        value_out = torch.einsum("jgd,kgd->gkj", o_proj, values[0, :n]).norm(dim=-1)  # [Hq, n]: ||W_o,g v_k||
        reading = attention[0, :, n:, :n] / x[n:].norm(dim=-1)[None, :, None]  # [Hq, m, n]
        scores = (reading * value_out[:, None, :]).amax(dim=1)  # [Hq, n]
        per_head = scores.view(shape.num_kv_heads, group, n).amax(dim=1)  # [H_kv, n]
        found.append((queries, per_head.clamp(min=LOG_FLOOR).log().T))

    model.forward(ids, observe=observe)
    return found


def collect(model: PlainLlama, texts: list[list[int]], instruction: list[int]) -> list[LayerSamples]:
    layers = [LayerSamples() for _ in range(model.shape.num_layers)]
    for context in texts:
        for layer, (inputs, targets) in zip(layers, kvzip_plus_targets(model, context, instruction), strict=True):
            layer.inputs.append(inputs)
            layer.targets.append(targets)
    return layers


def fit_linear(inputs: torch.Tensor, targets: torch.Tensor, ridge: float = 1e-3) -> Surrogate:
    """Least squares with a small ridge (relative to the inputs' scale), closed form."""
    mean_x, mean_y = inputs.mean(0), targets.mean(0)
    x, y = (inputs - mean_x).double(), (targets - mean_y).double()
    gram = x.T @ x
    gram += torch.eye(gram.shape[0], dtype=gram.dtype) * ridge * gram.diagonal().mean()
    weight = torch.linalg.solve(gram, x.T @ y).T.float()  # [H_kv, in]
    surrogate = Surrogate(inputs.shape[1], targets.shape[1], None)
    with torch.no_grad():
        surrogate.net.weight.copy_(weight)
        surrogate.net.bias.copy_(mean_y - weight @ mean_x)
    return surrogate


def fit_mlp(
    inputs: torch.Tensor, targets: torch.Tensor, hidden: int, epochs: int, lr: float = 5e-3, batch: int = 512
) -> Surrogate:
    """Adam on the mean squared error; the first layer reads standardised inputs (folded into its weights after)."""
    torch.manual_seed(0)
    mean, std = inputs.mean(0), inputs.std(0).clamp(min=1e-6)
    surrogate = Surrogate(inputs.shape[1], targets.shape[1], hidden)
    optimizer = torch.optim.Adam(surrogate.parameters(), lr=lr)
    scaled = (inputs - mean) / std
    for _ in range(epochs):
        for index in torch.randperm(len(scaled)).split(batch):
            optimizer.zero_grad()
            F.mse_loss(surrogate(scaled[index]), targets[index]).backward()
            optimizer.step()
    first = surrogate.net[0]
    with torch.no_grad():  # W (x - m) / s + b = (W / s) x + (b - W m / s)
        first.bias -= first.weight @ (mean / std)
        first.weight /= std
    return surrogate


def ranks(values: torch.Tensor) -> torch.Tensor:
    return values.argsort(0).argsort(0).float()


def fit_report(surrogate: Surrogate, inputs: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    """Held-out fit, averaged over KV heads: R^2 of the log scores and Spearman's rank correlation."""
    with torch.no_grad():
        predicted = surrogate(inputs)
    residual = ((predicted - targets) ** 2).sum(0)
    total = ((targets - targets.mean(0)) ** 2).sum(0).clamp(min=1e-12)
    a, b = ranks(predicted), ranks(targets)
    a, b = a - a.mean(0), b - b.mean(0)
    spearman = (a * b).sum(0) / (a.norm(dim=0) * b.norm(dim=0)).clamp(min=1e-12)
    return {"r2": float((1 - residual / total).mean()), "spearman": float(spearman.mean())}


@dataclass
class TrainResult:
    kind: str
    texts: int
    held_out: int
    tokens: int
    fit: list[dict]
    seconds: float


def train(
    model_dir: Path,
    texts: list[list[int]],
    held_out: list[list[int]],
    kind: str,
    hidden: int = 256,
    epochs: int = 15,
    model: PlainLlama | None = None,
) -> tuple[SurrogateSet, TrainResult]:
    """Targets from `texts` (token ids of each context), one surrogate per layer, its fit on `held_out`; `model`:
    the folder's reference model where the caller has loaded it already."""
    import time

    from transformers import AutoTokenizer

    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, not {kind!r}")
    started = time.perf_counter()
    model = model or PlainLlama(model_dir)
    instruction = AutoTokenizer.from_pretrained(model_dir).encode(REPEAT_INSTRUCTION, add_special_tokens=False)
    train_layers, test_layers = collect(model, texts, instruction), collect(model, held_out, instruction)
    layers, fit = [], []
    for train_samples, test_samples in zip(train_layers, test_layers, strict=True):
        inputs, targets = train_samples.stacked()
        surrogate = fit_linear(inputs, targets) if kind == "linear" else fit_mlp(inputs, targets, hidden, epochs)
        layers.append(surrogate)
        fit.append(fit_report(surrogate, *test_samples.stacked()))
    result = TrainResult(kind, len(texts), len(held_out), sum(map(len, texts)), fit, time.perf_counter() - started)
    return SurrogateSet(kind, model_identity(model_dir), layers, fit), result


def as_kvpress(surrogates: SurrogateSet, model: PlainLlama, out: Path) -> None:
    """The surrogates in kvpress's form (`KVzapModel.from_pretrained(out)`: config.json + model.safetensors, one
    module per layer reading the layer's normalised hidden states): each first linear map composed with the layer's
    query projection, q = x W_q^T + b_q (`model`: the reference model of the folder they were trained for)."""
    tensors = {}
    hidden = None
    for index, surrogate in enumerate(surrogates.layers):
        first = surrogate.net if isinstance(surrogate.net, torch.nn.Linear) else surrogate.net[0]
        w_q = model._w(index, "self_attn.q_proj")
        b_q = model.weights.get(f"layers.{index}.self_attn.q_proj.bias", torch.zeros(w_q.shape[0]))
        prefix = f"layers.{index}." if first is surrogate.net else f"layers.{index}.0."
        tensors[prefix + "weight"] = (first.weight @ w_q).contiguous()
        tensors[prefix + "bias"] = (first.bias + first.weight @ b_q).contiguous()
        if first is not surrogate.net:
            hidden = first.weight.shape[0]
            tensors[f"layers.{index}.2.weight"] = surrogate.net[2].weight.contiguous()
            tensors[f"layers.{index}.2.bias"] = surrogate.net[2].bias.contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = {
        "model_type": "kvzap",
        "input_dim": model.shape.hidden,
        "output_dim": model.shape.num_kv_heads,
        "hidden_dim": hidden,
        "n_modules": len(surrogates.layers),
        "architectures": ["KVzapModel"],
    }
    (out / "config.json").write_text(json.dumps(config, indent=1))


def record_text(rng: random.Random, words: list[str]) -> str:
    """One short record of the kind documents carry and no model can predict: a number, an identifier or a few
    unrelated words, in one of a few plain phrasings."""
    number, hex_id = str(rng.randrange(10**3, 10**8)), f"{rng.getrandbits(32):08x}-{rng.getrandbits(16):04x}"
    picked = " ".join(rng.sample(words, 3))
    date = f"{rng.randrange(1990, 2030)}-{rng.randrange(1, 13):02d}-{rng.randrange(1, 29):02d}"
    return rng.choice(
        (
            f" Entry {rng.randrange(1, 999)}: {number}.",
            f" The {rng.choice(words)} value is {number}.",
            f" Reference {hex_id}.",
            f" Code word: {picked}.",
            f" Recorded on {date}: {number}.",
        )
    )


def corpus_windows(
    model_dir: Path, texts: int, tokens: int, records: int = 0, seed: int = 0
) -> tuple[list[list[int]], list[list[int]]]:
    """`texts` training windows of `tokens` tokens from the train split of kvserve's prose corpus (pydoc_data's
    topics, as the Attention-Gates train on), and a quarter as many (at least one) from its held-out split. With
    `records` R, each window gets R short records (`record_text`: numbers, identifiers, unrelated words) at seeded
    random places between its tokens: the prose alone holds few of the unpredictable tokens that a reconstruction
    (and a question) needs most, which the paper's training mix (web text, code, math) has throughout."""
    from kvserve.tools.training.corpus import load_corpus, load_tokenizer
    from kvserve.tools.training.retrieval import vocabulary

    corpus = load_corpus(model_dir)
    tokenizer = load_tokenizer(model_dir)
    words = vocabulary(tokenizer.decode(corpus.train[:20000]))
    rng = random.Random(seed)

    def windows(stream: list[int], count: int) -> list[list[int]]:
        if len(stream) < tokens * count:
            raise ValueError(f"the corpus split holds {len(stream)} tokens, fewer than {count} x {tokens}")
        step = len(stream) // count
        made = []
        for i in range(count):
            window = stream[i * step : i * step + tokens]
            for place in sorted(rng.sample(range(1, tokens), records), reverse=True):
                record = tokenizer.encode(record_text(rng, words), add_special_tokens=False).ids
                window = window[:place] + record + window[place:]
            made.append(window[:tokens])
        return made

    return windows(corpus.train, texts), windows(corpus.held_out, max(1, texts // 4))


def parse_args(argv: list[str] | None = None):
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m kvserve.tools.training.kvzap", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("model", type=Path, help="a Llama or Qwen2 model folder")
    parser.add_argument("--kind", choices=KINDS, default="linear")
    parser.add_argument("--texts", type=int, default=32, help="training windows of the corpus")
    parser.add_argument("--tokens", type=int, default=512, help="tokens per window (the reconstruction doubles it)")
    parser.add_argument(
        "--records", type=int, default=6, help="short records (numbers, identifiers) inserted into each window"
    )
    parser.add_argument("--hidden", type=int, default=256, help="the MLP's hidden width")
    parser.add_argument("--epochs", type=int, default=15, help="the MLP's epochs")
    parser.add_argument("--out", type=Path, required=True, help="the surrogate file")
    parser.add_argument("--kvpress", type=Path, default=None, help="also write kvpress's form to this folder")
    parser.add_argument("--report", type=Path, default=None, help="also write the fit per layer to this JSON file")
    return parser.parse_args(argv)


def run(args) -> TrainResult:
    """Train, save, print each layer's held-out fit; returns the result."""
    texts, held_out = corpus_windows(args.model, args.texts, args.tokens, args.records)
    model = PlainLlama(args.model)  # loaded once: the targets and kvpress's form read it
    surrogates, result = train(args.model, texts, held_out, args.kind, args.hidden, args.epochs, model)
    surrogates.save(args.out)
    if args.kvpress is not None:
        as_kvpress(surrogates, model, args.kvpress)
    if getattr(args, "report", None) is not None:
        from kvserve.provenance import command_line, provenance

        record = {"model": Path(args.model).name, **asdict(result), "records": args.records, "out": Path(args.out).name}
        record["provenance"] = provenance(command_line(None, "python -m kvserve.tools.training.kvzap"))
        args.report.parent.mkdir(parents=True, exist_ok=True)
        args.report.write_text(json.dumps(record, indent=1))
    for layer, fit in enumerate(result.fit):
        print(f"layer {layer}: R^2 {fit['r2']:.3f}, Spearman {fit['spearman']:.3f}")
    r2 = sum(f["r2"] for f in result.fit) / len(result.fit)
    rho = sum(f["spearman"] for f in result.fit) / len(result.fit)
    print(
        f"{args.kind} KVzap surrogate for {Path(args.model).name}: {result.texts} windows ({result.tokens} tokens), "
        f"held-out mean R^2 {r2:.3f}, Spearman {rho:.3f}, in {result.seconds:.0f} s -> {args.out}"
    )
    return result


def main(argv: list[str] | None = None) -> None:
    run(parse_args(argv))


if __name__ == "__main__":
    main()


__all__ = ["KINDS", "SurrogateSet", "TrainResult", "as_kvpress", "kvzip_plus_targets", "train"]
