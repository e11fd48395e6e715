"""kvserve: per-request KV-cache eviction inside vLLM's paged cache."""

# Semantic versioning; each release has its section in CHANGELOG.md.
__version__ = "0.27.0"

# The one vLLM release whose internals kvserve patches (see kvserve/vllm/points.py).
REQUIRED_VLLM_VERSION = "0.32.0"
