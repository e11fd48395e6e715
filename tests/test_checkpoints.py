"""Prompt checkpoints (`kv_checkpoint`) on the shared in-process engine: compacted prefixes in the prefix cache.

A request with `kv_checkpoint=C` compacts its prompt at every multiple of C and publishes the compacted lists there;
a later request with the same start resumes from the latest one. Resuming must change nothing it computes: each
case runs the same request where a checkpoint is cached and under a fresh `cache_salt` (the reference computes
every checkpoint itself), and compares greedy tokens, the evicted count and every layer's kept positions.
"""

from __future__ import annotations

import uuid

import pytest
from engine_settings import BLOCK_SIZE
from test_prefix_cache import assert_same, question, run, salted

from kvserve.config import KVConfig, check_against_model, parse_kv_config
from kvserve.engine.checkpoints import first_compacting_checkpoint
from kvserve.errors import InvalidSetting
from kvserve.eval.haystack import haystack
from kvserve.metrics import metrics

BUDGET = 64
CHECKPOINT = 64


def counter(name: str) -> float:
    return getattr(metrics(), name)._value.get()


@pytest.mark.parametrize("policy", ["snapkv", "tova", "streamingllm"])
def test_resuming_from_a_checkpoint_keeps_what_a_miss_keeps(engine, policy):
    """A repeated document with a new question, and a chat's second turn, resume from the first request's latest
    checkpoint (past where plain blocks may be read; for the chat, one published while it generated its reply);
    tokens, evicted count and kept positions equal the salted miss's, and the pool is full again afterwards."""
    kv = {"kv_policy": policy, "kv_budget": BUDGET, "kv_checkpoint": CHECKPOINT}
    config = parse_kv_config(kv)
    tail = config.prefix_sharing().computed_tail
    salt = uuid.uuid4().hex
    document = haystack(engine.tokenizer, 330, seed=900)
    first = document + question(engine, "What is this text about?")
    published, hits = counter("checkpoints_published"), counter("checkpoint_hits")
    reply_tokens = CHECKPOINT + 6  # its reply crosses a multiple of C: a checkpoint published while decoding
    (turn_one,) = run(engine, [salted(first, salt)], kv, max_tokens=reply_tokens)
    assert counter("checkpoints_published") > published
    free = engine.free_blocks()

    again = document + question(engine, "Who would read this text?")
    chat = first + list(turn_one.outputs[0].token_ids) + question(engine, "Say it again in other words.")
    computed = len(first) + reply_tokens - 1  # the last reply token was sampled, never computed
    for label, ids, covered in (("new question", again, len(document)), ("second turn", chat, computed)):
        before = counter("checkpoint_hits")
        (hit,) = run(engine, [salted(ids, salt)], kv)
        (reference,) = run(engine, [salted(ids, uuid.uuid4().hex)], kv)
        latest = min(covered, len(ids) - tail) // CHECKPOINT * CHECKPOINT
        assert latest >= first_compacting_checkpoint(config), label
        assert label == "new question" or latest > len(first), label  # the turn resumes inside the reply
        assert hit.num_cached_tokens == latest, label  # it resumed from the latest checkpoint both prompts share
        assert counter("checkpoint_hits") == before + 1, label
        assert reference.num_cached_tokens == 0, label
        assert_same(engine, hit, reference, label)
    assert counter("checkpoint_hits") == hits + 2
    assert engine.free_blocks() == free  # nothing held once they finished (cached blocks count as free)


def test_a_checkpoint_is_only_published_where_its_lists_fill_whole_blocks(engine):
    """A checkpoint request whose prompt ends before its first compacting checkpoint publishes none, and a plain
    request never sees a checkpoint's blocks as a hit on its tokens."""
    kv = {"kv_policy": "snapkv", "kv_budget": BUDGET, "kv_checkpoint": CHECKPOINT}
    salt = uuid.uuid4().hex
    short = haystack(engine.tokenizer, 100, seed=910)
    assert len(short) < first_compacting_checkpoint(parse_kv_config(kv))
    published = counter("checkpoints_published")
    run(engine, [salted(short, salt)], kv)
    assert counter("checkpoints_published") == published
    long_prompt = haystack(engine.tokenizer, 300, seed=911)
    run(engine, [salted(long_prompt, salt)], kv)
    assert counter("checkpoints_published") > published
    (plain,) = run(engine, [salted(long_prompt + question(engine, "Why?"), salt)], None, max_tokens=2)
    (reference,) = run(engine, [salted(long_prompt + question(engine, "Why?"), uuid.uuid4().hex)], None, 2)
    # plain blocks up to the first compaction were published; the checkpoints are not its tokens' blocks
    assert plain.num_cached_tokens <= first_compacting_checkpoint(parse_kv_config(kv))
    assert list(plain.outputs[0].token_ids) == list(reference.outputs[0].token_ids)


def test_checkpoint_chunks_end_at_checkpoints(engine):
    """Alone, a prompt is prefilled in one chunk; with checkpoints its chunks end at every multiple of C, so its
    compacted lists at jC do not depend on how the scheduler would otherwise have cut the prompt."""
    scheduler = engine.scheduler
    seen: list[int] = []
    original = type(scheduler)._reserve_prefill_lookahead

    def spy(self, request, computed, new):
        result = original(self, request, computed, new)
        if request.request_id in self.kv_configs:
            seen.append(computed + result)
        return result

    kv = {"kv_policy": "snapkv", "kv_budget": BUDGET, "kv_checkpoint": CHECKPOINT}
    ids = haystack(engine.tokenizer, 300, seed=920)
    type(scheduler)._reserve_prefill_lookahead = spy
    try:
        run(engine, [salted(ids, uuid.uuid4().hex)], kv, max_tokens=2)
    finally:
        type(scheduler)._reserve_prefill_lookahead = original
    prompt_ends = [end for end in seen if end <= len(ids)]
    assert prompt_ends == [*range(CHECKPOINT, len(ids), CHECKPOINT), len(ids)]


@pytest.mark.parametrize(
    ("kv", "why"),
    [
        ({"kv_policy": "h2o", "kv_budget": 64, "kv_checkpoint": 64}, "reads every query"),
        ({"kv_policy": "snapkv", "kv_checkpoint": 64, "kv_budget": 64, "kv_evict_when": "pressure"}, "pressure"),
        ({"kv_policy": "snapkv", "kv_checkpoint": 64, "kv_budget": 64, "kv_allocation": "heads"}, "uneven"),
        ({"kv_policy": "snapkv", "kv_checkpoint": 64, "kv_budget": 64, "kv_evict_every_chunk": True}, "chunks"),
        ({"kv_policy": "snapkv", "kv_checkpoint": 16, "kv_budget": 64}, "at least the 32"),
        ({"kv_policy": "snapkv", "kv_checkpoint": -1, "kv_budget": 64}, ">= 0"),
    ],
)
def test_checkpoint_settings_that_cannot_hold_are_refused(kv, why):
    with pytest.raises(InvalidSetting, match=why) as raised:
        parse_kv_config(kv)
    assert raised.value.field == "kv_checkpoint"


def test_checkpoint_engine_checks_name_the_block_size_and_pipeline(engine):
    model_config = engine.llm.llm_engine.vllm_config.model_config
    for kv, why, shape in (
        ({"kv_checkpoint": 48, "kv_budget": 64}, "multiple of the block size", {}),
        ({"kv_checkpoint": 64, "kv_budget": 80}, "kv_budget to be a multiple", {}),
        ({"kv_checkpoint": 64, "kv_budget": 64}, "pipeline parallelism", {"pipeline_stages": 2}),
    ):
        config = parse_kv_config({"kv_policy": "snapkv", **kv})
        with pytest.raises(InvalidSetting, match=why):
            check_against_model(config, model_config, kv, **{"block_size": BLOCK_SIZE, **shape})
    good = parse_kv_config({"kv_policy": "snapkv", "kv_checkpoint": 64, "kv_budget": 64})
    assert check_against_model(good, model_config, {}, block_size=BLOCK_SIZE) is good
    assert KVConfig().checkpoint == 0


def test_resuming_fails_when_a_compaction_writes_into_a_published_checkpoint(engine, monkeypatch):
    """The mutation the test above must catch: the request that published a checkpoint compacts again in place (no
    copy out of the checkpoint's blocks), so the next request resumes from lists that are no longer the
    checkpoint's."""
    from kvserve.engine.pages import HeadPages

    kv = {"kv_policy": "snapkv", "kv_budget": BUDGET, "kv_checkpoint": CHECKPOINT}
    salt = uuid.uuid4().hex
    document = haystack(engine.tokenizer, 330, seed=930)
    monkeypatch.setattr(HeadPages, "relocate", lambda self, layer, keep_pages: [])
    run(engine, [salted(document + question(engine, "What is this text about?"), salt)], kv)
    ids = document + question(engine, "Who would read this text?")
    (hit,) = run(engine, [salted(ids, salt)], kv)
    (reference,) = run(engine, [salted(ids, uuid.uuid4().hex)], kv)
    assert hit.num_cached_tokens > 0
    assert list(hit.outputs[0].token_ids) != list(reference.outputs[0].token_ids)
    engine.llm.reset_prefix_cache()  # the cache now holds those corrupted blocks


TURNS = {"kv_policy": "snapkv", "kv_budget": BUDGET, "kv_checkpoint": "turns"}


def chat_ids(engine, messages: list[dict]) -> list[int]:
    encoded = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def test_a_chat_turn_resumes_where_the_last_turn_left_off_and_keeps_what_a_miss_keeps(engine):
    """`kv_checkpoint=turns`: the first turn compacts where its prompt ends (the chat template's generation prompt)
    and again while its reply grows past B + block size; the second turn resumes from the latest of those its
    prompt shares and keeps what the salted miss keeps."""
    salt = uuid.uuid4().hex
    document = engine.tokenizer.decode(haystack(engine.tokenizer, 300, seed=940))
    messages = [{"role": "user", "content": document + " What is this text about?"}]
    first = chat_ids(engine, messages)
    published = counter("checkpoints_published")
    (turn_one,) = run(engine, [salted(first, salt)], TURNS, max_tokens=BLOCK_SIZE + 8)
    assert counter("checkpoints_published") >= published + 2  # the turn's end, and once in its reply
    reply = engine.tokenizer.decode(turn_one.outputs[0].token_ids)
    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "Say it again in other words."}]
    second = chat_ids(engine, messages)
    assert second[: len(first)] == first
    hits = counter("checkpoint_hits")
    (hit,) = run(engine, [salted(second, salt)], TURNS)
    (reference,) = run(engine, [salted(second, uuid.uuid4().hex)], TURNS)
    assert hit.num_cached_tokens >= len(first) and counter("checkpoint_hits") == hits + 1
    assert reference.num_cached_tokens == 0
    assert_same(engine, hit, reference, "second turn")


def test_turn_checkpoints_keep_what_eager_eviction_keeps_on_a_single_prompt(engine):
    """One chat turn compacts once where its prompt ends, with the question's window, as eager eviction does, then
    by the same decode rule: same tokens, evicted count and kept positions. A prompt without the chat template
    (no turn ends in it) is served exactly as eager too, and publishes nothing."""
    question_text = " What is this text about?"
    chat = chat_ids(
        engine,
        [
            {
                "role": "user",
                "content": engine.tokenizer.decode(haystack(engine.tokenizer, 300, seed=950)) + question_text,
            }
        ],
    )
    plain = haystack(engine.tokenizer, 300, seed=951) + question(engine, "What is this text about?")
    eager = {"kv_policy": "snapkv", "kv_budget": BUDGET}
    for label, ids in (("chat", chat), ("completion", plain)):
        published = counter("checkpoints_published")
        (turns,) = run(engine, [salted(ids, uuid.uuid4().hex)], TURNS, max_tokens=BLOCK_SIZE + 8)
        (reference,) = run(engine, [salted(ids, uuid.uuid4().hex)], eager, max_tokens=BLOCK_SIZE + 8)
        assert_same(engine, turns, reference, label)
        assert (counter("checkpoints_published") > published) == (label == "chat"), label
