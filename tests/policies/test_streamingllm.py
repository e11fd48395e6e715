"""StreamingLLM ("Efficient Streaming Language Models with Attention Sinks", Xiao et al. 2023, arXiv:2309.17453):
every head keeps the attention sinks plus the most recent entries."""

from __future__ import annotations

from references import window_observation

from kvserve.policies import StreamingLLM


def test_streamingllm_keeps_sinks_and_recent():
    obs = window_observation(100)
    keep = StreamingLLM(sink_tokens=4).keep_indices(obs, 20)
    expected = [0, 1, 2, 3] + list(range(84, 100))
    assert keep.shape == (3, 20)
    assert all(row.tolist() == expected for row in keep)
