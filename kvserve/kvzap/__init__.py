"""KVzap's trained surrogates ("KVzap: Fast, Adaptive, and Faithful KV Cache Pruning", arXiv:2601.07891): the model
that predicts each entry's KVzip+ score from what the layer's attention sees of its token (`surrogate.py`), and which
file serves which model (`registry.py`)."""
