"""Which policy, how much memory saved, at what cost: one row per policy from the sections' own data (the quality
suite, the decode-heavy capacity benchmark, the overhead benchmark), the server's default marked, and the KV memory
a request holds at the suite's prompt lengths."""

from __future__ import annotations

from pathlib import Path

from kvserve.config import BUILTIN_DEFAULTS, parse_kv_config
from kvserve.tools.markdown import ratio, table
from kvserve.tools.report.quality import base_policy, best_labels, load_suite
from kvserve.tools.report.sources import DataDir
from kvserve.tools.report.throughput import DECODE_HEAVY

OVERHEAD = "costs/overhead-kernel.json"
# decode-heavy runs at B=188 (8x) beside the one in DECODE_HEAVY[0], for policies that one did not run
MORE_DECODE_HEAVY = ("costs/decode-heavy-h2o.json",)
SHOWN_BUDGETS = (128, 256, 512)
# The default model's KV entry per token: keys and values, 30 layers x 3 KV heads x 64 dimensions, bf16
LAYERS, KV_HEADS, HEAD_DIM, BYTES = 30, 3, 64, 2
BLOCK_SIZE = 32
OUTPUT_TOKENS = 64


def prefix_support(policy: str) -> str:
    sharing = parse_kv_config({"kv_policy": policy, "kv_budget": 512}, defaults={}).prefix_sharing()
    if sharing.reads and sharing.publishes:
        return "reads and publishes"
    return "publishes" if sharing.publishes else "neither"


def decode_heavy_ratios(runs: list[dict]) -> dict[str, str]:
    """Each policy's output tokens/s against the vanilla of its own decode-heavy run, `1.98x (B=188)`; the first run
    that has the policy gives it."""
    ratios: dict[str, str] = {}
    for run in runs:
        vanilla = next(r for r in run["results"] if r["server"] == "vanilla")
        for r in run["results"]:
            if r["server"] == "kvserve" and r["policy"] not in ratios:
                against_vanilla = ratio(r["output_tokens_per_s"], vanilla["output_tokens_per_s"])
                ratios[r["policy"]] = f"{against_vanilla} (B={r['budget']})"
    return ratios


def policy_table(data: DataDir) -> tuple[str, list]:
    """One row per policy that ran the whole suite (its best setting there), the server's default first: a share over
    the single-needle tasks alone does not compare with these, so those policies are in the quality section only."""
    sources, suite, cells = load_suite(data)
    chosen = best_labels(suite, cells)
    capacity = data.load(DECODE_HEAVY[0])
    more = [data.load(name) for name in MORE_DECODE_HEAVY]
    throughput = decode_heavy_ratios([run.data for run in (capacity, *more)])
    overhead = data.load(OVERHEAD)
    costs = overhead.data["results"]
    full = next(r for r in costs if r["server"] == "kvserve" and r["policy"] == "full")
    decode = {r["policy"]: ratio(r["tpot_p50"], full["tpot_p50"]) for r in costs if r["server"] == "kvserve"}
    default = BUILTIN_DEFAULTS["kv_policy"]
    order = sorted(chosen, key=lambda p: (p != default, -(suite.ratio((chosen[p], 256), cells) or 0)))
    rows = []
    for policy in order:
        label = chosen[policy]
        shares = []
        for budget in SHOWN_BUDGETS:
            found = suite.share_interval((label, budget), cells)
            shares.append("-" if found is None else f"{found[0]:.0%} ({found[1]:.0%}-{found[2]:.0%})")
        name = f"`{policy}`" + (" **(default)**" if policy == default else "")
        setting = label.removeprefix(policy).lstrip("/:") or "span 1"
        rows.append(
            [
                name,
                setting,
                *shares,
                throughput.get(base_policy(policy), "not run"),
                decode.get(policy, "not run"),
                prefix_support(policy),
            ]
        )
    headers = ["policy", "setting", *(f"B={b}" for b in SHOWN_BUDGETS)]
    headers += ["output tok/s vs vanilla, equal memory", "decode step vs `full`", "prefix cache"]
    return table(headers, rows), [*sources, capacity, *more, overhead]


def memory_table() -> str:
    """KV memory a request holds once its prompt is computed, by prompt length and budget: every token's entries
    without eviction; with it, at most B + one block of entries per layer and KV head (eviction runs once per block of
    new tokens), rounded up to whole blocks."""
    per_token = 2 * LAYERS * KV_HEADS * HEAD_DIM * BYTES
    rows = []
    for prompt in (1024, 2048, 4096):
        tokens = prompt + OUTPUT_TOKENS
        full = -(-tokens // BLOCK_SIZE) * BLOCK_SIZE * per_token
        kept = [min(full, -(-(budget + BLOCK_SIZE) // BLOCK_SIZE) * BLOCK_SIZE * per_token) for budget in SHOWN_BUDGETS]
        cells = [f"{bytes_ / 2**20:.1f} ({full / bytes_:.0f}x less)" for bytes_ in kept]
        rows.append([f"{prompt:,}", f"{full / 2**20:.1f}", *cells])
    return table(["prompt tokens", "`full`, MiB", *(f"B={b}, MiB" for b in SHOWN_BUDGETS)], rows)


def section(data: DataDir, plots: Path, plot_link: str) -> str:
    policies, sources = policy_table(data)
    return "\n\n".join(
        [
            "## Summary: which policy, how much memory, at what cost",
            "Each policy that ran the whole quality suite, at its best setting, the default first: its share of "
            "`full`'s score at B (95% interval); output tokens/s against vanilla vLLM in equal KV memory "
            "(decode-heavy); decode step against kvserve `full` when scoring without evicting; prefix-cache use. "
            "The others: [the single-needle suite](#the-single-needle-suite-every-policy); the second model: "
            "[its table](#a-second-model-qwen25-coder-05b-instruct).",
            policies,
            "Data: " + ", ".join(f"`{source.name}`" for source in sources) + " (machines and commands in the sections "
            "below).",
            f"KV memory a request holds (the default model, {2 * LAYERS * KV_HEADS * HEAD_DIM * BYTES:,} bytes a "
            f"token in bf16; {OUTPUT_TOKENS} output tokens, blocks of {BLOCK_SIZE}; evicting, at most B + one block a "
            "list): divide the pool (`VLLM_CPU_KVCACHE_SPACE`) by it.",
            memory_table(),
        ]
    )
