"""docker-compose.yml parses with a compose-spec parser and wires every role to NATS."""

from __future__ import annotations

import tomllib

from compose_spec import PyCompose

from shared.messages.heartbeat import ROLES
from tests.procs import REPO


def load() -> PyCompose:
    compose = PyCompose.from_yaml((REPO / "docker-compose.yml").read_text())
    compose.validate()
    return compose


def test_every_role_runs_from_the_repo_image() -> None:
    services = load().services
    for role in ROLES:
        svc = services[role]
        assert svc.build == "."
        assert svc.command == ["python", "-m", f"services.{role}"]
        urls = svc.environment["KVMESH_NATS_URL"].split(",")
        assert urls == [f"nats://nats-{i}:4222" for i in range(3)]  # every node of the cluster
        assert svc.environment["KVMESH_JETSTREAM_REPLICAS"] == "3"
        assert {"nats-0", "nats-1", "nats-2"} <= set(svc.depends_on)
    assert (REPO / "Dockerfile").is_file()


def test_nats_is_a_three_node_jetstream_cluster_and_jaeger_takes_otlp() -> None:
    services = load().services
    for i in range(3):
        node = services[f"nats-{i}"]
        assert node.image.startswith("nats:") and "-js" in node.command
        cmd = node.command
        flags = {a: cmd[k + 1] for k, a in enumerate(cmd[:-1]) if a.startswith("--")}
        assert flags["--cluster_name"] == "kvmesh" and flags["--server_name"] == f"nats-{i}"
        routes = flags["--routes"].split(",")
        assert routes == [f"nats://nats-{j}:6222" for j in range(3) if j != i]
    assert services["jaeger"].environment["COLLECTOR_OTLP_ENABLED"] == "true"
    assert "4317:4317" in services["jaeger"].ports


def test_nats_runs_with_the_identities_kvmesh_init_writes() -> None:
    """NATS starts after `kvmesh init` wrote its configuration (the roles' identities and
    permissions) into the state dir every service mounts, and reads it from there."""
    services = load().services
    init = services["init"]
    assert init.command == ["python", "-m", "kvmesh", "init"]
    state = init.environment["KVMESH_STATE_DIR"]
    for i in range(3):
        nats = services[f"nats-{i}"]
        assert nats.depends_on["init"].condition == "service_completed_successfully"
        assert nats.command[nats.command.index("-c") + 1] == f"{state}/nats/server.conf"
        assert any(str(v).startswith(f"kvstore:{state}") for v in nats.volumes)
    for role in ROLES:
        assert services[role].environment["KVMESH_STATE_DIR"] == state
        assert f"kvstore:{state}" in [str(v) for v in services[role].volumes]


def test_router_publishes_the_api_port() -> None:
    router = load().services["router"]
    assert router.environment["KVMESH_ROUTER_HTTP_HOST"] == "0.0.0.0"
    assert "8000:8000" in router.ports


def test_what_the_stack_mounts_and_copies_is_there() -> None:
    """Files and folders mounted from the repo exist (NATS's config moved with the kvmesh
    command), and the image copies every package the project installs."""
    for svc in load().services.values():
        for volume in svc.volumes or []:
            source = str(volume).split(":")[0]
            if source.startswith("./"):
                assert (REPO / source).exists(), f"mounted {source} is missing"
    dockerfile = (REPO / "Dockerfile").read_text()
    packages = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    for pattern in packages["packages"]["find"]["include"]:
        name = pattern.rstrip("*")
        assert f"COPY {name} ./{name}" in dockerfile, f"the image lacks {name}/"


def test_prometheus_scrapes_every_role_and_grafana_is_provisioned() -> None:
    import yaml

    services = load().services
    scrape = yaml.safe_load((REPO / "deploy" / "prometheus.yml").read_text())
    targets = set()
    for job in scrape["scrape_configs"]:
        for static in job.get("static_configs", []):
            targets |= {t.split(":")[0] for t in static["targets"]}
        for dns in job.get("dns_sd_configs", []):
            targets |= set(dns["names"])
            port = str(dns["port"])
            for name in dns["names"]:  # each answers on the port scraped
                assert services[name].environment[f"KVMESH_{name.upper()}_HTTP_PORT"] == port
    assert set(ROLES) <= targets
    prometheus, grafana = services["prometheus"], services["grafana"]
    assert any("deploy/prometheus.yml" in v for v in prometheus.volumes)
    assert any("deploy/grafana/dashboards" in v for v in grafana.volumes)
    provider = yaml.safe_load(
        (REPO / "deploy/grafana/provisioning/dashboards/kvmesh.yml").read_text()
    )
    assert provider["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
