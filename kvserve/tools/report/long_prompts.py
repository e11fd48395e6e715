"""Long prompts through a bounded cache: full against eviction after every prefill chunk on the second model, time
to first token against prompt length, the pages a request held, and the answers (`kvserve bench long`)."""

from __future__ import annotations

from pathlib import Path

from kvserve.tools.bench.long_prompts import plot, report
from kvserve.tools.report.sources import DataDir

LONG = "long/qwen05.json"
TITLE = "## Long prompts through a bounded cache"


def section(data: DataDir, plots: Path, plot_link: str) -> str:
    source = data.load(LONG)
    args, rows = source.data["args"], source.data["results"]
    plot(rows, str(plots / "long-prompts.png"))
    per_list = args["block_size"] / (args["layers"] * args["kv_heads"])
    tasks = ", ".join(f"`{task}`" for task in args["tasks"].split(","))
    return "\n\n".join(
        [
            TITLE,
            f"One request at a time on {args['model']}, prefill chunks of {args['chunk']:,} tokens "
            f"(`--max-num-batched-tokens`), blocks of {args['block_size']}: `full` computes each chunk against the "
            f"whole prompt so far, while `{args['policy']}` with `kv_evict_every_chunk` compacts every list back to B "
            "after each chunk, so a chunk attends to at most B + itself and the prompt's attention grows linearly. "
            f"{args['samples']} cases of each task ({tasks}) at each length; TTFT and TPOT are medians over them, the "
            "scores means (1 = every answer right). Peak entries / list: the most `kvserve:kv_pages_in_use` the "
            "server reported while a request ran (alone), as entries per (layer, KV head) list; the bound is B + one "
            "chunk + one block.",
            report(rows, per_list, args["chunk"], args["block_size"]),
            f"![TTFT against prompt length]({plot_link}/long-prompts.png)",
            source.caption(),
        ]
    )
