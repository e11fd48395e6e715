"""`python -m kvserve.tools.eval.streaming`: eviction while a long prompt streams in, computed in transformers, to
try scoring rules before the server runs them and to hold the server to them.

The model reads the prompt in chunks (as vLLM's chunked prefill does), and after every chunk each (layer, KV head)
keeps `budget` entries chosen by kvserve's own policy classes (`kvserve.policies`): each chunk attends to at most B
entries plus itself, which is what `kv_evict_every_chunk` serves. Then the answer is decoded greedily from what is
left. Rules (`--scorers`):

- `full`: nothing evicted (the reference answer);
- `keydiff`, `snapkv`: the served policies as they run every chunk (SnapKV votes with the chunk's own newest queries,
  which never include the question);
- `lookahead`: SnapKV's votes cast by the question's queries instead: the prompt's last `--tail` tokens (where the
  question is) are run alone first, at their own positions, and their queries score every chunk. A server holds the
  whole prompt when it admits it, so the question is known before the document streams in; run alone, its queries
  have not seen the document (the price of knowing them early);
- `mix`: each entry's better percentile rank under `lookahead` and `keydiff`, so each rule's best half survives
  (the policy `snapkv_keydiff`).

The server runs `lookahead` and `mix` as `kv_lookahead=T` with `snapkv` or `snapkv_keydiff`
(`kvserve/server/lookahead.py`); tests/test_lookahead.py holds the two to the same choices.

Measured on Qwen2.5-Coder-0.5B (docs/benchmarks.md, "Long prompts"):

    python -m kvserve.tools.eval.streaming --model "$(kvserve setup-model qwen2.5-coder-0.5b)" --lengths 16000 \\
        --tasks passkey --samples 2 --scorers full,keydiff,lookahead,mix --out docs/eval/long/streaming-16k.json
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from kvserve.policies.base import LayerObservation
from kvserve.policies.keydiff import KeyDiff
from kvserve.policies.snapkv import SnapKV
from kvserve.policies.snapkv_keydiff import SnapKVKeyDiff
from kvserve.provenance import command_line, provenance

PROG = "python -m kvserve.tools.eval.streaming"
SCORERS = ("full", "keydiff", "snapkv", "lookahead", "mix")
WINDOW = 32  # the newest entries every rule keeps, and SnapKV's voting window (both policies' defaults)
KERNEL = SnapKVKeyDiff().kernel_size  # the served mix's pool; the `snapkv` rule votes with the same, to compare
KEYDIFF, SNAPKV = KeyDiff(window=WINDOW), SnapKV(window=WINDOW, kernel_size=KERNEL)
MIX = SnapKVKeyDiff(window=WINDOW, kernel_size=KERNEL)  # the served `snapkv_keydiff`


class QueryCapture:
    """A pre-hook on every attention module: records each layer's rotated queries of the model's last forward pass,
    and gives the attention `mask` when set (a compacted cache is shorter than the positions it covers, so the
    model's own causal mask, built from positions, would not fit it)."""

    def __init__(self, model) -> None:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        self.queries: dict[int, torch.Tensor] = {}  # layer -> [q, Hq, D]
        self.mask: torch.Tensor | None = None  # [1, 1, q, held + q] bool, True: attends
        self.handles = []
        for index, layer in enumerate(model.model.layers):
            attention = layer.self_attn

            def capture(module, args, kwargs, index=index, attention=attention):
                hidden = kwargs["hidden_states"]
                cos, sin = kwargs["position_embeddings"]
                q = attention.q_proj(hidden).view(1, hidden.shape[1], -1, attention.head_dim).transpose(1, 2)
                q, _ = apply_rotary_pos_emb(q, q, cos, sin)
                self.queries[index] = q[0].transpose(0, 1)
                if self.mask is not None:  # additive, as eager attention and SDPA both take it
                    additive = torch.zeros(self.mask.shape, dtype=hidden.dtype).masked_fill(~self.mask, float("-inf"))
                    return args, {**kwargs, "attention_mask": additive}
                return None

            self.handles.append(attention.register_forward_pre_hook(capture, with_kwargs=True))

    def remove(self) -> None:
        """The model as it was (a test's shared model goes on to other tests)."""
        for handle in self.handles:
            handle.remove()


@dataclass
class Streamed:
    answer: str
    prefill_s: float
    kept_positions: list[torch.Tensor]  # per layer: [H, n] the prompt positions each head held when decoding began


def keep_indices(rule: str, obs: LayerObservation, budget: int, question: LayerObservation | None) -> torch.Tensor:
    """[H, budget] ascending cache indices each head keeps under `rule`."""
    if rule == "keydiff":
        return KEYDIFF.keep_indices(obs, budget)
    if rule == "snapkv":
        return SNAPKV.keep_indices(obs, budget)
    assert question is not None
    if rule == "lookahead":
        return SNAPKV.keep_indices(question, budget)
    if rule == "mix":  # KeyDiff reads no queries: the question's observation holds the same keys
        return MIX.keep_indices(question, budget)
    raise ValueError(f"scorer must be one of {', '.join(SCORERS)}, not {rule!r}")


def stream(
    model,
    capture: QueryCapture,
    ids: list[int],
    rule: str,
    budget: int,
    chunk: int | Sequence[int],
    tail: int,
    max_new: int,
    tokenizer,
) -> Streamed:
    """Reads `ids` in chunks (of `chunk` tokens, or of the sizes listed, as a server's scheduler cut them),
    compacting every layer to `budget` per KV head after each chunk under `rule`, then decodes `max_new` tokens
    greedily."""
    from transformers import DynamicCache

    config = model.config
    scale = model.model.layers[0].self_attn.scaling  # the model's own softmax scale
    prompt = torch.tensor([ids])
    total = len(ids)
    question_queries: dict[int, torch.Tensor] = {}
    positions: dict[int, torch.Tensor] = {}  # layer -> [H, n] logical positions of its cache entries
    newest: dict[int, torch.Tensor] = {}  # layer -> [<= WINDOW, Hq, D] the newest queries, across chunks
    start_time = time.time()
    with torch.no_grad():
        capture.mask = None
        if rule in ("lookahead", "mix"):  # the question, alone, at its own positions
            model(
                prompt[:, -tail:],
                position_ids=torch.arange(total - tail, total)[None],
                past_key_values=DynamicCache(config=config),
            )
            question_queries = dict(capture.queries)
        cache = DynamicCache(config=config)
        starts = range(0, total, chunk) if isinstance(chunk, int) else [sum(chunk[:i]) for i in range(len(chunk))]
        for start, end in zip(starts, [*starts[1:], total], strict=True):
            piece = prompt[:, start:end]
            width = piece.shape[1]
            held = cache.get_seq_length()
            mask = torch.ones(width, held + width, dtype=torch.bool)
            mask[:, held:] = torch.tril(torch.ones(width, width, dtype=torch.bool))
            capture.mask = mask[None, None]
            output = model(piece, position_ids=torch.arange(start, start + width)[None], past_key_values=cache)
            for index, layer in enumerate(cache.layers):
                keys, values = layer.keys[0], layer.values[0]  # [H, n, D]
                heads = keys.shape[0]
                new = torch.arange(start, start + width).expand(heads, width)
                recent = (
                    capture.queries[index]
                    if index not in newest
                    else torch.cat([newest[index], capture.queries[index]])
                )
                newest[index] = recent[-WINDOW:]
                positions[index] = torch.cat([positions[index], new], 1) if index in positions else new.clone()
                if rule == "full" or keys.shape[1] <= budget:
                    continue
                obs = LayerObservation(
                    layer_idx=index,
                    keys=keys,
                    values=values,
                    positions=positions[index],
                    scale=scale,
                    window_queries=newest[index],
                    window_positions=torch.arange(start + width - newest[index].shape[0], start + width),
                    budget=budget,
                )
                question = None
                if question_queries:  # the same entries, voted on by the question's queries
                    question = replace(
                        obs, window_queries=question_queries[index], window_positions=torch.arange(total - tail, total)
                    )
                keep = keep_indices(rule, obs, budget, question)
                gather = keep[..., None].expand(-1, -1, keys.shape[-1])
                layer.keys, layer.values = keys.gather(1, gather)[None], values.gather(1, gather)[None]
                positions[index] = positions[index].gather(1, keep)
        prefill_s = time.time() - start_time
        kept_positions = [positions[index].clone() for index in sorted(positions)]
        answer = []
        logits = output.logits[:, -1]
        for step in range(max_new):
            token = logits.argmax(-1)
            answer.append(int(token))
            if tokenizer.eos_token_id is not None and int(token) == tokenizer.eos_token_id:
                break
            capture.mask = torch.ones(1, 1, 1, cache.get_seq_length() + 1, dtype=torch.bool)
            output = model(token[None], position_ids=torch.tensor([[total + step]]), past_key_values=cache)
            logits = output.logits[:, -1]
        capture.mask = None  # the model is the caller's again
    return Streamed(tokenizer.decode(answer), prefill_s, kept_positions)


def needle_kept(kept_positions: list[torch.Tensor], needle: tuple[int, int]) -> list[float]:
    """Per layer, the share of the needle's positions [low, high) its heads kept (mean over heads)."""
    low, high = needle
    return [
        round(float(((p >= low) & (p < high)).float().sum(1).mean()) / max(high - low, 1), 3) for p in kept_positions
    ]


def needle_span(tokenizer, prompt: str, answer: str) -> tuple[int, int]:
    """Token positions around the answer's first appearance in the prompt (the needle), or (0, 0)."""
    at = prompt.find(answer)
    if at < 0:
        return (0, 0)
    first = len(tokenizer(prompt[:at]).input_ids)
    return (max(first - 5, 0), first + 20)


def main(argv: list[str] | None = None) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvserve.tools.eval.tasks import make_case, score

    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a model folder (kvserve setup-model prints one)")
    parser.add_argument("--lengths", default="8000,16000")
    parser.add_argument("--tasks", default="passkey")
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--scorers", default="full,keydiff,lookahead,mix")
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--tail", type=int, default=32, help="lookahead: the prompt's last tokens that vote")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    rules = args.scorers.split(",")
    for rule in rules:
        if rule not in SCORERS:
            raise SystemExit(f"--scorers: {rule!r} is not one of {', '.join(SCORERS)}")
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).eval()
    capture = QueryCapture(model)
    rows = []
    for length in (int(n) for n in args.lengths.split(",")):
        for task in args.tasks.split(","):
            for index in range(args.samples):
                case = make_case(tokenizer, task, length, index)
                ids = tokenizer(case.prompt).input_ids
                needle = needle_span(tokenizer, case.prompt, case.references[0])
                for rule in rules:
                    streamed = stream(
                        model,
                        capture,
                        ids,
                        rule,
                        args.budget,
                        args.chunk,
                        args.tail,
                        case.max_tokens,
                        tokenizer,
                    )
                    row = {
                        "task": task,
                        "length": length,
                        "index": index,
                        "tokens": len(ids),
                        "scorer": rule,
                        "budget": args.budget,
                        "score": score(streamed.answer, case.references),
                        "answer": streamed.answer,
                        "needle_at": needle[0],
                        "prefill_s": streamed.prefill_s,
                        "needle_kept": needle_kept(streamed.kept_positions, needle),
                    }
                    rows.append(row)
                    print(
                        f"{task} {length} #{index} {rule}: score={row['score']:.2f} prefill={row['prefill_s']:.1f}s "
                        f"answer={row['answer']!r} needle at {needle[0]}/{len(ids)}",
                        flush=True,
                    )
    if args.out:
        ran = provenance(command_line(argv, PROG))
        recorded = {**vars(args), "model": Path(args.model).name}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"args": recorded, "provenance": ran, "results": rows}, indent=1))


if __name__ == "__main__":
    main()
