"""Tools users do not import while serving: benchmarks against vanilla vLLM (`bench`), the quality evaluation
(`eval`), the benchmarks page (`report`) and the training of Attention-Gate gates and DuoAttention roles
(`training`). `kvserve bench|eval|report` run them."""
