"""The Grafana dashboards as a Kubernetes ConfigMap (deploy/kubernetes/grafana-dashboards.yaml), written from
deploy/grafana/dashboards/ so the cluster's dashboards are compose's: labelled `grafana_dashboard: "1"`, which
Grafana's dashboard sidecar (the Grafana Helm chart's) loads.

    python -m kvserve.tools.kubernetes [--check]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[2]
DASHBOARDS = REPOSITORY / "deploy" / "grafana" / "dashboards"
OUT = REPOSITORY / "deploy" / "kubernetes" / "grafana-dashboards.yaml"


def dashboards_configmap(folder: Path = DASHBOARDS) -> str:
    """The ConfigMap's YAML: one key per dashboard file, its JSON as a literal block."""
    lines = [
        "# Written by `python -m kvserve.tools.kubernetes` from deploy/grafana/dashboards/: edit those, not this.",
        "apiVersion: v1",
        "kind: ConfigMap",
        "metadata:",
        "  name: kvserve-grafana-dashboards",
        '  labels: {grafana_dashboard: "1"}',
        "data:",
    ]
    for path in sorted(folder.glob("*.json")):
        text = json.dumps(json.loads(path.read_text()), indent=1, sort_keys=True)
        lines.append(f"  {path.name}: |")
        lines += [f"    {line}" for line in text.splitlines()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kvserve.tools.kubernetes", description=__doc__)
    parser.add_argument("--check", action="store_true", help="exit 1 if the committed file is not a fresh generation")
    args = parser.parse_args(argv)
    text = dashboards_configmap()
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            sys.exit(f"{OUT} is stale: run python -m kvserve.tools.kubernetes")
        return
    OUT.write_text(text)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
