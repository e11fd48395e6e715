"""`kvserve report [DATA] -o PAGE`: rebuild the benchmarks page and its plots from the committed result files.

kvserve report docs/eval -o docs/benchmarks.md           # write the page and docs/benchmarks/*.png
kvserve report docs/eval -o docs/benchmarks.md --check   # exit 1 if the committed page differs from the data
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from kvserve.tools.report.page import build


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="kvserve report", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("data", nargs="?", default="docs/eval", type=Path, help="folder of result files")
    parser.add_argument("-o", "--out", default=Path("docs/benchmarks.md"), type=Path, help="the page to write")
    parser.add_argument("--check", action="store_true", help="compare with the existing page instead of writing")
    args = parser.parse_args(argv)
    root = Path.cwd()
    if args.check:
        with tempfile.TemporaryDirectory() as scratch:  # plots go to a scratch folder: the markdown is compared
            text = build(args.data, args.out, root=root, plots=Path(scratch))
        if not args.out.exists() or args.out.read_text() != text:
            print(
                f"kvserve report: {args.out} differs from what {args.data} gives; run without --check", file=sys.stderr
            )
            sys.exit(1)
        print(f"kvserve report: {args.out} matches {args.data}")
        return
    args.out.write_text(build(args.data, args.out, root=root))
    print(f"kvserve report: wrote {args.out} and its plots in {args.out.parent / args.out.stem}")


if __name__ == "__main__":
    main()
