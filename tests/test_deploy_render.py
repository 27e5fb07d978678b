"""What kustomize makes of deploy/: every kustomization (the base, each overlay, the preflights, KWOK)
rendered by a real `kubectl kustomize`, offline, and every rendered object validated against the
Kubernetes schemas (kubernetes-validate, strict). Then what each variant promises, on the rendered
objects: which nodes its pods can land on (a small evaluator of nodeSelectorTerms, so that no pod ever
lands on a KWOK node), the Pod Security labels of its namespace and that its pods meet them, the optional
RuntimeClass, read-only host mounts, the preflight Jobs' GPU count and exit codes, and the PodMonitor
(a custom resource kubernetes-validate has no schema for, checked field by field).

kubectl comes from `make kubectl` (which `make test` runs) at .venv/tools/kubectl, or from PATH."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import kubernetes_validate
import pytest
import yaml

from conftest import REPO
from detector.cli.main import build_parser

DEPLOY = REPO / "deploy"
NAMESPACE = "gpu-npd"
STATE_DIR = "/var/lib/gpu-npd"
# The oldest Kubernetes the manifests promise (docs/deploying.md), and the newest kubernetes-validate knows that
# the bundled kubectl (1.35) also speaks.
K8S_VERSIONS = ("1.30", "1.35")
KUBECTL_CANDIDATES = (REPO / ".venv" / "tools" / "kubectl", REPO / ".venv" / "bin" / "kubectl")
KUBECTL_MIN_MINOR = 27          # kustomize v5: components, replacements into list items and dotted keys
KWOK_EXCLUSION = {"key": "type", "operator": "NotIn", "values": ["kwok"]}
POD_KINDS = {"DaemonSet", "Deployment", "StatefulSet", "Job"}
# Host paths a check reads, and the one the daemon writes.
CHECK_HOST_PATHS = {"/dev/kmsg", "/sys", "/proc", "/dev"}


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    """In-process: any attempt to open a connection fails the test. kubectl runs with a proxy that
    refuses, so a kustomization that reached for a remote base would fail too."""
    def refuse(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args!r}")
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)


# --- kubectl kustomize

KUBECTL_MISSING = ("kubectl not found at .venv/tools/kubectl nor on PATH: run `make kubectl` (`make test` runs "
                   "it) to install it, then run the tests again")


def find_kubectl() -> str | None:
    for candidate in KUBECTL_CANDIDATES:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return shutil.which("kubectl")


def require_kubectl() -> str:
    """kubectl's path; a failure (not a skip) without it: CI runs `make test`, which installs it."""
    path = find_kubectl()
    if path is None:
        pytest.fail(KUBECTL_MISSING)
    return path


def offline_env() -> dict[str, str]:
    env = dict(os.environ)
    refused = "http://127.0.0.1:9"          # the discard port: nothing listens, a fetch fails at once
    env.update(HTTP_PROXY=refused, HTTPS_PROXY=refused, http_proxy=refused, https_proxy=refused,
               NO_PROXY="", no_proxy="", KUBECONFIG=os.devnull, GIT_TERMINAL_PROMPT="0")
    return env


@pytest.fixture(scope="session")
def kubectl() -> str:
    path = require_kubectl()
    proc = subprocess.run([path, "version", "--client", "-o", "json"], capture_output=True, text=True,
                          timeout=60, env=offline_env())
    assert proc.returncode == 0, f"{path} version: {proc.stderr}"
    minor = int(re.match(r"\d+", json.loads(proc.stdout)["clientVersion"]["minor"])[0])
    if minor < KUBECTL_MIN_MINOR:
        pytest.fail(f"{path} is kubectl 1.{minor}; these kustomizations need 1.{KUBECTL_MIN_MINOR} or newer: "
                    "run `make kubectl` for the pinned one")
    return path


def test_kubectl_is_installed():
    """Not a skip: CI runs `make test`, which installs it, so a missing kubectl is a broken setup."""
    assert find_kubectl(), KUBECTL_MISSING


_rendered: dict[str, list[dict]] = {}


def render(kubectl: str, directory: Path) -> list[dict]:
    """`kubectl kustomize DIRECTORY`, parsed; each directory of deploy/ once per session."""
    key = str(directory.resolve())
    if key not in _rendered:
        proc = subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True, text=True,
                              timeout=120, env=offline_env())
        if proc.returncode != 0:
            pytest.fail(f"kubectl kustomize {directory}: {proc.stderr.strip()}")
        docs = [d for d in yaml.safe_load_all(proc.stdout) if d is not None]
        assert docs, f"kubectl kustomize {directory} rendered nothing"
        _rendered[key] = docs
    return _rendered[key]


def kustomization_kind(directory: Path) -> str:
    return yaml.safe_load((directory / "kustomization.yaml").read_text(encoding="utf-8"))["kind"]


# Every directory `kubectl apply -k` can take: Kustomizations, not Components (those only go into one).
VARIANTS = sorted(p.parent for p in DEPLOY.rglob("kustomization.yaml") if kustomization_kind(p.parent) == "Kustomization")
# The variants that deploy the DaemonSet, with the Pod Security level their namespace must enforce.
DAEMON_VARIANTS = {
    "base": "privileged",
    "overlays/nvidia-runtime": "privileged",
    "overlays/podmonitor": "privileged",
    "overlays/custom-node-label": "privileged",
    "overlays/unprivileged": "baseline",
    "overlays/dra-taints": "privileged",
    "overlays/networkpolicy": "privileged",
}
PREFLIGHTS = {"preflight": "gpu-npd-preflight", "preflight-nccl": "gpu-npd-preflight-nccl"}


def name_of(directory: Path) -> str:
    return str(directory.relative_to(DEPLOY))


def variant(kubectl: str, name: str) -> list[dict]:
    return render(kubectl, DEPLOY / name)


def objects(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict], kind: str, name: str | None = None) -> dict:
    found = [d for d in objects(docs, kind) if name is None or d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def pod_spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def only_container(workload: dict) -> dict:
    [container] = pod_spec(workload)["containers"]
    return container


def copy_of_deploy(tmp_path: Path) -> Path:
    """A scratch copy of deploy/, so a test can change a file and render it with paths intact."""
    copy = tmp_path / "deploy"
    shutil.copytree(DEPLOY, copy)
    return copy


def test_every_variant_is_covered():
    """A new overlay is rendered and validated below without being named; naming the DaemonSet ones
    here makes its Pod Security level and node selection a decision, not an accident. deploy/monitoring
    holds no pods (alerts and a dashboard: tests/test_monitoring.py), nor do deploy/remediation (a
    NodeHealthCheck: tests/test_remediation.py), deploy/readiness (a NodeReadinessRule:
    tests/test_readiness.py) and deploy/fleet-viewer (read-only RBAC for `gpu-npd fleet`:
    tests/test_fleet_cli.py)."""
    names = {name_of(v) for v in VARIANTS}
    expected = set(DAEMON_VARIANTS) | set(PREFLIGHTS) | {"kwok", "monitoring", "remediation", "readiness",
                                                         "fleet-viewer"}
    assert names == expected, f"new or missing kustomizations: {sorted(names ^ expected)}"


# --- Rendering and schemas

def schema_failures(docs: list[dict], version: str, skip_kinds: set[str] | frozenset[str]) -> list[str]:
    """Each object that does not validate (strictly) against Kubernetes `version`'s schema, said as
    Kind/name: field: why. Objects of `skip_kinds` (custom resources: no schema offline) are left out."""
    failures = []
    for doc in docs:
        if doc["kind"] in skip_kinds:
            continue
        where = f"{doc['kind']}/{doc['metadata']['name']}"
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            failures.append(f"{where}: {'.'.join(str(p) for p in e.path)}: {e.message}")
        except kubernetes_validate.SchemaNotFoundError as e:
            failures.append(f"{where}: {e.message}")
    return failures


@pytest.mark.parametrize("directory", VARIANTS, ids=name_of)
@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_rendered_objects_validate_against_the_kubernetes_schema(kubectl, directory, version):
    # custom resources have no schema here: test_podmonitor_* and test_monitoring.py check them
    failures = schema_failures(render(kubectl, directory), version, CUSTOM_RESOURCES)
    assert not failures, f"kubectl kustomize {name_of(directory)} against Kubernetes {version}:\n" + "\n".join(failures)


def test_strict_validation_rejects_a_misspelt_field(kubectl):
    """The check above would prove little if unknown fields passed."""
    broken = json.loads(json.dumps(one(variant(kubectl, "base"), "DaemonSet")))
    pod_spec(broken)["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExcecution"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSIONS[0], strict=True)


@pytest.mark.parametrize("directory", VARIANTS, ids=name_of)
def test_rendered_objects_live_in_the_gpu_npd_namespace_and_nothing_local_leaks(kubectl, directory):
    cluster_scoped = {"Namespace", "ClusterRole", "ClusterRoleBinding", "Node", "NodeHealthCheck", "NodeReadinessRule"}
    for doc in render(kubectl, directory):
        where = f"{doc['kind']}/{doc['metadata']['name']}"
        if doc["kind"] in cluster_scoped:
            assert "namespace" not in doc["metadata"], where
        else:
            assert doc["metadata"].get("namespace") == NAMESPACE, where
        annotations = doc["metadata"].get("annotations") or {}
        assert "config.kubernetes.io/local-config" not in annotations, f"{where} is kustomize's input only"
        assert "REPLACE" not in json.dumps(doc) or doc["kind"] == "Job", f"{where}: a placeholder left"


def test_kustomizations_render_offline_from_local_files_only():
    for path in DEPLOY.rglob("kustomization.yaml"):
        text = path.read_text(encoding="utf-8")
        assert not re.search(r"(https?|git|ssh)://|github\.com", text), f"{path}: remote reference"


# --- Node selection: nodeAffinity evaluated as the scheduler (and the DaemonSet controller) does

def requirement_matches(requirement: dict, values_by_key: dict[str, str]) -> bool:
    key, op, values = requirement["key"], requirement["operator"], requirement.get("values", [])
    present = key in values_by_key
    if op == "In":
        return present and values_by_key[key] in values
    if op == "NotIn":
        return not present or values_by_key[key] not in values
    if op == "Exists":
        return present
    if op == "DoesNotExist":
        return not present
    if op in ("Gt", "Lt"):
        [bound] = values
        try:
            value = int(values_by_key[key]) if present else None
        except ValueError:
            return False
        return value is not None and (value > int(bound) if op == "Gt" else value < int(bound))
    raise AssertionError(f"unknown nodeSelector operator {op!r}")


def term_matches(term: dict, node: dict) -> bool:
    """A nodeSelectorTerm: its expressions (labels) and fields (metadata.name) all hold. A term with
    neither matches no node."""
    expressions, fields = term.get("matchExpressions") or [], term.get("matchFields") or []
    if not expressions and not fields:
        return False
    labels = node["metadata"].get("labels") or {}
    node_fields = {"metadata.name": node["metadata"]["name"]}
    return all(requirement_matches(e, labels) for e in expressions) and \
        all(requirement_matches(f, node_fields) for f in fields)


def pod_may_run_on(spec: dict, node: dict) -> bool:
    """nodeName, nodeSelector (every label) and the required node affinity (any term)."""
    if "nodeName" in spec and spec["nodeName"] != node["metadata"]["name"]:
        return False
    labels = node["metadata"].get("labels") or {}
    if any(labels.get(k) != v for k, v in (spec.get("nodeSelector") or {}).items()):
        return False
    required = ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution")
    if required is None:
        return True
    return any(term_matches(t, node) for t in required["nodeSelectorTerms"])


def node(name: str, **labels: str) -> dict:
    return {"kind": "Node", "metadata": {"name": name, "labels": dict(labels)}}


def gpu_labels(**labels: str) -> dict[str, str]:
    return {"kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64", **labels}


GPU_OPERATOR_NODE = node("gpu-a", **gpu_labels(**{
    "nvidia.com/gpu.present": "true", "nvidia.com/gpu.count": "8", "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
    "feature.node.kubernetes.io/pci-10de.present": "true"}))
GFD_ONLY_NODE = node("gpu-b", **gpu_labels(**{"nvidia.com/gpu.present": "true"}))
NFD_ONLY_NODE = node("gpu-c", **gpu_labels(**{"feature.node.kubernetes.io/pci-10de.present": "true"}))
NFD_DEFAULT_NODE = node("gpu-d", **gpu_labels(**{"feature.node.kubernetes.io/pci-0302_10de.present": "true"}))
KWOK_GPU_NODE = node("kwok-gpu-0001", type="kwok", **gpu_labels(**{"nvidia.com/gpu.present": "true"}))
CPU_NODE = node("cpu-a", **gpu_labels(**{"feature.node.kubernetes.io/pci-1af4.present": "true"}))


def test_evaluator_follows_kubernetes_semantics():
    has = {"a": "1", "n": "5"}
    assert requirement_matches({"key": "a", "operator": "In", "values": ["1", "2"]}, has)
    assert not requirement_matches({"key": "b", "operator": "In", "values": ["1"]}, has)
    assert requirement_matches({"key": "b", "operator": "NotIn", "values": ["1"]}, has)     # absent: not in
    assert not requirement_matches({"key": "a", "operator": "NotIn", "values": ["1"]}, has)
    assert requirement_matches({"key": "a", "operator": "Exists"}, has)
    assert requirement_matches({"key": "b", "operator": "DoesNotExist"}, has)
    assert requirement_matches({"key": "n", "operator": "Gt", "values": ["4"]}, has)
    assert not requirement_matches({"key": "n", "operator": "Lt", "values": ["5"]}, has)
    two_terms = {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [{"key": "x", "operator": "Exists"},
                                                    {"key": "y", "operator": "Exists"}]},
                              {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["m"]}]}]}}}}
    assert pod_may_run_on(two_terms, node("n", x="", y=""))          # first term: both expressions
    assert not pod_may_run_on(two_terms, node("n", x=""))            # ANDed within a term
    assert pod_may_run_on(two_terms, node("m"))                      # ORed across terms
    assert not pod_may_run_on({"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{}]}}}}, node("n"))                      # an empty term matches nothing
    assert not pod_may_run_on({"nodeSelector": {"x": "1"}}, node("n", x="2"))


def daemon_node_affinity_terms(daemonset: dict) -> list[dict]:
    return pod_spec(daemonset)["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"]


def kwok_nodes_asking_for(terms: list[dict]) -> Iterator[dict]:
    """For each term, a KWOK node carrying every label that term asks for: such a node would match if
    the term did not exclude KWOK itself."""
    for i, term in enumerate(terms):
        labels = {"type": "kwok"}
        for e in term.get("matchExpressions") or []:
            if e["operator"] == "In":
                labels[e["key"]] = e["values"][0]
            elif e["operator"] == "Exists":
                labels[e["key"]] = "true"
            elif e["operator"] == "Gt":
                labels[e["key"]] = str(int(e["values"][0]) + 1)
            elif e["operator"] == "Lt":
                labels[e["key"]] = str(int(e["values"][0]) - 1)
        labels["type"] = "kwok"
        yield node(f"kwok-term-{i}", **labels)


def simulator_kwok_node() -> dict:
    """A node exactly as `gpu-npd simulate` creates it for a fleet in a KWOK cluster."""
    from detector.sim.fleet import kwok_node
    from detector.sim.fleetfile import SimNodeSpec
    return kwok_node(SimNodeSpec("kwok-gpu-0042", "h100-sxm-8", {}, 8, "rack-02"), "h100-sxm-8",
                     "NVIDIA-H100-80GB-HBM3")


@pytest.mark.parametrize("name", sorted(DAEMON_VARIANTS))
def test_no_daemon_pod_can_land_on_a_kwok_node(kubectl, name):
    """KWOK's nodes carry GPU labels and the DaemonSet tolerates every taint (KWOK's included), so only
    the affinity keeps the pods off them: every term must exclude type=kwok on its own."""
    daemonset = one(variant(kubectl, name), "DaemonSet", "gpu-npd")
    terms = daemon_node_affinity_terms(daemonset)
    for term in terms:
        assert KWOK_EXCLUSION in term.get("matchExpressions", []), f"{name}: a term without the KWOK exclusion"
    kwok = [KWOK_GPU_NODE, simulator_kwok_node(), *objects(variant(kubectl, "kwok"), "Node"),
            *kwok_nodes_asking_for(terms)]
    assert len(kwok) >= 4 + len(terms)
    for candidate in kwok:
        assert candidate["metadata"]["labels"]["type"] == "kwok"
        assert not pod_may_run_on(pod_spec(daemonset), candidate), \
            f"{name}: a gpu-npd pod could land on KWOK node {candidate['metadata']['name']}"
    assert not pod_may_run_on(pod_spec(daemonset), CPU_NODE), f"{name}: a node without GPUs"


@pytest.mark.parametrize("name", [n for n in sorted(DAEMON_VARIANTS) if n != "overlays/custom-node-label"])
def test_daemon_runs_on_gpu_nodes_labelled_by_the_gpu_operator_or_by_nfd(kubectl, name):
    spec = pod_spec(one(variant(kubectl, name), "DaemonSet", "gpu-npd"))
    for gpu_node in (GPU_OPERATOR_NODE, GFD_ONLY_NODE, NFD_ONLY_NODE, NFD_DEFAULT_NODE):
        assert pod_may_run_on(spec, gpu_node), f"{name}: no pod on {gpu_node['metadata']['labels']}"
    assert not pod_may_run_on(spec, CPU_NODE) and not pod_may_run_on(spec, KWOK_GPU_NODE)


def test_custom_node_label_overlay_selects_by_its_label_alone(kubectl):
    spec = pod_spec(one(variant(kubectl, "overlays/custom-node-label"), "DaemonSet", "gpu-npd"))
    assert pod_may_run_on(spec, node("site-gpu", **{"example.com/gpu-node": "true"}))
    assert not pod_may_run_on(spec, node("kwok-site-gpu", type="kwok", **{"example.com/gpu-node": "true"}))
    assert not pod_may_run_on(spec, GPU_OPERATOR_NODE), "the patch replaces the base's terms"
    # The rest of the DaemonSet is the base's.
    base = one(variant(kubectl, "base"), "DaemonSet", "gpu-npd")
    assert only_container(base) == only_container(one(variant(kubectl, "overlays/custom-node-label"), "DaemonSet"))


@pytest.mark.parametrize("preflight", sorted(PREFLIGHTS))
def test_preflight_runs_on_the_named_node_only_and_never_on_kwok(kubectl, preflight, tmp_path):
    copy = copy_of_deploy(tmp_path)
    settings = copy / preflight / "settings.yaml"
    settings.write_text(settings.read_text(encoding="utf-8").replace("node: REPLACE-WITH-NODE", "node: gpu-17"),
                        encoding="utf-8")
    spec = pod_spec(one(render(kubectl, copy / preflight), "Job", PREFLIGHTS[preflight]))
    assert "nodeName" not in spec, "through the scheduler, so the affinity applies"
    assert pod_may_run_on(spec, node("gpu-17", **GPU_OPERATOR_NODE["metadata"]["labels"]))
    assert not pod_may_run_on(spec, node("gpu-17", type="kwok", **{"nvidia.com/gpu.present": "true"}))
    assert not pod_may_run_on(spec, GPU_OPERATOR_NODE)                       # another node
    for term in spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]:
        assert KWOK_EXCLUSION in term["matchExpressions"]


# --- Pod Security Admission

# Pod Security Standards, baseline (https://kubernetes.io/docs/concepts/security/pod-security-standards/).
BASELINE_CAPABILITIES = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
                         "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}
SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
                "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
                "net.ipv4.tcp_keepalive_probes"}


def baseline_violations(spec: dict) -> list[str]:
    """What Pod Security `baseline` would refuse in this pod spec."""
    found = []
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(field):
            found.append(field)
    found += [f"hostPath volume {v['name']}" for v in spec.get("volumes", []) if "hostPath" in v]
    pod_context = spec.get("securityContext") or {}
    found += [f"sysctl {s['name']}" for s in pod_context.get("sysctls", []) if s["name"] not in SAFE_SYSCTLS]
    contexts = [("pod", pod_context)]
    for container in spec.get("containers", []) + spec.get("initContainers", []) + spec.get("ephemeralContainers", []):
        context = container.get("securityContext") or {}
        contexts.append((container["name"], context))
        if context.get("privileged"):
            found.append(f"{container['name']}: privileged")
        added = set((context.get("capabilities") or {}).get("add", [])) - BASELINE_CAPABILITIES
        if added:
            found.append(f"{container['name']}: capabilities {sorted(added)}")
        if context.get("procMount", "Default") != "Default":
            found.append(f"{container['name']}: procMount")
        found += [f"{container['name']}: hostPort" for p in container.get("ports", []) if p.get("hostPort")]
    for who, context in contexts:
        if (context.get("seccompProfile") or {}).get("type") == "Unconfined":
            found.append(f"{who}: seccomp Unconfined")
        if (context.get("appArmorProfile") or {}).get("type") == "Unconfined":
            found.append(f"{who}: AppArmor unconfined")
        if (context.get("windowsOptions") or {}).get("hostProcess"):
            found.append(f"{who}: hostProcess")
        selinux = context.get("seLinuxOptions") or {}
        if selinux.get("type") not in (None, "", "container_t", "container_init_t", "container_kvm_t",
                                       "container_engine_t") or selinux.get("user") or selinux.get("role"):
            found.append(f"{who}: seLinuxOptions")
    return found


def test_baseline_checker_catches_what_baseline_refuses():
    assert baseline_violations({"containers": [{"name": "c"}]}) == []
    assert baseline_violations({"hostPID": True, "volumes": [{"name": "h", "hostPath": {"path": "/"}}],
                                "containers": [{"name": "c", "securityContext": {
                                    "privileged": True, "capabilities": {"add": ["SYS_ADMIN"]}}}]}) == [
        "hostPID", "hostPath volume h", "c: privileged", "c: capabilities ['SYS_ADMIN']"]


@pytest.mark.parametrize("name", sorted(DAEMON_VARIANTS))
def test_namespace_pod_security_labels_fit_the_pods(kubectl, name):
    """enforce, audit and warn all name the variant's level, and it is the least that admits its pods:
    `baseline` must admit them, and a `privileged` namespace must hold a pod that baseline refuses."""
    docs = variant(kubectl, name)
    labels = one(docs, "Namespace", NAMESPACE)["metadata"]["labels"]
    level = DAEMON_VARIANTS[name]
    for mode in ("enforce", "audit", "warn"):
        assert labels.get(f"pod-security.kubernetes.io/{mode}") == level, f"{name}: {mode}"
    refused = {f"{w['kind']}/{w['metadata']['name']}": baseline_violations(pod_spec(w))
               for w in docs if w["kind"] in POD_KINDS}
    assert refused
    if level == "baseline":
        assert not any(refused.values()), f"{name}: baseline refuses {refused}"
    else:
        assert any(refused.values()), f"{name}: nothing needs `privileged`; label it baseline"


def test_privileged_namespace_says_why_in_a_comment():
    text = (DEPLOY / "base" / "namespace.yaml").read_text(encoding="utf-8")
    comments = " ".join(line for line in text.splitlines() if line.lstrip().startswith("#"))
    assert "/dev/kmsg" in comments and "privileged" in comments


def test_preflight_jobs_need_the_privileged_namespace(kubectl):
    """They read /dev/kmsg like the base DaemonSet: the unprivileged variant's baseline namespace would
    refuse them, which its namespace.yaml says."""
    for preflight, job in PREFLIGHTS.items():
        assert baseline_violations(pod_spec(one(variant(kubectl, preflight), "Job", job)))
    text = (DEPLOY / "components" / "unprivileged" / "namespace.yaml").read_text(encoding="utf-8")
    assert "deploy/preflight" in text


# --- The unprivileged variant

def test_unprivileged_daemonset_runs_only_checks_that_work_without_host_access(kubectl, registry):
    daemonset = one(variant(kubectl, "overlays/unprivileged"), "DaemonSet", "gpu-npd")
    container, spec = only_container(daemonset), pod_spec(daemonset)
    args = build_parser().parse_args(container["args"])
    assert args.func.__name__ == "cmd_run"
    assert args.checks.split(",") == ["xid", "visibility"], "pcie and nccl need what this variant drops"
    assert {"xid", "visibility"} <= set(registry.names())
    # No /host/sys: the PCI bus is read from the container's own (read-only) sysfs.
    assert args.sysfs_root == Path("/sys")
    assert not any("hostPath" in v for v in spec["volumes"])
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert "/dev/kmsg" not in mounts and "/host/sys" not in mounts
    # The state directory is still given, on an emptyDir: held problems outlive a container restart.
    state = next(v for v in spec["volumes"] if v["name"] == "state")
    assert args.state_dir == Path(STATE_DIR) and "emptyDir" in state
    context = container["securityContext"]
    assert context["privileged"] is False and context["allowPrivilegeEscalation"] is False
    assert context["capabilities"] == {"drop": ["ALL"]} and context["readOnlyRootFilesystem"] is True
    assert context["seccompProfile"] == {"type": "RuntimeDefault"}
    # Everything else is the base's: same image, env, probes, resources, selection and tolerations.
    base = one(variant(kubectl, "base"), "DaemonSet", "gpu-npd")
    for key in ("image", "env", "ports", "livenessProbe", "readinessProbe", "resources"):
        assert container[key] == only_container(base)[key], key
    for key in ("affinity", "tolerations", "priorityClassName", "serviceAccountName"):
        assert spec[key] == pod_spec(base)[key], key


def test_unprivileged_xid_comes_from_nvml_events(tmp_path, registry):
    """With no /dev/kmsg the xid check has NVML's XID events only: they are on by default and the
    ConfigMap does not turn them off. The journald fallback would need journalctl in the image."""
    from detector.config import load_check_settings
    xid = registry.get("xid")
    assert xid.config_fields["nvml_events"].default is True
    config = yaml.safe_load((DEPLOY / "base" / "configmap.yaml").read_text(encoding="utf-8"))["data"]["config.yaml"]
    path = tmp_path / "config.yaml"
    path.write_text(config, encoding="utf-8")
    _, settings = load_check_settings(path)
    assert settings.get("xid", {}).get("nvml_events", True) is True
    dockerfile = (REPO / "Dockerfile").read_text(encoding="utf-8")
    assert "journalctl" not in dockerfile and "systemd" not in dockerfile, \
        "the image now carries journalctl: the unprivileged variant could read the journal; revisit its comments"


# --- RuntimeClass

@pytest.mark.parametrize("directory", VARIANTS, ids=name_of)
def test_runtime_class_only_where_asked_for(kubectl, directory):
    for workload in render(kubectl, directory):
        if workload["kind"] not in POD_KINDS:
            continue
        runtime = pod_spec(workload).get("runtimeClassName")
        if name_of(directory) == "overlays/nvidia-runtime":
            assert runtime == "nvidia", workload["metadata"]["name"]
        else:
            assert runtime is None, f"{name_of(directory)}: {workload['kind']} names RuntimeClass {runtime}"


@pytest.mark.parametrize("preflight", sorted(PREFLIGHTS))
def test_preflight_takes_the_nvidia_runtime_component_as_its_comment_says(kubectl, preflight, tmp_path):
    copy = copy_of_deploy(tmp_path)
    kustomization = copy / preflight / "kustomization.yaml"
    text = kustomization.read_text(encoding="utf-8")
    enabled = text.replace("# components:\n#   - ../components/nvidia-runtime\n",
                           "components:\n  - ../components/nvidia-runtime\n")
    assert enabled != text, "the commented-out components: lines are gone"
    kustomization.write_text(enabled, encoding="utf-8")
    job = one(render(kubectl, copy / preflight), "Job", PREFLIGHTS[preflight])
    assert pod_spec(job)["runtimeClassName"] == "nvidia"
    kubernetes_validate.validate(job, K8S_VERSIONS[0], strict=True)


# --- Host mounts

def host_mounts(workload: dict) -> dict[str, dict]:
    """Host path -> the container's mount of it, for every container."""
    volumes = {v["name"]: v for v in pod_spec(workload).get("volumes", [])}
    mounts = {}
    for container in pod_spec(workload)["containers"]:
        for mount in container.get("volumeMounts", []):
            volume = volumes[mount["name"]]
            if "hostPath" in volume:
                mounts[volume["hostPath"]["path"]] = mount
    return mounts


@pytest.mark.parametrize("directory", VARIANTS, ids=name_of)
def test_host_mounts_are_what_a_check_reads_all_read_only_but_the_state_directory(kubectl, directory):
    for workload in render(kubectl, directory):
        if workload["kind"] not in POD_KINDS:
            continue
        where = f"{name_of(directory)}: {workload['kind']}/{workload['metadata']['name']}"
        mounts = host_mounts(workload)
        assert set(mounts) <= CHECK_HOST_PATHS | {STATE_DIR}, f"{where}: {sorted(set(mounts) - CHECK_HOST_PATHS)}"
        for host_path, mount in mounts.items():
            if host_path == STATE_DIR:
                assert workload["kind"] == "DaemonSet" and not mount.get("readOnly"), where
            else:
                assert mount.get("readOnly") is True, f"{where}: {host_path} must be mounted readOnly"
        if "/sys" in mounts:    # mounted where --sysfs-root looks
            args = only_container(workload)["args"]
            assert args[args.index("--sysfs-root") + 1] == mounts["/sys"]["mountPath"], where


# --- Preflight Jobs: GPU count, deadline, exit code

def settings_of(preflight: str) -> dict[str, str]:
    return yaml.safe_load((DEPLOY / preflight / "settings.yaml").read_text(encoding="utf-8"))["data"]


@pytest.mark.parametrize("preflight", sorted(PREFLIGHTS))
def test_preflight_job_fails_once_and_in_bounded_time(kubectl, preflight):
    job = one(variant(kubectl, preflight), "Job", PREFLIGHTS[preflight])
    assert job["spec"]["backoffLimit"] == 0
    assert job["spec"]["activeDeadlineSeconds"] >= 300
    assert pod_spec(job)["restartPolicy"] == "Never"
    assert only_container(job)["resources"]["limits"]["nvidia.com/gpu"] == int(settings_of(preflight)["gpus"]) == 8


@pytest.mark.parametrize("preflight", sorted(PREFLIGHTS))
def test_preflight_gpu_count_follows_the_settings(kubectl, preflight, tmp_path):
    copy = copy_of_deploy(tmp_path)
    settings = copy / preflight / "settings.yaml"
    text = settings.read_text(encoding="utf-8")
    assert 'gpus: "8"' in text
    settings.write_text(text.replace('gpus: "8"', 'gpus: "4"'), encoding="utf-8")
    job = one(render(kubectl, copy / preflight), "Job", PREFLIGHTS[preflight])
    limits = only_container(job)["resources"]["limits"]
    assert str(limits["nvidia.com/gpu"]) == "4"
    assert {k: v for k, v in limits.items() if k != "nvidia.com/gpu"} == \
        {k: v for k, v in only_container(one(variant(kubectl, preflight), "Job"))["resources"]["limits"].items()
         if k != "nvidia.com/gpu"}
    kubernetes_validate.validate(job, K8S_VERSIONS[0], strict=True)


def dockerfile_entrypoint(name: str) -> str:
    [entrypoint] = [line.split(None, 1)[1].strip() for line in (REPO / name).read_text(encoding="utf-8").splitlines()
                    if line.startswith("ENTRYPOINT")]
    return entrypoint


@pytest.mark.parametrize("preflight", sorted(PREFLIGHTS))
def test_preflight_container_exits_with_diagnose_s_code(kubectl, preflight):
    """No command, no shell: the image's exec-form entrypoint is gpu-npd, so the pod's exit code (and the
    Job's outcome) is diagnose's. The Job's own args, run here on fake nodes, give 0, 1 and 2."""
    container = only_container(one(variant(kubectl, preflight), "Job", PREFLIGHTS[preflight]))
    assert "command" not in container
    dockerfile = "Dockerfile.nccl" if preflight == "preflight-nccl" else "Dockerfile"
    assert dockerfile_entrypoint(dockerfile) == '["gpu-npd"]'
    args = container["args"]
    assert args[0] == "diagnose" and build_parser().parse_args(args).func.__name__ == "cmd_diagnose"
    if preflight == "preflight-nccl":
        return       # its nccl-tests binary exists only in the gpu-npd-nccl image; the args parse above
    env = {k: v for k, v in os.environ.items() if k != "GPU_NPD_NVML"}

    def exit_code(*extra: str) -> int:
        proc = subprocess.run([sys.executable, "-m", "detector.cli.main", *args, *extra, "-q"],
                              capture_output=True, text=True, timeout=120, cwd=REPO, env=env)
        return proc.returncode

    assert exit_code("--nvml", "fake:h100-sxm-8") == 0
    assert exit_code("--nvml", "fake:h100-sxm-8-xid79") == 1
    assert exit_code("--nvml", "fake:no-such-scenario") == 2


# --- PodMonitor (Prometheus Operator)

# NodeHealthCheck (deploy/remediation): validated against medik8s' CRD in tests/test_remediation.py;
# NodeReadinessRule (deploy/readiness): against the Node Readiness Controller's in tests/test_readiness.py.
CUSTOM_RESOURCES = {"PodMonitor": "monitoring.coreos.com/v1", "PrometheusRule": "monitoring.coreos.com/v1",
                    "NodeHealthCheck": "remediation.medik8s.io/v1alpha1",
                    "NodeReadinessRule": "readiness.node.x-k8s.io/v1alpha1"}
# monitoring.coreos.com/v1 PodMonitor: the fields this project may use, so a misspelt one fails here
# as it would against the CRD's schema.
PODMONITOR_SPEC_FIELDS = {"selector", "namespaceSelector", "podMetricsEndpoints", "jobLabel", "podTargetLabels",
                          "sampleLimit", "targetLimit", "labelLimit", "attachMetadata", "scrapeProtocols"}
ENDPOINT_FIELDS = {"port", "portNumber", "targetPort", "path", "scheme", "params", "interval", "scrapeTimeout",
                   "honorLabels", "honorTimestamps", "relabelings", "metricRelabelings", "enableHttp2",
                   "filterRunning", "followRedirects", "proxyUrl", "bearerTokenSecret", "basicAuth", "tlsConfig",
                   "authorization", "oauth2"}
RELABEL_FIELDS = {"sourceLabels", "separator", "targetLabel", "regex", "modulus", "replacement", "action"}
RELABEL_ACTIONS = {"replace", "keep", "drop", "hashmod", "labelmap", "labeldrop", "labelkeep", "lowercase",
                   "uppercase", "keepequal", "dropequal"}
DURATION = re.compile(r"(\d+(ms|s|m|h|d|w|y))+")


def selector_matches(selector: dict, labels: dict[str, str]) -> bool:
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    return all(requirement_matches(e, labels) for e in selector.get("matchExpressions") or [])


def test_podmonitor_scrapes_the_daemonset_pods_metrics_port(kubectl):
    docs = variant(kubectl, "overlays/podmonitor")
    monitor = one(docs, "PodMonitor", "gpu-npd")
    daemonset = one(docs, "DaemonSet", "gpu-npd")
    assert monitor["apiVersion"] == CUSTOM_RESOURCES["PodMonitor"]
    assert set(monitor) == {"apiVersion", "kind", "metadata", "spec"}
    assert monitor["metadata"]["namespace"] == daemonset["metadata"]["namespace"] == NAMESPACE
    spec = monitor["spec"]
    assert set(spec) <= PODMONITOR_SPEC_FIELDS, sorted(set(spec) - PODMONITOR_SPEC_FIELDS)
    selector = spec["selector"]                                              # required by the CRD
    assert selector and set(selector) <= {"matchLabels", "matchExpressions"}
    pod_labels = daemonset["spec"]["template"]["metadata"]["labels"]
    assert selector_matches(selector, pod_labels), "the PodMonitor selects no gpu-npd pod"
    for other in (v for v in VARIANTS if name_of(v) != "overlays/podmonitor"):
        for workload in render(kubectl, other):          # and no pod of the preflights or the simulator
            if workload["kind"] in POD_KINDS and workload["metadata"]["name"] != "gpu-npd":
                assert not selector_matches(selector, workload["spec"]["template"]["metadata"]["labels"])
    assert NAMESPACE in spec["namespaceSelector"]["matchNames"]
    [endpoint] = spec["podMetricsEndpoints"]
    assert set(endpoint) <= ENDPOINT_FIELDS, sorted(set(endpoint) - ENDPOINT_FIELDS)
    assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"
    container_ports = {p["name"]: p for p in only_container(daemonset)["ports"]}
    assert "metrics" in container_ports, "the PodMonitor names a port the pod does not have"
    readiness = only_container(daemonset)["readinessProbe"]["httpGet"]
    assert readiness["port"] == "metrics"
    assert DURATION.fullmatch(endpoint["interval"])
    for relabeling in endpoint.get("relabelings", []):
        assert set(relabeling) <= RELABEL_FIELDS and relabeling.get("action", "replace") in RELABEL_ACTIONS
        assert all(re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9_]*", label) for label in relabeling.get("sourceLabels", []))
    assert {"sourceLabels": ["__meta_kubernetes_pod_node_name"], "targetLabel": "node", "action": "replace"} in \
        endpoint["relabelings"], "the metrics carry no node label: the scrape must add it"


def test_podmonitor_overlay_is_the_base_plus_the_podmonitor(kubectl):
    def key(d: dict) -> tuple[str, str]:
        return d["kind"], d["metadata"]["name"]
    base = {key(d): d for d in variant(kubectl, "base")}
    overlay = {key(d): d for d in variant(kubectl, "overlays/podmonitor")}
    assert set(overlay) - set(base) == {("PodMonitor", "gpu-npd")}
    assert all(overlay[k] == base[k] for k in base)


def test_dra_taints_overlay_is_the_base_plus_its_role_and_the_flag(kubectl):
    def key(d: dict) -> tuple[str, str]:
        return d["kind"], d["metadata"]["name"]
    base = {key(d): d for d in variant(kubectl, "base")}
    overlay = {key(d): d for d in variant(kubectl, "overlays/dra-taints")}
    assert set(overlay) - set(base) == {("ClusterRole", "gpu-npd-dra-taints"),
                                        ("ClusterRoleBinding", "gpu-npd-dra-taints")}
    assert all(overlay[k] == base[k] for k in base if k != ("DaemonSet", "gpu-npd"))
    args = only_container(overlay[("DaemonSet", "gpu-npd")])["args"]
    assert args == only_container(base[("DaemonSet", "gpu-npd")])["args"] + ["--dra-taints"]


def test_networkpolicy_admits_only_the_scraper_to_the_daemon_s_metrics_port(kubectl):
    docs = variant(kubectl, "overlays/networkpolicy")
    policy = one(docs, "NetworkPolicy", "gpu-npd-metrics")
    daemonset = one(docs, "DaemonSet", "gpu-npd")
    assert policy["metadata"]["namespace"] == NAMESPACE
    spec = policy["spec"]
    assert selector_matches(spec["podSelector"], daemonset["spec"]["template"]["metadata"]["labels"])
    for other in VARIANTS:                               # no pod of the preflights or the simulator
        for workload in render(kubectl, other):
            if workload["kind"] in POD_KINDS and workload["metadata"]["name"] != "gpu-npd":
                assert not selector_matches(spec["podSelector"], workload["spec"]["template"]["metadata"]["labels"])
    assert spec["policyTypes"] == ["Ingress"], "egress to the API server must stay open"
    [rule] = spec["ingress"]
    assert rule["ports"] == [{"port": "metrics", "protocol": "TCP"}]
    assert "metrics" in {p["name"] for p in only_container(daemonset)["ports"]}
    # One peer holding both selectors (a pod must match both); two peers would admit either, and an empty
    # selector every pod or namespace.
    [peer] = rule["from"]
    assert set(peer) == {"namespaceSelector", "podSelector"}
    assert peer["namespaceSelector"]["matchLabels"] and peer["podSelector"]["matchLabels"]


def test_networkpolicy_overlay_is_the_base_plus_the_policy(kubectl):
    def key(d: dict) -> tuple[str, str]:
        return d["kind"], d["metadata"]["name"]
    base = {key(d): d for d in variant(kubectl, "base")}
    overlay = {key(d): d for d in variant(kubectl, "overlays/networkpolicy")}
    assert set(overlay) - set(base) == {("NetworkPolicy", "gpu-npd-metrics")}
    assert all(overlay[k] == base[k] for k in base)


def test_docs_scraper_patch_names_another_prometheus(kubectl, tmp_path):
    """docs/deploying.md's patch for a Prometheus of another name, in a site kustomization as it says."""
    [patch] = re.findall(r"```yaml\n(# my-site/scraper.yaml:.*?)```", deploying_docs(), re.S)
    copy_of_deploy(tmp_path)
    site = tmp_path / "my-site"
    site.mkdir()
    (site / "scraper.yaml").write_text(patch, encoding="utf-8")
    (site / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": ["../deploy/overlays/networkpolicy"], "patches": [{"path": "scraper.yaml"}]}), encoding="utf-8")
    docs = render(kubectl, site)
    base_peer = one(variant(kubectl, "overlays/networkpolicy"), "NetworkPolicy")["spec"]["ingress"][0]["from"][0]
    policy = one(docs, "NetworkPolicy", "gpu-npd-metrics")
    [rule] = policy["spec"]["ingress"]
    [peer] = rule["from"]
    assert peer != base_peer and set(peer) == {"namespaceSelector", "podSelector"}
    assert rule["ports"] == [{"port": "metrics", "protocol": "TCP"}]
    kubernetes_validate.validate(policy, K8S_VERSIONS[0], strict=True)


def test_custom_resources_are_only_the_known_ones(kubectl):
    for directory in VARIANTS:
        for doc in render(kubectl, directory):
            if doc["apiVersion"].split("/")[0].endswith(".coreos.com"):
                assert CUSTOM_RESOURCES.get(doc["kind"]) == doc["apiVersion"], doc["kind"]


# --- Components compose

def test_components_compose_in_a_kustomization_of_ones_own(kubectl, tmp_path):
    """A site's own kustomization: the unprivileged variant, the NVIDIA RuntimeClass and the PodMonitor."""
    site = tmp_path / "site"
    site.mkdir()
    rel = os.path.relpath(DEPLOY, site)
    (site / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [f"{rel}/overlays/unprivileged"],
        "components": [f"{rel}/components/nvidia-runtime", f"{rel}/components/podmonitor"],
    }), encoding="utf-8")
    docs = render(kubectl, site)
    daemonset = one(docs, "DaemonSet", "gpu-npd")
    assert pod_spec(daemonset)["runtimeClassName"] == "nvidia"
    assert "xid,visibility" in only_container(daemonset)["args"]
    assert one(docs, "Namespace")["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "baseline"
    one(docs, "PodMonitor", "gpu-npd")
    for doc in docs:
        if doc["kind"] not in CUSTOM_RESOURCES:
            kubernetes_validate.validate(doc, K8S_VERSIONS[0], strict=True)


# --- The docs on deploying: docs/deploying.md and docs/remediation.md (the README's Deploying section once)

DEPLOYING_PAGES = ("docs/deploying.md", "docs/remediation.md")


def deploying_docs() -> str:
    return "\n".join((REPO / page).read_text(encoding="utf-8") for page in DEPLOYING_PAGES)


def test_readme_names_only_kustomizations_that_exist():
    section = deploying_docs()
    named = set(re.findall(r"kubectl (?:apply -k|kustomize) (deploy/[\w./-]+)", section))
    assert named, f"{DEPLOYING_PAGES} show no kubectl apply -k"
    assert named <= {f"deploy/{name_of(v)}" for v in VARIANTS}, sorted(named)
    for path in re.findall(r"`(deploy/[\w./-]+)`", section):
        assert (REPO / path.rstrip("/")).exists(), f"{DEPLOYING_PAGES} name {path}, which does not exist"


def test_readme_site_kustomization_renders(kubectl, tmp_path):
    """docs/deploying.md's own kustomization, beside a copy of deploy/ as it says, renders and validates."""
    [block] = re.findall(r"```yaml\n(apiVersion: kustomize[^`]*?kind: Kustomization\n.*?)```", deploying_docs(),
                         re.S)
    copy_of_deploy(tmp_path)
    site = tmp_path / "my-site"
    site.mkdir()
    (site / "kustomization.yaml").write_text(block, encoding="utf-8")
    docs = render(kubectl, site)
    daemonset = one(docs, "DaemonSet", "gpu-npd")
    assert only_container(daemonset)["image"] == "registry.example/gpu-npd:0.1.0"
    assert pod_spec(daemonset)["runtimeClassName"] == "nvidia"
    one(docs, "PodMonitor", "gpu-npd")
    for doc in docs:
        if doc["kind"] not in CUSTOM_RESOURCES:
            kubernetes_validate.validate(doc, K8S_VERSIONS[0], strict=True)


# --- Resources against the footprint budget

REAL_NVML_RSS_MIB = 58      # gpu-npd run, every default check, real one-GPU H100, driver 580 (steady state)


def mebibytes(quantity: str) -> float:
    m = re.fullmatch(r"(\d+)(Mi|Gi)", quantity)
    assert m, quantity
    return int(m[1]) * (1024 if m[2] == "Gi" else 1)


def millicores(quantity: str) -> float:
    return float(quantity[:-1]) if quantity.endswith("m") else float(quantity) * 1000


@pytest.mark.parametrize("name", sorted(DAEMON_VARIANTS))
def test_daemon_requests_cover_the_footprint_budget(kubectl, name):
    """Sized from real NVML: the daemon held REAL_NVML_RSS_MIB on a real H100 (the fake node, without
    libnvidia-ml, reads about 20 MiB less), within DESIGN section 8's budget (RSS <= 60 MiB, CPU <= 5
    millicores). The requests cover the budget with headroom; the limits leave room above them (a
    kernel-log flood, nvidia-smi's runs)."""
    resources = only_container(one(variant(kubectl, name), "DaemonSet", "gpu-npd"))["resources"]
    assert mebibytes(resources["requests"]["memory"]) >= 1.25 * max(REAL_NVML_RSS_MIB, 60)
    assert millicores(resources["requests"]["cpu"]) >= 2 * 5
    assert mebibytes(resources["limits"]["memory"]) >= 2 * mebibytes(resources["requests"]["memory"])
    assert millicores(resources["limits"]["cpu"]) >= 10 * millicores(resources["requests"]["cpu"])