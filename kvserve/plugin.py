"""vLLM general-plugin entry point (`vllm.general_plugins: kvserve`): loaded in every vLLM process."""

from __future__ import annotations


def register() -> None:
    from kvserve.vllm import patches

    patches.apply()
