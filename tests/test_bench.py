"""Benchmark commands on a tiny workload (they start their own vanilla and kvserve servers, run in the background:
tests/background.py), and their parsing."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
from background import Run
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from kvserve.tools.bench.workload import compaction_histogram

PROMPTS, PROMPT_TOKENS, MAX_TOKENS, BUDGET = 3, 300, 12, 64
TINY = [
    "--prompts",
    str(PROMPTS),
    "--prompt-tokens",
    str(PROMPT_TOKENS),
    "--max-tokens",
    str(MAX_TOKENS),
    "--block-size",
    "32",
    "--kv-space-gib",
    "1",
    "--server-args=--enforce-eager",
]


def test_compaction_histogram_is_the_per_bucket_difference_of_two_scrapes():
    registry = CollectorRegistry()
    histogram = Histogram("kvserve:compaction_seconds", "t", ["policy"], buckets=(0.01, 0.1, 1.0), registry=registry)
    histogram.labels(policy="snapkv").observe(0.5)
    before = generate_latest(registry).decode()
    samples = [0.005, 0.05, 0.07, 0.5, 3.0]
    for value in samples:
        histogram.labels(policy="snapkv").observe(value)
    histogram.labels(policy="h2o").observe(0.05)
    after = generate_latest(registry).decode()
    expected = {"0.01": 1, "0.1": 3, "1.0": 1, "+Inf": 1}  # samples binned by hand, plus h2o's one in 0.1
    assert compaction_histogram(before, after) == pytest.approx(expected)


PNG = b"\x89PNG\r\n\x1a\n"
LONG_CHUNK = 64
CHAT = dict(conversations=2, turns=2, reply=4)


def _bench(fixture: str, *args: str) -> Run:
    """`python -m kvserve.tools.bench ARGS --out JSON`, its JSON read by `fixture`."""
    return Run(fixture, [sys.executable, "-m", "kvserve.tools.bench", *args, "--out", "{out}"])


def background_runs() -> list[Run]:
    """Each command starts its own servers one after another: run beside the other tests (tests/background.py)."""
    capacity = ["capacity", *TINY, "--num-blocks", "24", "--budgets", str(BUDGET), "--ceiling", "--plot", "{out}.png"]
    chat = [
        "chat",
        *("--conversations", str(CHAT["conversations"]), "--turns", str(CHAT["turns"])),
        *("--reply-tokens", str(CHAT["reply"]), "--doc-tokens", "200", "--user-tokens", "20", "--block-size", "32"),
        *("--kv-space-gib", "1", "--pools", "small", "--budget", "64", "--server-args=--enforce-eager"),
        *("--plot", "{out}.png"),
    ]
    soak = [
        "soak",
        *("--requests", "2", "--prompt-tokens", str(PROMPT_TOKENS), "--max-tokens", "2", "--budget", str(BUDGET)),
        *("--allocators", "glibc-threshold", "--server-args=--block-size 32 --enforce-eager --dtype float32"),
    ]
    long = [
        *("long", "--model", "tiny:llama", "--lengths", str(PROMPT_TOKENS), "--budgets", str(BUDGET)),
        *("--tasks", "passkey", "--samples", "1", "--chunk", str(LONG_CHUNK), "--block-size", "32"),
        *("--kv-space-gib", "1", "--server-args=--enforce-eager"),
    ]
    return [
        _bench("capacity_run", *capacity),
        _bench("long_run", *long),
        _bench("overhead_run", "overhead", *TINY, "--policy", "h2o"),
        _bench("chat_run", *chat),
        _bench("soak_run", *soak),
    ]


@pytest.fixture(scope="module")
def capacity_run(background):
    return background.results("capacity_run")[0]


@pytest.fixture(scope="module")
def long_run(background):
    return background.results("long_run")[0]


@pytest.fixture(scope="module")
def overhead_run(background):
    return background.results("overhead_run")[0]


@pytest.fixture(scope="module")
def chat_run(background):
    return background.results("chat_run")[0]


@pytest.fixture(scope="module")
def soak_run(background):
    return background.results("soak_run")[0]


def _plot_of(background, fixture: str) -> bytes:
    (run,) = background.runs[fixture]
    return Path(f"{run.out}.png").read_bytes()


def test_capacity_command_compares_vanilla_and_kvserve(capacity_run, background):
    assert _plot_of(background, "capacity_run")[:8] == PNG
    results = capacity_run["results"]
    vanilla, ceiling, kvserve = results
    assert (vanilla["server"], kvserve["server"], kvserve["budget"]) == ("vanilla", "kvserve", BUDGET)
    # the ceiling: vanilla with a pool for every request never preempts (the running peak is a sample, scraped every
    # 0.5 s and at each first token: it sees a request running, but is too coarse to compare servers on this workload)
    assert ceiling["server"] == "vanilla-unlimited" and ceiling["preemptions"] == 0
    assert ceiling["pool_limit"] == PROMPTS
    for result in results:
        assert result["requests"] == PROMPTS
        assert result["output_tokens_per_s"] * result["wall_s"] == pytest.approx(PROMPTS * MAX_TOKENS)
        assert 1 <= result["peak_running"] <= PROMPTS
    # a 300-token prompt at budget 64: one compaction per request, none in 4 decode steps; vanilla never evicts
    assert vanilla["blocks_freed"] == 0 and vanilla["compactions"] == 0 and not ceiling["compactions"]
    assert kvserve["compactions"] == PROMPTS and kvserve["blocks_freed"] > 0
    assert sum(kvserve["compaction_histogram"].values()) == PROMPTS
    # where kvserve's engine time went: the phases inside the worker's step add up to at most the step
    phases = kvserve["phase_seconds"]
    assert phases["worker"] > 0 and phases["compaction"] > 0 and phases["statistics"] > 0 and phases["attention"] > 0
    assert sum(phases[p] for p in ("attention", "statistics", "compaction", "pages")) < phases["worker"]
    assert not any(vanilla["phase_seconds"].values()) and not any(ceiling["phase_seconds"].values())
    printed = background.printed("capacity_run")
    assert "Engine time by phase" in printed
    assert "Ratios kvserve / vanilla" in printed and f"| {PROMPT_TOKENS / BUDGET:.1f} |" in printed


def test_long_command_streams_a_prompt_through_a_bounded_cache_and_against_full(long_run, background):
    full, evicting = long_run["results"]
    assert (full["policy"], evicting["policy"], evicting["budget"]) == ("full", "keydiff", BUDGET)
    assert full["prompt_tokens"] == evicting["prompt_tokens"] > BUDGET + LONG_CHUNK
    assert full["evicted"] == 0 and evicting["evicted"] > 0  # it compacted while the prompt streamed in
    for row in (full, evicting):
        assert row["ttft_s"] > 0 and 0 <= row["score"] <= 1
        assert row["phase_seconds"]["worker"] > 0
    # what the server reported while the evicting request ran never passed B + one chunk + one block per list
    shape = long_run["args"]
    per_list = 32 / (shape["layers"] * shape["kv_heads"])
    assert evicting["peak_allocated_pages"] * per_list <= BUDGET + LONG_CHUNK + 32
    assert evicting["phase_seconds"]["compaction"] > 0 and full["phase_seconds"]["compaction"] == 0
    printed = background.printed("long_run")
    assert "keydiff B=64 every chunk" in printed and "| setting | worker |" in printed


def test_overhead_command_runs_full_and_scoring_without_eviction(overhead_run):
    vanilla, full, scoring = overhead_run["results"]
    assert (full["policy"], scoring["policy"]) == ("full", "h2o")
    assert scoring["budget"] > PROMPT_TOKENS + MAX_TOKENS
    for result in (full, scoring):
        assert result["blocks_freed"] == 0 and result["compactions"] == 0
        assert result["output_tokens_per_s"] * result["wall_s"] == pytest.approx(PROMPTS * MAX_TOKENS)


def test_chat_command_runs_conversations_on_every_server_and_evicting_requests_hit_the_prefix_cache(
    chat_run, background
):
    conversations, turns, reply = CHAT["conversations"], CHAT["turns"], CHAT["reply"]
    assert _plot_of(background, "chat_run")[:8] == PNG
    results = chat_run["results"]
    assert [r["server"] for r in results] == [
        "vanilla",
        "kvserve full",
        "kvserve snapkv",
        "kvserve snapkv/pressure",
        "kvserve snapkv/checkpoint-turns",  # the default --checkpoints
        "kvserve snapkv/checkpoint128",
    ]
    for result in results:
        assert len(result["requests"]) == conversations * turns
        assert all(r["output_tokens"] == reply for r in result["requests"])
        assert [row["turn"] for row in result["turns"]] == list(range(1, turns + 1))
        # a conversation's second turn resends its first: its prompt is longer and the document is in the cache
        second = [r for r in result["requests"] if r["turn"] == 2]
        if result["server"].endswith("checkpoint128"):  # it resumes from a checkpoint: a multiple of 128 tokens
            assert all(r["cached_tokens"] >= 128 and r["cached_tokens"] % 128 == 0 for r in second)
        else:
            assert all(r["cached_tokens"] >= 192 for r in second), result["server"]
        assert result["prefix_cache_hits"] >= sum(r["cached_tokens"] for r in result["requests"])  # vLLM counts them
    full, evicting, deferred, *checkpointing = results[1:]
    for run in checkpointing:  # each conversation's second turn resumed from its first turn's checkpoint
        assert run["checkpoints_published"] > 0 and run["checkpoint_hits"] >= conversations, run["server"]
    assert evicting["blocks_published"] > 0 and full["blocks_published"] == 0  # counted for evicting requests
    # deferred eviction in a pool that holds both conversations: nothing compacts, so every turn hits what `full`'s
    # hit, its replies' blocks included (an eager request publishes only its prompt's)
    assert [r["cached_tokens"] for r in deferred["requests"]] == [r["cached_tokens"] for r in full["requests"]]
    assert deferred["blocks_published"] > 0
    printed = background.printed("chat_run")
    assert "snapkv / full TTFT p50" in printed and "small pool: snapkv output tok/s" in printed
    assert "small pool: snapkv/pressure output tok/s" in printed
    assert "small pool: snapkv/checkpoint-turns output tok/s" in printed
    assert "small pool: snapkv/checkpoint128 output tok/s" in printed


def test_chat_refuses_a_setting_the_server_would_before_starting_any_server(tmp_path):
    """duoattention assigns its heads' roles at the end of the prompt, so the server refuses kv_evict_when=pressure
    for it: the command says so at once (the vanilla and kvserve `full` runs before it took 9 minutes on the 0.5B
    model), and writes nothing."""
    from kvserve.tools.bench.chat import main

    out = tmp_path / "chat.json"
    argv = ["--policy", "duoattention", "--evict-when", "eager,pressure", "--checkpoints", "", "--out", str(out)]
    with pytest.raises(SystemExit, match="would refuse duoattention.*kv_evict_when"):
        main(argv)
    assert not out.exists()


def test_decode_heavy_preset_holds_two_requests_without_eviction_and_compresses_4_8_16x():
    import argparse

    from kvserve.tools.bench.__main__ import apply_decode_heavy

    args = argparse.Namespace(
        prompts=8, prompt_tokens=3000, max_tokens=64, block_size=128, num_blocks=64, budgets="256,512"
    )
    apply_decode_heavy(args, ["--decode-heavy"])
    per_request = -(-(args.prompt_tokens + args.max_tokens) // args.block_size)
    assert (args.prompts, args.max_tokens) == (16, 256) and args.num_blocks == 2 * per_request
    assert [round(args.prompt_tokens / int(b)) for b in args.budgets.split(",")] == [4, 8, 16]
    given = argparse.Namespace(**vars(args) | {"prompts": 4})
    apply_decode_heavy(given, ["--decode-heavy", "--prompts", "4"])
    assert given.prompts == 4  # a flag the user gave wins over the preset


def test_soak_records_engine_memory_after_each_request(soak_run, background):
    [result] = soak_run["results"]
    assert result["allocator"] == "glibc-threshold" and len(result["seconds"]) == 2
    assert len(result["rss_mb"]) == 3 and min(result["rss_mb"]) > 100  # a loaded model, measured each time
    assert result["growth_after_first_mb"] == pytest.approx(result["rss_mb"][2] - result["rss_mb"][1])
    assert "| glibc-threshold |" in background.printed("soak_run")


def test_flame_summary_shares_samples_under_the_root_frame():
    from kvserve.tools.bench.flame import summarize

    stacks = [
        "main (a.py:1);step (b.py:2);attention (c.py:3) 6",
        "main (a.py:1);step (b.py:9);score (d.py:4);gather (d.py:8) 3",
        "main (a.py:1);step (b.py:2) 1",
        "main (a.py:1);load (e.py:1) 90",
    ]  # outside the root: not counted
    table = summarize(stacks, root="step")
    assert table.startswith("10 samples under step")
    assert "| 100.0% | 10.0% | `step (b.py)` |" in table  # line numbers merged, 1 sample of its own
    assert "| 60.0% | 60.0% | `attention (c.py)` |" in table and "| 30.0% | 0.0% | `score (d.py)` |" in table
    assert "load" not in table


def test_capacity_limits_count_whole_blocks_held_while_decoding():
    import argparse

    from kvserve.tools.bench.__main__ import add_capacity_limits

    args = argparse.Namespace(
        command="capacity", num_blocks=28, block_size=128, prompts=16, prompt_tokens=1500, max_tokens=256
    )
    results = [
        {"server": "vanilla", "budget": None, "peak_running": 2},
        *({"server": "kvserve", "budget": b, "peak_running": 0} for b in (375, 188, 94)),
    ]
    add_capacity_limits(results, args)
    # vanilla: 1,756 tokens = 14 blocks -> 2 fit; evicting: B + one block of new tokens, in whole blocks
    assert [r["pool_limit"] for r in results] == [2, 28 // 4, 28 // 3, 28 // 2]
    assert [r["theoretical"] for r in results] == pytest.approx([2, 2 * 1500 / 375, 2 * 1500 / 188, 16])


def test_layouts_bench_times_the_same_work_in_every_layout(tmp_path, monkeypatch, capsys):
    """`kvserve bench layouts` checks that the layouts computed the same before it times them: a wrong AMX product
    stops it instead of timing different work."""
    import json

    from kvserve.tools.bench import layouts
    from kvserve.worker.layouts import AmxPages

    tiny = ["--requests", "1", "--tokens", "80", "--budget", "40", "--block-size", "32", "--window", "8"]
    layouts.main([*tiny, "--repeats", "1", "--out", str(tmp_path / "layouts.json")])
    rows = json.loads((tmp_path / "layouts.json").read_text())["results"]
    assert len(rows) == 4 and all(row[f"{name}_ms"] > 0 for row in rows for name in ("vec", "amx", "amx staged"))
    assert "| compaction |" in capsys.readouterr().out
    keys = AmxPages.key_pages  # a wrong AMX decoder
    monkeypatch.setattr(AmxPages, "key_pages", lambda self, ids: keys(self, ids) * 1.01)
    with pytest.raises(AssertionError, match="disagree"):
        layouts.main([*tiny, "--repeats", "1"])


def test_kernel_bench_times_the_kernel_only_where_it_gives_vllms_output(tmp_path, monkeypatch, capsys):
    """`kvserve bench kernel` checks the kernel's output against vLLM's op on the same rows before it times them: a
    wrong kernel stops it instead of timing different work."""
    import json

    from kvserve_kernels import cpu as cpu_kernel

    from kvserve.tools.bench import kernel

    if not cpu_kernel.available():
        pytest.skip(f"the CPU kernel did not build: {cpu_kernel.build_error()}")
    kernel.main(["--tokens", "64", "--repeats", "1", "--out", str(tmp_path / "kernel.json")])
    rows = json.loads((tmp_path / "kernel.json").read_text())["results"]
    names = ("vllm", "kernel", "kernel_sums", "pytorch_sums")
    assert len(rows) == 3 and all(row[f"{name}_ms"] > 0 for row in rows for name in names)
    assert "| prefill, 64 queries of 1 request |" in capsys.readouterr().out
    right = cpu_kernel.paged_attention
    monkeypatch.setattr(
        cpu_kernel, "paged_attention", lambda *a, **k: tuple(None if t is None else t * 1.1 for t in right(*a, **k))
    )
    with pytest.raises(AssertionError, match="not close"):
        kernel.main(["--tokens", "64", "--repeats", "1"])


def test_each_setting_runs_on_its_own_prefix_cache_salt(monkeypatch):
    """Settings run one after another with the same prompts on one server: without a salt of its own, a setting that
    reads prefix-cache hits would be served from the previous setting's blocks and time a warm cache."""
    import asyncio

    from kvserve.tools.bench import workload
    from kvserve.tools.eval.client import Setting

    bodies = []

    async def fake_stream(client, url, path, body, setting):
        bodies.append(body)
        yield {"choices": [{"text": "x"}], "usage": {"completion_tokens": 1}}

    monkeypatch.setattr(workload, "stream_chunks", fake_stream)
    for setting in (Setting("snapkv", 128), Setting("snapkv", 256), Setting("tova", 128), Setting("full", None)):
        asyncio.run(workload._one(None, "http://x", "m", [1, 2, 3], 1, setting))
    salts = [body["cache_salt"] for body in bodies]
    assert len(set(salts)) == len(salts)


def test_the_running_peak_is_read_when_a_request_streams_its_first_token(monkeypatch):
    """A request that runs only between two periodic scrapes (here 60 s apart) is read running by the scrape its first
    token triggers (the capacity bench once reported a peak of 0 requests running for a sub-second workload)."""
    import asyncio

    import httpx

    from kvserve.tools.bench import workload
    from kvserve.tools.eval.client import Setting

    running, scrapes, real_client = [0], [0], httpx.AsyncClient

    def metrics(request: httpx.Request) -> httpx.Response:
        scrapes[0] += 1
        return httpx.Response(200, text=f'vllm:num_requests_running{{engine="0"}} {running[0]}\n')

    def mock_client(**kwargs) -> httpx.AsyncClient:
        return real_client(transport=httpx.MockTransport(metrics), **kwargs)

    async def one_short_request(client, url, path, body, setting):
        while scrapes[0] < 2:  # after the first periodic scrape (the first scrape is the workload's "before")
            await asyncio.sleep(0.01)
        running[0] += 1
        scraped = scrapes[0]
        yield {"choices": [{"text": "x"}]}
        # running until a scrape after the first token, or 10 s: no fixed window a busy machine could miss, yet far
        # below the next periodic scrape (60 s), so a sampler that the first token does not wake still reads 0
        deadline = time.monotonic() + 10
        while scrapes[0] == scraped and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        running[0] -= 1
        yield {"choices": [{"text": "y"}], "usage": {"completion_tokens": 2}}

    monkeypatch.setattr(workload, "SCRAPE_EVERY_S", 60.0)
    monkeypatch.setattr(workload.httpx, "AsyncClient", mock_client)
    monkeypatch.setattr(workload, "stream_chunks", one_short_request)
    started = time.perf_counter()
    result = workload.run_workload("http://x", "m", [[1, 2, 3]], 2, Setting("full", None))
    assert time.perf_counter() - started < 30  # the end of the workload wakes the sampler
    assert running[0] == 0 and result["requests"] == 1
    assert result["peak_running"] == 1


DROPPING_SERVER = """
import http.server, sys, threading

class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/health":
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif self.path == "/v1/never":  # the connection stays open and nothing comes back
            print("holding", self.path, flush=True)
            threading.Event().wait()
        else:  # no answer at all: the connection closes
            print("dropping", self.path, flush=True)
            self.close_connection = True

http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
"""


def test_a_request_a_server_drops_is_reported_with_the_servers_log(tmp_path, monkeypatch):
    import httpx

    from kvserve.tools.bench import servers

    script = tmp_path / "dropping.py"
    script.write_text(DROPPING_SERVER)
    monkeypatch.setattr(
        servers, "server_command", lambda kind, model, port, args: [sys.executable, str(script), str(port)]
    )
    with pytest.raises(
        servers.ServerRequestError, match=r"(?s)^kvserve server dropped a request .*running.*dropping /v1/x"
    ):
        with servers.running_server("kvserve", None, [], tmp_path / "server.log") as url:
            httpx.get(url + "/v1/x", timeout=60)
    # a request the server holds without answering is reported as a timeout, not as a dropped request (the server
    # never answers /v1/never, so the client's timeout decides nothing about the server's speed)
    with pytest.raises(
        servers.ServerRequestError, match=r"(?s)^kvserve server did not answer a request in time .*ReadTimeout.*holding"
    ):
        with servers.running_server("kvserve", None, [], tmp_path / "server.log") as url:
            httpx.get(url + "/v1/never", timeout=1)


def test_rounds_keep_each_sizes_servers_up_together_and_alternate_their_order(tmp_path, monkeypatch):
    """--rounds N: the servers of one size started once and up together while measured, each given an uncounted
    pass first, the order reversed every other round, each round on a prefix-cache salt of its own (a kept-up server
    must not answer round 2 from round 1's cache); then the next size's servers."""
    from contextlib import contextmanager

    from kvserve.tools.bench import __main__ as bench
    from kvserve.tools.eval.client import Setting

    started, up, sent = [], set(), []

    @contextmanager
    def fake_server(kind, model, engine_args, log, env):
        url = f"http://{kind}{engine_args[-1]}"
        started.append(url)
        up.add(url)
        yield url
        up.discard(url)

    def fake_workload(url, model, prompts, max_tokens, setting, salt=""):
        if len(prompts) > 1:  # the workload, not the short warm-up request
            sent.append((url, salt, frozenset(up)))
        return {column: 1.0 for column in bench.COLUMNS}

    monkeypatch.setattr(bench, "running_server", fake_server)
    monkeypatch.setattr(bench, "run_workload", fake_workload)
    monkeypatch.setattr(bench, "SETTLE_S", 0.0)
    servers = [
        (kind, kind, ["--tensor-parallel-size", size], [Setting("full", None)])
        for size in ("1", "2")
        for kind in ("vanilla", "kvserve")
    ]
    workload = {"model": "m", "prompts": [[1], [2]], "warmup": [0], "max_tokens": 2}
    results = bench.run(servers, {}, workload, tmp_path, rounds=3)
    assert started == ["http://vanilla1", "http://kvserve1", "http://vanilla2", "http://kvserve2"] and not up
    for size in ("1", "2"):
        pair = [f"http://vanilla{size}", f"http://kvserve{size}"]
        mine = [(url, salt, others) for url, salt, others in sent if url in pair]
        assert [(url, salt) for url, salt, _ in mine[:2]] == [(url, "round0") for url in pair]
        assert [url for url, _, _ in mine[2:]] == pair + pair[::-1] + pair
        assert [salt for _, salt, _ in mine[2:]] == ["round1"] * 2 + ["round2"] * 2 + ["round3"] * 2
        assert all(others == set(pair) for _, _, others in mine[2:])  # both up, the other size's down
    assert [(r["server"], r["ranks"], r["round"]) for r in results[:6]] == [
        ("vanilla", 1, 1),
        ("kvserve", 1, 1),
        ("kvserve", 1, 2),
        ("vanilla", 1, 2),
        ("vanilla", 1, 3),
        ("kvserve", 1, 3),
    ]


def test_scaling_compares_each_server_with_vanilla_of_the_same_round_and_size():
    """kvserve's ratio to vanilla divides two runs of the same size and round (the machine's speed that round divides
    out); its gain over vanilla's is the median of those ratios at 2 ranks over the median at 1 rank."""
    import statistics

    from kvserve.tools.bench.scaling import against_vanilla, gain_over_vanilla, scaling_report

    # round: (vanilla 1 rank, kvserve 1 rank, vanilla 2 ranks, kvserve 2 ranks); round 2 ran on a slow machine
    tokens = {1: (10.0, 20.0, 15.0, 33.0), 2: (5.0, 9.0, 7.0, 14.7), 3: (11.0, 23.1, 16.0, 30.4)}
    results = [
        {
            "server": server,
            "policy": "full" if server == "vanilla" else "snapkv",
            "budget": None if server == "vanilla" else 188,
            "ranks": ranks,
            "round": round_number,
            "output_tokens_per_s": row[column],
        }
        for round_number, row in tokens.items()
        for column, (server, ranks) in enumerate((("vanilla", 1), ("kvserve", 1), ("vanilla", 2), ("kvserve", 2)))
    ]
    one_rank = [row[1] / row[0] for row in tokens.values()]
    two_ranks = [row[3] / row[2] for row in tokens.values()]
    ratios = against_vanilla(results)
    assert ratios[("kvserve", "snapkv", 188, 1)] == pytest.approx(one_rank)
    assert ratios[("kvserve", "snapkv", 188, 2)] == pytest.approx(two_ranks)
    assert ratios[("vanilla", "full", None, 2)] == [1.0, 1.0, 1.0]
    relative = statistics.median(two_ranks) / statistics.median(one_rank)
    assert gain_over_vanilla(results, ("kvserve", "snapkv", 188), 2) == pytest.approx(relative)
    printed = scaling_report(results)
    median_tokens = statistics.median(row[3] for row in tokens.values())
    median_gain = median_tokens / statistics.median(row[1] for row in tokens.values())
    spread = f"{statistics.median(two_ranks):.2f}x ({min(two_ranks):.2f}-{max(two_ranks):.2f})"
    assert (
        f"| kvserve | snapkv | 188 | 2 | {median_tokens:.1f} | {median_gain:.2f}x | {spread} | {relative:.2f} |"
        in printed
    )
    assert "Medians over 3 rounds" in printed


def test_kvserves_clients_drop_idle_connections_before_vllms_server_closes_them():
    """vLLM's API server closes a connection idle for VLLM_HTTP_TIMEOUT_KEEP_ALIVE seconds; a client that reuses one
    as long gets "Server disconnected without sending a response" when both happen at once. Every httpx client in
    kvserve (the tools') takes the shorter limits."""
    import re

    from vllm import envs

    import kvserve
    from kvserve.http_client import KEEPALIVE_EXPIRY_S, client_limits

    assert client_limits().keepalive_expiry == KEEPALIVE_EXPIRY_S < envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE
    clients = []
    for path in Path(kvserve.__file__).parent.rglob("*.py"):
        clients += [(path.name, call) for call in re.findall(r"httpx\.(?:Async)?Client\((.*)", path.read_text())]
    assert len(clients) >= 8  # the tools', found
    assert [client for client in clients if "limits=" not in client[1]] == []


def test_the_speculative_table_compares_each_server_with_itself_without_drafts_and_with_vanilla_drafting():
    from kvserve.tools.bench.speculative import label, report

    def row(kind: str, ngram: bool, speed: float, texts: list[str], drafted: int = 0, accepted: int = 0) -> dict:
        speculation = {"num_drafts": drafted // 4, "num_draft_tokens": drafted, "num_accepted_tokens": accepted}
        return {"server": label(kind, ngram), "kind": kind, "ngram": ngram, "setting": "s", "texts": texts,
                "output_tokens_per_s": speed, "peak_running": 2, "speculation": speculation}  # fmt: skip

    rows = [
        row("vanilla", False, 10.0, ["a", "b"]),
        row("vanilla", True, 15.0, ["a", "b"], 40, 30),
        row("kvserve", False, 20.0, ["a", "c"]),
        row("kvserve", True, 26.0, ["a", "d"], 80, 20),
    ]
    lines = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in report(rows).splitlines()[2:]}
    assert lines["kvserve + n-gram"][3] == f"{26.0 / 20.0:.2f}"  # against kvserve without drafts
    assert lines["kvserve + n-gram"][4] == f"{26.0 / 15.0:.2f}"  # against vanilla + n-gram
    assert lines["kvserve + n-gram"][5] == f"{20 / 80:.0%} of 80"
    assert lines["kvserve + n-gram"][7].strip(" |") == "1 of 2"  # one answer differs from kvserve's without
    assert lines["vanilla + n-gram"][7].strip(" |") == "2 of 2"
