"""kvserve's kernels, each with a PyTorch reference: `kvserve_kernels` (the folder is `kernels/`). Triton for GPUs:

- `decode_attention.decode_attention_with_scores`: paged decode attention that also accumulates H2O scores, writes
  TOVA's last-query probabilities and MAT's first-key logits in the same pass.
- `prefill_window.prefill_attention_with_window_sums`: causal varlen (chunked-)prefill attention that also returns
  the observation-window column sums (SnapKV, AhaKV with an optional per-query logit scale, EMS, H2O).
- `compaction.compact`: moves each (request, KV head)'s kept entries to the front of its blocks in place, with its
  statistics rows.
- `reference`: the PyTorch versions (also kvserve's CPU path); `layout`: the vLLM cache layout targeted.
- `bench`: `python -m kvserve_kernels.bench` on a GPU.
- `cpu`: the CPU kernel (C++, built on first use): paged attention over kvserve's page lists in vLLM's CPU cache
  formats with the statistics (column sums, first logits, a gain, Attention-Gate's mask) from the same logits.

Importing this package does not import Triton; the kernel modules do.
"""

from .layout import split_kv_cache
from .reference import compact_reference, decode_attention_reference, prefill_attention_reference

__all__ = ["split_kv_cache", "compact_reference", "decode_attention_reference", "prefill_attention_reference"]
