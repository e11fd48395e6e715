"""`kvserve report [DATA] -o PAGE`: rebuild the benchmarks page and its plots from the committed result files.

kvserve report docs/eval -o docs/benchmarks.md           # write the page, its plots and the README's results
kvserve report docs/eval -o docs/benchmarks.md --check   # exit 1 if the committed page or README differs

The README's results (one small table per model) are the block between its markers (kvserve/tools/report/readme.py);
the guide's compatibility matrix likewise (kvserve/tools/report/compatibility.py).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from kvserve.tools.report import compatibility, readme
from kvserve.tools.report.page import build
from kvserve.tools.report.sources import DataDir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="kvserve report", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("data", nargs="?", default="docs/eval", type=Path, help="folder of result files")
    parser.add_argument("-o", "--out", default=Path("docs/benchmarks.md"), type=Path, help="the page to write")
    parser.add_argument("--readme", default=Path("README.md"), type=Path, help="the README whose results to rebuild")
    parser.add_argument(
        "--guide", default=compatibility.GUIDE, type=Path, help="the guide page whose compatibility matrix to rebuild"
    )
    parser.add_argument("--check", action="store_true", help="compare with the existing page instead of writing")
    args = parser.parse_args(argv)
    root = Path.cwd()
    blocks = {
        args.readme: readme.update(args.readme, DataDir(args.data, root)),
        args.guide: compatibility.update(args.guide, DataDir(args.data, root)),
    }
    if args.check:
        for path, text in blocks.items():
            if path.read_text() != text:
                stale = f"kvserve report: {path}'s generated block differs from {args.data}; run without --check"
                print(stale, file=sys.stderr)
                sys.exit(1)
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
    for path, text in blocks.items():
        path.write_text(text)
    print(
        f"kvserve report: wrote {args.out}, its plots in {args.out.parent / args.out.stem}, {args.readme}'s results, "
        f"{args.guide}'s compatibility matrix"
    )


if __name__ == "__main__":
    main()
