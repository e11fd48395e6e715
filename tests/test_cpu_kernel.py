"""kvserve's CPU kernel (`kvserve_kernels.cpu`): attention output held to vLLM's own CPU attention op and to the PyTorch
references, statistics to `kvserve_kernels.reference`, for both page formats, float32 and bfloat16 caches, several
GQA groups and block sizes, ragged lists with partly filled last pages and one-page lists; Attention-Gate's mask to
`masked_attention`; and the PyTorch path it replaces, still there where the kernel is off."""

from __future__ import annotations

import pytest
import torch
from cache_writers import write
from kvserve_kernels import cpu as cpu_kernel
from kvserve_kernels.reference import decode_attention_reference, prefill_attention_reference

from kvserve.provenance import present_flags
from kvserve.tools.bench.kernel import vllm_attention
from kvserve.worker.gated import masked_attention
from kvserve.worker.layouts import AmxPages, VecPages

DIM = 64
LENGTHS = torch.tensor([75, 40, 96, 1, 33, 32, 16])  # partial last pages, whole pages, one-page lists, one entry
SCALE = DIM**-0.5
OUT_TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}
PROB_TOL = dict(rtol=1e-4, atol=1e-6)

pytestmark = pytest.mark.skipif(
    not cpu_kernel.available(), reason=f"the kernel did not build: {cpu_kernel.build_error()}"
)


def pool(layout: str, dtype: torch.dtype, block: int, lengths: torch.Tensor, seed: int):
    """Pages of `layout` holding each row's entries at shuffled pages: (pages, tables [R, W], [(keys, values)])."""
    generator = torch.Generator().manual_seed(seed)
    width = -(-int(lengths.max()) // block)
    num_pages = len(lengths) * width + 2
    tables = torch.randperm(num_pages, generator=generator)[: len(lengths) * width].view(len(lengths), width)
    pages = torch.randn(num_pages, 1, block, 2 * DIM, generator=generator).to(dtype)  # garbage in unused slots
    rows = []
    for row, length in enumerate(lengths.tolist()):
        entries = torch.arange(length)
        keys, values = (torch.randn(length, DIM, generator=generator).to(dtype) for _ in range(2))
        write(pages, layout, keys, values, tables[row, entries // block] * block + entries % block)
        rows.append((keys, values))
    return pages, tables, rows


def dense_reference(queries: torch.Tensor, rows: list, lengths: torch.Tensor, gain=None):
    """Plain causal attention per row in float32 from the entries themselves: (output [R, Q, G, D], sums [R, n])."""
    num_rows, num_queries, group, _ = queries.shape
    outputs = torch.zeros(num_rows, num_queries, group, DIM)
    sums = torch.zeros(num_rows, int(lengths.max()))
    for row, (keys, values) in enumerate(rows):
        n = int(lengths[row])
        logits = torch.einsum("qgd,nd->qgn", queries[row].float(), keys.float()) * SCALE
        if gain is not None:
            logits = logits * gain[row][:, None, None]
        own = n - num_queries + torch.arange(num_queries)
        logits = logits.masked_fill(torch.arange(n)[None, None, :] > own[:, None, None], float("-inf"))
        probs = logits.softmax(-1)
        outputs[row] = torch.einsum("qgn,nd->qgd", probs, values.float())
        sums[row, :n] = probs.sum(dim=(0, 1))
    return outputs, sums


# vLLM stores bf16 in the AMX format (on CPUs with tiles), float32 never
@pytest.mark.parametrize("layout,dtype", [("vec", torch.float32), ("vec", torch.bfloat16), ("amx", torch.bfloat16)])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("block", [16, 32])
@pytest.mark.parametrize("num_queries", [1, 5, 20])
def test_output_sums_and_first_logits_match_dense_attention(layout, dtype, group, block, num_queries):
    if layout == "amx" and block % 32:
        pytest.skip("vLLM's AMX cache needs blocks of a multiple of 32 tokens")
    lengths = LENGTHS.clamp(min=num_queries)
    pages, tables, rows = pool(layout, dtype, block, lengths, seed=group + block)
    queries = torch.randn(len(lengths), num_queries, group, DIM, generator=torch.Generator().manual_seed(9)).to(dtype)
    out, sums, first = cpu_kernel.paged_attention(queries, pages, layout, tables, lengths, SCALE, first_logits=True)
    want_out, want_sums = dense_reference(queries, rows, lengths)
    assert out.dtype == dtype and out.shape == queries.shape
    torch.testing.assert_close(out.float(), want_out, **OUT_TOL[dtype])
    torch.testing.assert_close(sums, want_sums, **PROB_TOL)
    for row, (keys, _) in enumerate(rows):
        want_first = torch.einsum("qgd,d->qg", queries[row].float(), keys[0].float()) * SCALE
        torch.testing.assert_close(first[row], want_first.reshape(-1), **PROB_TOL)
        assert not sums[row, int(lengths[row]) :].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_queries", [1, 7])
def test_output_matches_vllms_attention_op(dtype, num_queries):
    """The kernel replaces vLLM's op for some rows: on the same pages, pseudo rows and lengths it gives vLLM's output
    (bit for bit in a bf16 decode where both sum in AVX-512's order; within bf16 rounding of a differently ordered
    sum otherwise: on an AVX2-only CPU vLLM's bf16 decode rounds some outputs one bf16 step apart from the kernel)."""
    block, group = 32, 3
    lengths = LENGTHS.clamp(min=num_queries)
    pages, tables, _ = pool("vec", dtype, block, lengths, seed=4)
    queries = torch.randn(len(lengths), num_queries, group, DIM, generator=torch.Generator().manual_seed(3)).to(dtype)
    out, _, _ = cpu_kernel.paged_attention(queries, pages, "vec", tables, lengths, SCALE, sums=False)
    want = vllm_attention(queries, pages, tables, lengths)()  # vLLM's op as kvserve's backend calls it
    if dtype == torch.bfloat16 and num_queries == 1 and "avx512f" in present_flags():
        assert torch.equal(out.reshape_as(want), want)
    torch.testing.assert_close(out.reshape_as(want).float(), want.float(), **OUT_TOL[dtype])


@pytest.mark.parametrize("layout", ["vec", "amx"])
def test_statistics_match_the_kernel_references(layout):
    """Decode column sums and first logits to `decode_attention_reference`; a prefill chunk's window sums, with and
    without a per-query gain (AhaKV), to `prefill_attention_reference`, read from a vec twin of the same entries."""
    block, group, chunk, window = 32, 3, 20, 7
    lengths = LENGTHS.clamp(min=chunk)
    pages, tables, rows = pool(layout, torch.bfloat16, block, lengths, seed=11)
    twin = torch.zeros_like(pages)
    for row, (keys, values) in enumerate(rows):
        entries = torch.arange(keys.shape[0])
        write(twin, "vec", keys, values, tables[row, entries // block] * block + entries % block)
    views = VecPages(twin).views
    generator = torch.Generator().manual_seed(12)
    decode = torch.randn(len(lengths), 1, group, DIM, generator=generator)
    _, sums, first = cpu_kernel.paged_attention(
        decode, pages, layout, tables, lengths, SCALE, output=False, first_logits=True
    )
    want_sums, want_first = torch.zeros(len(lengths), 1, int(lengths.max())), torch.empty(len(lengths), group)
    decode_attention_reference(
        decode[:, 0], views.keys, views.values, tables.int(), lengths.int(), SCALE, scores=want_sums,
        first_logit=want_first, need_output=False,
    )  # fmt: skip
    torch.testing.assert_close(sums, want_sums[:, 0], **PROB_TOL)
    torch.testing.assert_close(first, want_first, **PROB_TOL)
    queries = torch.randn(len(lengths), chunk, group, DIM, generator=generator)
    for gain in (None, 1 + torch.rand(len(lengths), window, generator=generator)):
        _, sums, _ = cpu_kernel.paged_attention(
            queries[:, -window:], pages, layout, tables, lengths, SCALE, gain=gain, output=False
        )
        row_scale = None
        if gain is not None:
            row_scale = torch.ones(len(lengths), chunk)
            row_scale[:, -window:] = gain
            row_scale = row_scale.reshape(1, -1)
        _, want, _ = prefill_attention_reference(
            queries.reshape(-1, group, DIM), views.keys, views.values, tables.int(), lengths.int(),
            torch.arange(len(lengths) + 1, dtype=torch.int32) * chunk, SCALE, window, score_logit_scale=row_scale,
            need_output=False,
        )  # fmt: skip
        torch.testing.assert_close(sums, want[:, 0], **PROB_TOL)


@pytest.mark.parametrize("layout", ["vec", "amx"])
@pytest.mark.parametrize("recent", [0, 4])
def test_attention_gates_mask_matches_masked_attention(layout, recent):
    """Attention-Gate's prompt: each head hides the earlier entries its gate flagged out; the kernel's masked output
    equals kvserve's PyTorch `masked_attention` on the same entries."""
    block, group, heads, chunk = 32, 3, 3, 24
    lengths = torch.tensor([90, 90, 90])  # one request: its three KV heads' lists, the chunk's entries at the end
    pages, tables, rows = pool(layout, torch.bfloat16, block, lengths, seed=21)
    generator = torch.Generator().manual_seed(22)
    valid = torch.rand(heads, 90, generator=generator) < 0.5
    positions = torch.arange(90).repeat(heads, 1) + 7  # positions need not start at 0
    query_positions = positions[0, -chunk:]
    queries = torch.randn(chunk, heads * group, DIM, generator=generator).to(torch.bfloat16)
    keys = torch.stack([entry[0] for entry in rows])
    values = torch.stack([entry[1] for entry in rows])
    want = masked_attention(queries, query_positions, keys, values, positions, valid, SCALE, recent)
    got, _, _ = cpu_kernel.paged_attention(
        queries.view(chunk, heads, group, DIM).transpose(0, 1), pages, layout, tables, lengths, SCALE,
        valid=valid, key_positions=positions, query_positions=query_positions.expand(heads, -1), recent=recent,
        sums=False,
    )  # fmt: skip
    torch.testing.assert_close(got.transpose(0, 1).reshape(chunk, -1, DIM).float(), want, **OUT_TOL[torch.bfloat16])


@pytest.mark.parametrize("cls", [VecPages, AmxPages])
def test_the_pytorch_path_serves_where_the_kernel_is_off(cls, monkeypatch):
    """KVSERVE_CPU_KERNEL=0 (or no compiler) leaves the page-wise PyTorch statistics: the kernel's numbers."""
    pages, tables, _ = pool(cls.name, torch.bfloat16, 32, LENGTHS, seed=31)
    queries = torch.randn(len(LENGTHS), 1, 3, DIM, generator=torch.Generator().manual_seed(32))
    with_kernel = cls(pages)
    assert with_kernel.uses_kernel()
    monkeypatch.setenv(cpu_kernel.ENV, "0")
    without = cls(pages)
    assert not without.uses_kernel()
    for got, want in zip(
        without.query_sums(queries, tables, LENGTHS, SCALE, first_logits=True),
        with_kernel.query_sums(queries, tables, LENGTHS, SCALE, first_logits=True),
        strict=True,
    ):
        torch.testing.assert_close(got, want, **PROB_TOL)
    monkeypatch.setenv(cpu_kernel.ENV, "maybe")
    with pytest.raises(ValueError, match=cpu_kernel.ENV):
        cpu_kernel.enabled()


def test_bad_arguments_are_refused_by_name():
    pages, tables, _ = pool("vec", torch.bfloat16, 32, LENGTHS, seed=41)
    queries = torch.randn(len(LENGTHS), 1, 3, DIM, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="queries must be float32 or the cache's dtype"):
        cpu_kernel.paged_attention(queries, pages, "vec", tables, LENGTHS, SCALE)
    with pytest.raises(RuntimeError, match="row 0 needs 3 pages, its table holds 2"):
        cpu_kernel.paged_attention(queries.float(), pages, "vec", tables[:, :2], LENGTHS, SCALE)
    with pytest.raises(RuntimeError, match="every row must hold its Q queries"):
        cpu_kernel.paged_attention(queries.float().expand(-1, 3, -1, -1), pages, "vec", tables, LENGTHS, SCALE)


@pytest.mark.parametrize("policy", ["h2o", "ems", "mat"])
def test_the_engine_keeps_the_same_positions_with_the_kernel_as_without(engine, policy, monkeypatch):
    """In the real engine the kernel computes these policies' rows (output and column sums or first logits in one
    pass); with it off, vLLM's op and the PyTorch statistics do. Every layer keeps the same positions, and the text
    is the same."""
    from kvserve.tools.eval.haystack import haystack
    from kvserve.worker.layouts import CachePages

    ids = haystack(engine.tokenizer, 300, seed=14)
    kv = {"kv_policy": policy, "kv_budget": 128, "kv_span": 1}
    calls = []
    kernel = cpu_kernel.paged_attention
    monkeypatch.setattr(cpu_kernel, "paged_attention", lambda *a, **k: calls.append(k) or kernel(*a, **k))
    fused = engine.generate([ids], 24, kv, cache_salt=f"kernel-{policy}")[0]
    assert any(call.get("output", True) for call in calls)  # the kernel computed attention output in the engine
    monkeypatch.setattr(CachePages, "uses_kernel", lambda self: False)
    calls.clear()
    plain = engine.generate([ids], 24, kv, cache_salt=f"pytorch-{policy}")[0]
    assert not calls
    fused_state, plain_state = engine.eviction_state(fused.request_id), engine.eviction_state(plain.request_id)
    for layer in plain_state.layers:
        assert torch.equal(fused_state.layers[layer].kept_positions, plain_state.layers[layer].kept_positions), layer
    assert list(fused.outputs[0].token_ids) == list(plain.outputs[0].token_ids)


@pytest.mark.parametrize("broken", ["kernel", "gate"])
def test_a_failure_in_the_fused_pass_fails_only_its_request(engine, broken, monkeypatch):
    """The kernel's rows (H2O) or a gate run in the attention pass (Attention-Gate) raising ends that request with
    finish_reason "error"; its neighbour, the pool and the engine go on."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from kvserve.policies.attention_gate import AttentionGate
    from kvserve.tools.eval.haystack import haystack

    prompts = [haystack(engine.tokenizer, 300, seed=70 + i) for i in range(2)]
    snapkv = {"kv_policy": "snapkv", "kv_budget": 64}
    alone = engine.generate(prompts[1:], 16, snapkv)[0].outputs[0]
    free_before = engine.free_blocks()

    def raising(*args, **kwargs):
        raise RuntimeError(f"injected {broken} failure")

    if broken == "kernel":
        kernel = cpu_kernel.paged_attention
        monkeypatch.setattr(
            cpu_kernel, "paged_attention", lambda *a, **k: raising() if k.get("output", True) else kernel(*a, **k)
        )
        failing = {"kv_policy": "h2o", "kv_budget": 64}
    else:
        monkeypatch.setattr(AttentionGate, "gate_flags", raising)
        failing = {"kv_policy": "attention_gate"}
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, extra_args=kv) for kv in (failing, snapkv)]
    failed, neighbour = engine.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    assert failed.outputs[0].finish_reason == "error"
    assert f"injected {broken} failure" in failed.kv_transfer_params["kv_policy_failure"]
    assert neighbour.outputs[0].finish_reason == "length"
    assert neighbour.outputs[0].token_ids == alone.token_ids
    assert engine.free_blocks() == free_before
