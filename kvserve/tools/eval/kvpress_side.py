"""The reference side of `kvserve eval parity`: the same cases through kvpress's presses (NVIDIA's kvpress, the
reference implementations of KVzip, SnapKV, TOVA, ...), in kvpress's own environment.

This file is run as a script by the reference environment's Python (`.kvpress-venv`: kvpress 0.5.5 and
transformers<5.3 on `.venv`'s torch, since kvpress needs transformers<5.3 and vLLM's CPU build >=5.16), so it imports
nothing from kvserve:

    .kvpress-venv/bin/python kvserve/tools/eval/kvpress_side.py CASES.json OUT.jsonl

CASES.json (written by `kvserve/tools/eval/parity.py`): the model's directory, the settings ({"label", "press",
"budget"}, and for DuoAttention its head roles and each case's number of retrieval heads) and the cases ({"key",
"context_ids", "question_ids", "references", "max_tokens"}). Each case's context is compressed by the press alone
(kvpress's pipeline: the question is not in it), then the question is asked and answered greedily by the pipeline's
own code (`KVPressTextGenerationPipeline._forward`). A budget B means what it means to kvserve: the press keeps B
entries per (layer, KV head) of the context on average, compression_ratio = 1 - B / context tokens. DuoAttention
keeps every entry of its retrieval heads and the sinks and newest entries of the others (the paper's plain form):
its heads are ranked by the roles kvserve serves with (kvpress would download the authors' patterns, which exist
only for 7-8B models), with as many retrieval heads as B allows. One JSON line per (setting, case) is appended to
OUT.jsonl; lines already there are skipped.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

# a press by the name `kvserve eval parity` gives it: kvpress's class and its arguments beside compression_ratio
PRESSES = {
    "kvzip": ("KVzipPress", {}),  # one ranking over all layers and heads (kvpress's default, layerwise=False)
    "kvzip_layerwise": ("KVzipPress", {"layerwise": True}),  # each layer keeps the same share, ranked over its heads
    "snapkv": ("SnapKVPress", {}),
    "tova": ("TOVAPress", {}),
    "streamingllm": ("StreamingLLMPress", {}),
    "expected_attention": ("ExpectedAttentionPress", {}),
    "keydiff": ("KeyDiffPress", {}),
}


def make_press(name: str, ratio: float, setting: dict, case_key: list):
    import kvpress

    if name == "duoattention":
        return duo_press(setting, case_key)
    if ratio <= 0:
        return None
    if name == "kvzap":
        return kvzap_press(setting, ratio)
    class_name, kwargs = PRESSES[name]
    return getattr(kvpress, class_name)(compression_ratio=ratio, **kwargs)


def duo_press(setting: dict, case_key: list):
    """kvpress's DuoAttentionPress with kvserve's head roles in place of the downloaded patterns, streaming all but the
    case's retrieval heads (`retrieval_heads`, keyed by the case's key as JSON)."""
    import numpy as np
    from kvpress import DuoAttentionPress

    roles = setting["roles"]
    gates = np.array(roles["gates"], dtype=float)
    retrieval = setting["retrieval_heads"][json.dumps(case_key)]
    press = DuoAttentionPress(head_compression_ratio=(gates.size - retrieval) / gates.size)
    # an instance attribute shadows the static method that would download the authors' patterns
    press.load_attention_pattern = lambda model: (roles["sink_tokens"], roles["recent"], gates)
    return press


def kvzap_press(setting: dict, ratio: float):
    """kvpress's KVzapPress with the surrogate kvserve serves, in kvpress's form (`kvzap_model`: a folder written by
    kvserve.tools.training.kvzap.as_kvpress), instead of the authors' trained models, which exist for 8B-class models
    only and would be downloaded."""
    from kvpress import KVzapPress
    from kvpress.presses.kvzap_press import KVzapModel

    press = KVzapPress(model_type=setting["kvzap_kind"], compression_ratio=ratio)
    press.kvzap_model = KVzapModel.from_pretrained(setting["kvzap_model"])
    # the name its post_init_from_model compares with: set, it keeps the model given here
    press.kvzap_model_name = f"nvidia/KVzap-{setting['kvzap_kind']}-{setting['model_name']}"
    return press


def compression_ratio(setting: dict, case: dict, tokens: int) -> float:
    """kvpress's compression_ratio for a setting's budget B on a case of `tokens` context tokens. A setting with a
    budget per case (`budgets`, keyed by the case's key as JSON: the scoreboard's) gets 1 - (B + 0.5) / tokens, for
    which a press's int(tokens x (1 - ratio)) is exactly B; one budget for all (`budget`: parity's) 1 - B / tokens."""
    if "budgets" in setting:
        budget = setting["budgets"][json.dumps(case["key"])]
        return max(0.0, 1.0 - (budget + 0.5) / tokens)
    budget = setting["budget"]
    return 0.0 if budget is None else max(0.0, 1.0 - budget / tokens)


def main(cases_path: str, out_path: str) -> None:
    import kvpress  # noqa: F401  (registers the pipeline and patches attention for masked heads)
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

    spec = json.loads(Path(cases_path).read_text())
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.bfloat16, attn_implementation="sdpa")
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, device="cpu")
    done = set()
    out = Path(out_path)
    if out.exists():
        rows = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
        done = {(row["label"], tuple(row["key"])) for row in rows if row["side"] == "kvpress"}
    # case by case, every setting on each: a run stopped early has as many answers of each setting
    for case in spec["cases"]:
        for setting in spec["settings"]:
            if (setting["label"], tuple(case["key"])) in done:
                continue
            context = torch.tensor([case["context_ids"]])
            ratio = compression_ratio(setting, case, context.shape[1])
            press = None if setting["press"] == "full" else make_press(setting["press"], ratio, setting, case["key"])
            started = time.perf_counter()
            with torch.inference_mode():
                answer = pipe._forward(
                    {"context_ids": context, "questions_ids": [torch.tensor([case["question_ids"]])]},
                    max_new_tokens=case["max_tokens"],
                    press=press,
                )[0]
            row = {
                "side": "kvpress",
                "label": setting["label"],
                "key": case["key"],
                "answer": answer,
                "references": case["references"],
                "context_tokens": context.shape[1],
                "compression_ratio": round(ratio, 4),
                **({"budget": setting["budgets"][json.dumps(case["key"])]} if "budgets" in setting else {}),
                "seconds": round(time.perf_counter() - started, 2),
            }
            with out.open("a") as f:
                f.write(json.dumps(row) + "\n")
            print(f"kvpress {setting['label']} {case['key']}: {answer!r}", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:3])
