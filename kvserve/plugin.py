"""vLLM general-plugin entry point (`vllm.general_plugins: kvserve`): loaded in every vLLM process."""

from __future__ import annotations


def register() -> None:
    from kvserve.metrics import read_new_metric_files_as_empty
    from kvserve.vllm import patches

    read_new_metric_files_as_empty()
    patches.apply()
