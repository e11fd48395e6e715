"""Beyond one engine: where data parallelism sends a conversation's turns, and whether they resume."""

from __future__ import annotations

from pathlib import Path

from kvserve.tools.bench.sessions import report as sessions_table
from kvserve.tools.report.sources import DataDir, Source
from kvserve.tools.report.throughput import tensor_table, workload

SESSIONS = "scale/sessions.json"
DATA_PARALLEL = "scale/dp-decode-heavy.json"
ROUTER = "scale/router.json"
ROUTER_NO_SESSION = "scale/router-no-session.json"


def data_parallel_gain(source: Source) -> str:
    """kvserve's gain over vanilla with each engine count, and the DP=2 gain over the one-engine gain."""
    results = source.data["results"]

    def tokens(server: str, engines: int) -> float:
        return next(r["output_tokens_per_s"] for r in results if r["server"] == server and r["engines"] == engines)

    one, two = (tokens("kvserve", n) / tokens("vanilla", n) for n in (1, 2))
    return (
        f"kvserve over vanilla at equal memory: {one:.2f}x with one engine, {two:.2f}x with two, so two engines keep "
        f"{two / one:.2f} of the one-engine gain."
    )


def section(data: DataDir, plots: Path, plot_link: str) -> str:
    sessions = data.load(SESSIONS)
    engines = data.load(DATA_PARALLEL)
    args = sessions.data["args"]
    return "\n\n".join(
        [
            "## Beyond one engine",
            "### Conversations over data-parallel engines",
            f"One `kvserve serve --data-parallel-size {args['data_parallel_size']}` serves {args['conversations']} "
            f"conversations at once, {args['turns']} turns each, with turn checkpoints ({args['policy']}, "
            f"B={args['budget']}, `kv_checkpoint=turns`): routed by vLLM's balancer, then with a session per "
            "conversation (`x-kv-session`). A later turn resumes from its checkpoint only on the engine that holds "
            "it.",
            sessions_table(sessions.data["results"]),
            sessions.caption(),
            *router_section(data),
            "### Decode-heavy over data-parallel engines",
            "Vanilla vLLM and kvserve with one engine and with `--data-parallel-size 2` (an engine per core, "
            "`--api-server-count 1`), one after another, each engine with: "
            + workload(engines)
            + " "
            + data_parallel_gain(engines)
            + " Vanilla is bound by its pool, which a second engine doubles; kvserve by compute.",
            tensor_table(engines, "engines"),
            engines.caption(),
        ]
    )


def router_section(data: DataDir) -> list[str]:
    """The same conversations over separate servers behind vLLM's router, each policy in turn."""
    routed, bare = data.load(ROUTER), data.load(ROUTER_NO_SESSION)
    args = routed.data["args"]
    return [
        "### Conversations over servers behind vLLM's router",
        f"{args['replicas']} `kvserve serve` servers (one core each) behind `vllm-router`, one policy at a time, the "
        f"same {args['conversations']} conversations of {args['turns']} turns; each conversation sends "
        "`X-Session-ID` (consistent_hash's key), and kv_aware follows the servers' KV-cache events "
        "(`--kv-events-config`; a checkpoint is not among them, its conversation's published prompt blocks are).",
        sessions_table(routed.data["results"]),
        routed.caption(),
        "Without any header naming the conversation:",
        sessions_table(bare.data["results"]),
        bare.caption(),
    ]
