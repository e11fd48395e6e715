"""Shared fixtures: ONE in-process kvserve engine for the whole session, and vanilla vLLM in a subprocess.

vLLM plugins patch process-wide state, so vanilla vLLM (the baseline) runs in its own process with
VLLM_PLUGINS=none; it starts first and runs while this process builds the kvserve engine. Other engines the tests
only read (tests/background.py) start once the tests are collected and run beside this process's tests.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

# One OpenMP thread in this process and (inherited) in every engine it starts, set before torch loads: vLLM binds a
# CPU worker to one CPU, yet torch's second OpenMP thread stayed and spun beside it (top -H: two busy threads per
# engine process), so on a 2-CPU machine the in-process engine and a background engine ran 4 busy threads on 2 CPUs
# and each became 4-20x slower: tests/kernel_attention_run.py outlived its timeout that way here (likely on CI too).
os.environ.setdefault("OMP_NUM_THREADS", "1")

# SIGINT is how the session stops a background run, so that its `finally` blocks stop what it started
# (tests/background.py).
# A shell starts a command it runs in the background (`make test &`, nohup, some CI runners) with SIGINT ignored, and
# every process inherits that: Python then installs no KeyboardInterrupt handler, the interrupt does nothing, and the
# run's own children outlive it (two suites started with `&` each failed test_background's session test that way).
# A handler set here is reset to the default by exec, so every process the tests start can be interrupted again.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

import pytest  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))

from background import Background, machine_line  # noqa: E402
from engine_settings import engine_kwargs, find_state, in_process_env, keep_finished_states  # noqa: E402

TESTS = Path(__file__).parent


def _import_triton_for_its_interpreter() -> None:
    """Triton decides at its FIRST import whether its own library functions (tl.cdiv, ...) are interpreted. The kernel
    tests run Triton's interpreter on CPU, and vLLM imports Triton without it (a kernel then fails with "Cannot call
    @triton.jit'd outside of the scope of a kernel"), so import it here first, under TRITON_INTERPRET=1. The variable
    is restored at once: vLLM and the servers the tests start never see it."""
    import torch

    if torch.cuda.is_available() or "triton" in sys.modules:
        return
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton.language  # noqa: F401
    except Exception:  # noqa: BLE001 - no usable Triton: tests/test_kernels.py skips with the reason
        pass
    finally:
        if saved is None:
            os.environ.pop("TRITON_INTERPRET")
        else:
            os.environ["TRITON_INTERPRET"] = saved


_import_triton_for_its_interpreter()


def _ask_for_amx_tiles() -> None:
    """A process that calls vLLM's AMX ops itself (tests/test_head_pages.py, the in-process engine on bf16) must first
    ask Linux for AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM), or the first tile instruction kills it with
    SIGILL; vLLM's own worker asks only on its code path. Asked once here, so any test file runs alone."""
    import torch

    if torch.cpu._is_amx_tile_supported():
        torch.cpu._init_amx()


_ask_for_amx_tiles()


class Engine:
    """The kvserve engine plus handles on its scheduler and worker state."""

    def __init__(self) -> None:
        in_process_env()
        from vllm import LLM

        cpus = os.sched_getaffinity(0)
        self.llm = LLM(**engine_kwargs())
        # vLLM's CPU worker, here this thread, bound itself to one CPU; the servers and engines tests start from it
        # would inherit that one CPU (their own workers, engine cores and API servers all on it)
        os.sched_setaffinity(0, cpus)
        core = self.llm.llm_engine.engine_core.engine_core
        self.scheduler = core.scheduler
        self.runner = core.model_executor.driver_worker.worker.model_runner
        self.tokenizer = self.llm.get_tokenizer()
        self.pool = self.scheduler.kv_cache_manager.block_pool
        self.finished_states = keep_finished_states(self.runner)

    def free_blocks(self) -> int:
        return self.pool.get_num_free_blocks()

    def generate(
        self,
        prompts: list[list[int]],
        max_tokens: int,
        kv: dict | None = None,
        ignore_eos: bool = True,
        cache_salt: str | None = None,
    ):
        """Greedy outputs; a `cache_salt` keeps these prompts from hitting blocks earlier requests published."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos, extra_args=kv)
        salt = {} if cache_salt is None else {"cache_salt": cache_salt}
        return self.llm.generate([TokensPrompt(prompt_token_ids=p, **salt) for p in prompts], params, use_tqdm=False)

    def eviction_state(self, request_id: str):
        """The worker's eviction state of a request (by its external id), live or recently finished."""
        return find_state((self.runner.kvserve.requests, self.finished_states), request_id)


_background = Background()


def pytest_report_header(config) -> str:
    """The machine, first thing in the log: CI's machines differ (AMX or not, AVX-512 or AVX2 only)."""
    return f"machine: {machine_line()}"


def pytest_collection_modifyitems(session, config, items: list) -> None:
    """The modules whose tests read background runs go last (in their order): the runs then have the rest of the
    session to finish beside this process's tests. Tests marked `large_model` run only when asked for
    (KVSERVE_LARGE_MODELS=1): they fetch and convert a 0.5 GB model, which CI's default run leaves out."""
    items.sort(key=lambda item: hasattr(getattr(item, "module", None), "background_runs"))  # stable
    if os.environ.get("KVSERVE_LARGE_MODELS") != "1":
        skip = pytest.mark.skip(reason="large model: opt in with KVSERVE_LARGE_MODELS=1")
        for item in items:
            if "large_model" in item.keywords:
                item.add_marker(skip)


def pytest_collection_finish(session) -> None:
    """Start the background runs (`background_runs()` of each collected module) that some collected test reads."""
    if session.config.option.collectonly:
        return
    modules = list(dict.fromkeys(getattr(item, "module", None) for item in session.items))
    wanted = {name for item in session.items for name in getattr(item, "fixturenames", ())}
    runs = [run for module in modules for run in getattr(module, "background_runs", list)() if run.fixture in wanted]
    if runs:
        _background.start(runs)


def pytest_sessionfinish(session) -> None:
    _background.stop()


def pytest_terminal_summary(terminalreporter) -> None:
    """How long each background run took and how long its tests waited for it: the place to look when the suite
    grows."""
    lines = _background.timings()
    if lines:
        terminalreporter.section("background runs")
        for line in lines:
            terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def background() -> Background:
    return _background


@pytest.fixture(scope="session")
def vanilla_process(tmp_path_factory):
    out = tmp_path_factory.mktemp("vanilla") / "outputs.json"
    env = dict(os.environ, VLLM_PLUGINS="none")
    log = open(out.with_suffix(".log"), "w")
    proc = subprocess.Popen(
        [sys.executable, str(TESTS / "vanilla_run.py"), str(out)], env=env, stdout=log, stderr=subprocess.STDOUT
    )
    yield proc, out
    if proc.poll() is None:
        proc.kill()


@pytest.fixture(scope="session")
def vanilla_outputs(vanilla_process):
    proc, out = vanilla_process
    if proc.wait(timeout=600) != 0:
        raise RuntimeError("vanilla vLLM run failed:\n" + out.with_suffix(".log").read_text()[-4000:])
    return json.loads(out.read_text())


@pytest.fixture(scope="session")
def engine(vanilla_process) -> Engine:
    return Engine()


@pytest.fixture(scope="session")
def hf_model():
    from hf_reference import load_hf_model

    from kvserve.model import ensure_default_model

    return load_hf_model(ensure_default_model())


@pytest.fixture(scope="session")
def server_kv_events() -> str:
    """Where the session's server answers replay requests for its KV-cache events (tests/test_kv_events.py)."""
    from kvserve.tools.bench.servers import free_port

    return f"tcp://127.0.0.1:{free_port()}"


@pytest.fixture(scope="session")
def server(tmp_path_factory, server_kv_events):
    """ONE real `kvserve serve` for the HTTP tests (started the way the benchmark starts its servers), publishing
    vLLM's KV-cache events (ZMQ, with a replay socket)."""
    from engine_settings import SERVER_ARGS

    from kvserve.tools.bench.servers import free_port, running_server

    replay_port = server_kv_events.rsplit(":", 1)[1]
    events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{free_port()}",
        "replay_endpoint": f"tcp://*:{replay_port}",
    }
    args = [*SERVER_ARGS, "--kv-events-config", json.dumps(events)]
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    # no MODEL: the default model, served under its own name (what `make serve` does)
    with running_server("kvserve", None, args, log_path, env={"VLLM_CPU_KVCACHE_SPACE": "1"}) as base:
        yield base


@pytest.fixture(scope="session")
def long_prompt():
    from transformers import AutoTokenizer

    from kvserve.model import ensure_default_model
    from kvserve.tools.eval.haystack import haystack

    tokenizer = AutoTokenizer.from_pretrained(ensure_default_model())
    return tokenizer.decode(haystack(tokenizer, 300, seed=50))
