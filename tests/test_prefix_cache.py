"""Evicting requests and vLLM's prefix cache, on the shared in-process engine.

An evicting request reads the cached blocks of its prompt's prefix and publishes its own prompt blocks, and a hit
must change nothing it computes: each case below runs the same request twice, once where the prefix cache holds its
document (a hit) and once under a fresh `cache_salt` (vLLM then finds nothing: the reference), and compares greedy
tokens, the evicted count and the kept positions.
"""

from __future__ import annotations

import random
import uuid

import pytest
from engine_settings import BLOCK_SIZE, fitting_window

from kvserve.config import KVConfig
from kvserve.policies import representative_policies
from kvserve.tools.eval.haystack import haystack

BUDGET = 96
# every registered way of running whose requests read hits, a meta-score over a reading base, and both allocations
# and spans that share the prefix cache
READERS = [name for name in representative_policies() if KVConfig(policy=name, budget=BUDGET).prefix_sharing().reads]
READER_SETTINGS = [{"kv_policy": name} for name in READERS] + [
    {"kv_policy": "snapkv+fastcaote"},
    {"kv_policy": "snapkv", "kv_allocation": "pyramid"},
    {"kv_policy": "ahakv", "kv_span": 8},
]
SKIPPERS = [name for name in representative_policies() if name not in READERS]


def test_readers_and_skippers_are_the_policies_the_papers_allow():
    # a policy with running statistics (every query) or a gate (every hidden state) must compute its whole prompt
    assert {"snapkv", "streamingllm", "tova", "ahakv"} <= set(READERS)
    assert {"h2o", "mat", "ems", "attention_gate"} <= set(SKIPPERS)


def salted(ids: list[int], salt: str):
    from vllm.inputs import TokensPrompt

    return TokensPrompt(prompt_token_ids=ids, cache_salt=salt)


def run(engine, prompts: list, kv: dict | None, max_tokens: int = 8) -> list:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, extra_args=kv)
    return engine.llm.generate(prompts, params, use_tqdm=False)


def evicted(output) -> int:
    return (output.kv_transfer_params or {}).get("kv_tokens_evicted", 0)


def kept_positions(engine, output) -> list[list[list[int]]]:
    state = engine.eviction_state(output.request_id)
    return [state.layers[layer].kept_positions.tolist() for layer in sorted(state.layers)]


def question(engine, text: str) -> list[int]:
    return engine.tokenizer.encode(f" {text} It is about", add_special_tokens=False)


def assert_same(engine, hit, reference, label: str) -> None:
    assert list(hit.outputs[0].token_ids) == list(reference.outputs[0].token_ids), label
    assert evicted(hit) == evicted(reference) > 0, label
    assert kept_positions(engine, hit) == kept_positions(engine, reference), label


@pytest.mark.parametrize("kv", READER_SETTINGS, ids=lambda kv: "/".join(str(v) for v in kv.values()))
def test_a_hit_keeps_what_a_miss_keeps(engine, kv):
    """A repeated document with a new question, and the second turn of a chat, each read the first request's
    blocks; tokens, evicted count and every layer's kept positions equal the same request's under a fresh salt."""
    kv = {**kv, "kv_budget": BUDGET}
    salt = uuid.uuid4().hex
    document = haystack(engine.tokenizer, 330, seed=400)
    first = document + question(engine, "What is this text about?")
    (turn_one,) = run(engine, [salted(first, salt)], kv)
    free = engine.free_blocks()

    again = document + question(engine, "Who would read this text?")
    chat = first + list(turn_one.outputs[0].token_ids) + question(engine, "Say it again in other words.")
    for label, ids in (("new question", again), ("second turn", chat)):
        (hit,) = run(engine, [salted(ids, salt)], kv)
        (reference,) = run(engine, [salted(ids, uuid.uuid4().hex)], kv)
        tail = KVConfig(policy=kv["kv_policy"], budget=BUDGET).prefix_sharing().computed_tail
        assert hit.num_cached_tokens >= len(document) - tail - BLOCK_SIZE, label  # it read the document's blocks
        assert len(ids) - hit.num_cached_tokens >= tail, label  # and computed every query its policy reads
        assert reference.num_cached_tokens == 0, label
        assert_same(engine, hit, reference, label)
    assert engine.free_blocks() == free  # nothing held once they finished (cached blocks count as free)


SKIPPER_SETTINGS = [fitting_window({"kv_policy": name, "kv_budget": BUDGET}) for name in SKIPPERS] + [
    {"kv_policy": "streamingllm", "kv_evict_every_chunk": True}
]


@pytest.mark.parametrize("kv", SKIPPER_SETTINGS, ids=lambda kv: "/".join(str(v) for v in kv.values()))
def test_policies_that_read_every_query_compute_their_prompt(engine, kv):
    """H2O, MAT, EMS and their meta-scores never read a hit but publish their prompt blocks, which a plain request
    then reads unchanged; Attention-Gate's keys come from gated attention, and eviction after every chunk holds no
    more than the budget plus a chunk, so they do neither."""
    kv = {**kv, "kv_budget": BUDGET}
    salt = uuid.uuid4().hex
    ids = haystack(engine.tokenizer, 330, seed=410) + question(engine, "What is this text about?")
    run(engine, [salted(ids, salt)], kv)
    (again,) = run(engine, [salted(ids, salt)], kv)
    assert again.num_cached_tokens == 0
    (plain,) = run(engine, [salted(ids, salt)], None)
    (reference,) = run(engine, [salted(ids, uuid.uuid4().hex)], None)
    config = KVConfig(policy=kv["kv_policy"], budget=BUDGET, evict_every_chunk=kv.get("kv_evict_every_chunk", False))
    publishes = config.prefix_sharing().publishes
    assert (plain.num_cached_tokens > 0) == publishes
    assert list(plain.outputs[0].token_ids) == list(reference.outputs[0].token_ids)


def test_compacted_blocks_are_never_published(engine):
    """A request that compacted its prompt publishes none of the blocks that hold its compacted lists: a plain
    request with its whole sequence hits at most its prompt's complete blocks."""
    salt = uuid.uuid4().hex
    ids = haystack(engine.tokenizer, 300, seed=420)
    (evicting,) = run(engine, [salted(ids, salt)], {"kv_policy": "snapkv", "kv_budget": 64}, max_tokens=70)
    whole = ids + list(evicting.outputs[0].token_ids)
    (plain,) = run(engine, [salted(whole, salt)], None, max_tokens=2)
    assert 0 < plain.num_cached_tokens <= len(ids) // BLOCK_SIZE * BLOCK_SIZE


def test_a_first_compaction_while_decoding_leaves_the_published_blocks_intact(engine):
    """A prompt under the budget publishes its blocks, and the ones its generated tokens fill, until it reaches
    B + block size while decoding; that compaction copies out of them, so a plain request over the prompt and the
    first generated tokens, and an evicting one over the prompt, hit them and match their references."""
    kv = {"kv_policy": "tova", "kv_budget": 128}
    salt = uuid.uuid4().hex
    ids = haystack(engine.tokenizer, 120, seed=425)
    (evicting,) = run(engine, [salted(ids, salt)], kv, max_tokens=48)
    (reference,) = run(engine, [salted(ids, uuid.uuid4().hex)], kv, max_tokens=48)
    assert list(evicting.outputs[0].token_ids) == list(reference.outputs[0].token_ids)
    assert evicted(evicting) == evicted(reference) > 0  # it compacted while decoding
    generated = list(evicting.outputs[0].token_ids)
    for sequence, policy in ((ids + generated[:40], None), (ids + question(engine, "And then?"), kv)):
        (hit,) = run(engine, [salted(sequence, salt)], policy)
        (miss,) = run(engine, [salted(sequence, uuid.uuid4().hex)], policy)
        assert hit.num_cached_tokens >= 96, policy  # blocks that held prompt and generated tokens when published
        assert list(hit.outputs[0].token_ids) == list(miss.outputs[0].token_ids), policy


def fuzz_case(engine, seed: int) -> tuple[list, list]:
    """Random interleavings of plain and evicting requests (some with prompt checkpoints) over three shared
    documents with different questions:
    each request is in a random batch of 1-4 (so its prompt is prefilled alone in one chunk or in 128-token chunks
    beside others), then the same request runs again under a fresh salt. Returns (outputs, references)."""
    from vllm import SamplingParams

    rng = random.Random(seed)
    salt = uuid.uuid4().hex
    documents = [haystack(engine.tokenizer, rng.randrange(150, 400), seed=430 + seed * 10 + d) for d in range(3)]
    settings = [None, {"kv_policy": "snapkv"}, {"kv_policy": "streamingllm"}, {"kv_policy": "tova"}]
    settings += [{"kv_policy": "h2o"}, {"kv_policy": "ahakv"}]
    # prompt checkpoints (tests/test_checkpoints.py): compacted prefixes published and resumed from
    # (one budget each, so that requests share checkpoints)
    settings += [{"kv_policy": policy, "kv_checkpoint": 64, "kv_budget": 64} for policy in ("snapkv", "tova")]
    requests = []
    for number in range(14):
        ids = documents[rng.randrange(3)] + question(engine, f"Question {number}: what comes next?")
        kv = rng.choice(settings)
        kv = None if kv is None else {"kv_budget": rng.choice([64, 96, 160]), **kv}
        requests.append((ids, kv, rng.randrange(2, 10)))
    outputs = []
    start = 0
    while start < len(requests):
        batch = requests[start : start + rng.randrange(1, 5)]
        start += len(batch)
        params = [
            SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, extra_args=kv) for _, kv, tokens in batch
        ]
        outputs += engine.llm.generate([salted(ids, salt) for ids, _, _ in batch], params, use_tqdm=False)
    references = [run(engine, [salted(ids, uuid.uuid4().hex)], kv, tokens)[0] for ids, kv, tokens in requests]
    return outputs, references


def test_fuzz_interleaved_plain_and_evicting_requests_match_their_references(engine):
    from kvserve.metrics import metrics

    free = engine.free_blocks()
    resumed = metrics().checkpoint_hits._value.get()
    for seed in range(2):
        outputs, references = fuzz_case(engine, seed)
        assert sum(output.num_cached_tokens > 0 for output in outputs) >= 6  # the documents were hit
        for number, (output, reference) in enumerate(zip(outputs, references, strict=True)):
            label = f"seed {seed} request {number}"
            assert list(output.outputs[0].token_ids) == list(reference.outputs[0].token_ids), label
            assert evicted(output) == evicted(reference), label
    assert metrics().checkpoint_hits._value.get() >= resumed + 2  # requests resumed from checkpoints (salted: none)
    assert engine.free_blocks() == free


def test_fuzz_fails_when_a_compaction_writes_into_published_blocks(engine, monkeypatch):
    """The mutation the fuzz must catch: compacting in place while publishing (no copy out of protected blocks).
    Later hits then read compacted pages instead of the document's keys."""
    from kvserve.worker.pages import HeadPages

    monkeypatch.setattr(HeadPages, "relocate", lambda self, layer, keep_pages: [])
    outputs, references = fuzz_case(engine, seed=7)
    assert any(
        list(output.outputs[0].token_ids) != list(reference.outputs[0].token_ids)
        for output, reference in zip(outputs, references, strict=True)
    )
    engine.llm.reset_prefix_cache()  # the cache now holds those corrupted blocks


def test_no_room_for_the_copy_compacts_in_place_and_stops_publishing(engine):
    """A long evicting prompt beside a plain request in a pool without room for the compaction's copy: the request
    compacts in place, its blocks leave the prefix cache, the fallback is counted, and outputs are exact."""
    from vllm import SamplingParams

    from kvserve.metrics import metrics

    fallbacks = metrics().prefix_publish_fallbacks._value.get()
    published = metrics().prefix_blocks_published._value.get()
    salt = uuid.uuid4().hex
    beside = haystack(engine.tokenizer, 700, seed=440)
    long_prompt = haystack(engine.tokenizer, 1500, seed=441)
    kv = {"kv_policy": "snapkv", "kv_budget": 512}  # 16 spare blocks needed; 22 + 47 + 16 > 79
    params = [
        SamplingParams(temperature=0, max_tokens=120, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, extra_args=kv),
    ]
    free = engine.free_blocks()
    plain, evicting = engine.llm.generate([salted(beside, salt), salted(long_prompt, salt)], params, use_tqdm=False)
    assert metrics().prefix_publish_fallbacks._value.get() == fallbacks + 1
    assert metrics().prefix_blocks_published._value.get() > published  # its early chunks were published first
    records = engine.scheduler.core.records.values()
    assert not any(record.private for record in records)  # forgotten with the request
    (reference,) = run(engine, [salted(long_prompt, uuid.uuid4().hex)], kv, max_tokens=4)
    assert list(evicting.outputs[0].token_ids) == list(reference.outputs[0].token_ids)
    assert evicted(evicting) == evicted(reference)
    (after,) = run(engine, [salted(long_prompt, salt)], None, max_tokens=2)
    assert after.num_cached_tokens == 0  # the blocks it compacted in place left the cache
    assert engine.free_blocks() == free


def test_a_prompt_near_max_model_len_hits_only_what_its_row_has_room_to_copy_out_of(engine):
    """A published document that fills the block-table row nearly to max_model_len: the compaction's copies out of
    cached blocks would need cdiv(B, bs) spare blocks past the prompt's, which the row cannot hold. The evicting
    request then hits only what the row has room for, compacts in place, and answers as on a miss."""
    kv = {"kv_policy": "snapkv", "kv_budget": 512}
    row = engine.scheduler.evicting_manager.max_blocks_per_request
    salt = uuid.uuid4().hex
    ids = haystack(engine.tokenizer, row * BLOCK_SIZE - 50, seed=450) + question(engine, "What is this text about?")
    room = row - -(-len(ids) // BLOCK_SIZE)
    assert 0 <= room < 512 // BLOCK_SIZE  # the row cannot hold the copies of a whole hit
    free = engine.free_blocks()
    (plain,) = run(engine, [salted(ids, salt)], None, max_tokens=2)  # publishes the document
    (hit,) = run(engine, [salted(ids, salt)], kv, max_tokens=4)
    (reference,) = run(engine, [salted(ids, uuid.uuid4().hex)], kv, max_tokens=4)
    assert hit.outputs[0].finish_reason == "length", hit.outputs[0]
    assert list(hit.outputs[0].token_ids) == list(reference.outputs[0].token_ids)
    assert evicted(hit) == evicted(reference) > 0
    assert hit.num_cached_tokens <= room * BLOCK_SIZE
    assert engine.free_blocks() == free


def test_deferred_eviction_with_room_serves_as_full_and_publishes_its_reply(engine):
    """`kv_evict_when=pressure` in a pool with room: the request never compacts, answers as `full` does, and the
    blocks its reply fills enter the prefix cache (an eager request publishes only its prompt's: the test above)."""
    kv = {"kv_policy": "snapkv", "kv_budget": 64, "kv_evict_when": "pressure"}
    salt = uuid.uuid4().hex
    ids = haystack(engine.tokenizer, 300, seed=460)
    (deferred,) = run(engine, [salted(ids, salt)], kv, max_tokens=40)
    (plain,) = run(engine, [salted(ids, uuid.uuid4().hex)], None, max_tokens=40)
    assert list(deferred.outputs[0].token_ids) == list(plain.outputs[0].token_ids)
    assert evicted(deferred) == 0
    whole = ids + list(deferred.outputs[0].token_ids)[:36]
    (turn,) = run(engine, [salted(whole, salt)], None, max_tokens=2)
    assert turn.num_cached_tokens == (len(ids) + 36) // BLOCK_SIZE * BLOCK_SIZE > len(ids) // BLOCK_SIZE * BLOCK_SIZE


def test_deferred_eviction_compacts_when_the_pool_is_short(engine):
    """Two 1,000-token prompts in an 80-block pool run as `full` (the pool has room); a third arrives and cannot
    fit, so the two compact at their next step (counted) and it gets in. It then runs with room and never compacts,
    answering as `full`. No request is preempted, every output is complete, and the pool is full again."""
    from vllm import SamplingParams

    from kvserve.metrics import metrics

    kv = {"kv_policy": "snapkv", "kv_budget": 128, "kv_evict_when": "pressure"}
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, extra_args=kv)
    prompts = [salted(haystack(engine.tokenizer, 1000, seed=470 + i), uuid.uuid4().hex) for i in range(3)]
    blocks = -(-1016 // BLOCK_SIZE)
    assert 2 * blocks <= engine.free_blocks() < 3 * blocks
    free, preemptions = engine.free_blocks(), engine.scheduler.num_preemptions
    deferred_before = metrics().deferred_compactions._value.get()
    llm_engine, finished = engine.llm.llm_engine, {}

    def step_until(done) -> None:
        while not done():
            for output in llm_engine.step():
                if output.finished:
                    finished[output.request_id] = output

    for number in (0, 1):
        llm_engine.add_request(f"deferred-{number}", prompts[number], params)
    running = engine.scheduler.running
    step_until(lambda: len(running) == 2 and all(r.num_computed_tokens > r.num_prompt_tokens for r in running))
    assert metrics().deferred_compactions._value.get() == deferred_before  # room so far: nothing compacted
    llm_engine.add_request("deferred-2", prompts[2], params)
    step_until(lambda: not llm_engine.has_unfinished_requests())
    outputs = [finished[f"deferred-{number}"] for number in range(3)]
    counts = [evicted(output) for output in outputs]
    assert all(len(output.outputs[0].token_ids) == 16 for output in outputs)
    assert counts[0] > 0 and counts[1] > 0 and counts[2] == 0, counts
    assert metrics().deferred_compactions._value.get() == deferred_before + 2
    assert engine.scheduler.num_preemptions == preemptions
    (reference,) = run(engine, [salted(prompts[2]["prompt_token_ids"], uuid.uuid4().hex)], None, max_tokens=16)
    assert list(outputs[2].outputs[0].token_ids) == list(reference.outputs[0].token_ids)
    assert engine.free_blocks() == free
