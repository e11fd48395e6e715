"""DuoAttention's training pieces (arXiv:2410.10819): the synthetic retrieval samples, the frozen model's mixed
attention against its two ends computed another way, and the shipped roles file of the default model."""

from __future__ import annotations

import json
import random

import pytest
import torch

from kvserve.duo.roles import ROLES_DIR, HeadRoles
from kvserve.model import DEFAULT_MODEL_NAME, ensure_default_model
from kvserve.tools.training.corpus import load_tokenizer
from kvserve.tools.training.llama import PlainLlama, streaming_keep_matrix
from kvserve.tools.training.retrieval import retrieval_sample, vocabulary


@pytest.fixture(scope="module")
def model_dir():
    return ensure_default_model()


def test_a_sample_hides_the_passkeys_in_order_and_ends_with_them(model_dir):
    tokenizer = load_tokenizer(model_dir)
    stream = tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 200, add_special_tokens=False).ids
    words = vocabulary("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november")
    sample = retrieval_sample(tokenizer, stream, words, 400, random.Random(3), keys=3, key_words=4)
    assert len(sample.ids) == 400
    text = tokenizer.decode(sample.ids[: sample.answer_start])
    answer = tokenizer.decode(sample.ids[sample.answer_start :])
    keys = [part.strip(" .") for part in answer.split(";")]
    assert len(keys) == 3 and all(len(key.split()) == 4 for key in keys)
    hidden = [text.index(f"Secret word sequence {i + 1}: {key}.") for i, key in enumerate(keys)]
    assert hidden == sorted(hidden) and text.rstrip().endswith("The secret word sequences are:")


def test_streaming_mask_sees_sinks_and_recent_keys_causally():
    mask = streaming_keep_matrix(8, sinks=2, recent=3).bool()
    for query in range(8):
        expected = [key for key in range(query + 1) if key < 2 or key > query - 3]
        assert torch.nonzero(mask[query]).flatten().tolist() == expected


def test_mixed_attention_ends_are_the_full_and_the_streaming_model(model_dir):
    model = PlainLlama(model_dir)
    layers, heads = model.shape.num_layers, model.shape.num_kv_heads
    ids = torch.tensor([list(range(100, 160))])
    plain = model(ids).hidden
    torch.testing.assert_close(model(ids, head_mix=torch.ones(layers, heads), streaming=(4, 8)).hidden, plain)
    streaming = streaming_keep_matrix(60, 4, 8).bool()
    visible = [streaming.expand(heads, -1, -1)] * layers  # the same rule through the per-head visibility path
    torch.testing.assert_close(
        model(ids, head_mix=torch.zeros(layers, heads), streaming=(4, 8)).hidden, model(ids, visible=visible).hidden
    )
    gates = torch.full((layers, heads), 0.5, requires_grad=True)
    model(ids, head_mix=gates, streaming=(4, 8)).hidden[0, -1].pow(2).sum().backward()
    assert torch.isfinite(gates.grad).all() and gates.grad.abs().sum() > 0


def test_roles_round_trip(tmp_path):
    roles = HeadRoles("m", torch.rand(4, 2), sink_tokens=8, recent=32)
    roles.save(tmp_path / "m.json", {"steps": 1})
    loaded = HeadRoles.load(tmp_path / "m.json")
    torch.testing.assert_close(loaded.gates, roles.gates, atol=1e-6, rtol=0)
    assert (loaded.sink_tokens, loaded.recent) == (8, 32)


def test_the_shipped_roles_fit_the_default_model_and_beat_random_roles():
    roles = HeadRoles.for_model(DEFAULT_MODEL_NAME, 3)
    assert roles.gates.shape == (30, 3) and bool(((roles.gates >= 0) & (roles.gates <= 1)).all())
    record = json.loads((ROLES_DIR / f"{DEFAULT_MODEL_NAME}.json").read_text())
    assert "/" not in record["recipe"]["model"]  # a name, never a machine path
    for row in record["recipe"]["held_out"]:  # measured when trained: distillation error on held-out samples
        assert row["trained_roles"] < row["random_roles"], row
