"""DuoAttention's head roles ("DuoAttention: Efficient Long-Context LLM Inference with Retrieval and Streaming
Heads", Xiao et al. 2024, arXiv:2410.10819): training the per-KV-head gates (`train.py`) on synthetic retrieval data
(`data.py`), and the roles file the serving policy reads (`roles.py`)."""
