"""Each compose file's health checks probe what their service serves: the port it listens on (from its command, or
the default of the program it runs) and a health route it has (kvserve's from vLLM's app as the code builds it;
vLLM router's, Prometheus's and Grafana's from their documentation). And deploy/scale-out's router fronts every
replica, which Prometheus scrapes."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).parent.parent
COMPOSE_FILES = sorted((REPO / "deploy").rglob("compose*.yaml"))
ENTRYPOINT_SCRIPT = REPO / "docker" / "entrypoint.sh"
PROBE = re.compile(r"https?://(?P<host>[^/:'\"\s]+):(?P<port>\d+)(?P<path>/[^'\"\s]*)")
# https://prometheus.io/docs/prometheus/latest/management_api/ and
# https://grafana.com/docs/grafana/latest/developers/http_api/other/#health-api; their default ports
PROMETHEUS = {"port": 9090, "flag": "--web.listen-address", "paths": {"/-/healthy", "/-/ready"}}
GRAFANA = {"port": 3000, "env": "GF_SERVER_HTTP_PORT", "paths": {"/api/health"}}
# vllm-router's own routes (answered by the router itself, 200 with every worker down: tried with vllm-router 0.1.17);
# any other path is forwarded to a worker. Its port's default is 30000 (`vllm-router --help`).
VLLM_ROUTER = {"port": 30000, "flag": "--port", "paths": {"/health", "/liveness", "/readiness"}}


def services() -> list[tuple[str, str, dict]]:
    return [
        (str(path.relative_to(REPO)), name, service)
        for path in COMPOSE_FILES
        for name, service in yaml.safe_load(path.read_text())["services"].items()
    ]


def as_list(value) -> list[str]:
    if value is None:
        return []
    return shlex.split(value) if isinstance(value, str) else [str(part) for part in value]


def flag_value(argv: list[str], flag: str) -> str | None:
    for index, arg in enumerate(argv):
        if arg == flag and index + 1 < len(argv):
            return argv[index + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def entrypoint_default_port() -> int:
    """The port docker/entrypoint.sh gives `kvserve serve` when the command names none."""
    return int(re.search(r'port_args="--port (\d+)"', ENTRYPOINT_SCRIPT.read_text())[1])


def exact_paths(routes) -> set[str]:
    """The routes' own paths, not a catch-all or a parametrised one (a forwarding `/{path}` serves no health)."""
    return {route.path for route in routes if "{" not in getattr(route, "path", "{")}


@pytest.fixture(scope="module")
def vllm_server_paths() -> set[str]:
    """The routes vLLM's API server registers, built as `kvserve serve` builds it (no engine)."""
    from vllm.entrypoints.launchers.app import build_app

    from kvserve.server.launch import parse_serve_args

    return exact_paths(build_app(parse_serve_args(["--model", "unused"]), ("generate",)).routes)


def served(service: dict, vllm_paths: set[str]) -> tuple[int, set[str]]:
    """(the port the service's program listens on inside its container, its health routes)."""
    image = str(service.get("image", ""))
    entrypoint, command = as_list(service.get("entrypoint")), as_list(service.get("command"))
    if image.startswith("kvserve:") or "build" in service:
        if entrypoint[:1] == ["vllm-router"]:
            port = flag_value(entrypoint + command, VLLM_ROUTER["flag"])
            return int(port) if port else VLLM_ROUTER["port"], VLLM_ROUTER["paths"]
        assert not entrypoint, f"an entrypoint this test does not know: {entrypoint}"
        port = flag_value(command, "--port")
        return int(port) if port else entrypoint_default_port(), vllm_paths
    if image.startswith("prom/prometheus"):
        address = flag_value(command, PROMETHEUS["flag"])
        return (int(address.rsplit(":", 1)[1]) if address else PROMETHEUS["port"]), PROMETHEUS["paths"]
    if image.startswith("grafana/grafana"):
        port = (service.get("environment") or {}).get(GRAFANA["env"])
        return (int(port) if port else GRAFANA["port"]), GRAFANA["paths"]
    raise AssertionError(f"a service this test does not know: {image or service}")


def probe_problems(service: dict, vllm_paths: set[str]) -> list[str]:
    """What is wrong with a service's health check (empty: it probes a health route on the port served)."""
    check = service.get("healthcheck")
    if not check or check.get("disable"):
        return ["no health check of its own (kvserve's image would probe :8000/health, whatever the service runs)"]
    found = PROBE.findall(" ".join(as_list(check.get("test"))))
    if len(found) != 1:
        return [f"the check should probe one URL, it probes {len(found)}"]
    host, port, path = found[0]
    listens, paths = served(service, vllm_paths)
    problems = []
    if host not in ("127.0.0.1", "localhost"):
        problems.append(f"probes {host}, not the container itself")
    if int(port) != listens:
        problems.append(f"probes port {port}, the service listens on {listens}")
    published = {str(mapping).rsplit(":", 1)[-1].split("/")[0] for mapping in service.get("ports", [])}
    if published and str(listens) not in published:
        problems.append(f"listens on {listens} but publishes {sorted(published)}")
    if path not in paths:
        problems.append(f"probes {path}, which it does not serve (its health routes: {sorted(paths)})")
    return problems


@pytest.mark.parametrize(("file", "name", "service"), services(), ids=lambda v: v if isinstance(v, str) else "")
def test_each_health_check_probes_what_its_service_serves(file, name, service, vllm_server_paths):
    assert probe_problems(service, vllm_server_paths) == []


def test_a_check_that_probes_what_the_service_does_not_serve_is_found(vllm_server_paths):
    router_service = {
        "image": "kvserve:cpu",
        "entrypoint": ["vllm-router", "--port", "8080", "--worker-urls", "http://replica-0:8000"],
        "ports": ["8080:8080"],
    }
    assert "no health check" in probe_problems(router_service, vllm_server_paths)[0]
    # the image's own probe (a replica's port), at a path only a worker would answer
    image_probe = "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/v1/models', timeout=4)"
    router_service["healthcheck"] = {"test": ["CMD", "python3", "-c", image_probe]}
    found = probe_problems(router_service, vllm_server_paths)
    assert any("port 8000" in p for p in found) and any("/v1/models, which it does not serve" in p for p in found)
    grafana = {"image": "grafana/grafana:11.2.0", "healthcheck": {"test": "wget -q --spider http://127.0.0.1:3000/"}}
    assert any("probes /," in p for p in probe_problems(grafana, vllm_server_paths))


def test_the_scale_out_manifest_routes_to_every_replica_and_scrapes_each():
    """deploy/scale-out/compose.yaml (no cluster here: parsed): vLLM's router names every replica service at the
    port it serves on, keeps sessions (consistent_hash), runs from the replicas' image; each replica has CPUs of its
    own, and Prometheus scrapes each replica and the router's metrics port."""
    folder = REPO / "deploy" / "scale-out"
    compose = yaml.safe_load((folder / "compose.yaml").read_text())["services"]
    replicas = sorted(name for name in compose if name.startswith("replica-"))
    assert len(replicas) >= 2
    command = compose["router"]["entrypoint"]
    assert command[0] == "vllm-router" and flag_value(command, "--policy") == "consistent_hash"
    workers = command[command.index("--worker-urls") + 1 :]
    workers = workers[: next((i for i, arg in enumerate(workers) if arg.startswith("--")), len(workers))]
    assert sorted(workers) == [f"http://{name}:8000" for name in replicas]
    port = flag_value(command, "--port")
    assert compose["router"]["ports"] == [f"{port}:{port}"]
    cpus = [compose[name]["cpuset"] for name in replicas]
    expanded = [set(range(int(a), int(b) + 1)) for a, b in (cpu.split("-") for cpu in cpus)]
    assert all(not (x & y) for i, x in enumerate(expanded) for y in expanded[i + 1 :])  # no CPU shared
    for name in replicas:
        assert compose[name]["image"] == compose["router"]["image"]
    jobs = {job["job_name"]: job for job in yaml.safe_load((folder / "prometheus.yml").read_text())["scrape_configs"]}
    assert sorted(jobs["kvserve"]["static_configs"][0]["targets"]) == [f"{name}:8000" for name in replicas]
    assert jobs["vllm-router"]["static_configs"][0]["targets"] == [f"router:{flag_value(command, '--prometheus-port')}"]
    assert "prometheus.yml" in compose["prometheus"]["volumes"][0]


def test_vllm_routers_flags_in_the_manifests_and_the_bench_are_its_own():
    """Every flag deploy/ and `kvserve bench sessions --replicas` give vllm-router is one its --help lists (the wheel
    the `router` extra installs)."""
    import subprocess

    from kvserve.tools.bench.replicas import ROUTER_POLICIES, Replica, router_binary, router_command

    listed = set(
        re.findall(
            r"--[a-z][a-z0-9-]*",
            subprocess.run([router_binary(), "--help"], capture_output=True, text=True, timeout=60).stdout,
        )
    )
    scale_out = yaml.safe_load((REPO / "deploy" / "scale-out" / "compose.yaml").read_text())["services"]["router"]
    kubernetes = next(
        doc
        for doc in yaml.safe_load_all((REPO / "deploy" / "kubernetes" / "router.yaml").read_text())
        if doc and doc["kind"] == "Deployment"
    )["spec"]["template"]["spec"]["containers"][0]["args"]
    bench = [arg for policy in ROUTER_POLICIES for arg in router_command("", policy, 1, [Replica("u", "e")], 32)]
    given = [arg.split("=", 1)[0] for arg in [*scale_out["entrypoint"], *kubernetes, *bench] if arg.startswith("--")]
    assert given and set(given) <= listed, sorted(set(given) - listed)
