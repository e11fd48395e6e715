"""The engine core's side of eviction, in plain Python over kvserve's own types (no vLLM): when a request compacts
and to how many entries, where its checkpoints fall, when the pool is short, which waiting request goes first, what
a prefix-cache hit may cover, and the one record the engine core keeps per request. `kvserve/vllm/` calls it."""
