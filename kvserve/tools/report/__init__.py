"""The benchmarks page (docs/benchmarks.md), rebuilt from the committed result files by `kvserve report`.

Each section answers one question a user asks (how much quality at 8x, how much faster at the same memory, what a
policy costs, the kernels on a GPU, reliability) from the newest data only, and every table says which file it came
from, the machine, the date and the command that wrote it. Older numbers stay in git history.
"""
