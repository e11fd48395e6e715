"""kvserve's additions to vLLM's OpenAI-compatible server."""
