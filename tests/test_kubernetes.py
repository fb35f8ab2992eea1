"""The Kubernetes manifests (deploy/kustomization.yaml, the base; deploy/kubernetes/overlays/*),
checked offline: rendered as Kustomize renders them (``render``: the features they use, since
kustomize itself does not install here), every object valid against the Kubernetes schemas
(``kubernetes-validate``, strict: no field the API does not have), every KVMESH_* variable a
setting of the service it is given to and accepted by it, every port and probe one the service
serves, secrets only in Secrets, the grace period longer than the drain, only the routers
facing clients."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from services.cachemeta.settings import CachemetaSettings
from services.decode.settings import DecodeSettings
from services.encoder.settings import EncoderSettings
from services.prefill.settings import PrefillSettings
from services.router.settings import RouterSettings
from shared.settings import CommonSettings, env_name, load_settings

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
OVERLAYS = sorted(
    p.parent for p in (DEPLOY / "kubernetes" / "overlays").glob("*/kustomization.yaml")
)
KUBERNETES = "1.31.0"  # the oldest release the manifests are checked against
ROLES = {
    "router": RouterSettings,
    "cachemeta": CachemetaSettings,
    "prefill": PrefillSettings,
    "decode": DecodeSettings,
    "encoder": EncoderSettings,
}
FIELD_REFS = {"status.podIP": "10.1.2.3", "metadata.name": "kvmesh-decode-7f9c-x2k4q"}


# -- rendering ------------------------------------------------------------------------------


def render(root: Path) -> list[dict]:
    """The objects ``root``'s kustomization makes: its resources (files, or directories with a
    kustomization of their own), its ConfigMap generators (no name hash: the manifests ask for
    none), its strategic-merge patches, images, labels."""
    k = yaml.safe_load((root / "kustomization.yaml").read_text())
    unknown = set(k) - {
        "apiVersion", "kind", "resources", "patches", "images", "labels",
        "generatorOptions", "configMapGenerator",
    }  # fmt: skip
    assert not unknown, f"{root}: this renderer does not know {unknown}"
    objects: list[dict] = []
    for resource in k.get("resources", []):
        path = (root / resource).resolve()
        if path.is_dir():
            objects += render(path)
        else:
            objects += [d for d in yaml.safe_load_all(path.read_text()) if d]
    if k.get("configMapGenerator"):
        assert k["generatorOptions"]["disableNameSuffixHash"], "a name hash is not rendered"
    for gen in k.get("configMapGenerator", []):
        data = {}
        for entry in gen["files"]:
            key, _, path = entry.rpartition("=")
            data[key or Path(path).name] = (root / path).read_text()
        labels = gen.get("options", {}).get("labels", {})
        meta = {"name": gen["name"], **({"labels": labels} if labels else {})}
        objects.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": data})
    for patch in k.get("patches", []):
        for doc in yaml.safe_load_all((root / patch["path"]).read_text()):
            (target,) = [o for o in objects if same_object(o, doc)]
            merge(target, doc)
    for image in k.get("images", []):
        for spec in pod_specs(objects):
            for c in spec.get("containers", []) + spec.get("initContainers", []):
                if c["image"] == image["name"]:
                    c["image"] = f"{image.get('newName', image['name'])}:{image['newTag']}"
    for label in k.get("labels", []):
        for o in objects:
            o["metadata"].setdefault("labels", {}).update(label["pairs"])
    return objects


def same_object(a: dict, b: dict) -> bool:
    return (a["kind"], a["metadata"]["name"]) == (b["kind"], b["metadata"]["name"])


def merge(into: dict, patch: dict) -> None:
    """A strategic merge as Kustomize does it for these objects: maps merge, lists of named
    entries (containers, env, ports, volumes) merge by name, other lists are replaced."""
    for key, value in patch.items():
        old = into.get(key)
        if isinstance(value, dict) and isinstance(old, dict):
            merge(old, value)
        elif isinstance(value, list) and isinstance(old, list) and all("name" in v for v in value):
            by_name = {o.get("name"): o for o in old}
            for v in value:
                if v["name"] in by_name:
                    merge(by_name[v["name"]], v)
                else:
                    old.append(copy.deepcopy(v))
        else:
            into[key] = copy.deepcopy(value)


def pod_specs(objects: list[dict]) -> list[dict]:
    return [o["spec"]["template"]["spec"] for o in objects if "template" in o.get("spec", {})]


def kvmesh_containers(objects: list[dict]) -> list[tuple[str, dict, dict]]:
    """(role, container, pod spec) of each kvmesh service's container."""
    out = []
    for spec in pod_specs(objects):
        for c in spec["containers"]:
            command = c.get("command", [])
            if command[:2] == ["python", "-m"] and command[2].startswith("services."):
                out.append((command[2].removeprefix("services."), c, spec))
    return out


def env_of(container: dict) -> dict[str, str]:
    """The container's environment as the service sees it (field references filled in)."""
    env = {}
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
        else:
            env[e["name"]] = FIELD_REFS[e["valueFrom"]["fieldRef"]["fieldPath"]]
    return env


@pytest.fixture(scope="module", params=[DEPLOY, *OVERLAYS], ids=lambda p: p.name)
def rendered(request) -> list[dict]:
    return render(request.param)


# -- the checks -----------------------------------------------------------------------------


def test_every_object_is_valid_against_the_kubernetes_schemas(rendered: list[dict]) -> None:
    kinds = {o["kind"] for o in rendered}
    assert {"StatefulSet", "Deployment", "Job", "Service", "NetworkPolicy"} <= kinds
    assert {"PersistentVolumeClaim", "ConfigMap", "Role", "PodDisruptionBudget"} <= kinds
    for o in rendered:
        kubernetes_validate.validate(o, KUBERNETES, strict=True)
    assert {role for role, _, _ in kvmesh_containers(rendered)} == set(ROLES)


def test_every_kvmesh_variable_is_a_setting_its_service_takes(
    rendered: list[dict], monkeypatch: pytest.MonkeyPatch
) -> None:
    common = {env_name(CommonSettings, f) for f in CommonSettings.model_fields}
    for role, container, _ in kvmesh_containers(rendered):
        cls = ROLES[role]
        own = {env_name(cls, f) for f in cls.model_fields}
        env = env_of(container)
        for name in env:
            assert not name.startswith("KVMESH_") or name in common | own, f"{role}: {name}"
        with monkeypatch.context() as m:  # the values are accepted, not only the names
            for name in [n for n in __import__("os").environ if n.startswith("KVMESH_")]:
                m.delenv(name)
            for name, value in env.items():
                m.setenv(name, value)
            load_settings(cls)
            load_settings(CommonSettings)


def test_ports_and_probes_are_those_the_services_serve(rendered: list[dict]) -> None:
    for role, container, spec in kvmesh_containers(rendered):
        env = env_of(container)
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        prefix = f"KVMESH_{role.upper()}_"
        assert ports["http"] == int(env[f"{prefix}HTTP_PORT"]) and env[f"{prefix}HTTP_HOST"]
        assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
        assert container["livenessProbe"]["tcpSocket"]["port"] == "http"
        if role == "router":
            assert ports["grpc"] == int(env["KVMESH_ROUTER_GRPC_PORT"])
        if role == "decode":
            assert ports["kv"] == int(env["KVMESH_DECODE_KV_PORT"])
        if "KVMESH_PREFILL_PD_TRANSFER" in env:
            assert ports["bootstrap"] == int(env["KVMESH_PREFILL_BOOTSTRAP_PORT"])
        assert env[f"{prefix}ADVERTISE_HOST"] == FIELD_REFS["status.podIP"]
        # SIGTERM drains the service; the pod is not killed before it is done.
        assert spec["terminationGracePeriodSeconds"] > float(env["KVMESH_DRAIN_TIMEOUT_S"])
    by_name = {(o["kind"], o["metadata"]["name"]): o for o in rendered}
    router = by_name[("Service", "kvmesh-router")]["spec"]["ports"]
    assert {(p["port"], p["targetPort"]) for p in router} == {(8000, "http"), (50051, "grpc")}
    nats = by_name[("StatefulSet", "nats")]["spec"]
    assert nats["replicas"] == 3 and nats["volumeClaimTemplates"]
    urls = {env_of(c)["KVMESH_NATS_URL"] for _, c, _ in kvmesh_containers(rendered)}
    assert urls == {",".join(f"nats://nats-{i}.nats:4222" for i in range(3))}


def test_secrets_are_only_in_secrets(rendered: list[dict]) -> None:
    for o in rendered:
        if o["kind"] != "ConfigMap":
            continue
        for key, text in o["data"].items():
            assert not key.endswith((".key", ".conf")) and "PRIVATE KEY" not in text, key
    for role, container, spec in kvmesh_containers(rendered):
        volumes = {v["name"]: v for v in spec["volumes"]}
        (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/etc/kvmesh/secrets"]
        assert (
            volumes[mount["name"]]["secret"]["secretName"] == "kvmesh-secrets" and mount["readOnly"]
        )
        assert env_of(container)["KVMESH_SECRETS_DIR"] == "/etc/kvmesh/secrets"
        plain = {e["name"] for e in container["env"] if "value" in e}
        assert not plain & {"KVMESH_NATS_PASSWORD", "KVMESH_NATS_TOKEN"}, role
    nats = next(o for o in rendered if o["kind"] == "StatefulSet")["spec"]["template"]["spec"]
    assert nats["volumes"][0]["secret"]["secretName"] == "kvmesh-nats"


def test_the_storage_tier_is_one_shared_volume_and_only_routers_face_clients(
    rendered: list[dict],
) -> None:
    (claim,) = [o for o in rendered if o["kind"] == "PersistentVolumeClaim"]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    for role, container, spec in kvmesh_containers(rendered):
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        claims = {v["name"] for v in spec["volumes"] if "persistentVolumeClaim" in v}
        if role in ("cachemeta", "prefill", "decode"):
            (name,) = claims
            assert mounts[name] == env_of(container)["KVMESH_KV_STORE_DIR"]
    policies = [o for o in rendered if o["kind"] == "NetworkPolicy"]
    for policy in policies:
        spec = policy["spec"]
        selects_router = "router" in spec["podSelector"].get("matchLabels", {}).values()
        for rule in spec["ingress"]:
            ports = {p["port"] for p in rule.get("ports", ())}
            if selects_router and ports <= {8000, 50051}:
                assert "from" not in rule  # clients, from anywhere
            else:  # kvmesh's own pods only (and Prometheus): a router's token links too
                assert rule["from"] and all("podSelector" in f for f in rule["from"])
    (router,) = [c for role, c, _ in kvmesh_containers(rendered) if role == "router"]
    token_port = int(env_of(router)["KVMESH_ROUTER_TOKEN_PORT"])
    assert token_port in {p["containerPort"] for p in router["ports"]}
    assert any(  # the workers reach it, and only they
        rule.get("from") and {p["port"] for p in rule["ports"]} == {token_port}
        for policy in policies
        if "router" in policy["spec"]["podSelector"].get("matchLabels", {}).values()
        for rule in policy["spec"]["ingress"]
    )
    (internal,) = [p for p in policies if "matchExpressions" in p["spec"]["podSelector"]]
    (excluded,) = internal["spec"]["podSelector"]["matchExpressions"]
    assert excluded["operator"] == "NotIn" and excluded["values"] == ["router"]


def test_the_gpu_overlay_runs_sglang_workers_on_gpus() -> None:
    objects = render(DEPLOY / "kubernetes" / "overlays" / "gpu")
    for role, container, spec in kvmesh_containers(objects):
        if role not in ("prefill", "decode"):
            assert "nvidia.com/gpu" not in container["resources"].get("limits", {})
            continue
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert env_of(container)[f"KVMESH_{role.upper()}_ENGINE"] == "sglang"
        assert spec["tolerations"][0]["key"] == "nvidia.com/gpu"
        assert len(container["env"]) == len({e["name"] for e in container["env"]})


def test_the_autoscale_overlay_scales_each_pool_to_the_routers_plan() -> None:
    """An HPA per worker pool on the metric the routers serve (kvmesh_recommended_workers,
    by role), read as the pool's size; the adapter's rule serves that metric."""
    objects = render(DEPLOY / "kubernetes" / "overlays" / "autoscale")
    deployments = {o["metadata"]["name"] for o in objects if o["kind"] == "Deployment"}
    hpas = [o for o in objects if o["kind"] == "HorizontalPodAutoscaler"]
    assert sorted(h["spec"]["scaleTargetRef"]["name"] for h in hpas) == [
        "kvmesh-decode",
        "kvmesh-prefill",
    ]
    for hpa in hpas:
        assert hpa["spec"]["scaleTargetRef"]["name"] in deployments
        (metric,) = hpa["spec"]["metrics"]
        role = hpa["spec"]["scaleTargetRef"]["name"].removeprefix("kvmesh-")
        assert metric["external"]["metric"]["name"] == RECOMMENDED
        assert metric["external"]["metric"]["selector"]["matchLabels"] == {"role": role}
        assert metric["external"]["target"] == {"type": "AverageValue", "averageValue": "1"}
        down = hpa["spec"]["behavior"]["scaleDown"]
        assert (
            down["stabilizationWindowSeconds"]
            > hpa["spec"]["behavior"]["scaleUp"]["stabilizationWindowSeconds"]
        )
    (rules,) = [o for o in objects if o["metadata"]["name"] == "kvmesh-prometheus-adapter"]
    # (the metric the routers serve: tests/test_observability.py reads it on /metrics)
    assert f"{RECOMMENDED}{{" in rules["data"]["rules.yaml"]


RECOMMENDED = "kvmesh_recommended_workers"


def test_the_upstream_overlay_puts_the_routers_in_front_of_vllm_servers() -> None:
    """The routers' upstreams are every address of a headless Service over the vLLM pods, at
    the port the servers serve; the servers publish their KV events on the ports the Service
    names and run with the flags the router reads; kvmesh's own worker pools are empty."""
    objects = render(DEPLOY / "kubernetes" / "overlays" / "upstream")
    by = {(o["kind"], o["metadata"]["name"]): o for o in objects}
    router = by["Deployment", "kvmesh-router"]["spec"]["template"]["spec"]["containers"][0]
    (entry,) = json.loads(env_of(router)["KVMESH_ROUTER_UPSTREAMS"])
    RouterSettings(upstreams=[entry])  # (the router takes it)
    model, url = entry.split("=", 1)
    host, port = url.removeprefix("dns://").split(":")
    service = by["Service", host.split(".")[0]]
    assert service["spec"]["clusterIP"] == "None"  # headless: one record per ready pod
    vllm = by["Deployment", service["metadata"]["name"]]
    pod = vllm["spec"]["template"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    (server,) = pod["spec"]["containers"]
    args = dict(a.removeprefix("--").split("=", 1) for a in server["args"] if "=" in a)
    assert args["port"] == port and args["served-model-name"] == model
    assert {"--enable-prompt-tokens-details", "--enable-scale-out"} <= set(server["args"])
    events = json.loads(args["kv-events-config"])
    ports = {p["name"]: p["port"] for p in service["spec"]["ports"]}
    assert events["endpoint"] == f"tcp://*:{ports['kv-events']}"
    assert events["replay_endpoint"] == f"tcp://*:{ports['kv-replay']}"
    for role in ("prefill", "decode", "encoder"):
        assert by["Deployment", f"kvmesh-{role}"]["spec"]["replicas"] == 0
