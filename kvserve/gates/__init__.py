"""Attention-Gate ("In-context KV-Cache Eviction for LLMs via Attention-Gate", Zeng et al. 2024, arXiv:2410.12876):
trained per-layer gates that flag, per token and KV head, which K/V entries to keep.

`module.py` is the gate, `model.py` a plain PyTorch Llama forward with gates (training and the offline reference),
`train.py` the training recipe, `registry.py` which gate file serves which model.
"""
