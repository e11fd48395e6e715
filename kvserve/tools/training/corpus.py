"""Offline continual-pre-training data for the gates: Python's own documentation (`pydoc_data.topics`, ~465 kB).

No data set can be downloaded here. The 79 topic documents are split by document with a fixed seed into train and
held-out (about 10% of the characters held out). Each split is one token stream (documents joined by a blank line);
a sample is a window of `seq_len` tokens at a random offset. A share of the samples (`chat_fraction`) starts with the
model's chat-template header (system prompt and the opening of a user turn, as served prompts do) followed by the
window's text, so the gates also see the token pattern of real requests.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

import torch

MARK = "\x00GATE-TEXT\x00"


def load_tokenizer(model_dir: str | Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))


def chat_header(model_dir: str | Path) -> str:
    """The chat template rendered up to a user message's content ("" when the model has no template)."""
    model_dir = Path(model_dir)
    template_file = model_dir / "chat_template.jinja"
    if template_file.exists():
        template = template_file.read_text()
    else:
        config = model_dir / "tokenizer_config.json"
        template = json.loads(config.read_text()).get("chat_template") if config.exists() else None
    if not isinstance(template, str):
        return ""
    import jinja2

    rendered = (
        jinja2.Environment()
        .from_string(template)
        .render(messages=[{"role": "user", "content": MARK}], add_generation_prompt=True, bos_token="", eos_token="")
    )
    return rendered.split(MARK)[0]


@dataclass
class Corpus:
    train: list[int]  # token stream of the train documents
    held_out: list[int]  # token stream of the held-out documents
    header: list[int]  # chat-template header tokens (may be empty)
    train_docs: list[str] = field(default_factory=list)
    held_out_docs: list[str] = field(default_factory=list)
    extra_train_docs: int = 0  # documents of other text in the train stream (stdlib docstrings)
    extra_train_tokens: int = 0

    def description(self) -> dict:
        return {
            "source": "pydoc_data.topics (Python's own documentation, ships with Python)",
            "split": "by document, seeded shuffle, ~10% of characters held out",
            "train_docs": len(self.train_docs),
            "held_out_docs": len(self.held_out_docs),
            "held_out_topics": sorted(self.held_out_docs),
            "train_tokens": len(self.train),
            "held_out_tokens": len(self.held_out),
            "chat_header_tokens": len(self.header),
            "extra_train": (
                f"{self.extra_train_docs} standard-library modules' docstrings ({self.extra_train_tokens} tokens)"
                if self.extra_train_docs
                else "none"
            ),
        }


def stdlib_docstrings(minimum_chars: int = 200) -> dict[str, str]:
    """More prose that ships with Python: the docstrings of the standard library's modules, classes and functions
    (read from the source with `ast`, nothing imported), one document per module, by module path. Test suites and
    private modules are left out."""
    import ast
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    documents: dict[str, str] = {}
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if any(
            part in ("test", "tests", "idlelib", "site-packages") or part.startswith("_") for part in relative.parts
        ):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        nodes = [tree] + [
            node for node in ast.walk(tree) if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        ]
        texts = [doc for node in nodes if (doc := ast.get_docstring(node)) and len(doc) >= minimum_chars]
        if texts:
            documents[str(relative.with_suffix("")).replace("/", ".")] = "\n\n".join(texts)
    return documents


def load_corpus(
    model_dir: str | Path,
    seed: int = 0,
    held_out_fraction: float = 0.1,
    topics: dict[str, str] | None = None,
    extra_train: dict[str, str] | None = None,
) -> Corpus:
    """pydoc topics split by document into train and held-out; `extra_train` documents (e.g. `stdlib_docstrings()`)
    join the train stream only, so the held-out split stays the same whatever is added."""
    if topics is None:
        from pydoc_data.topics import topics
    tokenizer = load_tokenizer(model_dir)
    keys = sorted(topics)
    random.Random(seed).shuffle(keys)
    total = sum(len(topics[k]) for k in keys)
    held_out, chars = [], 0
    for key in keys:
        if chars >= held_out_fraction * total:
            break
        held_out.append(key)
        chars += len(topics[key])
    train = [k for k in keys if k not in held_out]

    def stream(names: list[str]) -> list[int]:
        text = "\n\n".join(topics[k].strip() for k in names)
        return tokenizer.encode(text, add_special_tokens=False).ids

    header = chat_header(model_dir)
    header_ids = tokenizer.encode(header, add_special_tokens=False).ids if header else []
    train_stream = stream(train)
    extra_tokens = 0
    if extra_train:
        extra = tokenizer.encode(
            "\n\n".join(extra_train[k].strip() for k in sorted(extra_train)), add_special_tokens=False
        )
        extra_tokens = len(extra.ids)
        train_stream += extra.ids
    corpus = Corpus(train_stream, stream(held_out), header_ids, train, held_out)
    corpus.extra_train_docs = len(extra_train or {})
    corpus.extra_train_tokens = extra_tokens
    return corpus


def window(stream: list[int], header: list[int], seq_len: int, start: int, chat: bool) -> list[int]:
    prefix = header if chat else []
    body = seq_len - len(prefix)
    return prefix + stream[start : start + body]


def sample_batch(
    corpus: Corpus, seq_len: int, batch: int, rng: random.Random, chat_fraction: float = 0.5
) -> torch.Tensor:
    """[batch, seq_len] token ids: windows of the train stream at random offsets, some behind the chat header."""
    rows = []
    for _ in range(batch):
        chat = bool(corpus.header) and rng.random() < chat_fraction
        start = rng.randrange(0, len(corpus.train) - seq_len)
        rows.append(window(corpus.train, corpus.header, seq_len, start, chat))
    return torch.tensor(rows)


def fixed_windows(stream: list[int], header: list[int], seq_len: int, count: int) -> torch.Tensor:
    """`count` evenly spaced windows of a stream, every other one behind the chat header (the evaluation set)."""
    if len(stream) < seq_len:
        raise ValueError(f"stream of {len(stream)} tokens is shorter than one window of {seq_len}")
    step = max(1, (len(stream) - seq_len) // max(1, count - 1))
    rows = [
        window(stream, header, seq_len, min(i * step, len(stream) - seq_len), bool(header) and i % 2 == 1)
        for i in range(count)
    ]
    return torch.tensor(rows)
