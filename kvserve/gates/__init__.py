"""Attention-Gate ("In-context KV-Cache Eviction for LLMs via Attention-Gate", Zeng et al. 2024, arXiv:2410.12876):
trained per-layer gates that flag, per token and KV head, which K/V entries to keep.

`module.py` is the gate, `gateset.py` one model's gates, `shape.py` the model shape they are built for, `registry.py`
which gate file serves which model. Training (and the plain PyTorch Llama it uses) is `kvserve/tools/training/`.
"""
