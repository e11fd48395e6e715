"""DuoAttention's head roles ("DuoAttention: Efficient Long-Context LLM Inference with Retrieval and Streaming
Heads", Xiao et al. 2024, arXiv:2410.10819): the roles file the serving policy reads (`roles.py`); they are trained by
`kvserve/tools/training/roles.py`."""
