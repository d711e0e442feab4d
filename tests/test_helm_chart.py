"""The Helm chart ``helm/argus``, with no cluster and no helm binary.

The chart is rendered by the real Helm engine (Helm v4 as a library: ``helm-python-sdk``,
imported as ``helm_python``), linted strictly, and every rendered manifest is validated against
the Kubernetes 1.30 schemas shipped in ``kubernetes-validate`` (strict: unknown fields fail).
Then the properties an operator relies on are asserted for the default values and for a
production-like values file (``tests/helm_values/production.yaml``): GPU limits and GPU nodes
for workers, gRPC health probes on every Argus pod, non-root containers with read-only root
file systems, NetworkPolicies exposing only the router, PodDisruptionBudgets, Prometheus
scraping, Grafana dashboards built from metrics the code exports, the external-Qdrant switch,
and container arguments the real ``argus`` CLI parses (every component's, the router's
included). Malformed values are rejected by ``values.schema.json`` with a message naming the
field. ``docker/Dockerfile`` cannot be built here; it is held to what the chart assumes.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from argus import defaults

pytestmark = pytest.mark.unit


ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "helm" / "argus"
VALUES_DIR = Path(__file__).resolve().parent / "helm_values"
KUBE_VERSION = "1.30.0"
RELEASE = "demo"
NAMESPACE = "serving"

# The Argus components and their pods' gRPC ports under default values.
ARGUS_COMPONENTS = ("router", "allocator", "worker", "controlnet")
WORKLOAD_KINDS = ("Deployment", "StatefulSet")

# Custom resources the Kubernetes schemas do not cover, checked field by field below instead.
CUSTOM_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor")}


Manifest = dict[str, Any]


# -- rendering ---------------------------------------------------------------------------------


def load_values(name: str) -> dict[str, Any]:
    if name == "default":
        return {}
    loaded = yaml.safe_load((VALUES_DIR / f"{name}.yaml").read_text())
    assert isinstance(loaded, dict)
    return loaded


def merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


@functools.cache
def _chart() -> helm.Chart:
    return helm.Chart.load(CHART)


def render_files(values: dict[str, Any]) -> dict[str, str]:
    return _chart().render(values=values, name=RELEASE, namespace=NAMESPACE, is_install=True)


def render(values: dict[str, Any]) -> list[Manifest]:
    docs: list[Manifest] = []
    for path, text in sorted(render_files(values).items()):
        if not path.endswith(".yaml"):
            continue
        docs.extend(d for d in yaml.safe_load_all(text) if d)
    return docs


@functools.cache
def _rendered(name: str) -> tuple[Manifest, ...]:
    return tuple(render(load_values(name)))


def rendered(name: str) -> list[Manifest]:
    return copy.deepcopy(list(_rendered(name)))


VARIANTS = ("default", "production")


@pytest.fixture(params=VARIANTS)
def variant(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


# -- helpers over manifests --------------------------------------------------------------------


def of_kind(docs: list[Manifest], kind: str) -> list[Manifest]:
    return [d for d in docs if d["kind"] == kind]


def component(doc: Manifest) -> str:
    labels = doc["metadata"].get("labels", {})
    return str(labels.get("app.kubernetes.io/component", ""))


def workloads(docs: list[Manifest]) -> dict[str, Manifest]:
    """component → its Deployment or StatefulSet."""
    out = {component(d): d for d in docs if d["kind"] in WORKLOAD_KINDS}
    assert len(out) == len([d for d in docs if d["kind"] in WORKLOAD_KINDS])
    return out


def pod_spec(workload: Manifest) -> dict[str, Any]:
    spec: dict[str, Any] = workload["spec"]["template"]["spec"]
    return spec


def main_container(workload: Manifest) -> dict[str, Any]:
    containers = pod_spec(workload)["containers"]
    assert len(containers) == 1
    container: dict[str, Any] = containers[0]
    return container


def only(docs: list[Manifest], kind: str, comp: str) -> Manifest:
    found = [d for d in of_kind(docs, kind) if component(d) == comp]
    assert len(found) == 1, f"expected one {kind} for {comp}, found {len(found)}"
    return found[0]


def ports_of(service: Manifest) -> set[str]:
    return {p["name"] for p in service["spec"]["ports"]}


def services(docs: list[Manifest], comp: str) -> dict[str, Manifest]:
    """name → Service of that component (the router has two: public and metrics)."""
    return {d["metadata"]["name"]: d for d in of_kind(docs, "Service") if component(d) == comp}


def public_router_service(docs: list[Manifest]) -> Manifest:
    (svc,) = [s for name, s in services(docs, "router").items() if not name.endswith("-metrics")]
    return svc


def arg_value(args: list[str], flag: str) -> str:
    assert flag in args, f"{flag} missing from {shlex.join(args)}"
    return args[args.index(flag) + 1]


def walk(node: Any) -> Iterator[Any]:
    yield node
    if isinstance(node, dict):
        for v in node.values():
            yield from walk(v)
    elif isinstance(node, list):
        for v in node:
            yield from walk(v)


# -- Helm: lint, render, Kubernetes schemas ----------------------------------------------------


def test_helm_is_the_v4_engine() -> None:
    assert helm.helm_sdk_version().startswith("v4.")


@pytest.mark.parametrize("name", VARIANTS)
def test_lint_strict_is_clean(name: str) -> None:
    report = helm.lint(CHART, load_values(name), strict=True, kube_version=f"v{KUBE_VERSION}")
    assert report["errors"] == []
    problems = [m for m in report["messages"] if m["severity"] >= 2]  # warnings and errors
    assert problems == []


def test_every_manifest_validates_against_kubernetes_1_30(variant: str) -> None:
    docs = rendered(variant)
    assert len(docs) > 15
    checked = 0
    for doc in docs:
        if (doc["apiVersion"], doc["kind"]) in CUSTOM_KINDS:
            continue
        where = f"{doc['kind']}/{doc['metadata']['name']}"
        try:
            kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
        except kubernetes_validate.ValidationError as err:
            path = ".".join(str(p) for p in err.path)
            pytest.fail(f"{where}: {path}: {err.message}")
        except kubernetes_validate.SchemaNotFoundError as err:
            pytest.fail(f"{where}: {err.message}")
        checked += 1
    assert checked >= len(docs) - 1


def test_the_schema_check_catches_a_bad_manifest() -> None:
    """The validation above is not vacuous: a typo'd field or a wrong type fails it."""
    worker = workloads(rendered("default"))["worker"]
    typo = copy.deepcopy(worker)
    main_container(typo)["readinessprobe"] = main_container(typo).pop("readinessProbe")
    wrong = copy.deepcopy(worker)
    main_container(wrong)["ports"][0]["containerPort"] = "grpc"
    for bad in (typo, wrong):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(bad, KUBE_VERSION, strict=True)


def test_manifests_are_namespaced_and_labelled(variant: str) -> None:
    for doc in rendered(variant):
        meta = doc["metadata"]
        assert meta["namespace"] in (NAMESPACE, "monitoring"), meta["name"]
        assert meta["labels"]["app.kubernetes.io/instance"] == RELEASE
        assert meta["labels"]["app.kubernetes.io/part-of"] == "argus"
        assert meta["name"].startswith(f"{RELEASE}-argus"), meta["name"]
        assert len(meta["name"]) <= 63


def test_notes_render() -> None:
    notes = render_files({})["argus/templates/NOTES.txt"]
    assert "demo-argus-router.serving.svc:50051" in notes
    assert "tiny seeded random models" in notes


# -- the components ---------------------------------------------------------------------------


def test_every_component_is_deployed(variant: str) -> None:
    docs = rendered(variant)
    w = workloads(docs)
    assert set(w) == {*ARGUS_COMPONENTS, "qdrant"}
    assert w["router"]["kind"] == "Deployment"
    assert w["allocator"]["kind"] == "Deployment"
    assert w["worker"]["kind"] == "StatefulSet"
    assert w["controlnet"]["kind"] == "Deployment"
    assert w["qdrant"]["kind"] == "StatefulSet"
    for name in ARGUS_COMPONENTS:
        assert main_container(w[name])["command"] == ["argus"]
        assert main_container(w[name])["args"][0] == name


def test_allocator_is_one_replica_recreated() -> None:
    for name in VARIANTS:
        allocator = workloads(rendered(name))["allocator"]
        assert allocator["spec"]["replicas"] == 1
        assert allocator["spec"]["strategy"] == {"type": "Recreate"}


def test_router_scales_by_replicas_or_hpa() -> None:
    default = rendered("default")
    assert workloads(default)["router"]["spec"]["replicas"] == 2
    assert of_kind(default, "HorizontalPodAutoscaler") == []

    prod = rendered("production")
    router = workloads(prod)["router"]
    assert "replicas" not in router["spec"]  # the HPA owns it
    (hpa,) = of_kind(prod, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": router["metadata"]["name"],
    }
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (3, 12)


def test_workers_run_on_gpu_nodes_with_gpu_limits(variant: str) -> None:
    docs = rendered(variant)
    for name in ("worker", "controlnet"):
        workload = workloads(docs)[name]
        spec = pod_spec(workload)
        limits = main_container(workload)["resources"]["limits"]
        assert limits["nvidia.com/gpu"] == 1, name
        assert "nvidia.com/gpu" not in main_container(workload)["resources"]["requests"]
        assert any(k.startswith("nvidia.com/gpu") for k in spec["nodeSelector"]), name
        assert any(
            t["key"] == "nvidia.com/gpu" and t["effect"] == "NoSchedule"
            for t in spec["tolerations"]
        ), name
    # nothing else asks for a GPU
    for name, workload in workloads(docs).items():
        if name not in ("worker", "controlnet"):
            assert "nvidia.com/gpu" not in json.dumps(workload), name


def test_worker_gpu_count_follows_values() -> None:
    docs = render({"worker": {"gpu": {"count": 2}}, "controlnet": {"gpu": {"count": 0}}})
    w = workloads(docs)
    assert main_container(w["worker"])["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert "nvidia.com/gpu" not in main_container(w["controlnet"])["resources"]["limits"]


def test_worker_model_volume_and_shared_latent_store() -> None:
    docs = rendered("production")
    worker = workloads(docs)["worker"]
    spec = pod_spec(worker)
    mounts = {m["name"]: m for m in main_container(worker)["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert mounts["models"]["mountPath"] == "/models" and mounts["models"]["readOnly"] is True
    assert volumes["models"]["persistentVolumeClaim"]["claimName"] == "argus-models"
    assert mounts["shm"]["mountPath"] == "/dev/shm"
    assert volumes["shm"]["emptyDir"]["medium"] == "Memory"

    assert mounts["latents"]["mountPath"] == "/var/lib/argus/cache"
    claim = volumes["latents"]["persistentVolumeClaim"]["claimName"]
    (pvc,) = of_kind(docs, "PersistentVolumeClaim")
    assert pvc["metadata"]["name"] == claim
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    assert pvc["spec"]["storageClassName"] == "nfs-rwx"
    assert pvc["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"

    args = main_container(worker)["args"]
    assert arg_value(args, "--model") == "/models/sdxl"
    assert arg_value(args, "--cache-dir") == "/var/lib/argus/cache"
    variants = [args[i + 1] for i, a in enumerate(args) if a == "--variant"]
    assert "small-sd=/models/small-sd" in variants and len(variants) == 5


def test_the_router_prices_requests_at_the_workers_defaults() -> None:
    values = {"worker": {"defaultSteps": 30, "defaultSize": 512}}
    args = main_container(workloads(render(values))["router"])["args"]
    assert arg_value(args, "--default-steps") == "30"
    assert arg_value(args, "--default-size") == "512"


def test_the_allocator_reads_the_routers_classifier() -> None:
    """The allocator prices the router's classes with the Q(v | c) of the same artifacts:
    one value names them for both pods, and a classifier volume is mounted in both."""
    volume = {"persistentVolumeClaim": {"claimName": "classifiers", "readOnly": True}}
    values = {"router": {"classifier": "/classifiers/v2", "classifierVolume": volume}}
    w = workloads(render(values))
    for name in ("router", "allocator"):
        assert arg_value(main_container(w[name])["args"], "--classifier") == "/classifiers/v2"
        mounts = {m["name"]: m for m in main_container(w[name])["volumeMounts"]}
        assert mounts["classifiers"] == {
            "name": "classifiers",
            "mountPath": "/classifiers",
            "readOnly": True,
        }
        assert {"name": "classifiers", **volume} in pod_spec(w[name])["volumes"]
    averages = workloads(render(merge(values, {"allocator": {"classQuality": False}})))
    allocator = averages["allocator"]
    assert arg_value(main_container(allocator)["args"], "--classifier") == "none"
    assert all(v["name"] != "classifiers" for v in pod_spec(allocator)["volumes"])


def test_latent_store_existing_claim_and_cache_off() -> None:
    docs = render({"latentStore": {"existingClaim": "shared-latents"}})
    assert of_kind(docs, "PersistentVolumeClaim") == []
    volumes = {v["name"]: v for v in pod_spec(workloads(docs)["worker"])["volumes"]}
    assert volumes["latents"]["persistentVolumeClaim"]["claimName"] == "shared-latents"

    docs = render({"worker": {"cache": {"enabled": False}}})
    assert of_kind(docs, "PersistentVolumeClaim") == []
    args = main_container(workloads(docs)["worker"])["args"]
    assert "--no-cache" in args and "--qdrant-url" not in args


def test_worker_as_deployment_never_surges() -> None:
    docs = render({"worker": {"kind": "Deployment"}})
    worker = workloads(docs)["worker"]
    assert worker["kind"] == "Deployment"
    assert worker["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
    for doc in docs:
        kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)


def test_qdrant_statefulset_has_a_persistent_volume(variant: str) -> None:
    docs = rendered(variant)
    qdrant = workloads(docs)["qdrant"]
    assert main_container(qdrant)["image"].startswith("qdrant/qdrant:")
    (claim,) = qdrant["spec"]["volumeClaimTemplates"]
    mounts = {m["name"]: m["mountPath"] for m in main_container(qdrant)["volumeMounts"]}
    assert mounts[claim["metadata"]["name"]] == "/qdrant/storage"
    url = arg_value(main_container(workloads(docs)["worker"])["args"], "--qdrant-url")
    assert url == "http://demo-argus-qdrant:6333"
    services = {d["metadata"]["name"] for d in of_kind(docs, "Service")}
    assert "demo-argus-qdrant" in services


def test_external_qdrant_url_replaces_the_statefulset(variant: str) -> None:
    url = "https://qdrant.vectors.svc.cluster.local:6333"
    docs = render(merge(load_values(variant), {"qdrant": {"external": {"url": url}}}))
    assert "qdrant" not in workloads(docs)
    assert all(component(d) != "qdrant" for d in docs)
    assert arg_value(main_container(workloads(docs)["worker"])["args"], "--qdrant-url") == url


def test_secrets_created_or_referenced() -> None:
    # created from values
    docs = render(
        {
            "auth": {"enabled": True, "token": "s3cret"},
            "tls": {"enabled": True, "cert": "CERT", "key": "KEY"},
        }
    )
    secrets = {component(s): s for s in of_kind(docs, "Secret")}
    assert secrets["auth"]["type"] == "Opaque"
    assert secrets["tls"]["type"] == "kubernetes.io/tls"
    router = workloads(docs)["router"]
    annotations = router["spec"]["template"]["metadata"]["annotations"]
    assert {"checksum/auth", "checksum/tls"} <= set(annotations)
    volumes = {v["name"]: v for v in pod_spec(router)["volumes"]}
    assert volumes["auth"]["secret"]["secretName"] == secrets["auth"]["metadata"]["name"]
    assert volumes["tls"]["secret"]["secretName"] == secrets["tls"]["metadata"]["name"]

    # referenced (production): no Secret rendered, the existing names and key are mounted
    docs = rendered("production")
    assert of_kind(docs, "Secret") == []
    router = workloads(docs)["router"]
    volumes = {v["name"]: v for v in pod_spec(router)["volumes"]}
    assert volumes["auth"]["secret"]["secretName"] == "argus-clients"
    assert volumes["auth"]["secret"]["items"] == [{"key": "bearer-token", "path": "token"}]
    assert volumes["tls"]["secret"]["secretName"] == "argus-public-tls"
    args = main_container(router)["args"]
    assert arg_value(args, "--auth-token-file") == "/etc/argus/auth/token"
    assert arg_value(args, "--tls-cert") == "/etc/argus/tls/tls.crt"
    assert arg_value(args, "--tls-key") == "/etc/argus/tls/tls.key"

    # no auth, no TLS by default: no secret, no flag
    args = main_container(workloads(rendered("default"))["router"])["args"]
    assert not {"--auth-token-file", "--tls-cert", "--tls-key"} & set(args)


def test_profile_configmap_is_shared() -> None:
    toml = '[[levels]]\nname = "ac-k0"\n'
    docs = render({"profile": {"toml": toml}})
    (cm,) = [d for d in of_kind(docs, "ConfigMap") if component(d) == "profile"]
    assert cm["data"]["profile.toml"].strip() == toml.strip()
    w = workloads(docs)
    for name in ("router", "allocator", "worker"):
        args = main_container(w[name])["args"]
        assert arg_value(args, "--profile") == "/etc/argus/profile/profile.toml"
        annotations = w[name]["spec"]["template"]["metadata"]["annotations"]
        assert "checksum/profile" in annotations
    assert "--profile" not in main_container(w["controlnet"])["args"]  # it has no profile


# -- probes, security, resources ---------------------------------------------------------------


def test_every_argus_pod_has_grpc_health_probes(variant: str) -> None:
    """Internal services take only certificates of the cluster CA: their probes run ``argus
    health`` in the container with the pod's certificate (the real CLI parses it); with the
    internal plane's TLS off they are kubelet gRPC probes."""
    for values, mutual in (
        (load_values(variant), True),
        ({"internalTls": {"enabled": False}}, False),
    ):
        for name, workload in workloads(render(values)).items():
            if name in ("qdrant", "router"):
                continue
            container = main_container(workload)
            ports = {p["name"]: p["containerPort"] for p in container["ports"]}
            for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                if not mutual:
                    assert container[probe]["grpc"] == {"port": ports["grpc"], "service": ""}
                    continue
                command = container[probe]["exec"]["command"]
                assert command[:2] == ["argus", "health"], (name, probe)
                parsed = cli_parser("health").parse_args(command[2:])
                assert parsed.address == f"127.0.0.1:{ports['grpc']}", (name, probe)
                assert (parsed.role, parsed.service) == (name, ""), (name, probe)
                assert parsed.internal_tls_dir == INTERNAL_TLS_DIR, (name, probe)
            # the startup probe covers model loading; liveness only starts after it
            startup = container["startupProbe"]
            assert startup["periodSeconds"] * startup["failureThreshold"] >= 120, name


INTERNAL_TLS_DIR = "/etc/argus/internal-tls"


def test_every_argus_pod_issues_its_own_certificate_and_never_sees_the_ca_key(
    variant: str,
) -> None:
    values = merge(load_values(variant), {"internalTls": {"secretName": "cluster-ca"}})
    for name, workload in workloads(render(values)).items():
        if name == "qdrant":
            continue
        spec = pod_spec(workload)
        (init,) = spec["initContainers"]
        args = expand_env(init["args"], f"demo-argus-{name}-0")
        assert init["command"] == ["argus"] and args[0] == "issue-cert", name
        parsed = cli_parser("issue-cert").parse_args(args[1:])
        assert parsed.identity == f"{name}/demo-argus-{name}-0", name
        assert str(parsed.out) == INTERNAL_TLS_DIR and not parsed.new_ca, name
        volumes = {v["name"]: v for v in spec["volumes"]}
        ca = volumes["internal-ca"]["secret"]
        assert ca["secretName"] == "cluster-ca", name
        assert {i["key"] for i in ca["items"]} == {"ca.crt", "ca.key"}, name
        assert volumes["internal-tls"]["emptyDir"]["medium"] == "Memory", name
        init_mounts = {m["name"]: m for m in init["volumeMounts"]}
        assert init_mounts["internal-ca"]["mountPath"] == parsed.ca_dir, name
        assert init_mounts["internal-tls"]["mountPath"] == INTERNAL_TLS_DIR, name
        # the serving container: its certificate, read-only; the CA key is nowhere in it
        container = main_container(workload)
        mounts = {m["name"]: m for m in container["volumeMounts"]}
        assert "internal-ca" not in mounts, name
        assert mounts["internal-tls"] == {
            "name": "internal-tls",
            "mountPath": INTERNAL_TLS_DIR,
            "readOnly": True,
        }, name
        args = expand_env(container["args"], f"demo-argus-{name}-0")
        served = cli_parser(name).parse_args(args[1:])
        assert served.internal_tls_dir == INTERNAL_TLS_DIR and not served.insecure_internal


def test_the_internal_plane_off_is_explicit_and_needs_no_ca() -> None:
    w = workloads(render({"internalTls": {"enabled": False, "secretName": ""}}))
    for name in ARGUS_COMPONENTS:
        spec = pod_spec(w[name])
        assert "initContainers" not in spec, name
        assert "internal-ca" not in {v["name"] for v in spec["volumes"]}, name
        args = expand_env(main_container(w[name])["args"], f"demo-argus-{name}-0")
        parsed = cli_parser(name).parse_args(args[1:])
        assert parsed.insecure_internal and parsed.internal_tls_dir is None, name


def test_router_probes_never_restart_it_for_want_of_a_plan() -> None:
    """A router is NOT_SERVING until the allocator's first plan: readiness asks whether it can
    serve, startup and liveness only whether it is alive (a restart brings no plan sooner).
    With the HTTP API (the default) those are GET /readyz and /healthz, over HTTPS with TLS.
    Without it, readiness is gRPC health, or TCP with TLS (the kubelet's gRPC probe speaks
    plaintext only), and liveness is TCP."""
    off: dict[str, Any] = {"router": {"http": {"enabled": False}}}
    tls: dict[str, Any] = {"tls": {"enabled": True, "cert": "C", "key": "K"}}
    for values, http, secure in (
        ({}, True, False),
        (tls, True, True),
        (off, False, False),
        ({**off, **tls}, False, True),
    ):
        router = main_container(workloads(render(values))["router"])
        ports = {p["name"]: p["containerPort"] for p in router["ports"]}
        port = ports["grpc"]
        startup = router["startupProbe"]
        assert startup["tcpSocket"] == {"port": port}
        assert startup["periodSeconds"] * startup["failureThreshold"] == 300
        readiness = router["readinessProbe"]
        if http:
            scheme = "HTTPS" if secure else "HTTP"
            assert router["livenessProbe"]["httpGet"] == {
                "path": "/healthz",
                "port": "http",
                "scheme": scheme,
            }
            assert readiness["httpGet"] == {"path": "/readyz", "port": "http", "scheme": scheme}
            args = router["args"]
            assert args[args.index("--http-port") + 1] == str(ports["http"])
            assert args[args.index("--http-host") + 1] == "0.0.0.0"
            continue
        assert "http" not in ports and "--http-port" not in router["args"]
        assert router["livenessProbe"]["tcpSocket"] == {"port": port}
        if secure:
            assert readiness["tcpSocket"] == {"port": port} and "grpc" not in readiness
        else:
            assert readiness["grpc"] == {"port": port, "service": ""}
    prod = main_container(workloads(rendered("production"))["router"])
    assert prod["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"  # production serves TLS


def test_router_service_carries_the_http_api_unless_off() -> None:
    router = public_router_service(render({}))
    http = {p["name"]: p for p in router["spec"]["ports"]}["http"]
    assert http["port"] == 8000 and http["targetPort"] == "http"
    assert http["appProtocol"] == "http"
    assert ports_of(public_router_service(render({"router": {"http": {"enabled": False}}}))) == {
        "grpc"
    }


def test_qdrant_has_http_probes(variant: str) -> None:
    qdrant = workloads(rendered(variant))["qdrant"]
    container = main_container(qdrant)
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/livez"


def test_pods_run_as_non_root_with_read_only_root(variant: str) -> None:
    for name, workload in workloads(rendered(variant)).items():
        spec = pod_spec(workload)
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        assert spec["securityContext"]["runAsUser"] > 0, name
        assert spec["automountServiceAccountToken"] is False, name
        for container in spec["containers"] + spec.get("initContainers", []):
            sc = container["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True, name
            assert sc["allowPrivilegeEscalation"] is False, name
            assert sc["capabilities"]["drop"] == ["ALL"], name
            assert not sc.get("privileged", False), name
        # the writable places are volumes
        mounts = {m["mountPath"] for m in main_container(workload)["volumeMounts"]}
        assert "/tmp" in mounts, name
        if name in ARGUS_COMPONENTS:
            assert "/var/cache/argus" in mounts, name
            env = {e["name"]: e.get("value") for e in main_container(workload)["env"]}
            for var in ("HF_HOME", "TORCH_HOME", "TRITON_CACHE_DIR", "MPLCONFIGDIR"):
                assert env[var].startswith("/var/cache/argus"), (name, var)
            assert env["HOME"] == "/tmp"
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert "emptyDir" in volumes["tmp"], name


def test_every_container_has_requests_and_limits(variant: str) -> None:
    for name, workload in workloads(rendered(variant)).items():
        resources = main_container(workload)["resources"]
        for key in ("cpu", "memory"):
            assert key in resources["requests"], (name, key)
            assert key in resources["limits"], (name, key)


# -- network: only the router is reachable from outside ----------------------------------------


def test_only_the_router_service_can_be_exposed(variant: str) -> None:
    docs = rendered(variant)
    for svc in of_kind(docs, "Service"):
        if component(svc) != "router":
            assert svc["spec"]["type"] == "ClusterIP", svc["metadata"]["name"]
    router = public_router_service(docs)
    expected = "LoadBalancer" if variant == "production" else "ClusterIP"
    assert router["spec"]["type"] == expected
    # the public Service carries the public ports only; /metrics has a ClusterIP Service
    assert ports_of(router) == {"grpc", "http"}


def test_network_policies_let_only_the_router_in(variant: str) -> None:
    docs = rendered(variant)
    policies = {component(p): p for p in of_kind(docs, "NetworkPolicy")}
    assert set(policies) == {*ARGUS_COMPONENTS, "qdrant"}
    release = {"app.kubernetes.io/name": "argus", "app.kubernetes.io/instance": RELEASE}
    metrics_from = load_values(variant).get("networkPolicy", {}).get("metricsFrom") or [
        {
            "namespaceSelector": {},
            "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
        }
    ]
    pods = workloads(docs)
    for name, policy in policies.items():
        spec = policy["spec"]
        assert spec["policyTypes"] == ["Ingress"]
        # the policy selects exactly that component's pods
        pod_labels = pods[name]["spec"]["template"]["metadata"]["labels"]
        assert spec["podSelector"]["matchLabels"].items() <= pod_labels.items()
        ports = {p["name"]: p["containerPort"] for p in main_container(pods[name])["ports"]}
        grpc_rules = []
        for rule in spec["ingress"]:
            rule_ports = {p["port"] for p in rule["ports"]}
            assert rule_ports, name  # never "all ports"
            if rule.get("from") == metrics_from:
                assert rule_ports == ({6333} if name == "qdrant" else {ports["metrics"]}), name
            else:
                grpc_rules.append((rule_ports, rule.get("from")))
        (grpc_rule,) = grpc_rules
        if name == "router":
            public = [{"ipBlock": {"cidr": "10.20.0.0/16"}}] if variant == "production" else None
            # None: from anywhere
            assert grpc_rule == ({ports["grpc"], ports["http"]}, public)
        elif name == "qdrant":
            assert grpc_rule == ({6333, 6334}, [{"podSelector": {"matchLabels": release}}])
        else:
            assert grpc_rule == ({ports["grpc"]}, [{"podSelector": {"matchLabels": release}}])
    # every pod of the release is selected by some policy (so unlisted ingress is denied)
    for name, workload in pods.items():
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert any(
            p["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
            for p in policies.values()
        ), name


def test_network_policies_can_be_turned_off() -> None:
    assert of_kind(render({"networkPolicy": {"enabled": False}}), "NetworkPolicy") == []


def test_pod_disruption_budgets(variant: str) -> None:
    docs = rendered(variant)
    pdbs = {component(p): p for p in of_kind(docs, "PodDisruptionBudget")}
    # the allocator and Qdrant run one replica: a budget would only block node drains
    assert set(pdbs) == {"router", "worker", "controlnet"}
    pods = workloads(docs)
    for name, pdb in pdbs.items():
        labels = pods[name]["spec"]["template"]["metadata"]["labels"]
        assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
        assert pdb["spec"]["maxUnavailable"] == 1


# -- Prometheus and Grafana --------------------------------------------------------------------


def test_metrics_ports_and_scrape_annotations(variant: str) -> None:
    docs = rendered(variant)
    for name, workload in workloads(docs).items():
        annotations = workload["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true", name
        assert annotations["prometheus.io/path"] == "/metrics", name
        if name == "qdrant":
            assert annotations["prometheus.io/port"] == "6333"
            continue
        args = main_container(workload)["args"]
        assert arg_value(args, "--metrics-port") == annotations["prometheus.io/port"] == "9090"
        svcs = services(docs, name)
        public = {"grpc", "http"} if name == "router" else {"grpc"}
        assert set().union(*map(ports_of, svcs.values())) == {*public, "metrics"}, name
        (metrics_svc,) = [s for s in svcs.values() if "metrics" in ports_of(s)]
        assert metrics_svc["spec"]["type"] == "ClusterIP", name


def test_metrics_off_removes_ports_flags_and_annotations() -> None:
    docs = render({"metrics": {"enabled": False}})
    for name in ARGUS_COMPONENTS:
        workload = workloads(docs)[name]
        assert "--metrics-port" not in main_container(workload)["args"]
        annotations = workload["spec"]["template"]["metadata"].get("annotations", {})
        assert "prometheus.io/scrape" not in annotations
        assert "--metrics-host" not in main_container(workload)["args"]
        public = {"grpc", "http"} if name == "router" else {"grpc"}
        assert set().union(*map(ports_of, services(docs, name).values())) == public, name


def test_service_monitor_only_when_enabled() -> None:
    assert [d for d in rendered("default") if d["kind"] == "ServiceMonitor"] == []
    (sm,) = [d for d in rendered("production") if d["kind"] == "ServiceMonitor"]
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert sm["spec"]["selector"]["matchLabels"] == {
        "app.kubernetes.io/name": "argus",
        "app.kubernetes.io/instance": RELEASE,
    }
    assert sm["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    endpoints = {e["port"]: e for e in sm["spec"]["endpoints"]}
    assert set(endpoints) == {"metrics", "http"}  # Argus services, Qdrant
    for e in endpoints.values():
        assert e["path"] == "/metrics" and e["interval"] == "15s"
    # every Argus component has a Service it selects that exposes the port it scrapes
    prod = rendered("production")
    for name in ARGUS_COMPONENTS:
        assert any("metrics" in ports_of(s) for s in services(prod, name).values()), name


def exported_metric_names() -> set[str]:
    """Every sample name the allocator, routers, workers and ControlNet service export."""
    from prometheus_client import CollectorRegistry

    from argus.allocator.metrics import AllocatorMetrics
    from argus.profiles import default_profiles
    from argus.router.metrics import RouterMetrics
    from argus.worker.adapters.controlnet.metrics import ControlNetMetrics
    from argus.worker.approx_cache.cache import CacheMetrics
    from argus.worker.metrics import WorkerMetrics

    registry = CollectorRegistry()
    AllocatorMetrics(default_profiles(), registry)
    RouterMetrics(default_profiles(), registry)
    WorkerMetrics(registry)
    CacheMetrics(registry)
    cache = SimpleNamespace(
        hits=0, misses=0, loads=0, load_failures=0, evictions=0, load_seconds=0.0,
        resident=(), resident_bytes=0,
    )  # fmt: skip
    stats = SimpleNamespace(cache=cache, steps_total=0, sessions_open=0)
    ControlNetMetrics(lambda: stats, registry)  # type: ignore[arg-type,return-value]
    suffixes = {
        "counter": ("_total",),
        "gauge": ("",),
        "histogram": ("_bucket", "_sum", "_count"),
    }
    return {
        metric.name + suffix for metric in registry.collect() for suffix in suffixes[metric.type]
    }


def dashboards() -> dict[str, dict[str, Any]]:
    return {
        p.name: json.loads(p.read_text()) for p in sorted((CHART / "dashboards").glob("*.json"))
    }


def test_dashboards_use_only_metrics_the_code_exports() -> None:
    exported = exported_metric_names()
    boards = dashboards()
    assert len(boards) >= 3
    used: set[str] = set()
    for name, board in boards.items():
        assert board["uid"] and board["title"] and board["panels"], name
        variables = {v["name"] for v in board["templating"]["list"]}
        assert "datasource" in variables, name
        ids = [p["id"] for p in board["panels"]]
        assert len(ids) == len(set(ids)), name
        for panel in board["panels"]:
            assert panel["datasource"]["uid"] == "${datasource}", (name, panel["title"])
            assert panel["targets"], (name, panel["title"])
            for target in panel["targets"]:
                expr = target["expr"]
                assert expr.count("(") == expr.count(")"), (name, expr)
                for metric in re.findall(r"\bargus_[a-z0-9_]+", expr):
                    assert metric in exported, f"{name}: {metric} is not exported by the code"
                    used.add(metric)
    # the dashboards cover each exporter
    assert any(m.startswith("argus_allocator_") for m in used)
    assert any(m.startswith("argus_worker_cache_") for m in used)
    assert any(m.startswith("argus_controlnet_") for m in used)
    assert "argus_worker_request_seconds_bucket" in used


def test_dashboards_ship_as_configmaps_for_the_grafana_sidecar(variant: str) -> None:
    docs = rendered(variant)
    maps = [d for d in of_kind(docs, "ConfigMap") if component(d) == "dashboards"]
    boards = dashboards()
    assert len(maps) == len(boards)
    expected_ns = "monitoring" if variant == "production" else NAMESPACE
    shipped: dict[str, Any] = {}
    for cm in maps:
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert cm["metadata"]["namespace"] == expected_ns
        ((key, text),) = cm["data"].items()
        shipped[key] = json.loads(text)
    assert shipped == boards
    if variant == "production":
        assert maps[0]["metadata"]["annotations"] == {"grafana_folder": "Argus"}


def test_dashboards_can_be_turned_off() -> None:
    docs = render({"metrics": {"dashboards": {"enabled": False}}})
    assert [d for d in of_kind(docs, "ConfigMap") if component(d) == "dashboards"] == []


# -- the contract with the services: flags the real CLI parses ---------------------------------


def cli_parser(command: str) -> argparse.ArgumentParser:
    """The real parser of ``argus <command>``, as ``argus.cli.main`` builds it."""
    from argus.cli.main import COMMANDS, OneLineParser, load_command

    assert command in COMMANDS, f"argus has no {command!r} command"
    parser = OneLineParser(prog=f"argus {command}")
    load_command(command).add_arguments(parser)
    return parser


def expand_env(args: list[str], pod_name: str) -> list[str]:
    """What the kubelet does to $(VAR) in args, with example pod values."""
    env = {"POD_NAME": pod_name, "POD_IP": "10.1.2.3"}
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in args]


def test_container_args_parse_with_the_real_cli(variant: str) -> None:
    w = workloads(rendered(variant))
    values = merge(_chart().values, load_values(variant))
    for name in ARGUS_COMPONENTS:
        args = expand_env(main_container(w[name])["args"], f"demo-argus-{name}-0")
        command, rest = args[0], args[1:]
        assert command == name
        parsed = cli_parser(command).parse_args(rest)
        assert parsed.host == "0.0.0.0"
        ports = {p["name"]: p["containerPort"] for p in main_container(w[name])["ports"]}
        assert parsed.port == ports["grpc"]
        assert parsed.metrics_port == ports["metrics"]
        # /metrics must be reachable from Prometheus: the router binds it on --metrics-host
        # (loopback unless told), the others on --host
        assert getattr(parsed, "metrics_host", parsed.host) == "0.0.0.0", name
        if command == "worker":
            assert parsed.worker_id == "demo-argus-worker-0"
            cn_port = main_container(w["controlnet"])["ports"][0]["containerPort"]
            assert parsed.controlnet == f"demo-argus-controlnet:{cn_port}"
            assert parsed.advertise == f"10.1.2.3:{ports['grpc']}"
            assert parsed.allocator == "demo-argus-allocator:50052"
            assert parsed.worker_class == ("h100" if variant == "production" else None)
            assert parsed.index_outage_file is None  # fault injection, tests only
        if command == "allocator":
            assert parsed.classifier == values["router"]["classifier"]
            assert parsed.period_s == 60.0
            assert parsed.heartbeat_s == (2.0 if variant == "production" else 1.0)
            assert parsed.max_watchers >= 2
        if command == "router":
            router = values["router"]
            assert parsed.router_id == "demo-argus-router-0"  # the pod's name: unique
            assert parsed.allocator == "demo-argus-allocator:50052"
            assert parsed.classifier == router["classifier"]
            assert parsed.default_deadline_ms == router["defaultDeadlineMs"]
            assert parsed.max_in_flight == router["maxInFlight"]
            assert parsed.report_period_s == router["reportPeriodSeconds"]
            assert parsed.profile == (
                "/etc/argus/profile/profile.toml" if variant == "production" else None
            )
            secured = variant == "production"
            assert parsed.tls_cert == ("/etc/argus/tls/tls.crt" if secured else None)
            assert parsed.tls_key == ("/etc/argus/tls/tls.key" if secured else None)
            assert parsed.auth_token_file == ("/etc/argus/auth/token" if secured else None)


def test_every_flag_the_chart_can_pass_parses() -> None:
    """Values that switch on every optional flag still give arguments the CLI accepts."""
    values = {
        "profile": {"toml": '[[levels]]\nname = "ac-k0"\n'},
        "auth": {"enabled": True, "token": "t"},
        "tls": {"enabled": True, "cert": "C", "key": "K"},
        "router": {"reportPeriodSeconds": 0.5, "defaultDeadlineMs": 2_000_000},
        "worker": {
            "workerClass": "a100",
            "memoryBudgetGiB": 70,
            "lora": {"dir": "/models/loras"},
            "model": {
                "base": "/models/sdxl",
                "variants": {"sd-1.5": "/models/sd-1.5"},
                "volume": {"persistentVolumeClaim": {"claimName": "m"}},
            },
        },
        "controlnet": {"preload": ["sd15/canny"], "baseFamily": "sd15"},
    }
    w = workloads(render(values))
    for name in ARGUS_COMPONENTS:
        args = expand_env(main_container(w[name])["args"], f"demo-argus-{name}-0")
        parsed = cli_parser(name).parse_args(args[1:])
        assert parsed.metrics_port == 9090
    router = cli_parser("router").parse_args(main_container(w["router"])["args"][1:])
    assert router.report_period_s == 0.5
    assert router.default_deadline_ms == 2_000_000  # not 2e+06: Helm's float64 integers


def test_the_allocators_planner_strategy_choice_and_slo_are_values() -> None:
    """The chart passes the planner and the strategy choice always, and the SLO only when set
    (the allocator's own rule otherwise); the schema refuses a planner it does not know."""
    args = main_container(workloads(render({}))["allocator"])["args"]
    assert arg_value(args, "--planner") == "joint"
    assert arg_value(args, "--strategy-choice") == "best"
    assert "--slo-s" not in args
    chosen = {"allocator": {"planner": "paper", "strategyChoice": "ac-first", "sloSeconds": 9.5}}
    args = main_container(workloads(render(chosen))["allocator"])["args"]
    assert [arg_value(args, f) for f in ("--planner", "--strategy-choice", "--slo-s")] == [
        "paper",
        "ac-first",
        "9.5",
    ]
    with pytest.raises(helm.HelmValuesError, match="planner"):
        render({"allocator": {"planner": "greedy"}})


def test_the_workers_resident_models_are_a_value() -> None:
    """worker.maxResidentModels reaches every worker as --max-resident (default 1); the schema
    refuses fewer than one."""
    args = main_container(workloads(render({}))["worker"])["args"]
    assert arg_value(args, "--max-resident") == "1"
    args = main_container(workloads(render({"worker": {"maxResidentModels": 3}}))["worker"])["args"]
    assert arg_value(args, "--max-resident") == "3"
    assert cli_parser("worker").parse_args(["--max-resident", "3"]).max_resident == 3
    with pytest.raises(helm.HelmValuesError, match="maxResidentModels"):
        render({"worker": {"maxResidentModels": 0}})


def test_compile_is_a_value_off_by_default() -> None:
    """worker.compile reaches every worker as --compile MODE when set; the schema takes the
    binary's modes only."""
    args = main_container(workloads(render({}))["worker"])["args"]
    assert "--compile" not in args
    assert cli_parser("worker").parse_args([]).compile is None
    for mode in defaults.COMPILE_MODES:
        rendered_args = main_container(workloads(render({"worker": {"compile": mode}}))["worker"])[
            "args"
        ]
        assert arg_value(rendered_args, "--compile") == mode
        assert cli_parser("worker").parse_args(["--compile", mode]).compile == mode
    with pytest.raises(helm.HelmValuesError, match="compile"):
        render({"worker": {"compile": "fastest"}})


def test_cuda_graphs_are_a_value_auto_by_default() -> None:
    """worker.cudaGraphs reaches every worker as --cuda-graphs when it is a count, 0 included
    (left out at auto, the binary's default: graphs on a GPU worker, none on a CPU one); the
    schema refuses a negative count and other words."""
    args = main_container(workloads(render({}))["worker"])["args"]
    assert "--cuda-graphs" not in args
    assert cli_parser("worker").parse_args([]).cuda_graphs is None
    for count in (0, 4):
        rendered_args = main_container(
            workloads(render({"worker": {"cudaGraphs": count}}))["worker"]
        )["args"]
        assert arg_value(rendered_args, "--cuda-graphs") == str(count)
        assert cli_parser("worker").parse_args(["--cuda-graphs", str(count)]).cuda_graphs == count
    for bad in (-1, "always"):
        with pytest.raises(helm.HelmValuesError, match="cudaGraphs"):
            render({"worker": {"cudaGraphs": bad}})


def test_edit_batching_is_a_value_off_by_default() -> None:
    """worker.editBatch reaches every worker as --edit-batch above 1 and decodeThread as
    --decode-thread (both left out by default: the binary's one-at-a-time path); the schema
    refuses a bound below 1 and a decodeThread that is not a boolean."""
    args = main_container(workloads(render({}))["worker"])["args"]
    assert "--edit-batch" not in args and "--decode-thread" not in args
    parsed = cli_parser("worker").parse_args([])
    assert parsed.edit_batch == 1 and parsed.decode_thread is False
    assert "--edit-batch-table" not in args
    table = "/opt/argus/edit-batching.toml"
    values = {"worker": {"editBatch": 4, "decodeThread": True, "editBatchTable": table}}
    args = main_container(workloads(render(values))["worker"])["args"]
    assert arg_value(args, "--edit-batch") == "4" and "--decode-thread" in args
    assert arg_value(args, "--edit-batch-table") == table
    router = main_container(workloads(render(values))["router"])["args"]
    assert arg_value(router, "--edit-batch") == "4"  # the router prices the workers' bound
    assert arg_value(router, "--edit-batch-table") == table
    with pytest.raises(helm.HelmValuesError, match="editBatch"):
        render({"worker": {"editBatch": 0}})
    with pytest.raises(helm.HelmValuesError, match="decodeThread"):
        render({"worker": {"decodeThread": "yes"}})


def test_the_routers_edit_balancer_is_a_value_plan_by_default() -> None:
    """router.editBalancer reaches the router as --edit-balancer when not "plan" (the binary's
    default, left out); the schema accepts only the balancers the router knows."""
    from argus.router.config import EDIT_BALANCERS

    args = main_container(workloads(render({}))["router"])["args"]
    assert "--edit-balancer" not in args and "--edit-batch" not in args
    values = {"router": {"editBalancer": "mask-aware"}}
    args = main_container(workloads(render(values))["router"])["args"]
    assert arg_value(args, "--edit-balancer") == "mask-aware"
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert schema["properties"]["router"]["properties"]["editBalancer"]["enum"] == list(
        EDIT_BALANCERS
    )
    with pytest.raises(helm.HelmValuesError, match="editBalancer"):
        render({"router": {"editBalancer": "fastest"}})


def test_the_workers_edit_cache_is_a_value_with_an_optional_disk_tier() -> None:
    """worker.editCache reaches every worker as --edit-cache-bytes when it is a count (left
    out at auto, the binary's default: host memory only); its disk tier mounts a node-local
    emptyDir at the directory it passes, with an explicit bound (auto would measure the node's
    disk, not the emptyDir's limit); the schema refuses a negative bound."""
    parser = cli_parser("worker")
    worker = workloads(render({}))["worker"]
    args = main_container(worker)["args"]
    assert "--edit-cache-bytes" not in args
    assert parser.parse_args([]).edit_cache_bytes == "auto"
    assert "--edit-cache-dir" not in args
    disk = {"enabled": True, "bytes": 2**31, "sizeLimit": "3Gi"}
    worker = workloads(render({"worker": {"editCache": {"hostBytes": 0, "disk": disk}}}))["worker"]
    container = main_container(worker)
    args = container["args"]
    assert arg_value(args, "--edit-cache-bytes") == "0"
    assert arg_value(args, "--edit-cache-disk-bytes") == str(2**31)
    directory = arg_value(args, "--edit-cache-dir")
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "edit-cache"]
    assert mount["mountPath"] == directory
    (volume,) = [
        v for v in worker["spec"]["template"]["spec"]["volumes"] if v["name"] == "edit-cache"
    ]
    assert volume["emptyDir"] == {"sizeLimit": "3Gi"}
    parsed = parser.parse_args(["--edit-cache-dir", directory, "--edit-cache-disk-bytes", "9"])
    assert (parsed.edit_cache_dir, parsed.edit_cache_disk_bytes) == (directory, 9)
    with pytest.raises(helm.HelmValuesError, match="hostBytes"):
        render({"worker": {"editCache": {"hostBytes": -1}}})


def test_router_and_allocator_reach_each_other_by_service_name() -> None:
    docs = rendered("default")
    w = workloads(docs)
    allocator_svc = only(docs, "Service", "allocator")
    (grpc_port,) = [p["port"] for p in allocator_svc["spec"]["ports"] if p["name"] == "grpc"]
    expected = f"{allocator_svc['metadata']['name']}:{grpc_port}"
    assert arg_value(main_container(w["router"])["args"], "--allocator") == expected
    assert arg_value(main_container(w["worker"])["args"], "--allocator") == expected
    assert arg_value(main_container(w["allocator"])["args"], "--period-s") == "60"
    assert arg_value(main_container(w["allocator"])["args"], "--retrieval-threshold-s") == "0.5"


# -- values.schema.json rejects malformed values -----------------------------------------------

INVALID = [
    ({"router": {"replicas": -1}}, "/router/replicas"),
    ({"worker": {"replicas": "four"}}, "/worker/replicas"),
    ({"image": {"repository": ""}}, "/image/repository"),
    ({"image": {"repository": None}}, "repository"),
    ({"router": {"strategy": {"type": "BlueGreen"}}}, "/router/strategy/type"),
    ({"worker": {"kind": "DaemonSet"}}, "/worker/kind"),
    ({"worker": {"updateStrategy": {"type": "Canary"}}}, "/worker/updateStrategy/type"),
    ({"worker": {"gpus": 2}}, "gpus"),
    ({"worker": {"gpu": {"count": -1}}}, "/worker/gpu/count"),
    ({"router": {"port": 70000}}, "/router/port"),
    ({"metrics": {"port": "9090"}}, "/metrics/port"),
    ({"auth": {"enabled": True}}, "/auth"),
    ({"tls": {"enabled": True, "cert": "CERT"}}, "/tls"),
    ({"latentStore": {"accessModes": ["ReadWriteOnce"]}}, "/latentStore/accessModes"),
    ({"qdrant": {"external": {"url": "qdrant:6333"}}}, "/qdrant/external/url"),
    ({"worker": {"model": {"base": "models/sdxl"}}}, "/worker/model/base"),
    ({"worker": {"resources": {"limits": {"memory": "lots"}}}}, "/worker/resources/limits"),
    ({"controlnet": {"policy": "fifo"}}, "/controlnet/policy"),
    ({"worker": {"device": "tpu"}}, "/worker/device"),
    ({"router": {"autoscaling": {"enabled": "yes"}}}, "/router/autoscaling/enabled"),
    ({"allocator": {"periodSeconds": 0}}, "/allocator/periodSeconds"),
    ({"allocator": {"period": 60}}, "period"),
    ({"allocator": {"classQuality": "yes"}}, "/allocator/classQuality"),
    ({"internalTls": {"enabled": True, "secretName": ""}}, "/internalTls/secretName"),
]


@pytest.mark.parametrize(("values", "field"), INVALID, ids=[f for _, f in INVALID])
def test_schema_rejects_malformed_values_naming_the_field(
    values: dict[str, Any], field: str
) -> None:
    with pytest.raises(helm.HelmValuesError) as excinfo:
        render(values)
    assert field in str(excinfo.value)


def test_schema_accepts_the_shipped_values() -> None:
    for name in VARIANTS:
        _chart().validate_schema(load_values(name))


TEMPLATE_FAILURES = [
    (
        {"worker": {"model": {"base": "/models/sdxl"}}},
        "worker.model.volume: required when worker.model.base is a directory",
    ),
    (
        {"controlnet": {"catalog": "/controlnets"}},
        "controlnet.volume: required when controlnet.catalog is a directory",
    ),
    (
        {"router": {"autoscaling": {"enabled": True, "maxReplicas": 100}}},
        "allocator.maxWatchers: 64 is below the routers' 100 replicas",
    ),
    (
        {"worker": {"replicas": 20}, "allocator": {"maxWorkers": 16}},
        "allocator.maxWorkers: 16 is below worker.replicas 20",
    ),
    (
        {"worker": {"kind": "Deployment", "updateStrategy": {"type": "OnDelete"}}},
        "worker.updateStrategy.type: OnDelete is not a Deployment strategy",
    ),
]


@pytest.mark.parametrize(("values", "message"), TEMPLATE_FAILURES)
def test_inconsistent_values_fail_with_a_clear_message(
    values: dict[str, Any], message: str
) -> None:
    with pytest.raises(helm.HelmError) as excinfo:
        render(values)
    assert message in str(excinfo.value)


# -- the image the chart runs ------------------------------------------------------------------


def test_dockerfile_matches_the_chart() -> None:
    """docker/Dockerfile cannot be built here; hold it to what the chart assumes."""
    text = (ROOT / "docker" / "Dockerfile").read_text()
    instructions = [
        line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")
    ]
    defaults = _chart().values
    security = defaults["podSecurityContext"]
    (user,) = [i.split()[1] for i in instructions if i.startswith("USER ")]
    assert user == f"{security['runAsUser']}:{security['runAsGroup']}"
    assert 'ENTRYPOINT ["argus"]' in instructions
    # the router's default classifier is baked into the image
    assert (
        f"COPY classifiers/minilm-l2-logistic-int8 {defaults['router']['classifier']}"
        in instructions
    )
    (expose,) = [i.split()[1:] for i in instructions if i.startswith("EXPOSE ")]
    ports = {defaults[c]["port"] for c in ARGUS_COMPONENTS} | {defaults["metrics"]["port"]}
    assert {int(p) for p in expose} == ports
    # one image, two variants; Python as the project requires; torch as pyproject pins it
    assert "ARG VARIANT=cuda" in instructions
    assert any(i.startswith("FROM base-${VARIANT}") for i in instructions)
    assert "uv python install 3.11" in text
    pyproject = (ROOT / "pyproject.toml").read_text()
    (torch_pin,) = re.findall(r'"(torch==[^"]+)"', pyproject)
    assert f'"{torch_pin}"' in text
    # the generated gRPC code is built into the package, never at run time
    assert "python -m argus.plumbing.rpc" in text
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert "argus/v1/" in ignored
    # every COPY from the build context exists and is let through by .dockerignore
    kept = [p.removeprefix("!").rstrip("/") for p in ignored if p.startswith("!")]
    sources = [
        src
        for i in instructions
        if i.startswith("COPY ") and "--from=" not in i
        for src in i.split()[1:-1]
    ]
    assert {"pyproject.toml", "proto", "argus", "classifiers/minilm-l2-logistic-int8"} <= set(
        sources
    )
    for src in sources:
        assert (ROOT / src).exists(), src
        assert any(src == k or src.startswith(f"{k}/") for k in kept), src
    # ENTRYPOINT ["argus"] is the package's console script
    assert 'argus = "argus.cli.main:main"' in pyproject


def test_the_routers_default_classifier_is_the_one_the_image_bakes_in() -> None:
    """The chart passes /opt/argus/classifiers/minilm-l2-logistic-int8; the image copies the
    repo's classifiers/minilm-l2-logistic-int8 there: an AC and an SM artifact the router's
    loader accepts."""
    from argus.classifier.serving import strategy_dirs
    from argus.types import Strategy

    default = _chart().values["router"]["classifier"]
    assert default == "/opt/argus/classifiers/minilm-l2-logistic-int8"
    found = strategy_dirs(ROOT / "classifiers" / "minilm-l2-logistic-int8")
    assert set(found) == {Strategy.AC, Strategy.SM}
