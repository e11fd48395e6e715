"""The worker's side of eviction, with no vLLM: each request's page lists per (layer, KV head), the step's page tables,
the eviction step a layer runs after its attention, and the cache layouts it reads and compacts."""
