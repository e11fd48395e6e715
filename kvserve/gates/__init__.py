"""Attention-Gate (seed 000): trained per-layer gates that flag, per token and KV head, which K/V entries to keep.

`module.py` is the gate, `model.py` a plain PyTorch Llama forward with gates (training and the offline reference),
`train.py` the training recipe, `registry.py` which gate file serves which model.
"""
