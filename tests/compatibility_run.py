"""Background run for tests/test_compatibility.py: the features a server is started for, and (vanilla) the per-request
probes, on real `vllm serve` / `kvserve serve` servers of the default model. Writes each feature's outcome as JSON.

    python tests/compatibility_run.py vanilla|kvserve ADAPTER_DIR OUT.json

vanilla: a server with a LoRA adapter runs every per-request probe (tests/compatibility.py) and the adapter's; one
with n-gram speculation, one with a draft model, one with an EAGLE and one with an EAGLE-3 head (tests/drafters.py)
each answer a quoting request. kvserve, evicting by its server defaults (snapkv at the per-request probes' budget):
one server with n-gram speculation and the adapter; one with a draft model and one with each head, which draft for a
request until it compacts: an evicting request is served, and one that does not evict gets accepted drafts. A server
that refuses at start-up gives its reason as the outcome. The per-request probes of kvserve's side run on the
session's server.
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, os.path.dirname(__file__))

from compatibility import EVICTING_BUDGET, complete, outcome, run_probes  # noqa: E402
from drafters import eagle3_head, eagle_head  # noqa: E402
from engine_settings import SERVED_MODEL, SERVER_ARGS  # noqa: E402

from kvserve.model import ensure_default_model  # noqa: E402
from kvserve.tools.bench.servers import ServerStartError, running_server  # noqa: E402

EVICTING_FLAGS = ["--kv-policy", "snapkv", "--kv-budget", EVICTING_BUDGET]
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
SPACE = {"VLLM_CPU_KVCACHE_SPACE": "1"}  # GiB, as the session's server: vLLM's default reserves most of the memory
REFUSAL = re.compile(r"(kvserve eviction [^\n]*)")


def accepted_drafts(base: str) -> float:
    found = re.findall(rf"^{re.escape(ACCEPTED)}(?:\{{[^}}]*\}})? (\S+)$", httpx.get(base + "/metrics").text, re.M)
    return sum(float(value) for value in found)


def speculation(base: str, headers: dict | None = None) -> dict:
    """A request (`headers`: its settings) whose answer quotes its prompt: served, and drafts were accepted."""
    result = outcome(complete(base, SERVED_MODEL, headers or {}, max_tokens=48), lambda answer: None)
    deadline = time.monotonic() + 120  # the API server's counters follow the engine's steps with a lag
    while result["outcome"] == "serves" and accepted_drafts(base) == 0:
        if time.monotonic() > deadline:
            result["outcome"] = "fails: no draft was accepted"
        time.sleep(1)
    return result


def drafting_beside_eviction(base: str) -> dict:
    """A drafter with a KV cache of its own drafts for a request until it compacts: a request evicting by the
    server's defaults is served (the outcome, with its evicted count), and one that does not evict gets accepted
    drafts."""
    evicting = outcome(complete(base, SERVED_MODEL, {}, max_tokens=48), lambda answer: None)
    if evicting["outcome"] != "serves":
        return evicting
    drafted = speculation(base, {"x-kv-policy": "full"})
    return evicting if drafted["outcome"] == "serves" else drafted


def adapter(base: str) -> dict:
    """The adapter's request is served, and its logprobs are not the base model's (the adapter applies)."""

    def first_logprob(model: str) -> httpx.Response:
        return complete(base, model, {}, max_tokens=1, logprobs=1)

    base_answer = first_logprob(SERVED_MODEL).json()["choices"][0]["logprobs"]["token_logprobs"]

    def holds(answer: dict) -> str | None:
        same = answer["choices"][0]["logprobs"]["token_logprobs"] == base_answer
        return "the adapter's logprobs are the base model's" if same else None

    return outcome(first_logprob("trained"), holds)


def served(kind: str, args: list[str], log: Path, ask) -> dict:
    """`ask(base)` on a server started with `args`, or the server's start-up refusal."""
    # vanilla is named the model's folder, served under the name kvserve gives it
    model, named = (
        (None, []) if kind == "kvserve" else (str(ensure_default_model()), ["--served-model-name", SERVED_MODEL])
    )
    try:
        with running_server(kind, model, [*SERVER_ARGS, *named, *args], log, env=SPACE) as base:
            return ask(base)
    except ServerStartError:
        refusal = REFUSAL.search(log.read_text())
        if refusal is None:
            raise
        return {"outcome": f"refused at start-up: {refusal.group(1)}"}


def main(side: str, adapter_dir: str, out: str) -> None:
    folder = Path(tempfile.mkdtemp(prefix=f"kvserve-compatibility-{side}-"))
    lora = ["--enable-lora", "--max-lora-rank", "8", "--lora-modules", f"trained={adapter_dir}"]
    ngram = ["--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": 3})]
    draft = {"method": "draft_model", "model": str(ensure_default_model()), "num_speculative_tokens": 2}
    drafting = ["--speculative-config", json.dumps(draft)]
    heads = {"EAGLE": ("eagle", eagle_head), "EAGLE-3": ("eagle3", eagle3_head)}
    results: dict[str, dict] = {}
    if side == "vanilla":

        def probes_and_adapter(base: str) -> dict:
            results.update(run_probes(base, SERVED_MODEL, {}))
            return adapter(base)

        results["LoRA adapters"] = served(side, lora, folder / "lora.log", probes_and_adapter)
        results["speculative decoding, n-gram"] = served(side, ngram, folder / "ngram.log", speculation)
    else:

        def speculation_and_adapter(base: str) -> dict:
            results["LoRA adapters"] = adapter(base)
            return speculation(base)

        # vLLM's rule for LoRA beside drafts: a step's token budget holds every sequence's drafts
        args = [*EVICTING_FLAGS, *ngram, *lora, "--max-num-seqs", "16"]
        results["speculative decoding, n-gram"] = served(side, args, folder / "ngram.log", speculation_and_adapter)
    flags, ask = (EVICTING_FLAGS, drafting_beside_eviction) if side == "kvserve" else ([], speculation)
    results["speculative decoding, draft model"] = served(side, [*flags, *drafting], folder / "draft.log", ask)
    for name, (method, head) in heads.items():
        config = {"method": method, "model": str(head()), "num_speculative_tokens": 2}
        args = [*flags, "--speculative-config", json.dumps(config)]
        results[f"speculative decoding, {name}"] = served(side, args, folder / f"{method}.log", ask)
    Path(out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(*sys.argv[1:4])
