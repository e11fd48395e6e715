"""Tensor parallelism with eviction: the tiny Llama (4 query / 2 KV heads) served with `--tensor-parallel-size 2`
(each rank evicting its own KV head, tests/tensor_run.py) against the same engine on one rank: the same kept
positions per (layer, KV head), greedy tokens, evicted and cached counts, and the pool full again, also after an
aborted request; the same over two nodes on loopback (`--nnodes 2`, node 1 headless), whose node 1 ends once the
head node is gone; and what is refused under it, with the reason."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from background import Run
from tensor_run import BUDGET, SETTINGS

from kvserve.config import parse_kv_config
from kvserve.errors import InvalidSetting
from kvserve.model_support import check_against_model
from kvserve.parallelism import parallel_env, parallelism_refusal

TESTS = Path(__file__).parent
TENSOR = 2


def _two_cpus() -> bool:
    return len(os.sched_getaffinity(0)) >= TENSOR


def background_runs() -> list[Run]:
    """The engine on one rank, on two (binding a CPU per rank itself, as kvserve serve does), and on two pipeline
    stages of two ranks each (four workers: on fewer CPUs they share them, round robin)."""
    if not _two_cpus():
        return []
    run = [sys.executable, str(TESTS / "tensor_run.py")]
    cpus = sorted(os.sched_getaffinity(0))
    shared = {"VLLM_PLUGINS": None}
    if len(cpus) < 4:
        shared["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(cpus[worker % len(cpus)]) for worker in range(4))
    return [
        Run("tensor_results", [*run, "1", "{out}"]),
        Run("tensor_results", [*run, str(TENSOR), "{out}"], {"VLLM_PLUGINS": None}, bind_cpu=False),
        Run("tensor_results", [*run, f"{TENSOR}x2", "{out}"], shared, bind_cpu=False),
        # two nodes over loopback: this run is the head node, node 1 a `kvserve serve --headless` process tree
        Run("tensor_results", [*run, f"{TENSOR}n", "{out}"], {"VLLM_PLUGINS": None}, bind_cpu=False),
        Run("tensor_results", [*run, "1x2n", "{out}"], {"VLLM_PLUGINS": None}, bind_cpu=False),  # stages on 2 nodes
    ]


@pytest.fixture(scope="module")
def tensor_results(background):
    if not _two_cpus():
        pytest.skip("tensor parallelism on CPU needs a CPU per rank; this process may use one")
    results = background.results("tensor_results")
    layouts = {"1": (1, 1, 1), "2": (TENSOR, 1, 1), "2x2": (TENSOR, 2, 1), "2n": (TENSOR, 1, 2), "1x2n": (1, 2, 2)}
    assert [(r["tensor"], r["stages"], r["nodes"]) for r in results] == list(layouts.values())
    return dict(zip(layouts, results, strict=True))


def _untied_prefix(tokens: list[int], tied: list[bool]) -> list[int]:
    """The tokens up to the first step whose top two logits nearly tie (the ranks sum in another order)."""
    end = tied.index(True) if True in tied else len(tokens)
    return tokens[:end]


def _kept(result: dict, request_id: str) -> dict:
    for internal, state in result["kept"].items():
        if internal == request_id or internal.startswith(f"{request_id}-"):
            return state
    raise KeyError(request_id)


@pytest.mark.parametrize("layout", ["2", "2x2", "2n", "1x2n"])
@pytest.mark.parametrize("label", list(SETTINGS))
def test_two_ranks_keep_what_one_keeps_and_give_the_same_tokens(tensor_results, label, layout):
    """Two ranks, two pipeline stages of two ranks, two ranks on two nodes and two stages on two nodes, against one
    worker."""
    one, two = tensor_results["1"], tensor_results[layout]
    if label != "full":  # (under pressure, not every request needs to compact)
        assert any(split["evicted"] > 0 for split in two["settings"][label]), label
    for alone, split in zip(one["settings"][label], two["settings"][label], strict=True):
        assert alone["evicted"] == split["evicted"], label
        if label not in ("full", "pressure"):
            assert split["evicted"] > 0, label
        both_untied = [a or b for a, b in zip(alone["tied"], split["tied"], strict=True)]
        prefix = _untied_prefix(alone["tokens"], both_untied)
        assert split["tokens"][: len(prefix)] == prefix, label
        assert len(prefix) >= len(alone["tokens"]) // 2, (label, "too many near ties to compare")
        if label == "full":
            continue
        want, got = _kept(one, alone["request_id"]), _kept(two, split["request_id"])
        assert got["compactions"] == want["compactions"], label
        assert got["compactions"] > 0 or label == "pressure", label
        assert got["layers"].keys() == want["layers"].keys()
        for layer, rows in want["layers"].items():  # [KV heads, kept]: two ranks' heads side by side
            assert got["layers"][layer] == rows, (label, layer)


def test_a_prefix_hit_and_a_checkpoint_resume_under_tensor_parallelism(tensor_results):
    for layout, result in tensor_results.items():
        first, second, third = result["prefix"]
        assert third["cached"] > 0 and third["evicted"] == first["evicted"] > 0, layout
        assert third["tokens"] == first["tokens"], layout
        if result["stages"] > 1:  # checkpoints are refused under pipeline parallelism
            continue
        hit, miss = result["checkpoint"]
        assert hit["cached"] >= BUDGET and miss["cached"] == 0
        assert hit["tokens"] == miss["tokens"] and hit["evicted"] == miss["evicted"] > 0
        assert _kept(result, hit["request_id"])["layers"] == _kept(result, miss["request_id"])["layers"]


def test_the_pool_is_full_again_after_requests_and_an_abort_on_every_rank(tensor_results):
    for result in tensor_results.values():
        assert result["free_blocks"] == result["total_blocks"]
        assert result["held_before_abort"] > 0
        assert result["free_blocks_after_abort"] == result["total_blocks"]


@pytest.mark.parametrize("layout", ["2", "2n"])
def test_a_failure_on_another_rank_in_a_step_without_exchange_still_ends_the_request(tensor_results, layout):
    """Steps without a planned compaction exchange nothing between the ranks; a policy that raises on rank 1 (on
    the other node, for 2n) in such a step still fails the request, with its reason, within two steps of where one
    rank's failure ends it."""
    one, two = tensor_results["1"]["failed"], tensor_results[layout]["failed"]
    assert one["finish_reason"] == two["finish_reason"] == "error"
    assert two["failure"] == one["failure"] == "RuntimeError: injected failure on the last rank"
    assert one["tokens"] <= two["tokens"] <= one["tokens"] + 2
    assert tensor_results[layout]["free_blocks_after_failure"] == tensor_results[layout]["total_blocks"]


@pytest.mark.parametrize("layout", ["2n", "1x2n"])
def test_a_headless_node_ends_when_the_head_node_is_gone(tensor_results, layout):
    """Node 1 of a two-node run, once the head node's engine and workers are gone, stops on its own with status 1
    and says why (vLLM's headless runner alone waited forever)."""
    result = tensor_results[layout]
    assert result["second_node_exit"] == 1, result["second_node_log"]
    assert (
        "this headless node stops" in result["second_node_log"] and "the head node is gone" in result["second_node_log"]
    )


def test_what_needs_every_head_at_once_is_refused_under_tensor_parallelism():
    from vllm.config import ModelConfig

    from kvserve.tools.bench.tiny_models import tiny_model

    model_config = ModelConfig(str(tiny_model("llama")), dtype="float32", max_model_len=2048)
    for kv, field in (
        ({"kv_policy": "snapkv", "kv_budget": 64, "kv_allocation": "heads"}, "kv_allocation"),
        ({"kv_policy": "snapkv", "kv_budget": 64, "kv_allocation": "global"}, "kv_allocation"),
    ):
        check_against_model(parse_kv_config(kv), model_config, kv)  # one rank: served
        with pytest.raises(InvalidSetting) as raised:
            check_against_model(parse_kv_config(kv), model_config, kv, tensor_ranks=TENSOR)
        assert raised.value.field == field and "tensor parallelism" in str(raised.value)
    uniform = {"kv_policy": "snapkv", "kv_budget": 64}
    assert check_against_model(parse_kv_config(uniform), model_config, uniform, tensor_ranks=TENSOR).evicts


def test_the_attention_gate_kvzap_and_layer_wide_tova_votes_are_refused_under_tensor_parallelism():
    from kvserve.model_support import _check_tensor_parallel

    _check_tensor_parallel(parse_kv_config({"kv_policy": "snapkv", "kv_budget": 64}), TENSOR)
    for policy in ({"kv_policy": "attention_gate"}, {"kv_policy": "kvzap", "kv_budget": 256}):
        with pytest.raises(InvalidSetting, match="query head") as raised:  # (KVzap's surrogate reads them all)
            _check_tensor_parallel(parse_kv_config(policy), TENSOR)
        assert raised.value.field == "kv_policy"
    # TOVA's layer-wide votes average every query head of a layer, which no rank holds alone
    _check_tensor_parallel(parse_kv_config({"kv_policy": "tova", "kv_budget": 64}), TENSOR)
    layer = {"kv_policy": "tova", "kv_budget": 64, "kv_vote_scope": "layer"}
    with pytest.raises(InvalidSetting, match="query head") as raised:
        _check_tensor_parallel(parse_kv_config(layer), TENSOR)
    assert raised.value.field == "kv_vote_scope"


def test_more_ranks_than_kv_heads_and_context_parallelism_are_refused_with_the_reason():
    assert parallelism_refusal(2, num_kv_heads=2) is None and parallelism_refusal(2) is None
    assert "more tensor-parallel ranks (4) than the model has KV heads (2)" in parallelism_refusal(4, num_kv_heads=2)
    assert "decode context parallelism" in parallelism_refusal(1, decode_context_parallel_size=2)


def test_each_rank_and_stage_gets_cpus_of_its_own():
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < TENSOR:
        pytest.skip("one CPU: no split to check")
    bind = parallel_env(["--tensor-parallel-size", str(TENSOR)], {})["VLLM_CPU_OMP_THREADS_BIND"]
    groups = [[int(cpu) for cpu in group.split(",")] for group in bind.split("|")]
    assert len(groups) == TENSOR and not set(groups[0]) & set(groups[1]) and set(groups[0] + groups[1]) <= set(cpus)
    if len(cpus) < 4:
        with pytest.raises(SystemExit, match="a CPU per worker"):
            parallel_env(["-tp", "2", "-pp", "2"], {})
    assert parallel_env(["-tp=2"], {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}) == {}  # the user's choice stands


def test_duoattention_roles_split_by_rank():
    """A rank holding KV heads h0.. of the model reads those heads' roles: the roles rank all heads at once."""
    from kvserve.duo.roles import roles_for
    from kvserve.policies.base import LayerObservation
    from kvserve.policies.duo_attention import DuoAttention

    model, heads, layer = "SmolLM2-135M-Instruct", 3, 7
    policy = DuoAttention()
    whole = roles_for(model, heads).retrieval(policy.retrieval_fraction)[layer]

    def observation(first: int, count: int) -> LayerObservation:
        keys = torch.zeros(count, 10, 64)
        return LayerObservation(
            layer_idx=layer,
            keys=keys,
            values=keys,
            positions=torch.arange(10).expand(count, -1),
            scale=0.125,
            model=model,
            first_head=first,
            model_heads=heads,
        )

    assert torch.equal(policy.retrieval_heads(observation(0, heads)), whole)
    for first in range(heads):  # one head per rank (TP=3 on the default model)
        assert torch.equal(policy.retrieval_heads(observation(first, 1)), whole[first : first + 1])
    budget = 128
    split = torch.cat([policy.head_counts(observation(first, 1), budget) for first in range(heads)])
    assert torch.equal(split, policy.head_counts(observation(0, heads), budget))
