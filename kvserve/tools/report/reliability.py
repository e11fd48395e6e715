"""Does it stay up? The mixed load test (every policy, sampling parameter and bad input, with aborts, against one
server), the crash drill (the engine killed under load), and engine memory over long evicting requests."""

from __future__ import annotations

from pathlib import Path

from kvserve.tools.report.sources import DataDir, Source

LOAD = "load.json"
CRASH = "crash.json"
SOAK = "soak-issue15.json"


def load_summary(source: Source) -> str:
    report = source.data
    args = report["args"]
    invalid = sorted({o["policy"] for o in report["outcomes"] if o["kind"] == "invalid"})
    end = report["end_state"]
    checks = ", ".join(f"{name} {'yes' if ok else 'NO'}" for name, ok in end["checks"].items())
    return "\n".join(
        [
            "| requests | concurrency | completed | aborted by the client | bad inputs rejected with 400 | "
            "unexpected | output tok/s | passed |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
            f"| {report['sent']} | {args['concurrency']} | {report['ok']} | {report['aborted']} | "
            f"{report['rejected_as_expected']} of {report['invalid_planned_sent']} | "
            f"{sum(report['unexpected'].values()) if report['unexpected'] else 0} | "
            f"{report['output_tokens_per_s']:.1f} | {'yes' if report['passed'] else 'NO'} |",
            "",
            f"Bad inputs sent: {len(invalid)} kinds (each named in the file's outcomes).",
            "",
            f"After the run: {checks}; {end['evictions']:.0f} evictions freed {end['blocks_freed']:.0f} blocks.",
        ]
    )


def crash_summary(source: Source) -> str:
    report = source.data
    in_flight = report["in_flight"]
    errors = sum(1 for r in in_flight if r.get("error_event"))
    return (
        f"Engine killed with {len(in_flight)} streams in flight: `/health` failed after "
        f"{report['health_failed_s']:.2f} s, the server exited with code {report['exit_code']} after "
        f"{report['exit_s']:.2f} s (so a supervisor restarts it), {errors} of {len(in_flight)} streams received "
        f"an error event; the image's health check went from exit {report['healthcheck_exit_before']} to "
        f"{report['healthcheck_exit_after']}. Passed: {'yes' if report['passed'] else 'NO'}."
    )


def soak_table(source: Source) -> str:
    args = source.data["args"]
    lines = [
        f"{args['requests']} requests of {args['prompt_tokens']:,} tokens, `{args['policy']}` B={args['budget']}, "
        "one after another; engine resident memory after each:",
        "",
        "| allocator | RSS MB after each request | growth after the first, MB | s per request |",
        "| --- | --- | --- | --- |",
    ]
    for row in source.data["results"]:
        lines.append(
            f"| {row['allocator']} | {', '.join(f'{v:.0f}' for v in row['rss_mb'])} | "
            f"{row['growth_after_first_mb']:.0f} | {sum(row['seconds']) / len(row['seconds']):.1f} |"
        )
    return "\n".join(lines)


def section(data: DataDir, plots: Path, plot_link: str) -> str:
    load, crash, soak = data.load(LOAD), data.load(CRASH), data.load(SOAK)
    return "\n\n".join(
        [
            "## Does it stay up?",
            "### Load: every policy, every sampling parameter, bad inputs and aborts",
            load_summary(load),
            load.caption(),
            "### Crash drill",
            crash_summary(crash),
            crash.caption(),
            "### Memory over long evicting requests",
            soak_table(soak),
            soak.caption(),
        ]
    )
