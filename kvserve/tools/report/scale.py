"""Beyond one engine: where data parallelism sends a conversation's turns, and whether they resume."""

from __future__ import annotations

from pathlib import Path

from kvserve.tools.bench.sessions import report as sessions_table
from kvserve.tools.report.sources import DataDir

SESSIONS = "scale/sessions.json"


def section(data: DataDir, plots: Path, plot_link: str) -> str:
    sessions = data.load(SESSIONS)
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
        ]
    )
