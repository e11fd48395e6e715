"""Documents compressed once (`kv_document`: KVzip's, and any other policy's) and the requests that start with them.

The request that compresses a document sends the document, KVzip's repeat instruction and the document again; its
lists must be what the model's own attention during that reconstruction chooses (an independent transformers
reference), published under the document's key. A later request that starts with the document resumes from them:
its answer must be the reference's greedy answer from a cache holding only those entries. Without the compressed
document it is served in full, and says so (nothing evicted). Over HTTP, `POST /v1/kvserve/compress` does the first
part, and bad input is a 400 naming the field.
"""

from __future__ import annotations

import uuid

import httpx
import pytest
import torch
from engine_settings import BLOCK_SIZE
from hf_reference import generate_after_kept_prefix, kvzip_pieces_reference, kvzip_reference, snapkv_reference
from test_checkpoints import counter
from test_engine import _assert_same_kept
from test_prefix_cache import evicted, question, run, salted

from kvserve.config import parse_kv_config
from kvserve.errors import InvalidSetting
from kvserve.server.documents import instruction_ids, reconstruction_pieces
from kvserve.tools.eval.haystack import haystack

BUDGET = 2 * BLOCK_SIZE
SINKS = 4


def compress_settings(document: list[int], **extra) -> dict:
    return {"kv_policy": "kvzip", "kv_budget": BUDGET, "kv_document": len(document), **extra}


def instruction(engine) -> list[int]:
    return instruction_ids(engine.tokenizer)


def test_a_compressed_document_keeps_what_its_reconstruction_attends_to_and_its_questions_resume(engine, hf_model):
    document = haystack(engine.tokenizer, 300, seed=31)
    salt = uuid.uuid4().hex
    kv = compress_settings(document, kv_span=1, kv_allocation="uniform")  # B per list: the reference's choice
    published = counter("checkpoints_published")
    free = engine.free_blocks()
    (compressed,) = run(
        engine, [salted(document + instruction(engine) + document, salt)], {**kv, "kv_reconstruct": 1}, 1
    )
    assert counter("checkpoints_published") == published + 1
    assert evicted(compressed) == len(document) - BUDGET  # the lists stand for the document alone
    state = engine.eviction_state(compressed.request_id)
    ref_keep, ref_scores = kvzip_reference(hf_model, document, instruction(engine), BUDGET, SINKS)
    assert len(state.layers) == len(ref_keep)
    for layer, keep in enumerate(ref_keep):
        kept = state.layers[layer].kept_positions
        assert kept.shape == keep.shape
        assert int(kept.max()) < len(document)  # nothing of the instruction or the copy
        _assert_same_kept(kept, keep, ref_scores[layer], layer)

    asked = question(engine, "What is this text about?")
    hits = counter("checkpoint_hits")
    (answer,) = run(engine, [salted(document + asked, salt)], kv, max_tokens=6)
    assert answer.num_cached_tokens == len(document)  # it resumed where the document ends
    assert counter("checkpoint_hits") == hits + 1
    assert evicted(answer) == len(document) - BUDGET
    kept = [state.layers[layer].kept_positions for layer in sorted(state.layers)]
    reference = generate_after_kept_prefix(hf_model, document, kept, asked, 6)
    assert list(answer.outputs[0].token_ids) == reference

    # the same question under a salt whose document was never compressed: served in full, and it says so
    (missed,) = run(engine, [salted(document + asked, uuid.uuid4().hex)], kv, max_tokens=6)
    assert missed.num_cached_tokens == 0 and evicted(missed) == 0
    assert engine.free_blocks() == free  # nothing held once they finished (cached blocks count as free)


def test_kvzip_ranks_every_layer_and_head_together_and_publishes_whole_pages(engine, hf_model):
    """kvzip's default allocation (`global`, the paper's): one ranking of the raw reconstruction scores over every
    (layer, KV head, token), L x H x B kept in all, each list rounded to whole pages; the document is published and
    its question resumes from the uneven lists; the pool is whole after."""
    document = haystack(engine.tokenizer, 300, seed=34)
    salt = uuid.uuid4().hex
    kv = compress_settings(document, kv_span=1)
    free = engine.free_blocks()
    published = counter("checkpoints_published")
    (compressed,) = run(
        engine, [salted(document + instruction(engine) + document, salt)], {**kv, "kv_reconstruct": 1}, 1
    )
    assert counter("checkpoints_published") == published + 1
    state = engine.eviction_state(compressed.request_id)
    _, ref_scores = kvzip_reference(hf_model, document, instruction(engine), BUDGET, SINKS)
    scores = torch.stack(ref_scores)  # [L, H, n]
    num_layers, num_heads, n = scores.shape
    ranked = scores.masked_fill(torch.arange(n) < SINKS, float("inf"))
    # the ranking's own counts: every list fills the one page it must hold with its best entries, then the best of
    # all the remaining entries, whichever list they are in, fill the rest of L x H x B
    beyond_first_page = torch.sort(ranked, dim=-1, descending=True, stable=True).values[..., BLOCK_SIZE:]
    rest = num_layers * num_heads * (BUDGET - BLOCK_SIZE)
    threshold = torch.sort(beyond_first_page.flatten(), descending=True).values[rest - 1]
    exact = BLOCK_SIZE + (beyond_first_page >= threshold).sum(-1)
    counts = torch.stack([state.layers[layer].counts(num_heads) for layer in range(num_layers)]).long()
    assert int(counts.sum()) == num_layers * num_heads * BUDGET  # the memory B promises, no more
    assert not bool((counts % BLOCK_SIZE).any())  # whole pages, so that the document is published as blocks
    assert bool(((counts - exact).abs() < BLOCK_SIZE).all())  # within a page of the ranking's own counts
    assert len(set(counts.flatten().tolist())) > 1  # the lists really keep different counts
    for layer in range(num_layers):
        kept = state.layers[layer].kept_positions
        for head in range(num_heads):
            count = int(counts[layer, head])
            ours = kept[head, :count]
            assert int(ours.max()) < len(document) and set(range(SINKS)) <= set(ours.tolist())
            best = torch.sort(ranked[layer, head], descending=True, stable=True)
            _assert_same_kept(
                ours[None], torch.sort(best.indices[:count]).values[None], scores[layer, head][None], layer
            )

    asked = question(engine, "What is this text about?")
    (answer,) = run(engine, [salted(document + asked, salt)], kv, max_tokens=6)
    assert answer.num_cached_tokens == len(document)  # it resumed from the uneven lists
    assert evicted(answer) == len(document) - BUDGET
    assert engine.free_blocks() == free


def test_kvzip_max_pools_its_scores_over_neighbouring_entries_when_asked(engine, hf_model):
    """`kv_kernel_size=k` (kvserve's own knob, 1 the paper's): each document entry scores the most reconstruction
    attention any document entry within k // 2 of it got, and each list keeps the top B of those (the sinks first);
    the pooled choice is not the per-entry one."""
    document = haystack(engine.tokenizer, 300, seed=35)
    kernel, half = 5, 2
    kv = compress_settings(document, kv_span=1, kv_allocation="uniform", kv_kernel_size=kernel)
    free = engine.free_blocks()
    salt = uuid.uuid4().hex
    (compressed,) = run(
        engine, [salted(document + instruction(engine) + document, salt)], {**kv, "kv_reconstruct": 1}, 1
    )
    state = engine.eviction_state(compressed.request_id)
    plain_keep, ref_scores = kvzip_reference(hf_model, document, instruction(engine), BUDGET, SINKS)
    n = len(document)
    differs = False
    for layer, peak in enumerate(ref_scores):
        pooled = torch.stack([peak[:, max(0, i - half) : i + half + 1].amax(-1) for i in range(n)], dim=-1)
        ranked = pooled.masked_fill(torch.arange(n) < SINKS, float("inf"))
        keep = torch.sort(torch.sort(ranked, dim=-1, descending=True, stable=True).indices[:, :BUDGET], dim=-1).values
        kept = state.layers[layer].kept_positions
        _assert_same_kept(kept, keep, pooled, layer)
        differs |= not torch.equal(kept, plain_keep[layer])
    assert differs
    assert engine.free_blocks() == free


def test_a_document_reconstructed_piece_by_piece_keeps_what_every_pieces_reconstruction_attends_to(engine, hf_model):
    """The compress route's pieces (here of 128 tokens: three for a 300-token document), run in order: the last one
    compacts with the most attention any piece's reconstruction gave each entry (a transformers reference running
    each piece alone), publishes the document, and its question resumes from it; the pool is whole after."""
    document = haystack(engine.tokenizer, 300, seed=35)
    pieces = reconstruction_pieces(document, engine.tokenizer, max_model_len=2048, piece_tokens=128)
    assert [(piece.start, piece.end) for piece in pieces] == [(0, 128), (128, 256), (256, len(document))]
    salt = uuid.uuid4().hex
    kv = compress_settings(document, kv_span=1, kv_allocation="uniform")
    free = engine.free_blocks()
    published = counter("checkpoints_published")
    for piece in pieces:
        (out,) = run(
            engine,
            [salted(piece.prompt, salt)],
            {**kv, "kv_reconstruct": 1, "kv_reconstruct_piece": f"doc35:{piece.start}:{piece.end}"},
            1,
        )
        assert evicted(out) == (len(document) - BUDGET if piece is pieces[-1] else 0)  # only the last one compacts
    assert counter("checkpoints_published") == published + 1
    state = engine.eviction_state(out.request_id)
    suffixes = [piece.prompt[len(document) :] for piece in pieces]
    ref_keep, ref_scores = kvzip_pieces_reference(hf_model, document, suffixes, BUDGET, SINKS)
    for layer, keep in enumerate(ref_keep):
        _assert_same_kept(state.layers[layer].kept_positions, keep, ref_scores[layer], layer)
    # the pieces' scores are not the whole copy's: the test can tell them apart
    _, whole_scores = kvzip_reference(hf_model, document, instruction(engine), BUDGET, SINKS)
    assert any(not torch.allclose(a, b) for a, b in zip(ref_scores, whole_scores, strict=True))

    asked = question(engine, "What is this text about?")
    (answer,) = run(engine, [salted(document + asked, salt)], kv, max_tokens=6)
    assert answer.num_cached_tokens == len(document)
    kept = [state.layers[layer].kept_positions for layer in sorted(state.layers)]
    assert list(answer.outputs[0].token_ids) == generate_after_kept_prefix(hf_model, document, kept, asked, 6)
    assert engine.free_blocks() == free


def test_a_last_piece_whose_earlier_pieces_never_ran_fails_alone(engine):
    document = haystack(engine.tokenizer, 300, seed=36)
    last = reconstruction_pieces(document, engine.tokenizer, max_model_len=2048, piece_tokens=128)[-1]
    kv = {**compress_settings(document), "kv_reconstruct": 1, "kv_reconstruct_piece": f"never:{last.start}:300"}
    free = engine.free_blocks()
    (out,) = run(engine, [salted(last.prompt, uuid.uuid4().hex)], kv, 4)
    assert out.outputs[0].finish_reason == "error"
    assert "earlier pieces" in out.kv_transfer_params["kv_policy_failure"]
    assert engine.free_blocks() == free
    (fine,) = run(engine, [document[:50]], None, 2)  # the engine still serves
    assert len(fine.outputs[0].token_ids) == 2


def test_reconstruction_pieces_fit_max_model_len_and_one_piece_is_the_whole_copy(engine):
    document = haystack(engine.tokenizer, 300, seed=37)
    (whole,) = reconstruction_pieces(document, engine.tokenizer, max_model_len=2048)
    assert whole.prompt == document + instruction(engine) + document and (whole.start, whole.end) == (0, 300)
    long_document = haystack(engine.tokenizer, 1500, seed=38)  # over half of a 2,048-token context
    pieces = reconstruction_pieces(long_document, engine.tokenizer, max_model_len=2048)
    assert len(pieces) > 1 and all(len(piece.prompt) < 2048 for piece in pieces)
    assert [token for piece in pieces for token in piece.prompt[-(piece.end - piece.start) :]] == long_document
    with pytest.raises(InvalidSetting) as refused:  # room for pieces of fewer than MIN_PIECE tokens
        reconstruction_pieces(haystack(engine.tokenizer, 1900, seed=39), engine.tokenizer, max_model_len=2048)
    assert refused.value.field == "prompt"


def test_a_reconstruction_whose_prompt_is_not_its_document_twice_publishes_nothing(engine):
    document = haystack(engine.tokenizer, 200, seed=32)
    other = haystack(engine.tokenizer, 200, seed=33)
    published = counter("checkpoints_published")
    kv = {**compress_settings(document), "kv_reconstruct": 1}
    (out,) = run(engine, [salted(document + instruction(engine) + other, uuid.uuid4().hex)], kv, 1)
    assert counter("checkpoints_published") == published
    assert evicted(out) == len(document) - BUDGET  # it still compacted: the engine only refuses to share it


@pytest.mark.parametrize("policy", ["snapkv", "tova", "streamingllm"])
def test_any_policy_compresses_a_document_where_it_ends_and_its_questions_keep_theirs(engine, hf_model, policy):
    """kv_document with a policy that scores by its own queries (kvpress's compression before the question): the
    first request compacts once, where the document ends, keeping what the same policy keeps of the document alone
    compacted at its prompt's end; its question and reply are kept in full, so its answer is the reference's greedy
    answer from a cache of those entries; the next question resumes from the published document."""
    document = haystack(engine.tokenizer, 300, seed=35)
    kv = {"kv_policy": policy, "kv_budget": BUDGET, "kv_span": 1}
    free = engine.free_blocks()
    (alone,) = run(engine, [salted(document, uuid.uuid4().hex)], kv, 1)  # eager: compacted where its prompt ends
    alone_state = engine.eviction_state(alone.request_id)
    wanted = [alone_state.layers[layer].kept_positions[:, :BUDGET] for layer in sorted(alone_state.layers)]

    salt, asked = uuid.uuid4().hex, question(engine, "What is this text about?")
    published = counter("checkpoints_published")
    with_document = {**kv, "kv_document": len(document)}
    (first,) = run(engine, [salted(document + asked, salt)], with_document, max_tokens=6)
    assert counter("checkpoints_published") == published + 1
    assert evicted(first) == len(document) - BUDGET  # the question and the reply lost nothing
    state = engine.eviction_state(first.request_id)
    kept = [state.layers[layer].kept_positions[:, :BUDGET] for layer in sorted(state.layers)]
    for layer, (ours, theirs) in enumerate(zip(kept, wanted, strict=True)):
        assert torch.equal(ours, theirs), f"layer {layer}"
    assert list(first.outputs[0].token_ids) == generate_after_kept_prefix(hf_model, document, kept, asked, 6)

    other = question(engine, "Which words does it use most?")
    hits = counter("checkpoint_hits")
    (second,) = run(engine, [salted(document + other, salt)], with_document, max_tokens=6)
    assert second.num_cached_tokens == len(document) and counter("checkpoint_hits") == hits + 1
    assert evicted(second) == len(document) - BUDGET
    assert list(second.outputs[0].token_ids) == generate_after_kept_prefix(hf_model, document, kept, other, 6)
    assert engine.free_blocks() == free


def test_duoattention_compresses_a_document_to_whole_pages_of_its_roles_counts(engine, hf_model):
    """DuoAttention's counts differ by head (its trained roles), so a document it compresses is rounded to whole pages:
    a streaming head keeps its sinks and newest entries rounded up to a page, the retrieval heads split the rest of
    L x H x B as evenly as pages allow and keep SnapKV's choice (the same reference as without a document). The lists
    fill whole blocks, so the document is published, and the same question resumed from it gets the same answer."""
    from kvserve.duo.roles import HeadRoles
    from kvserve.model import DEFAULT_MODEL_NAME
    from kvserve.policies.duo_attention import DuoAttention

    document = haystack(engine.tokenizer, 300, seed=36)
    duo = DuoAttention()
    budget = 4 * BLOCK_SIZE
    kv = {"kv_policy": "duoattention", "kv_budget": budget, "kv_span": 1, "kv_document": len(document)}
    roles = HeadRoles.for_model(DEFAULT_MODEL_NAME, hf_model.config.num_key_value_heads).retrieval(
        duo.retrieval_fraction
    )
    streaming_pages = -(-(duo.sink_tokens + duo.recent) // BLOCK_SIZE)
    retrieval_pages = roles.numel() * budget // BLOCK_SIZE - int((~roles).sum()) * streaming_pages
    fewest, extra = divmod(retrieval_pages, int(roles.sum()))
    wanted = sorted([fewest * BLOCK_SIZE] * (int(roles.sum()) - extra) + [(fewest + 1) * BLOCK_SIZE] * extra)
    free, salt, asked = engine.free_blocks(), uuid.uuid4().hex, question(engine, "What is this text about?")
    published = counter("checkpoints_published")
    (first,) = run(engine, [salted(document + asked, salt)], kv, max_tokens=6)
    assert counter("checkpoints_published") == published + 1
    assert evicted(first) == len(document) - budget  # L x H x B entries kept of the document, its question in full
    state = engine.eviction_state(first.request_id)
    kept = [[[p for p in row if 0 <= p < len(document)] for row in state.layers[layer].kept_positions.tolist()]
            for layer in sorted(state.layers)]  # fmt: skip
    retrieval_kept = sorted(
        len(row) for layer, rows in enumerate(kept) for head, row in enumerate(rows) if roles[layer, head]
    )
    assert retrieval_kept == wanted
    streaming = set(range(duo.sink_tokens)) | set(range(len(document) - duo.recent, len(document)))
    references = {
        count: snapkv_reference(hf_model, document, count, duo.window, duo.kernel_size) for count in set(wanted)
    }
    for layer, rows in enumerate(kept):
        for head, row in enumerate(rows):
            if roles[layer, head]:
                keep, scores = references[len(row)]
                _assert_same_kept(
                    torch.tensor([row]), keep[layer][head : head + 1], scores[layer][head : head + 1], layer
                )
            else:
                assert len(row) == streaming_pages * BLOCK_SIZE and streaming <= set(row), (layer, head)

    hits = counter("checkpoint_hits")
    (second,) = run(engine, [salted(document + asked, salt)], kv, max_tokens=6)
    assert second.num_cached_tokens == len(document) and counter("checkpoint_hits") == hits + 1
    assert list(second.outputs[0].token_ids) == list(first.outputs[0].token_ids)
    assert engine.free_blocks() == free


@pytest.mark.parametrize(
    "kv, field",
    [
        ({"kv_policy": "kvzip", "kv_budget": 64, "kv_document": 64}, "kv_document"),  # fits: nothing to compress
        ({"kv_policy": "kvzip", "kv_document": 300}, "kv_budget"),  # no budget
        ({"kv_policy": "kvzip", "kv_budget": 64, "kv_document": 300, "kv_checkpoint": 64}, "kv_checkpoint"),
        ({"kv_policy": "kvzip", "kv_budget": 64, "kv_document": 300, "kv_allocation": "pyramid"}, "kv_document"),
        ({"kv_policy": "kvzip", "kv_budget": 64, "kv_document": 300, "kv_allocation": "heads"}, "kv_document"),
        ({"kv_policy": "kvzip", "kv_budget": 64, "kv_reconstruct": 1}, "kv_reconstruct"),
        ({"kv_policy": "snapkv", "kv_budget": 64, "kv_reconstruct": 1}, "kv_reconstruct"),
        ({"kv_policy": "snapkv", "kv_budget": 64, "kv_document": 300, "kv_reconstruct": 1}, "kv_reconstruct"),
        ({"kv_policy": "snapkv", "kv_budget": 64, "kv_document": 0}, "kv_document"),
        ({"kv_policy": "snapkv", "kv_budget": 64, "kv_document": 64}, "kv_document"),  # fits: nothing to compress
        ({"kv_policy": "tova", "kv_budget": 64, "kv_document": 300, "kv_evict_every_chunk": 1}, "kv_document"),
        ({"kv_policy": "kvzap", "kv_threshold": -6, "kv_budget": 256, "kv_document": 300}, "kv_document"),
    ],
)
def test_document_settings_that_cannot_hold_are_refused(kv, field):
    with pytest.raises(InvalidSetting) as refused:
        parse_kv_config(kv, defaults={})
    assert refused.value.field == field


def _post(base: str, path: str, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(f"{base}{path}", json=body, headers=headers or {}, timeout=300)


def test_compress_over_http_then_ask(server):
    from transformers import AutoTokenizer

    from kvserve.model import ensure_default_model

    tokenizer = AutoTokenizer.from_pretrained(str(ensure_default_model()))
    text = tokenizer.decode(haystack(tokenizer, 260, seed=34)) + "\n"
    salt = uuid.uuid4().hex
    made = _post(server, "/v1/kvserve/compress", {"prompt": text, "cache_salt": salt}, {"x-kv-budget": str(BUDGET)})
    assert made.status_code == 200, made.text
    answer = made.json()
    tokens = answer["document_tokens"]
    assert tokens == len(tokenizer(text)["input_ids"])
    assert answer["kv"] == {"kv_policy": "kvzip", "kv_budget": BUDGET, "kv_document": tokens}
    assert answer["kv_tokens_evicted"] == tokens - BUDGET and answer["compress_seconds"] > 0
    body = {"prompt": text + "What is this text about? It is about", "max_tokens": 4, "cache_salt": salt}
    asked = _post(server, "/v1/completions", {**body, **answer["kv"]})
    assert asked.status_code == 200, asked.text
    assert asked.json()["usage"]["kv_tokens_evicted"] == tokens - BUDGET  # it resumed from the compressed lists
    assert asked.headers["x-kv-policy-applied"] == "kvzip"


def test_a_document_longer_than_half_the_context_compresses_piece_by_piece_over_http(server):
    """1,200 tokens under max_model_len 2,048: the document and its whole copy would not fit, its pieces do."""
    tokenizer = _tokenizer()
    text = tokenizer.decode(haystack(tokenizer, 1200, seed=40)) + "\n"
    salt = uuid.uuid4().hex
    made = _post(server, "/v1/kvserve/compress", {"prompt": text, "cache_salt": salt}, {"x-kv-budget": str(BUDGET)})
    assert made.status_code == 200, made.text
    tokens = made.json()["document_tokens"]
    assert 2 * tokens > 2048 and made.json()["kv_tokens_evicted"] == tokens - BUDGET
    body = {"prompt": text + "What is this text about? It is about", "max_tokens": 4, "cache_salt": salt}
    asked = _post(server, "/v1/completions", {**body, **made.json()["kv"]})
    assert asked.status_code == 200, asked.text
    assert asked.json()["usage"]["kv_tokens_evicted"] == tokens - BUDGET  # it resumed from the compressed lists


def test_a_chat_document_compressed_as_messages_serves_the_chats_that_start_with_it(server):
    """The document as a chat's first message: the route renders it as the chat template renders the start of any
    chat that begins with it, so a chat completion with one more message resumes from it."""
    from transformers import AutoTokenizer

    from kvserve.model import ensure_default_model

    tokenizer = AutoTokenizer.from_pretrained(str(ensure_default_model()))
    system = {"role": "system", "content": tokenizer.decode(haystack(tokenizer, 260, seed=35))}
    salt = uuid.uuid4().hex
    made = _post(server, "/v1/kvserve/compress", {"messages": [system], "cache_salt": salt}, {"x-kv-budget": "64"})
    assert made.status_code == 200, made.text
    answer = made.json()
    question = {"role": "user", "content": "What is this text about?"}
    body = {"messages": [system, question], "max_tokens": 4, "cache_salt": salt, **answer["kv"]}
    asked = _post(server, "/v1/chat/completions", body)
    assert asked.status_code == 200, asked.text
    assert asked.json()["usage"]["kv_tokens_evicted"] == answer["document_tokens"] - 64


@pytest.mark.parametrize(
    "path, body, headers, field",
    [
        (
            "/v1/completions",
            {"prompt": "hi", "kv_policy": "kvzip", "kv_budget": 64, "kv_document": 300, "kv_reconstruct": 1},
            {},
            "kv_reconstruct",
        ),
        ("/v1/completions", {"prompt": "hi", "kv_policy": "kvzip", "kv_budget": 64}, {}, "kv_document"),
        ("/v1/kvserve/compress", {"prompt": "a short document"}, {"x-kv-budget": "64"}, "kv_document"),
        ("/v1/kvserve/compress", {"prompt": "text " * 200, "kv_policy": "snapkv"}, {"x-kv-budget": "64"}, "kv_policy"),
        ("/v1/kvserve/compress", {"prompt": "text " * 200, "kv_document": 5}, {"x-kv-budget": "64"}, "kv_document"),
        ("/v1/kvserve/compress", {"prompt": "text " * 2040}, {"x-kv-budget": "64"}, "prompt"),  # no room for a piece
        ("/v1/kvserve/compress", {"prompt": 7}, {"x-kv-budget": "64"}, "prompt"),
        ("/v1/kvserve/compress", {"prompt": "x", "messages": []}, {"x-kv-budget": "64"}, "prompt"),
    ],
)
def test_bad_document_requests_are_400s_naming_the_field(server, path, body, headers, field):
    refused = _post(server, path, body, headers)
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == field


def _tokenizer():
    from transformers import AutoTokenizer

    from kvserve.model import ensure_default_model

    return AutoTokenizer.from_pretrained(str(ensure_default_model()))


def test_kvzip_with_a_checkpoint_compresses_the_prefix_once_and_answers_as_an_explicit_compression(server):
    """`kv_checkpoint=C` with kvzip: the server compresses the prompt's last multiple of C before its end by the
    model's reconstruction, once, and the request resumes from it. The answer must be the one a client gets by
    compressing that prefix with POST /v1/kvserve/compress and asking with its kv_document (another salt, so nothing is
    shared), and a second request with the same prefix reuses the compression."""
    tokenizer = _tokenizer()
    text = tokenizer.decode(haystack(tokenizer, 300, seed=36)) + "\n"
    prompt = tokenizer(text + "What is this text about? It is about")["input_ids"]
    prefix_tokens = (len(prompt) - 1) // 128 * 128
    kv = {"kv_policy": "kvzip", "kv_budget": BUDGET, "kv_span": 1}
    salt = uuid.uuid4().hex
    body = {"prompt": text + "What is this text about? It is about", "max_tokens": 6, "temperature": 0}
    first = _post(server, "/v1/completions", {**body, **kv, "kv_checkpoint": 128, "cache_salt": salt})
    assert first.status_code == 200, first.text
    assert first.headers["x-kv-document"] == "compressed"
    assert int(first.headers["x-kv-document-tokens"]) == prefix_tokens
    assert first.json()["usage"]["kv_tokens_evicted"] == prefix_tokens - BUDGET

    other = uuid.uuid4().hex
    made = _post(server, "/v1/kvserve/compress", {"prompt": prompt[:prefix_tokens], "cache_salt": other, **kv})
    assert made.status_code == 200, made.text
    explicit = _post(server, "/v1/completions", {**body, **made.json()["kv"], "cache_salt": other})
    assert explicit.status_code == 200, explicit.text
    assert first.json()["choices"][0]["text"] == explicit.json()["choices"][0]["text"]

    # a request with checkpoints that names no policy gets the server's kv_checkpoint_policy (built in: kvzip), so
    # it is the same compression
    unnamed = {key: value for key, value in kv.items() if key != "kv_policy"}
    again = {**body, "prompt": text + "Which word comes first? The word", **unnamed, "kv_checkpoint": 128}
    second = _post(server, "/v1/completions", {**again, "cache_salt": salt})
    assert second.status_code == 200, second.text
    assert second.headers["x-kv-document"] == "reused" and second.headers["x-kv-policy-applied"] == "kvzip"
    assert second.json()["usage"]["kv_tokens_evicted"] == prefix_tokens - BUDGET  # it resumed from the first's


def test_kvzip_with_turn_checkpoints_compresses_the_conversation_before_its_last_message(server):
    tokenizer = _tokenizer()
    system = {"role": "system", "content": tokenizer.decode(haystack(tokenizer, 200, seed=37))}
    turns = [
        system,
        {"role": "user", "content": "What is this text about?"},
        {"role": "assistant", "content": "It is about Python's documentation."},
        {"role": "user", "content": "Name one word from it."},
    ]
    earlier = tokenizer.apply_chat_template(turns[:-1], tokenize=True)
    earlier = earlier["input_ids"] if hasattr(earlier, "keys") else earlier
    kv = {"kv_policy": "kvzip", "kv_budget": BUDGET, "kv_checkpoint": "turns", "cache_salt": uuid.uuid4().hex}
    asked = _post(server, "/v1/chat/completions", {"messages": turns, "max_tokens": 4, **kv})
    assert asked.status_code == 200, asked.text
    assert asked.headers["x-kv-document"] == "compressed"
    assert int(asked.headers["x-kv-document-tokens"]) == len(earlier)
    assert asked.json()["usage"]["kv_tokens_evicted"] == len(earlier) - BUDGET

    # a first turn whose conversation so far is shorter than the budget has nothing to compress: served in full
    short = [{"role": "user", "content": "Say hello."}]
    plain = _post(server, "/v1/chat/completions", {"messages": short, "max_tokens": 2, **kv})
    assert plain.status_code == 200, plain.text
    assert plain.headers["x-kv-document"] == "none" and plain.headers["x-kv-policy-applied"] == "full"
    assert plain.json()["usage"].get("kv_tokens_evicted", 0) == 0


def test_the_servers_checkpoints_are_compressed_by_its_checkpoint_policy_where_they_apply(monkeypatch):
    """The server's own kv_checkpoint=C, with the built-in kv_checkpoint_policy (kvzip), plans the prefix's
    compression for a request that names neither, as the request's kv_checkpoint does; `turns` keeps the server's
    kv_policy (a kvzip server's `turns` on a completion is refused, as a request's is); a request naming another
    policy is left to it."""
    import json

    from kvserve.config import BUILTIN_DEFAULTS, DEFAULTS_ENV
    from kvserve.server import checkpoint_documents

    monkeypatch.setattr(checkpoint_documents, "tokenizer_of", lambda engine: _tokenizer())
    prompt = _tokenizer().decode(haystack(_tokenizer(), 300, seed=38))
    tokens = len(_tokenizer()(prompt)["input_ids"])

    def plan(defaults: dict, path: str = "/v1/completions", **xargs):
        monkeypatch.setenv(DEFAULTS_ENV, json.dumps({**BUILTIN_DEFAULTS, "kv_budget": BUDGET, **defaults}))
        body = {"prompt": prompt, **({"vllm_xargs": xargs} if xargs else {})}
        return checkpoint_documents.plan_prefix_compression(body, path, engine=None)

    server_default, asked = plan({"kv_checkpoint": 128}), plan({}, kv_checkpoint=128)
    assert server_default.request_body == asked.request_body and server_default.key == asked.key
    assert server_default.request_body["vllm_xargs"] == {
        "kv_policy": "kvzip",
        "kv_document": (tokens - 1) // 128 * 128,
    }
    assert server_default.compress_body["prompt"] == _tokenizer()(prompt)["input_ids"][: (tokens - 1) // 128 * 128]
    assert plan({"kv_checkpoint": "turns"}) is None  # turns: the server's kv_policy, which compacts by itself
    with pytest.raises(InvalidSetting) as refused:  # a kvzip server's turns: no turns in a completion
        plan({"kv_policy": "kvzip", "kv_checkpoint": "turns"})
    assert refused.value.field == "kv_checkpoint"
    assert plan({"kv_checkpoint": 128}, kv_policy="snapkv") is None
    assert plan({"kv_checkpoint": 128}, kv_checkpoint=0) is None


@pytest.mark.parametrize(
    "path, body, field",
    [
        ("/v1/completions", {"prompt": "text " * 300, "kv_checkpoint": "turns"}, "kv_checkpoint"),
        ("/v1/completions", {"prompt": ["text " * 300, "more"], "kv_checkpoint": 128}, "prompt"),
        ("/v1/completions", {"prompt": "text " * 300, "kv_checkpoint": "many"}, "kv_checkpoint"),
        ("/v1/completions", {"prompt": "text " * 2000, "kv_checkpoint": 128}, "prompt"),  # pieces under 128
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "kv_checkpoint": 128, "tools": []},
            "tools",
        ),
    ],
)
def test_bad_kvzip_checkpoint_requests_are_400s_naming_the_field(server, path, body, field):
    body = {"kv_policy": "kvzip", "kv_budget": 64, "max_tokens": 1, **body}
    refused = _post(server, path, body)
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == field


def test_the_route_runs_the_pieces_in_order_and_stops_at_a_failed_one():
    import asyncio
    import json

    from kvserve.server.documents import Collected, reconstruct

    def answer(status: int, evicted: int) -> Collected:
        collected = Collected()
        collected.status, collected.body = status, json.dumps({"usage": {"kv_tokens_evicted": evicted}}).encode()
        return collected

    def route(answers: list[Collected]) -> tuple[Collected, list[str]]:
        ran = []

        async def run(completion: dict, config) -> Collected:
            ran.append(completion["piece"])
            return answers[len(ran) - 1]

        pieces = [{"piece": name} for name in ("a", "b", "c")]
        return asyncio.run(reconstruct(run, pieces, [None] * 3)), ran

    done, ran = route([answer(200, 0), answer(200, 0), answer(200, 236)])
    assert ran == ["a", "b", "c"] and done.status == 200
    failed, ran = route([answer(200, 0), answer(400, 0), answer(200, 236)])
    assert ran == ["a", "b"] and failed.status == 400  # the next piece never runs
    quiet, _ = route([answer(200, 0), answer(200, 0), answer(200, 0)])
    assert quiet.status == 500 and b"without compacting" in quiet.body  # the last piece compacted nothing
