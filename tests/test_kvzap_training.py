"""KVzap's surrogate training (kvserve/tools/training/kvzap.py) on tiny random-weight Llama and Qwen2 models: the
KVzip+ targets equal the same formula over transformers' own attention weights and hidden states, the fits recover
a planted relation, a trained set round-trips through its file and is refused for another model, and its kvpress
form reads hidden states to the same scores."""

from __future__ import annotations

import pytest
import torch

from kvserve.policies.kvzip import REPEAT_INSTRUCTION
from kvserve.tools.bench.tiny_models import tiny_model
from kvserve.tools.training.kvzap import (
    SurrogateSet,
    as_kvpress,
    fit_linear,
    fit_mlp,
    fit_report,
    kvzip_plus_targets,
    train,
)
from kvserve.tools.training.llama import PlainLlama


def contexts(model_dir, count: int, tokens: int, seed: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    from kvserve.tools.eval.haystack import haystack

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return [haystack(tokenizer, tokens, seed=seed + i) for i in range(count)]


def instruction(model_dir) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir).encode(REPEAT_INSTRUCTION, add_special_tokens=False)


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_targets_equal_kvzip_plus_over_transformers_attention(architecture):
    """max over reconstruction queries and group heads of attention / ||x_t|| * ||W_o,g v_k||, with attention
    weights, normalised inputs and values from transformers' eager forward of the same checkpoint."""
    from transformers import AutoModelForCausalLM

    model_dir = tiny_model(architecture)
    (context,) = contexts(model_dir, 1, 40, seed=3)
    repeat = instruction(model_dir)
    ours = kvzip_plus_targets(PlainLlama(model_dir), context, repeat)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager", dtype=torch.float32).eval()
    config = hf.config
    n, heads, kv_heads = len(context), config.num_attention_heads, config.num_key_value_heads
    head_dim = config.hidden_size // heads
    inputs, values = {}, {}

    def keep_input(layer):
        def hook(module, args, kwargs):
            inputs[layer] = kwargs.get("hidden_states", args[0] if args else None)[0]
            values[layer] = module.v_proj(inputs[layer])

        return hook

    for index, block in enumerate(hf.model.layers):
        block.self_attn.register_forward_pre_hook(keep_input(index), with_kwargs=True)
    with torch.no_grad():
        out = hf(torch.tensor([context + repeat + context]), output_attentions=True)
    assert len(ours) == config.num_hidden_layers
    for layer, (queries, targets) in enumerate(ours):
        attention = out.attentions[layer][0]  # [Hq, T, T]
        x = inputs[layer]
        v = values[layer].view(-1, kv_heads, head_dim).repeat_interleave(heads // kv_heads, dim=1)  # [T, Hq, D]
        o_proj = hf.model.layers[layer].self_attn.o_proj.weight.view(-1, heads, head_dim)
        value_out = torch.stack([(v[:n, g] @ o_proj[:, g].T).norm(dim=-1) for g in range(heads)])  # [Hq, n]
        reading = attention[:, n:, :n] / x[n:].norm(dim=-1)[None, :, None] * value_out[:, None, :]
        expected = reading.amax(dim=1).view(kv_heads, -1, n).amax(dim=1).clamp(min=1e-9).log().T
        torch.testing.assert_close(targets, expected, rtol=1e-3, atol=1e-3)
        torch.testing.assert_close(queries, hf.model.layers[layer].self_attn.q_proj(x[:n]), rtol=1e-4, atol=1e-4)


def test_the_fits_recover_a_planted_relation_and_the_report_measures_it():
    torch.manual_seed(0)
    inputs = torch.randn(3000, 24)
    weight, bias = torch.randn(3, 24), torch.randn(3)
    targets = inputs @ weight.T + bias
    linear = fit_linear(inputs[:2500], targets[:2500])
    torch.testing.assert_close(linear.net.weight, weight, rtol=1e-3, atol=1e-3)
    assert fit_report(linear, inputs[2500:], targets[2500:])["r2"] > 0.999
    mlp = fit_mlp(inputs[:2500], targets[:2500], hidden=64, epochs=60)
    report = fit_report(mlp, inputs[2500:], targets[2500:])
    assert report["r2"] > 0.9 and report["spearman"] > 0.9
    noise = fit_report(linear, inputs[2500:], torch.randn(500, 3))
    assert noise["r2"] < 0.1 and abs(noise["spearman"]) < 0.2  # the report can say "no fit"


def test_a_trained_set_round_trips_is_refused_for_another_model_and_composes_into_kvpress_form(tmp_path):
    llama, qwen = tiny_model("llama"), tiny_model("qwen2")
    surrogates, result = train(llama, contexts(llama, 3, 48, seed=10), contexts(llama, 1, 48, seed=20), "linear")
    assert len(result.fit) == len(surrogates.layers) == 4 and result.tokens == 3 * 48
    path = tmp_path / "kvzap.safetensors"
    surrogates.save(path)
    loaded = SurrogateSet.load(path, llama)
    queries = torch.randn(7, surrogates.layers[0].net.in_features)
    torch.testing.assert_close(loaded.scores(2, queries), surrogates.scores(2, queries))
    with pytest.raises(ValueError, match="not for qwen2"):
        SurrogateSet.load(path, qwen)
    mlp, _ = train(llama, contexts(llama, 2, 32, seed=30), contexts(llama, 1, 32, seed=40), "mlp", hidden=8, epochs=2)
    model = PlainLlama(llama)
    hidden = torch.randn(5, model.shape.hidden)
    for trained in (surrogates, mlp):
        out = tmp_path / trained.kind
        as_kvpress(trained, model, out)
        from safetensors.torch import load_file

        tensors = load_file(str(out / "model.safetensors"))
        layer = 1
        if trained.kind == "linear":
            via_kvpress = hidden @ tensors[f"layers.{layer}.weight"].T + tensors[f"layers.{layer}.bias"]
        else:
            first = hidden @ tensors[f"layers.{layer}.0.weight"].T + tensors[f"layers.{layer}.0.bias"]
            second = tensors[f"layers.{layer}.2.weight"]
            via_kvpress = torch.nn.functional.gelu(first) @ second.T + tensors[f"layers.{layer}.2.bias"]
        via_queries = trained.scores(layer, model._project(hidden, layer, "self_attn.q_proj")).T
        torch.testing.assert_close(via_kvpress, via_queries, rtol=1e-4, atol=1e-4)


def test_the_command_trains_on_the_prose_corpus_and_prints_each_layers_fit(tmp_path, capsys):
    from kvserve.tools.training import kvzap

    model_dir = tiny_model("qwen2")
    out = tmp_path / "surrogate.safetensors"
    argv = [str(model_dir), "--texts", "4", "--tokens", "64", "--out", str(out), "--kvpress", str(tmp_path / "kvpress")]
    result = kvzap.run(kvzap.parse_args(argv))
    printed = capsys.readouterr().out
    assert result.texts == 4 and result.held_out == 1 and result.tokens == 4 * 64
    assert printed.count("R^2") == len(result.fit) + 1 and str(out) in printed
    assert SurrogateSet.load(out, model_dir).fit == result.fit
    assert (tmp_path / "kvpress" / "config.json").exists()
