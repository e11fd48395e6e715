"""Run kvserve on the tiny Llama (4 query / 2 KV heads, tests/test_models.py's matrix) with `--tensor-parallel-size
TP` and write, as JSON, what tests/test_tensor_parallel.py compares between TP=2 and TP=1: greedy tokens (with where
the top two logits nearly tie), evicted counts, cached tokens, each finished request's kept positions per (layer,
KV head) gathered from every rank, and the pool's free blocks when idle (also after an aborted request). The engine
core runs in this process (the pool is read here); the ranks are vLLM's worker processes, read through
`collective_rpc`.

Usage: python tests/tensor_run.py TP[xPP] OUT.json   (e.g. 2, or 2x2 for two pipeline stages of two ranks each)
       python tests/tensor_run.py 2n OUT.json       (two ranks on two nodes over loopback: this process is the head
                                                     node, node 1 a `kvserve serve --headless` process tree;
                                                     1x2n: two pipeline stages on two nodes)
"""

import json
import math
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(__file__))

PROMPT_TOKENS = 500
MAX_TOKENS = 40  # past budget + block size: decode compactions too
BUDGET = 64
SETTINGS = {
    "full": {"kv_policy": "full"},
    "snapkv": {"kv_policy": "snapkv", "kv_budget": BUDGET},  # span 8, the default
    "snapkv_span1": {"kv_policy": "snapkv", "kv_budget": BUDGET, "kv_span": 1},
    "h2o": {"kv_policy": "h2o", "kv_budget": BUDGET},
    "tova": {"kv_policy": "tova", "kv_budget": BUDGET},
    "streamingllm": {"kv_policy": "streamingllm", "kv_budget": BUDGET, "kv_evict_every_chunk": True},
    "pyramid": {"kv_policy": "snapkv", "kv_budget": BUDGET, "kv_allocation": "pyramid"},
    "pressure": {"kv_policy": "snapkv", "kv_budget": BUDGET, "kv_evict_when": "pressure"},
}
CHECKPOINT = {"kv_policy": "snapkv", "kv_budget": BUDGET, "kv_checkpoint": BUDGET}


def keep_kept_positions(worker) -> int:
    """In a worker: remember each finished request's kept positions per model layer (its KV heads' rows)."""
    from kvserve.vllm.worker import requests_of

    runner = worker.model_runner
    book = requests_of(runner)
    runner.kvserve_kept = {}
    finish = book.finish

    def finish_and_keep(req_id: str) -> None:
        state = book.requests.get(req_id)
        if state is not None:
            runner.kvserve_kept[req_id] = {
                "compactions": state.compactions,
                "layers": {
                    str(book.layout.model_layer(layer)): state.layers[layer].kept_positions.tolist()
                    for layer in sorted(state.layers)
                    if state.layers[layer].kept_positions is not None
                },
            }
        finish(req_id)

    book.finish = finish_and_keep
    return book.layout.first_head


FAIL_AT = PROMPT_TOKENS + 6  # a decode step that plans no compaction (the next is at budget + block size entries)


def fail_on_last_rank(worker) -> bool:
    """In a worker: make the request's eviction work raise for the step that ends at FAIL_AT tokens (TOVA's decode
    step: recording its query window), on the rank holding the model's last KV heads only (rank 1 of 2; the only
    rank of 1). True where it was armed."""
    from kvserve.vllm.worker import requests_of
    from kvserve.worker.request import QueryWindow

    layout = requests_of(worker.model_runner).layout
    if layout.first_head + layout.num_heads != worker.model_runner.model_config.get_total_num_kv_heads():
        return False
    next_row = QueryWindow.next_row

    def failing(window, like, position):
        if position == FAIL_AT - 1:  # the step's one query sits at the position before FAIL_AT
            raise RuntimeError("injected failure on the last rank")
        return next_row(window, like, position)

    QueryWindow.next_row = failing
    worker.model_runner.kvserve_unpatched_next_row = next_row
    return True


def disarm(worker) -> None:
    from kvserve.worker.request import QueryWindow

    QueryWindow.next_row = getattr(worker.model_runner, "kvserve_unpatched_next_row", QueryWindow.next_row)


def kept_positions(worker) -> dict:
    runner = worker.model_runner
    return {"first_head": runner.kvserve.layout.first_head, "requests": runner.kvserve_kept}


ENGINE = dict(
    dtype="float32",
    enforce_eager=True,
    block_size=32,
    max_model_len=1024,
    max_num_batched_tokens=1024,
    long_prefill_token_threshold=128,
    num_gpu_blocks_override=40,  # three prompts outgrow it: the pressure setting compacts
    seed=0,
)


def start_second_node(model: str, tensor: int, stages: int, port: int, log_path: str):
    """Node 1 of two: `kvserve serve --headless` with the head node's engine flags, on the last CPU, in a process
    group of its own (as on a machine of its own)."""
    flags = [f"--{key.replace('_', '-')}" + ("" if value is True else f"={value}") for key, value in ENGINE.items()]
    node = ["--tensor-parallel-size", str(tensor), "--pipeline-parallel-size", str(stages)]
    node += ["--nnodes", "2", "--node-rank", "1", "--headless"]
    rendezvous = ["--master-addr", "127.0.0.1", "--master-port", str(port)]
    command = [sys.executable, "-m", "kvserve.cli", "serve", model, *flags, *node, *rendezvous]
    cpu = sorted(os.sched_getaffinity(0))[-1]
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=str(cpu))
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # (the in-process setting is this node's, not node 1's)
    log = open(log_path, "w")
    return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def main(tensor: int, stages: int, out_path: str, nodes: int = 1) -> None:
    from engine_settings import in_process_env

    in_process_env()
    from kvserve.parallelism import parallel_env

    layout = ["--tensor-parallel-size", str(tensor), "--pipeline-parallel-size", str(stages)]
    layout += ["--nnodes", str(nodes)]
    os.environ.update(parallel_env(layout, os.environ))  # as kvserve serve
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from kvserve.tools.bench.servers import free_port
    from kvserve.tools.bench.tiny_models import tiny_model
    from kvserve.tools.eval.haystack import haystack

    model = str(tiny_model("llama"))
    node_args, second = {}, None
    if nodes == 2:
        port = free_port()
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(sorted(os.sched_getaffinity(0))[0])
        second = start_second_node(model, tensor, stages, port, out_path + ".node1.log")
        node_args = dict(nnodes=2, node_rank=0, master_addr="127.0.0.1", master_port=port)
    llm = LLM(model=model, tensor_parallel_size=tensor, pipeline_parallel_size=stages, **ENGINE, **node_args)
    core = llm.llm_engine.engine_core.engine_core
    pool = core.scheduler.kv_cache_manager.block_pool
    llm.collective_rpc(keep_kept_positions)
    tokenizer = llm.get_tokenizer()

    def generate(prompts, kv, salt=None, max_tokens=MAX_TOKENS):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, extra_args=kv, logprobs=2)
        extra = {} if salt is None else {"cache_salt": salt}
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p, **extra) for p in prompts], params, use_tqdm=False)
        return [
            {
                "request_id": o.request_id,
                "tokens": list(o.outputs[0].token_ids),
                "tied": [_tied(step) for step in o.outputs[0].logprobs],
                "evicted": (o.kv_transfer_params or {}).get("kv_tokens_evicted", 0),
                "cached": o.num_cached_tokens,
            }
            for o in outputs
        ]

    prompts = [haystack(tokenizer, PROMPT_TOKENS, seed=500 + i) for i in range(3)]
    result = {"tensor": tensor, "stages": stages, "nodes": nodes, "total_blocks": pool.num_gpu_blocks - 1}
    result["settings"] = {}
    for label, kv in SETTINGS.items():
        result["settings"][label] = generate(prompts, kv, salt=label)
    # a prefix hit: the same prompt again reads the blocks the first published
    result["prefix"] = generate([prompts[0]] * 2, SETTINGS["snapkv"], salt="prefix") + generate(
        [prompts[0]], SETTINGS["snapkv"], salt="prefix"
    )
    # a checkpoint: a new question after the first request's prompt resumes from its latest checkpoint (refused
    # under pipeline parallelism: each stage would publish its own layers' pages)
    question = tokenizer.encode(" Who would read this text?", add_special_tokens=False)
    if stages == 1:
        generate([prompts[1]], CHECKPOINT, salt="checkpoint", max_tokens=4)
        result["checkpoint"] = [
            *generate([prompts[1] + question], CHECKPOINT, salt="checkpoint", max_tokens=8),
            *generate([prompts[1] + question], CHECKPOINT, salt="checkpoint-miss", max_tokens=8),
        ]
    generate([[1, 2, 3]], None, max_tokens=1)  # one more step lets the workers drop the finished requests
    result["free_blocks"] = pool.get_num_free_blocks()

    # a policy that fails on one rank in a step with no compaction (no exchange under tensor parallelism): the
    # request still ends with the failure, a step or two later at most than on one rank
    if stages == 1:
        assert sum(llm.collective_rpc(fail_on_last_rank)) == 1
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, extra_args=SETTINGS["tova"])
        (failed,) = llm.generate([TokensPrompt(prompt_token_ids=prompts[0])], params, use_tqdm=False)
        llm.collective_rpc(disarm)
        result["failed"] = {
            "finish_reason": failed.outputs[0].finish_reason,
            "tokens": len(failed.outputs[0].token_ids),
            "failure": (failed.kv_transfer_params or {}).get("kv_policy_failure"),
        }
        generate([[1, 2, 3]], None, max_tokens=1)
        result["free_blocks_after_failure"] = pool.get_num_free_blocks()

    # an aborted request: some steps of an evicting request, then abort; its blocks come back on every rank
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True, extra_args=SETTINGS["h2o"])
    engine.add_request("aborted", TokensPrompt(prompt_token_ids=prompts[2]), params)
    for _ in range(6):
        engine.step()
    result["held_before_abort"] = result["total_blocks"] - pool.get_num_free_blocks()
    engine.abort_request(["aborted"])
    generate([[1, 2, 3]], None, max_tokens=1)
    result["free_blocks_after_abort"] = pool.get_num_free_blocks()

    ranks = llm.collective_rpc(kept_positions)
    result["kept"] = {}
    for rank in sorted(ranks, key=lambda r: r["first_head"]):  # heads in order: rank 0's, then rank 1's
        for req_id, state in rank["requests"].items():
            mine = result["kept"].setdefault(req_id, {"compactions": state["compactions"], "layers": {}})
            for layer, rows in state["layers"].items():
                mine["layers"].setdefault(layer, []).extend(rows)
    if second is not None:
        # the head node goes away (its engine shut down, its workers gone): node 1 must end on its own, not hang
        llm.llm_engine.engine_core.shutdown()
        try:
            result["second_node_exit"] = second.wait(timeout=120)
        except subprocess.TimeoutExpired:
            result["second_node_exit"] = None
            os.killpg(second.pid, 9)
        result["second_node_log"] = open(out_path + ".node1.log").read()[-2000:]
    with open(out_path, "w") as f:
        json.dump(result, f)


def _tied(logprobs: dict) -> bool:
    """No clear best token here: the top two within 1e-4 (the ranks sum partial products in another order)."""
    values = sorted((entry.logprob for entry in logprobs.values()), reverse=True)
    if not all(math.isfinite(value) for value in values):
        return True
    return len(values) > 1 and values[0] - values[1] < 1e-4


if __name__ == "__main__":
    layout = sys.argv[1].removesuffix("n")  # TP[xPP]n: the workers over two nodes
    tensor, _, stages = layout.partition("x")
    main(int(tensor), int(stages or 1), sys.argv[2], nodes=2 if sys.argv[1].endswith("n") else 1)
