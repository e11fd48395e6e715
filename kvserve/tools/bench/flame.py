"""`python -m kvserve.tools.bench.flame PROFILE.txt [--root FRAME]`: a text summary of a py-spy raw (collapsed-stack)
profile: the frames with the largest inclusive and self shares of the samples under `--root` (a function name as
py-spy writes it, e.g. `LLMEngine.step` or `after_attention`)."""

from __future__ import annotations

import argparse
import re
from collections import Counter


def summarize(lines: list[str], root: str | None, top: int = 20) -> str:
    inclusive, own = Counter(), Counter()
    total = 0
    for line in lines:
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack:
            continue
        frames = [re.sub(r":\d+\)$", ")", frame) for frame in stack.split(";")]
        if root is not None:
            starts = [i for i, frame in enumerate(frames) if frame.startswith(root + " ")]
            if not starts:
                continue
            frames = frames[starts[0] :]
        samples = int(count)
        total += samples
        for frame in set(frames):
            inclusive[frame] += samples
        own[frames[-1]] += samples
    out = [f"{total} samples under {root or 'all'}", "", "| inclusive | self | frame |", "|---|---|---|"]
    for frame, samples in inclusive.most_common(top):
        out.append(f"| {100 * samples / total:.1f}% | {100 * own[frame] / total:.1f}% | `{frame}` |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("profile")
    parser.add_argument("--root", default=None)
    parser.add_argument("--top", type=int, default=20)
    args = parser.parse_args(argv)
    with open(args.profile) as f:
        print(summarize(f.readlines(), args.root, args.top))


if __name__ == "__main__":
    main()
