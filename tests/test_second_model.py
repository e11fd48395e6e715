"""The second model family, Qwen2.5-Coder-0.5B-Instruct (opt in: KVSERVE_LARGE_MODELS=1; it is fetched and converted
once, ~3 minutes, 0.5 GB): `kvserve setup-model` gives a folder whose joined GGUF passed its checksum, the reference
model that measures head roles computes transformers' Qwen2 logits, `kvserve calibrate`'s roles serve
duoattention on it, and its shipped Attention-Gate serves attention_gate."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest
import torch

pytestmark = pytest.mark.large_model


@pytest.fixture(scope="module")
def qwen():
    from kvserve.catalog import setup_model

    return setup_model("qwen2.5-coder-0.5b")


def test_setup_model_prints_the_converted_folder(qwen):
    done = subprocess.run(
        [sys.executable, "-m", "kvserve.cli", "setup-model", "qwen2.5-coder-0.5b"], capture_output=True, text=True
    )
    assert done.returncode == 0 and done.stdout.strip() == str(qwen)
    config = json.loads((qwen / "config.json").read_text())
    assert (config["num_hidden_layers"], config["num_key_value_heads"], config["model_type"]) == (24, 2, "qwen2")


def test_the_reference_model_computes_transformers_qwen2_logits(qwen):
    from transformers import AutoModelForCausalLM

    from kvserve.tools.training.llama import PlainLlama

    ids = torch.randint(0, 1000, (1, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = AutoModelForCausalLM.from_pretrained(qwen, dtype=torch.float32)(ids).logits
    ours = PlainLlama(qwen)(ids).logits
    assert torch.allclose(ours, reference, atol=1e-3, rtol=1e-3)


def test_measured_roles_serve_duoattention_on_qwen(qwen, tmp_path):
    from kvserve.profile import PROFILE_ENV, Profile, ProfileRoles, fingerprint
    from kvserve.tools.bench.servers import running_server
    from kvserve.tools.calibrate.heads import RECIPE, measured_roles

    roles = measured_roles(qwen, samples=1, seq_len=512)
    assert roles.gates.shape == (24, 2) and float(roles.gates.max()) == 1.0
    path = tmp_path / "profile.json"
    Profile(qwen.name, fingerprint(qwen), ProfileRoles(roles.gates, 16, 64), RECIPE).save(path)
    # `--kv-policy full`: no default budget, which would cap attention_gate's gates at that many recent entries
    args = ["--kv-profile", str(path), "--max-model-len", "4096", "--kv-policy", "full"]
    with running_server("kvserve", str(qwen), args, tmp_path / "serve.log", env={PROFILE_ENV: ""}) as url:
        prompt = "Remember: the code is 4417. " + "The sky was grey over the quiet harbour. " * 120
        body = {"model": str(qwen), "prompt": prompt + "The code is", "max_tokens": 6, "temperature": 0}
        reply = httpx.post(
            url + "/v1/completions",
            json=body,
            headers={"x-kv-policy": "duoattention", "x-kv-budget": "256"},
            timeout=600,
        )
        assert reply.status_code == 200, reply.text
        assert reply.headers["x-kv-policy-applied"] == "duoattention"
        assert reply.json()["usage"]["kv_tokens_evicted"] > 0
        # the shipped Attention-Gate (kvserve/gates/registry.yaml): each head keeps what its gate flags
        gated = httpx.post(url + "/v1/completions", json=body, headers={"x-kv-policy": "attention_gate"}, timeout=600)
        assert gated.status_code == 200, gated.text
        assert gated.headers["x-kv-policy-applied"] == "attention_gate"
        assert gated.json()["usage"]["kv_tokens_evicted"] > 0
