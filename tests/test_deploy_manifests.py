"""The deployment files validate against their schemas: every Kubernetes manifest in deploy/kubernetes/ against the
Kubernetes API's (kubernetes-validate, strict: an unknown field fails), the compose files against the compose
specification's (check-jsonschema's vendored copy); and they agree with the server: the router discovers the pods
kvserve's Deployment labels, on the port its container serves, the probes ask vLLM's /health, and the dashboards'
ConfigMap is a fresh generation of deploy/grafana/dashboards/. Validated only: no cluster runs here."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from kvserve.tools import kubernetes

DEPLOY = Path(__file__).parents[1] / "deploy"
MANIFESTS = sorted(path for path in (DEPLOY / "kubernetes").glob("*.yaml") if path.name != "kustomization.yaml")
COMPOSE = [DEPLOY / "compose.yaml", DEPLOY / "scale-out" / "compose.yaml"]


def resources(path: Path) -> list[dict]:
    return [document for document in yaml.safe_load_all(path.read_text()) if document]


def by_kind(kind: str, name: str) -> dict:
    (found,) = [r for path in MANIFESTS for r in resources(path) if (r["kind"], r["metadata"]["name"]) == (kind, name)]
    return found


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda path: path.name)
def test_each_manifest_validates_strictly_against_the_kubernetes_schema(path):
    for resource in resources(path):
        kubernetes_validate.validate(resource, kubernetes_validate.latest_version(), strict=True)


def test_the_validator_fails_an_unknown_field():
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "x"}, "spec": {"selectr": {"a": "b"}}}
    with pytest.raises(kubernetes_validate.ValidationError, match="selectr"):
        kubernetes_validate.validate(service, kubernetes_validate.latest_version(), strict=True)


def test_the_kustomization_lists_every_manifest():
    listed = yaml.safe_load((DEPLOY / "kubernetes" / "kustomization.yaml").read_text())["resources"]
    assert sorted(listed) == [path.name for path in MANIFESTS]


def test_the_router_discovers_kvserves_pods_on_the_port_they_serve():
    server = by_kind("Deployment", "kvserve")["spec"]["template"]
    (container,) = server["spec"]["containers"]
    port = {p["name"]: p["containerPort"] for p in container["ports"]}["http"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}
    router_args = by_kind("Deployment", "vllm-router")["spec"]["template"]["spec"]["containers"][0]["args"]
    selector = router_args[router_args.index("--selector") + 1]
    key, value = selector.split("=")
    assert server["metadata"]["labels"][key] == value
    assert f"--service-discovery-port={port}" in router_args and "--policy=consistent_hash" in router_args
    budget = by_kind("PodDisruptionBudget", "kvserve")["spec"]
    assert budget["selector"]["matchLabels"] == server["metadata"]["labels"]


def test_the_dashboards_configmap_is_a_fresh_generation():
    committed = (DEPLOY / "kubernetes" / "grafana-dashboards.yaml").read_text()
    assert committed == kubernetes.dashboards_configmap(), "run: python -m kvserve.tools.kubernetes"
    data = yaml.safe_load(committed)["data"]
    assert sorted(data) == sorted(path.name for path in (DEPLOY / "grafana" / "dashboards").glob("*.json"))


def check_compose(path: Path) -> subprocess.CompletedProcess:
    check = [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec", str(path)]
    return subprocess.run(check, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("path", COMPOSE, ids=lambda path: str(path.relative_to(DEPLOY)))
def test_each_compose_file_validates_against_the_compose_specification(path):
    done = check_compose(path)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_compose_check_fails_a_misspelt_key(tmp_path):
    bad = tmp_path / "compose.yaml"
    bad.write_text("services:\n  kvserve:\n    image: kvserve:cpu\n    portz: ['8000:8000']\n")
    assert check_compose(bad).returncode != 0
