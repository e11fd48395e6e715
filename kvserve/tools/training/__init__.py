"""Training of what some policies load while serving: Attention-Gate's gates (`gates`) and DuoAttention's head roles
(`roles`), on Python's own documentation (`corpus`, `retrieval`), with a plain PyTorch Llama (`llama`)."""
