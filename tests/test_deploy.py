"""deploy/ and the Dockerfile, checked offline: every manifest file against the Kubernetes OpenAPI schema
(kubernetes-validate bundles the schemas; strict, so an unknown or misspelt field is an error), the
kustomizations, least-privilege RBAC, the DaemonSet's mounts, env, probes and resources, and the
ConfigMap's files through the project's own loaders. These read the files as written; what kustomize
renders from them (the overlays, components and replacements) is checked in test_deploy_render.py."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from conftest import REPO
from detector.cli.main import build_parser
from detector.config import build_checks, load_check_settings
from detector.rules.loader import load_rules

K8S_VERSION = "1.30"
DEPLOY = REPO / "deploy"
NAMESPACE = "gpu-npd"
STATE_DIR = "/var/lib/gpu-npd"
METRICS_PORT = 9808


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    """Everything here must work offline: any attempt to open a connection fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args!r}")
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)


# --- Loading

def kustomizations() -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*") if p.name in ("kustomization.yaml", "kustomization.yml"))


def local_resources(kustomization: Path) -> list[Path]:
    """The files a kustomization (or component) lists under `resources:`; directories are other
    kustomizations, and patches are fragments, not objects."""
    k = yaml.safe_load(kustomization.read_text(encoding="utf-8"))
    return [kustomization.parent / r for r in k.get("resources", []) if (kustomization.parent / r).is_file()]


def manifest_files() -> list[Path]:
    return sorted({p for k in kustomizations() for p in local_resources(k)})


# Custom resources: kubernetes-validate has no schema for them; test_deploy_render.py and
# test_monitoring.py check them, test_remediation.py the NodeHealthCheck against medik8s' CRD, and
# test_readiness.py the NodeReadinessRule against the Node Readiness Controller's.
CUSTOM_KINDS = {"PodMonitor", "PrometheusRule", "NodeHealthCheck", "NodeReadinessRule"}


def documents(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d is not None]


ALL_DOCS = [(path, i, doc) for path in manifest_files() for i, doc in enumerate(documents(path))]


def doc_id(item: tuple[Path, int, dict]) -> str:
    path, _, doc = item
    return f"{path.relative_to(DEPLOY)}:{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"


def find(kind: str, name: str | None = None) -> dict:
    found = [d for _, _, d in ALL_DOCS if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''} in deploy/, found {len(found)}"
    return found[0]


@pytest.fixture(scope="module")
def daemonset() -> dict:
    return find("DaemonSet", "gpu-npd")


@pytest.fixture(scope="module")
def job() -> dict:
    return find("Job", "gpu-npd-preflight")


def pod_spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def only_container(workload: dict) -> dict:
    [container] = pod_spec(workload)["containers"]
    return container


def configmap_file(key: str, tmp_path: Path) -> Path:
    path = tmp_path / key
    path.write_text(find("ConfigMap", "gpu-npd-config")["data"][key], encoding="utf-8")
    return path


def commented_example(text: str, first_line: str) -> str:
    """The comment block that starts with `# <first_line>`, uncommented."""
    lines = text.splitlines()
    start = lines.index(f"# {first_line}")
    block = []
    for line in lines[start:]:
        if not line.startswith("#"):
            break
        block.append(line[2:] if line.startswith("# ") else line[1:])
    return "\n".join(block) + "\n"


# --- Schema

def test_deploy_has_the_expected_manifests():
    kinds = {(d["kind"], d["metadata"]["name"]) for _, _, d in ALL_DOCS}
    assert kinds == {
        ("Namespace", "gpu-npd"), ("ServiceAccount", "gpu-npd"), ("ClusterRole", "gpu-npd"),
        ("ClusterRoleBinding", "gpu-npd"), ("ConfigMap", "gpu-npd-config"), ("DaemonSet", "gpu-npd"),
        ("Service", "gpu-npd-metrics"), ("NetworkPolicy", "gpu-npd-metrics"), ("Job", "gpu-npd-preflight"), ("Job", "gpu-npd-preflight-nccl"),
        ("ConfigMap", "gpu-npd-preflight-settings"), ("ConfigMap", "gpu-npd-preflight-nccl-settings"),
        ("PodMonitor", "gpu-npd"), ("PrometheusRule", "gpu-npd"),
        ("ServiceAccount", "gpu-npd-simulator"), ("ClusterRole", "gpu-npd-simulator"),
        ("ClusterRoleBinding", "gpu-npd-simulator"), ("ConfigMap", "gpu-npd-fleet"),
        ("StatefulSet", "gpu-npd-simulator"), ("Service", "gpu-npd-simulator"), ("Node", "kwok-gpu-manual-0"), ("Node", "kwok-gpu-manual-1"),
        ("ClusterRole", "gpu-npd-dra-taints"), ("ClusterRoleBinding", "gpu-npd-dra-taints"),
        ("NodeHealthCheck", "gpu-npd"), ("NodeReadinessRule", "gpu-npd"),
        ("ClusterRole", "gpu-npd-fleet-viewer"), ("ClusterRoleBinding", "gpu-npd-fleet-viewer"),
    }


@pytest.mark.parametrize("item", [d for d in ALL_DOCS if d[2]["kind"] not in CUSTOM_KINDS], ids=doc_id)
def test_manifest_validates_against_the_kubernetes_schema(item):
    path, _, doc = item
    try:
        validated = kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        where = ".".join(str(p) for p in e.path)
        pytest.fail(f"{path.relative_to(REPO)}: {doc['kind']}/{doc['metadata']['name']}: {where}: {e.message}")
    except kubernetes_validate.SchemaNotFoundError as e:
        pytest.fail(f"{path.relative_to(REPO)}: {e.message}")
    assert validated == K8S_VERSION


def test_schema_validation_is_strict_and_offline(daemonset):
    """The check above would prove little if unknown fields passed: a misspelt field must fail."""
    broken = yaml.safe_load(yaml.safe_dump(daemonset))
    only_container(broken)["volumeMounts"][0]["readonly"] = True          # readOnly, misspelt
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


def test_namespaced_objects_live_in_the_gpu_npd_namespace():
    cluster_scoped = {"Namespace", "ClusterRole", "ClusterRoleBinding", "Node", "NodeHealthCheck", "NodeReadinessRule"}
    for path, _, doc in ALL_DOCS:
        namespace = doc["metadata"].get("namespace")
        if doc["kind"] in cluster_scoped:
            assert namespace is None, f"{path}: {doc['kind']} is cluster-scoped"
        else:
            assert namespace == NAMESPACE, f"{path}: {doc['kind']}/{doc['metadata']['name']}"


# --- Kustomizations

@pytest.mark.parametrize("kustomization", kustomizations(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_kustomization_uses_every_file_of_its_directory(kustomization):
    """Every YAML file beside a kustomization is one of its resources or patches (none forgotten), every
    reference resolves inside deploy/, and nothing is generated (no generators, no Helm) but the
    dashboard's ConfigMap in deploy/monitoring, made from dashboard.json so the JSON exists once."""
    k = yaml.safe_load(kustomization.read_text(encoding="utf-8"))
    expected = (("kustomize.config.k8s.io/v1alpha1", "Component") if "components" in kustomization.parts
                else ("kustomize.config.k8s.io/v1beta1", "Kustomization"))
    assert (k["apiVersion"], k["kind"]) == expected
    here = kustomization.parent
    allowed = {"configMapGenerator"} if here == DEPLOY / "monitoring" else set()
    assert not ({"configMapGenerator", "secretGenerator", "helmCharts", "bases", "vars"} - allowed) & set(k), \
        "plain resources, patches, components and replacements only"
    references = list(k.get("resources", [])) + [p["path"] for p in k.get("patches", []) if "path" in p]
    assert len(references) == len(set(references)), "a file is listed twice"
    for reference in references + list(k.get("components", [])):
        target = (here / reference).resolve()
        assert target.is_relative_to(DEPLOY), f"{reference}: outside deploy/"
        assert target.is_file() or (target / "kustomization.yaml").is_file(), f"{reference}: no such file"
    present = {p.name for p in here.iterdir() if p.suffix in (".yaml", ".yml") and p.stem != "kustomization"}
    # deploy/remediation/draino.yaml is the alternative to its kustomization's NodeHealthCheck, applied
    # on its own (kubectl apply -f); tests/test_remediation.py checks it.
    standalone = {"draino.yaml"} if here == DEPLOY / "remediation" else set()
    assert present - standalone <= set(references), \
        f"left out of {kustomization}: {sorted(present - standalone - set(references))}"


def test_every_directory_of_deploy_is_a_kustomization_or_component():
    """But the Helm chart, deploy/helm (tests/test_helm.py)."""
    directories = {p for p in DEPLOY.rglob("*") if p.is_dir() and not p.is_relative_to(DEPLOY / "helm")}
    groups = {DEPLOY / "overlays", DEPLOY / "components"}
    assert directories - groups == {k.parent for k in kustomizations()}
    assert {p.parent for p in manifest_files()} <= {k.parent for k in kustomizations()}


def test_base_kustomization_lists_the_base():
    k = yaml.safe_load((DEPLOY / "base" / "kustomization.yaml").read_text(encoding="utf-8"))
    assert k["resources"] == ["namespace.yaml", "rbac.yaml", "configmap.yaml", "daemonset.yaml", "service.yaml"]


# --- RBAC

def test_cluster_role_grants_exactly_what_gpu_npd_needs():
    role = find("ClusterRole", "gpu-npd")
    granted = set()
    for rule in role["rules"]:
        assert set(rule) == {"apiGroups", "resources", "verbs"}, f"unexpected keys in {rule}"
        granted |= {(group, resource, verb) for group in rule["apiGroups"]
                    for resource in rule["resources"] for verb in rule["verbs"]}
    assert granted == {("", "nodes", "get"), ("", "nodes", "list"), ("", "nodes", "watch"),
                       ("", "nodes/status", "patch"), ("", "events", "create"), ("", "events", "patch"),
                       ("resource.k8s.io", "resourceslices", "get"), ("resource.k8s.io", "resourceslices", "list"),
                       ("resource.k8s.io", "resourceslices", "watch")}
    assert "aggregationRule" not in role


def test_dra_taints_role_grants_only_what_device_taints_need(daemonset):
    """deploy/overlays/dra-taints: a role of its own for --dra-taints, bound to the daemon's account."""
    role = find("ClusterRole", "gpu-npd-dra-taints")
    granted = {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]
               for v in rule["verbs"]}
    assert granted == {("resource.k8s.io", "devicetaintrules", v) for v in ("get", "list", "create", "update", "delete")}
    binding = find("ClusterRoleBinding", "gpu-npd-dra-taints")
    assert binding["roleRef"]["name"] == "gpu-npd-dra-taints"
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "gpu-npd", "namespace": NAMESPACE}]


def test_no_wildcard_anywhere_in_rbac():
    for rule in find("ClusterRole", "gpu-npd")["rules"] + find("ClusterRole", "gpu-npd-dra-taints")["rules"]:
        for key in ("apiGroups", "resources", "verbs"):
            assert not any("*" in value for value in rule[key]), f"wildcard in {key}: {rule}"


def test_cluster_role_is_bound_to_the_daemonset_service_account(daemonset):
    binding = find("ClusterRoleBinding", "gpu-npd")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "gpu-npd"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "gpu-npd", "namespace": NAMESPACE}]
    find("ServiceAccount", "gpu-npd")
    spec = pod_spec(daemonset)
    assert spec["serviceAccountName"] == "gpu-npd" and spec["automountServiceAccountToken"] is True


# --- DaemonSet

def host_mounts(workload: dict) -> dict[str, tuple[dict, dict]]:
    """hostPath volumes by host path -> (the volume's hostPath, the container's mount)."""
    volumes = {v["name"]: v for v in pod_spec(workload)["volumes"]}
    mounts = {}
    for mount in only_container(workload)["volumeMounts"]:
        volume = volumes[mount["name"]]
        if "hostPath" in volume:
            mounts[volume["hostPath"]["path"]] = (volume["hostPath"], mount)
    return mounts


def test_daemonset_host_mounts_are_read_only_except_the_state_directory(daemonset):
    mounts = host_mounts(daemonset)
    # Only what a check reads: /dev/kmsg (xid), /sys (--sysfs-root /host/sys), /proc and /dev beside it
    # (the driver check; the fabric check's process table). No /run, no /var/log.
    assert set(mounts) == {"/dev/kmsg", "/sys", "/proc", "/dev", STATE_DIR}
    assert {host: mount["mountPath"] for host, (_, mount) in mounts.items() if host in ("/sys", "/proc", "/dev")} == {
        "/sys": "/host/sys", "/proc": "/host/proc", "/dev": "/host/dev"}, "the plumbing reader looks beside --sysfs-root"
    for host_path, (_, mount) in mounts.items():
        if host_path == STATE_DIR:
            assert not mount.get("readOnly", False), "the state directory must be writable"
        else:
            assert mount.get("readOnly") is True, f"hostPath {host_path} must be mounted readOnly"
    assert mounts["/dev/kmsg"][0]["type"] == "CharDevice" and mounts["/dev/kmsg"][1]["mountPath"] == "/dev/kmsg"
    assert mounts["/sys"][1]["mountPath"] == "/host/sys"
    assert mounts[STATE_DIR][0]["type"] == "DirectoryOrCreate" and mounts[STATE_DIR][1]["mountPath"] == STATE_DIR


def test_daemonset_mounts_the_configmap_read_only(daemonset):
    volumes = {v["name"]: v for v in pod_spec(daemonset)["volumes"]}
    [mount] = [m for m in only_container(daemonset)["volumeMounts"] if "configMap" in volumes[m["name"]]]
    assert volumes[mount["name"]]["configMap"]["name"] == "gpu-npd-config"
    assert mount["mountPath"] == "/etc/gpu-npd" and mount["readOnly"] is True


def test_daemonset_node_name_comes_from_the_downward_api(daemonset):
    env = {e["name"]: e for e in only_container(daemonset)["env"]}
    assert env["NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert env["NVIDIA_VISIBLE_DEVICES"]["value"] == "all"
    assert env["NVIDIA_DRIVER_CAPABILITIES"]["value"] == "utility"


def test_daemonset_runs_on_every_gpu_node_tainted_or_not(daemonset):
    spec = pod_spec(daemonset)
    assert "nodeSelector" not in spec, "nodes are chosen by nodeAffinity, labelled by GFD or NFD"
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    gpu_labels = {e["key"] for term in terms for e in term["matchExpressions"] if e["operator"] == "In"}
    assert {"nvidia.com/gpu.present", "feature.node.kubernetes.io/pci-10de.present"} <= gpu_labels
    for term in terms:   # ORed terms, ANDed expressions: the KWOK exclusion must be in each one
        assert {"key": "type", "operator": "NotIn", "values": ["kwok"]} in term["matchExpressions"], term
    tolerated = {(t["operator"], t.get("effect")) for t in spec["tolerations"] if "key" not in t}
    assert {("Exists", "NoSchedule"), ("Exists", "NoExecute")} <= tolerated
    assert spec["priorityClassName"] == "system-node-critical"
    assert "runtimeClassName" not in spec, "optional: deploy/overlays/nvidia-runtime adds it"
    assert daemonset["spec"]["updateStrategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": "10%"}}


def test_daemonset_liveness_is_healthz_and_readiness_is_readyz_on_the_metrics_port(daemonset):
    container = only_container(daemonset)
    assert {"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"} in container["ports"]
    for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
        assert container[probe]["httpGet"] == {"path": path, "port": "metrics"}, probe
        assert container[probe]["periodSeconds"] >= 5 and container[probe]["timeoutSeconds"] >= 1


def test_metrics_service_selects_the_daemonset_pods(daemonset):
    service = find("Service", "gpu-npd-metrics")
    assert service["spec"].get("type", "ClusterIP") == "ClusterIP" and service["spec"].get("clusterIP") != "None"
    labels = daemonset["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert service["spec"]["ports"] == [{"name": "metrics", "port": METRICS_PORT, "targetPort": "metrics",
                                         "protocol": "TCP"}]
    annotations = service["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/port"] == str(METRICS_PORT)


def quantity(value: str | int) -> float:
    units = {"m": 1e-3, "": 1, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "K": 1e3, "M": 1e6, "G": 1e9}
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([A-Za-z]*)", str(value))
    assert m and m[2] in units, f"unreadable quantity {value!r}"
    return float(m[1]) * units[m[2]]


@pytest.mark.parametrize("name", ["daemonset", "job"])
def test_resources_have_requests_and_limits(name, request):
    resources = only_container(request.getfixturevalue(name))["resources"]
    for resource in ("cpu", "memory"):
        request_, limit = resources["requests"][resource], resources["limits"][resource]
        assert 0 < quantity(request_) <= quantity(limit), f"{resource}: request {request_}, limit {limit}"


def test_daemonset_security_context(daemonset):
    spec = pod_spec(daemonset)
    assert only_container(daemonset)["securityContext"] == {
        "privileged": True, "runAsUser": 0, "readOnlyRootFilesystem": True}
    assert spec["terminationGracePeriodSeconds"] == 10 and spec["enableServiceLinks"] is False
    assert only_container(daemonset)["image"] == "gpu-npd:0.1.0"


def test_daemonset_args_point_at_what_the_pod_mounts(daemonset):
    container = only_container(daemonset)
    args = container["args"]
    options: dict[str, list[str]] = {}
    for flag, value in zip(args[1::2], args[2::2]):
        options.setdefault(flag, []).append(value)
    assert args[0] == "run"
    assert options["--rules"] == ["builtin", "/etc/gpu-npd/site-rules.yaml"]
    assert options["--config"] == ["/etc/gpu-npd/config.yaml"]
    data = find("ConfigMap", "gpu-npd-config")["data"]
    for path in (options["--rules"][1], options["--config"][0]):
        assert Path(path).parent == Path("/etc/gpu-npd") and Path(path).name in data
    mount_paths = {m["mountPath"] for m in container["volumeMounts"]}
    assert options["--sysfs-root"] == ["/host/sys"] and "/host/sys" in mount_paths
    assert options["--state-dir"] == [STATE_DIR] and STATE_DIR in mount_paths
    assert options["--listen"] == [f"0.0.0.0:{METRICS_PORT}"]


def test_daemonset_args_parse_with_the_cli(daemonset):
    probe = subprocess.run([sys.executable, "-m", "detector.cli.main", "run", "--help"],
                           capture_output=True, text=True, timeout=30, cwd=REPO)
    assert probe.returncode == 0, probe.stderr
    args = only_container(daemonset)["args"]
    try:
        parsed = build_parser().parse_args(args)
    except SystemExit as e:
        pytest.fail(f"gpu-npd rejects the DaemonSet's args {args} (exit {e.code})")
    assert getattr(parsed, "func", None) is not None


# --- Preflight Job

def test_preflight_job_shape(job):
    spec = pod_spec(job)
    assert job["spec"]["backoffLimit"] == 0 and job["spec"]["ttlSecondsAfterFinished"] == 3600
    assert job["spec"]["activeDeadlineSeconds"] > 90      # past the checks' own timeouts (20 + 10 + 60 s)
    assert spec["restartPolicy"] == "Never"
    assert spec["automountServiceAccountToken"] is False and "serviceAccountName" not in spec
    assert "nodeName" not in spec and "runtimeClassName" not in spec
    [term] = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert term["matchFields"] == [{"key": "metadata.name", "operator": "In", "values": ["REPLACE-WITH-NODE"]}]
    assert term["matchExpressions"] == [{"key": "type", "operator": "NotIn", "values": ["kwok"]}]
    container = only_container(job)
    assert "command" not in container, "the image's entrypoint, gpu-npd, must be what exits"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert container["securityContext"] == {"privileged": True, "runAsUser": 0, "readOnlyRootFilesystem": True}
    assert container["image"] == only_container(find("DaemonSet", "gpu-npd"))["image"]


def test_preflight_host_mounts_are_all_read_only(job):
    mounts = host_mounts(job)
    assert set(mounts) == {"/dev/kmsg", "/sys"}
    assert all(mount.get("readOnly") is True for _, mount in mounts.values())
    assert mounts["/sys"][1]["mountPath"] == "/host/sys"


def test_preflight_args_parse_with_the_cli(job):
    args = only_container(job)["args"]
    assert args == ["diagnose", "-o", "json", "--sysfs-root", "/host/sys", "--checks", "visibility,pcie,xid"]
    parsed = build_parser().parse_args(args)
    assert parsed.output == "json" and parsed.sysfs_root == Path("/host/sys")
    assert parsed.checks.split(",") == ["visibility", "pcie", "xid"]


@pytest.fixture(scope="module")
def nccl_job() -> dict:
    return find("Job", "gpu-npd-preflight-nccl")


def test_nccl_preflight_runs_the_probe_with_what_nccl_needs(nccl_job, job):
    container = only_container(nccl_job)
    parsed = build_parser().parse_args(container["args"])
    assert parsed.checks.split(",") == ["visibility", "pcie", "xid", "nccl"] and parsed.output == "json"
    assert parsed.nccl_tests == "/opt/nccl-tests/build/all_reduce_perf"
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert set(env["NVIDIA_DRIVER_CAPABILITIES"].split(",")) == {"compute", "utility"}
    shm = next(v for v in pod_spec(nccl_job)["volumes"] if v["name"] == "shm")
    assert shm["emptyDir"]["medium"] == "Memory"
    assert {m["mountPath"] for m in container["volumeMounts"]} >= {"/dev/shm", "/tmp"}
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert container["image"].startswith("gpu-npd-nccl:")
    assert host_mounts(nccl_job).keys() == host_mounts(job).keys()
    assert all(mount.get("readOnly") is True for _, mount in host_mounts(nccl_job).values())
    # The Job outlives the probe's own kill (check timeout 300 s less its margin).
    assert nccl_job["spec"]["activeDeadlineSeconds"] > 300


def test_nccl_dockerfile_builds_nccl_tests_where_the_job_looks():
    text = (REPO / "Dockerfile.nccl").read_text(encoding="utf-8")
    assert "/opt/nccl-tests/build" in text and "make -C /opt/nccl-tests" in text
    copied = [line.split()[1] for line in text.splitlines() if line.startswith("COPY ") and "--from" not in line]
    assert all((REPO / source).exists() for source in copied)


# --- KWOK: the fleet simulator

def test_simulator_role_adds_only_create_and_patch_nodes_to_the_daemon_role():
    """The simulator's nodes are its own (create, annotate); it reads no ResourceSlice of a real DRA driver."""
    daemon = {(r, v) for rule in find("ClusterRole", "gpu-npd")["rules"] for r in rule["resources"] for v in rule["verbs"]}
    sim = {(r, v) for rule in find("ClusterRole", "gpu-npd-simulator")["rules"]
           for r in rule["resources"] for v in rule["verbs"]}
    assert sim - daemon == {("nodes", "create"), ("nodes", "patch")}
    assert daemon - sim <= {("resourceslices", v) for v in ("get", "list", "watch")}


def test_simulator_statefulset_runs_the_fleet_file_as_non_root_one_shard_per_pod(tmp_path, registry):
    from detector.sim.fleetfile import load_fleet

    deployment = find("StatefulSet", "gpu-npd-simulator")
    container = only_container(deployment)
    env = {e["name"]: e for e in container["env"]}
    assert env["SHARD_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.labels['apps.kubernetes.io/pod-index']"
    assert env["SHARDS"]["value"] == str(deployment["spec"]["replicas"]), "one shard per pod"
    assert container["env"][1]["name"] == "SHARDS", "the comment's scaling patch names env/1"
    expanded = [a.replace("$(SHARD_INDEX)", "2").replace("$(SHARDS)", "4") for a in container["args"]]
    parsed = build_parser().parse_args(expanded)                  # as the kubelet expands them on pod 2 of 4
    assert parsed.func.__name__ == "cmd_simulate" and parsed.fleet == Path("/etc/gpu-npd-sim/fleet.yaml")
    assert parsed.shard == (2, 4)
    assert find("Service", "gpu-npd-simulator")["spec"]["clusterIP"] == "None"
    assert deployment["spec"]["serviceName"] == "gpu-npd-simulator"
    assert pod_spec(deployment)["serviceAccountName"] == "gpu-npd-simulator"
    assert pod_spec(deployment)["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(find("ConfigMap", "gpu-npd-fleet")["data"]["fleet.yaml"], encoding="utf-8")
    spec = load_fleet(fleet)
    assert len(spec.nodes) == 100 and spec.fault_specs


def test_kwok_nodes_follow_kwok_conventions():
    for name in ("kwok-gpu-manual-0", "kwok-gpu-manual-1"):
        node = find("Node", name)
        assert node["metadata"]["annotations"]["kwok.x-k8s.io/node"] == "fake"
        assert node["metadata"]["labels"]["type"] == "kwok"
        assert {"key": "kwok.x-k8s.io/node", "value": "fake", "effect": "NoSchedule"} in node["spec"]["taints"]
        assert node["status"]["capacity"]["nvidia.com/gpu"] == "8"


# --- ConfigMap contents, through the project's loaders

def test_site_rules_load_with_the_rule_loader(tmp_path, registry):
    """The DaemonSet loads them beside the bundled rules (as its args say); empty, they add nothing."""
    from detector.rules.sources import builtin_rules_dir
    site = configmap_file("site-rules.yaml", tmp_path)
    ruleset = load_rules([builtin_rules_dir(), site], registry.fields_by_check())
    assert ruleset.counts_by_file()[str(site)] == 0 and ruleset.rules


def test_site_rules_commented_example_is_a_valid_rule(tmp_path, registry):
    text = find("ConfigMap", "gpu-npd-config")["data"]["site-rules.yaml"]
    example = tmp_path / "example.yaml"
    example.write_text("version: 1\n" + commented_example(text, "rules:"), encoding="utf-8")
    [rule] = load_rules([example], registry.fields_by_check()).rules
    assert rule.name.startswith("site-")


def test_config_parses_and_builds_every_check(tmp_path, registry):
    file, settings = load_check_settings(configmap_file("config.yaml", tmp_path))
    checks = build_checks(registry, None, settings, file)
    assert {c.name for c in checks} >= {"visibility", "pcie", "xid"}


def test_config_commented_example_states_the_defaults(tmp_path, registry):
    text = find("ConfigMap", "gpu-npd-config")["data"]["config.yaml"]
    example = tmp_path / "example.yaml"
    example.write_text(commented_example(text, "checks:"), encoding="utf-8")
    file, settings = load_check_settings(example)
    assert set(settings) == set(registry.names()), "the example lists every check"
    build_checks(registry, None, settings, file)
    for name, values in settings.items():
        cls = registry.get(name)
        if cls.scheduled:
            assert (values["interval"], values["timeout"]) == (cls.default_interval_s, cls.default_timeout_s), name
        assert values.get("enabled", True) == cls.enabled_by_default, name


# --- Dockerfile

def dockerfile_instructions() -> list[tuple[str, str]]:
    text = (REPO / "Dockerfile").read_text(encoding="utf-8").replace("\\\n", " ")
    return [tuple(line.split(None, 1)) for line in text.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def test_dockerfile_copies_what_exists_and_is_not_ignored():
    ignored = {line.strip() for line in (REPO / ".dockerignore").read_text(encoding="utf-8").splitlines()
               if line.strip() and not line.startswith("#")}
    copied = []
    for op, rest in dockerfile_instructions():
        if op.upper() == "COPY" and "--from" not in rest:
            copied += rest.split()[:-1]
    assert copied, "no COPY from the build context"
    for source in copied:
        assert (REPO / source).exists(), f"COPY {source}: not in the repository"
        assert source.rstrip("/") not in ignored, f"COPY {source}: excluded by .dockerignore"
    assert {"pyproject.toml", "README.md", "detector/", "fake_nvml/", "kube_emulator/", "rules/"} <= set(copied)
    assert {".venv", "tests", "bench", ".git"} <= ignored


def test_dockerfile_entrypoint_and_port():
    instructions = dockerfile_instructions()
    by_op: dict[str, list[str]] = {}
    for op, rest in instructions:
        by_op.setdefault(op.upper(), []).append(rest.strip())
    assert by_op["FROM"][0].split()[0] == "python:3.11-slim" and by_op["FROM"][-1] == "python:3.11-slim"
    assert by_op["ENTRYPOINT"] == ['["gpu-npd"]'] and by_op["CMD"] == ['["run"]']
    assert by_op["EXPOSE"] == [str(METRICS_PORT)]
