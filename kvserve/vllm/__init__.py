"""The vLLM boundary: the only package of kvserve's serving code that imports vLLM or touches its objects."""
