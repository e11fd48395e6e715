"""kvserve's side of the vLLM engine: scheduler and block manager (engine core), step state and attention (worker)."""
