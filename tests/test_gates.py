"""Attention-Gate ("In-context KV-Cache Eviction for LLMs via Attention-Gate", Zeng et al. 2024, arXiv:2410.12876): the
masked attention of Eq. 4/7, the straight-through estimator, training, RoPE helpers,
the gate file and registry, and chunked (causal) gate evaluation. CPU only, tiny random shapes; one test loads the
real default model (skipped when it is not set up)."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import save_file

from kvserve.gates.gateset import GateSet, file_sha256
from kvserve.gates.module import GateHyper, LayerGate, straight_through
from kvserve.gates.registry import REGISTRY_ENV, gate_entry, load_gates
from kvserve.policies.rotary import Rotary
from kvserve.tools.training.corpus import Corpus
from kvserve.tools.training.llama import PlainLlama, gate_keep_matrix, masked_softmax

REAL_MODEL = Path("~/.cache/kvserve/models/SmolLM2-135M-Instruct").expanduser()


def make_tiny_llama(
    folder: Path,
    layers: int = 2,
    hidden: int = 32,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 8,
    intermediate: int = 48,
    vocab: int = 64,
    seed: int = 0,
) -> Path:
    """A random Llama checkpoint folder in Hugging Face layout (config.json + model.safetensors, tied embeddings)."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "num_hidden_layers": layers,
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "intermediate_size": intermediate,
        "vocab_size": vocab,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
    }
    (folder / "config.json").write_text(json.dumps(config))
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) / math.sqrt(shape[-1])

    tensors = {
        "model.embed_tokens.weight": torch.randn(vocab, hidden, generator=g),
        "model.norm.weight": torch.ones(hidden),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors.update(
            {
                p + "input_layernorm.weight": torch.ones(hidden),
                p + "post_attention_layernorm.weight": torch.ones(hidden),
                p + "self_attn.q_proj.weight": 2 * w(heads * head_dim, hidden),
                p + "self_attn.k_proj.weight": 2 * w(kv_heads * head_dim, hidden),
                p + "self_attn.v_proj.weight": w(kv_heads * head_dim, hidden),
                p + "self_attn.o_proj.weight": w(hidden, heads * head_dim),
                p + "mlp.gate_proj.weight": w(intermediate, hidden),
                p + "mlp.up_proj.weight": w(intermediate, hidden),
                p + "mlp.down_proj.weight": w(hidden, intermediate),
            }
        )
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama") / "TinyLlama")


@pytest.fixture(scope="module")
def tiny(tiny_dir) -> PlainLlama:
    return PlainLlama(tiny_dir)


def tiny_gates(model: PlainLlama, gamma: float = 2.0, seed: int = 0) -> GateSet:
    torch.manual_seed(seed)
    s = model.shape
    return GateSet(s.num_layers, s.num_heads * s.head_dim, s.num_kv_heads, GateHyper(gamma=gamma))


# (a) masked attention, Eq. 4/7, against a dense reference built by explicit loops
def test_masked_attention_matches_dense_reference():
    torch.manual_seed(0)
    batch, heads, n = 2, 3, 9
    scores = torch.randn(batch, heads, n, n) * 3
    flags = (torch.rand(batch, n, heads) > 0.5).float()
    scores[0, 1, 5, 2] = 80.0  # a masked key scoring far above the kept ones (if flag 0): must get no weight
    flags[0, 2, 1] = 0.0
    mask = torch.zeros(batch, heads, n, n, dtype=torch.float64)
    for b in range(batch):
        for h in range(heads):
            for s in range(n):  # query
                for t in range(n):  # key
                    mask[b, h, s, t] = 0.0 if s < t else 1.0 if s == t else float(flags[b, t, h])
    inf = 1e9
    reference = torch.softmax(scores.double() - inf * (1 - mask), dim=-1)
    keep = gate_keep_matrix(flags)
    assert torch.equal(keep.double(), mask)
    got = masked_softmax(scores, keep)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), reference, atol=1e-6, rtol=1e-5)
    assert float(got[0, 1, 5, 2]) == 0.0 or flags[0, 2, 1] == 1


@pytest.mark.parametrize("recent", [1, 3])
def test_the_recent_window_shows_each_query_its_recent_keys_whatever_their_flags(recent):
    torch.manual_seed(1)
    batch, heads, n = 1, 2, 10
    flags = (torch.rand(batch, n, heads) > 0.6).float()
    keep = gate_keep_matrix(flags, recent)
    for h in range(heads):
        for s in range(n):
            for t in range(n):
                expected = s == t or (t < s and (bool(flags[0, t, h]) or t >= s - recent))
                assert bool(keep[0, h, s, t]) == expected, (h, s, t)


def test_served_masked_attention_with_a_window_equals_the_training_mask():
    """kvserve/worker/gated.py's prefill attention (entries by position, a validity per head, the gates' window)
    against the training model's masked softmax over gate_keep_matrix: the same weights, so the same outputs."""
    from kvserve.worker.gated import masked_attention

    torch.manual_seed(2)
    kv_heads, group, n, dim, recent = 2, 3, 12, 8, 4
    queries = torch.randn(n, kv_heads * group, dim)
    keys, values = torch.randn(kv_heads, n, dim), torch.randn(kv_heads, n, dim)
    flags = torch.rand(1, n, kv_heads) > 0.5
    positions = torch.arange(n)
    served = masked_attention(
        queries, positions, keys, values, positions.expand(kv_heads, n), flags[0].T, 0.3, recent=recent
    )
    keep = gate_keep_matrix(flags.float(), recent)[0].repeat_interleave(group, dim=0)  # [Hq, n, n]
    scores = torch.einsum("qhd,hkd->hqk", queries, keys.repeat_interleave(group, dim=0)) * 0.3
    dense = torch.einsum("hqk,hkd->qhd", masked_softmax(scores, keep), values.repeat_interleave(group, dim=0))
    torch.testing.assert_close(served, dense, atol=1e-5, rtol=1e-5)


def test_sink_tokens_are_never_flagged_out():
    torch.manual_seed(3)
    gate = LayerGate(16, 2, GateHyper(gamma=-50.0, sink_tokens=3))  # every gate says evict
    logits, _ = gate(torch.randn(1, 7, 16))
    flags = gate.flags(logits, torch.arange(7))[0]
    assert flags[:3].all() and not flags[3:].any()
    shifted = gate.flags(logits, torch.arange(7) + 2)[0]  # a later chunk: only positions 0-2 are sinks
    assert shifted[:1].all() and not shifted[1:].any()


@pytest.mark.parametrize("tau", [0.2, 0.5, 0.8])
def test_a_requests_tau_sets_the_keep_threshold(tau):
    """The served policy's `tau` knob is Eq. 6's threshold: flags are sigmoid(logit + gamma) > tau, sinks aside,
    and a higher tau keeps a subset of what a lower one keeps."""
    from kvserve.policies.attention_gate import AttentionGate

    torch.manual_seed(4)
    gate = LayerGate(8 * 4, 2, GateHyper(gamma=0.0, sink_tokens=2))
    queries, positions, rotary = torch.randn(20, 4, 8), torch.arange(20), Rotary.default(8, 10000.0, 20)
    flags, _ = AttentionGate(tau=tau).gate_flags(gate, queries, positions, rotary, None)
    logits, _ = gate(rotary.unrotate(queries, positions).reshape(1, 20, -1))
    expected = torch.sigmoid(logits[0].T) > tau
    expected[:, :2] = True
    assert torch.equal(flags, expected)
    lower, _ = AttentionGate(tau=tau - 0.1).gate_flags(gate, queries, positions, rotary, None)
    assert bool((lower | ~flags).all()) and int(lower.sum()) >= int(flags.sum())


def test_all_keep_gates_equal_the_plain_model(tiny):
    ids = torch.randint(0, 64, (2, 12))
    plain = tiny(ids).logits
    gated = tiny(ids, tiny_gates(tiny, gamma=50.0))  # every flag 1
    assert all(bool(f.all()) for f in gated.flags)
    torch.testing.assert_close(gated.logits, plain, atol=1e-5, rtol=1e-5)


# (b) the straight-through estimator: exact 0/1 forward, gradients reach every gate parameter from the LM loss
def test_straight_through_gradients_reach_every_gate(tiny):
    from kvserve.tools.training.gates import lm_loss

    gates = tiny_gates(tiny, gamma=0.0)
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(1))
    out = tiny(ids, gates, train_gates=True)
    for probability, flags in zip(out.keep_probability, out.flags, strict=True):
        assert torch.equal(flags.detach(), (probability > 0.5).float())
        assert bool(((flags == 0) | (flags == 1)).all())
    every = torch.cat([f.detach().reshape(-1) for f in out.flags])
    assert 0 < float(every.mean()) < 1  # both decisions occur
    lm_loss(out.logits, ids).backward()
    for layer, gate in enumerate(gates.gates):
        for name, parameter in gate.named_parameters():
            assert parameter.grad is not None and float(parameter.grad.abs().sum()) > 0, (layer, name)
    probability = torch.tensor([0.2, 0.7], requires_grad=True)
    hard = straight_through(probability, 0.5)
    assert hard.tolist() == [0.0, 1.0]
    hard.sum().backward()
    assert probability.grad.tolist() == [1.0, 1.0]


def test_the_answer_term_is_the_kl_at_the_recited_positions_only(tiny):
    """`answer_weight` adds KL(full || gated) averaged over the positions predicting the answer of a retrieval row;
    a prose row (no answer) adds nothing, and the total is the sum of its terms."""
    from kvserve.tools.training.gates import step_losses, token_kl

    gates = tiny_gates(tiny, gamma=0.0)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(2))
    losses = step_losses(tiny, gates, ids, 5.0, 0.5, distill=0.0, answer_weight=2.0, answer_starts=[10, None])
    with torch.no_grad():
        per_token = token_kl(tiny(ids, gates).logits, tiny(ids).logits)
    torch.testing.assert_close(losses.answer_kl.detach(), per_token[0, 9:].mean())  # position 9 predicts token 10
    torch.testing.assert_close(losses.kl.detach(), per_token.mean())
    torch.testing.assert_close(losses.total.detach(), (losses.lm + losses.evict + 2.0 * losses.answer_kl).detach())
    prose = step_losses(tiny, gates, ids, 5.0, 0.5, distill=0.0, answer_weight=2.0, answer_starts=[None, None])
    assert float(prose.answer_kl) == 0.0


# (c) a few training steps (the real training entry point) lower the loss and move the keep ratio towards beta
def test_training_lowers_loss_and_moves_keep_towards_beta(tiny_dir, tmp_path):
    from kvserve.tools.training.gates import parse_args, train

    rng = random.Random(0)
    stream = [rng.randrange(64) for _ in range(3000)]
    corpus = Corpus(
        train=stream[:2500], held_out=stream[2500:], header=[1, 2, 3], train_docs=["a"], held_out_docs=["b"]
    )
    model_dir = tiny_dir
    registry = tmp_path / "registry.yaml"
    args = parse_args(
        [
            "--model",
            str(model_dir),
            "--steps",
            "40",
            "--seq-len",
            "32",
            "--batch",
            "2",
            "--lr",
            "1e-2",
            "--warmup",
            "2",
            "--eval-every",
            "20",
            "--eval-windows",
            "2",
            "--retrieval-fraction",
            "0",  # synthetic passkeys need the real tokenizer
            "--recent",
            "4",
            "--out",
            str(tmp_path / "weights" / "tiny.safetensors"),
            "--registry",
            str(registry),
            "--log",
            str(tmp_path / "log.jsonl"),
            "--plot",
            str(tmp_path / "plot.png"),
        ]
    )
    summary = train(args, corpus=corpus)
    records = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "step"]
    assert len(steps) == 40
    first, last = steps[:5], steps[-5:]

    def mean(rows: list[dict], key: str) -> float:
        return sum(r[key] for r in rows) / len(rows)

    assert mean(last, "loss") < mean(first, "loss")
    assert abs(mean(last, "keep") - 0.5) < abs(mean(first, "keep") - 0.5)
    assert all(r["kl"] >= 0 for r in steps) and mean(steps, "kl") > 0  # the distillation term is on by default
    log_text = (tmp_path / "log.jsonl").read_text()
    assert str(tmp_path) not in log_text and str(model_dir) not in log_text  # no machine paths in a shipped log
    entry = yaml.safe_load(registry.read_text())[model_dir.name]
    assert entry == {"file": "weights/tiny.safetensors", "sha256": summary["sha256"]}
    assert file_sha256(tmp_path / "weights" / "tiny.safetensors") == summary["sha256"]
    loaded = GateSet.load(tmp_path / "weights" / "tiny.safetensors")
    assert loaded.recipe["steps"] == 40 and len(loaded.recipe["final"]["keep_by_layer"]) == 2
    assert (loaded.hyper.sink_tokens, loaded.hyper.recent) == (4, 4)  # served with the window it trained with
    assert (tmp_path / "plot.png").stat().st_size > 0


# (d) the RoPE the gates' training model applies (kvserve.policies.rotary, also the served path's): unrotate inverts
# rotate; rotate matches an independent complex-number formula
def test_rotate_unrotate():
    torch.manual_seed(0)
    n, heads, dim, theta = 11, 3, 16, 100000.0
    x = torch.randn(n, heads, dim)
    positions = torch.tensor([0, 1, 2, 3, 7, 100, 511, 512, 2048, 4095, 8000])
    rotary = Rotary.default(dim, theta, 8001)
    rotated = rotary.rotate(x, positions)
    torch.testing.assert_close(rotary.unrotate(rotated, positions), x, atol=2e-5, rtol=1e-5)
    half = dim // 2
    expected = torch.empty(n, heads, dim, dtype=torch.float64)
    for i, position in enumerate(positions.tolist()):
        for j in range(half):  # pair (j, j + half) rotated by position * theta^(-2j/dim)
            angle = position * theta ** (-2 * j / dim)
            z = torch.complex(x[i, :, j].double(), x[i, :, j + half].double()) * complex(
                math.cos(angle), math.sin(angle)
            )
            expected[i, :, j], expected[i, :, j + half] = z.real, z.imag
    # a float32 table (vLLM computes its angles in float32 too: about position * 6e-8 rad of error)
    torch.testing.assert_close(rotated.double(), expected, atol=1e-3, rtol=1e-4)
    torch.testing.assert_close(rotated[:5].double(), expected[:5], atol=1e-5, rtol=1e-5)


# (e) the gate file: save/load roundtrip, and the shipped artifact matches the registry
def test_gateset_roundtrip(tmp_path):
    torch.manual_seed(0)
    gates = GateSet(3, 24, 2, GateHyper(tau=0.5, gamma=1.0))
    gates = gates.half().float()  # the file holds float16: start from representable weights
    sha = gates.save(tmp_path / "g.safetensors", {"note": "test", "steps": 3})
    assert sha == file_sha256(tmp_path / "g.safetensors")
    loaded = GateSet.load(tmp_path / "g.safetensors")
    assert loaded.recipe == {"note": "test", "steps": 3}
    assert loaded.hyper == gates.hyper and (len(loaded), loaded.in_dim, loaded.num_kv_heads) == (3, 24, 2)
    x = torch.randn(2, 17, 24)
    for layer in range(3):
        a, _ = gates[layer](x)
        b, _ = loaded[layer](x)
        assert torch.equal(gates[layer].flags(a), loaded[layer].flags(b))
        torch.testing.assert_close(a, b, atol=0, rtol=0)


# each shipped model's shape: layers, hidden size, KV heads (the models' config.json)
SHIPPED_GATES = {"SmolLM2-135M-Instruct": (30, 576, 3), "Qwen2.5-Coder-0.5B-Instruct": (24, 896, 2)}


@pytest.mark.parametrize("model", sorted(SHIPPED_GATES))
def test_shipped_gate_file_matches_registry(monkeypatch, model):
    monkeypatch.delenv(REGISTRY_ENV, raising=False)
    entry = gate_entry(f"/some/where/{model}/")
    assert entry.path.exists(), entry.path
    assert file_sha256(entry.path) == entry.sha256
    layers, hidden, kv_heads = SHIPPED_GATES[model]
    gates = load_gates(model, layers, hidden, kv_heads)
    assert (len(gates), gates.in_dim, gates.num_kv_heads) == (layers, hidden, kv_heads)
    assert gates.hyper.tau == 0.5 and gates.recipe["steps"] > 0
    assert len(gates.recipe["final"]["keep_by_layer"]) == layers


# (f) the causal gate run chunk by chunk (GatePast) equals the gate on the whole sequence: what serving relies on
def test_chunked_gate_equals_whole_sequence():
    torch.manual_seed(0)
    gate = LayerGate(24, 3, GateHyper()).eval()
    x = torch.randn(2, 41, 24) * 5
    with torch.no_grad():
        whole, whole_past = gate(x)
        past, pieces, start = None, [], 0
        for size in (7, 1, 13, 1, 19):
            logits, past = gate(x[:, start : start + size], past)
            pieces.append(logits)
            start += size
    chunked = torch.cat(pieces, dim=1)
    torch.testing.assert_close(chunked, whole, atol=1e-5, rtol=1e-5)
    assert torch.equal(gate.flags(chunked), gate.flags(whole))
    torch.testing.assert_close(past.keys, whole_past.keys)
    torch.testing.assert_close(past.values, whole_past.values)
    # a token's logit depends on its prefix only
    changed = x.clone()
    changed[:, 30:] = torch.randn(2, 11, 24)
    with torch.no_grad():
        torch.testing.assert_close(gate(changed)[0][:, :30], whole[:, :30], atol=1e-6, rtol=1e-6)


# the one test on the real model: the shipped gates evict a real share of a held-out text at a small loss cost
@pytest.mark.skipif(not (REAL_MODEL / "config.json").exists(), reason="default model not set up")
def test_shipped_gates_on_real_model(monkeypatch):
    from kvserve.tools.training.corpus import fixed_windows, load_corpus
    from kvserve.tools.training.gates import evaluate

    monkeypatch.delenv(REGISTRY_ENV, raising=False)
    torch.set_num_threads(2)
    model = PlainLlama(REAL_MODEL)
    gates = load_gates(REAL_MODEL.name, 30, 576, 3)
    corpus = load_corpus(REAL_MODEL, seed=gates.recipe["seed"])
    assert sorted(corpus.held_out_docs) == gates.recipe["data"]["held_out_topics"]
    windows = fixed_windows(corpus.held_out, corpus.header, 128, 2)
    plain, gated = evaluate(model, None, windows), evaluate(model, gates, windows)
    assert gated["keep"] < 0.7
    assert gated["lm"] - plain["lm"] < 0.5, (gated["lm"], plain["lm"])
