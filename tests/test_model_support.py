"""kvserve's reading of a model's attention layers (kvserve/model_support.py) on configs of the kinds the tiny-model
matrix cannot build here (tests/test_models.py serves the ones it can), and what the front ends make of it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvserve.config import parse_kv_config
from kvserve.errors import InvalidSetting
from kvserve.model_support import EvictionSupport, check_against_model, eviction_support
from kvserve.server.middleware import evicting_layers


def model_config(num_layers: int = 4, **text) -> SimpleNamespace:
    flags = {key: text.pop(key, False) for key in ("is_attention_free", "is_hybrid", "use_mla", "is_encoder_decoder")}
    return SimpleNamespace(
        model="tiny",
        max_model_len=2048,
        hf_text_config=SimpleNamespace(**text),
        get_total_num_hidden_layers=lambda: num_layers,
        **flags,
    )


@pytest.mark.parametrize(
    ("config", "words"),
    [
        (model_config(is_hybrid=True), "recurrent"),
        (model_config(use_mla=True), "latent attention"),
        (model_config(is_encoder_decoder=True), "cross-attention"),
        (model_config(attention_chunk_size=8192), "chunked local attention"),
        (model_config(model_type="gpt_oss", sliding_window=128), "attention sinks"),
        (model_config(num_kv_shared_layers=2), "share another layer's KV cache"),
        (model_config(sliding_window=4096), "every layer attends within a sliding window of 4096 tokens"),
        (model_config(layer_types=["sliding_attention"] * 4, sliding_window=512), "sliding window of 512"),
        (model_config(layer_types=["full_attention", "linear_attention"] * 2), "linear_attention"),
    ],
)
def test_models_that_cannot_evict_say_why(config, words):
    support = eviction_support(config)
    assert not support.evicts and support.paged_layers == ()
    assert words in support.reason


def test_full_attention_everywhere_evicts_on_every_layer():
    support = eviction_support(model_config(num_layers=6, sliding_window=None))
    assert support.evicts and not support.hybrid and support.paged_layers == tuple(range(6))
    # Qwen2-style: a window in the config that the model does not use
    assert eviction_support(model_config(sliding_window=4096, use_sliding_window=False)).paged_layers == (0, 1, 2, 3)


def test_hybrid_models_evict_on_their_full_attention_layers():
    kinds = (["sliding_attention"] * 5 + ["full_attention"]) * 2
    support = eviction_support(model_config(num_layers=12, layer_types=kinds, sliding_window=128))
    assert support.hybrid and support.paged_layers == (5, 11) and support.window == 128
    assert "2 full-attention layers [5, 11]" in support.describe()
    assert evicting_layers(support) == "5,11"
    assert evicting_layers(EvictionSupport(4, (0, 1, 2, 3))) == "all"


def test_server_default_eviction_does_not_apply_where_the_model_cannot_evict():
    mistral = model_config(sliding_window=128)
    defaults = {"kv_policy": "snapkv", "kv_budget": 256}
    served = check_against_model(parse_kv_config({}, defaults=defaults), mistral, {})
    assert served.policy == "full" and not served.evicts
    for asked in ({"kv_policy": "snapkv", "kv_budget": 64}, {"kv_budget": 64}):
        with pytest.raises(InvalidSetting, match="sliding window of 128") as error:
            check_against_model(parse_kv_config(asked, defaults=defaults), mistral, asked)
        assert error.value.field == ("kv_policy" if "kv_policy" in asked else "kv_budget")
    llama = model_config()
    config = parse_kv_config({}, defaults=defaults)
    assert check_against_model(config, llama, {}) is config  # a model that evicts gets the default as it is
