"""The Helm chart, deploy/helm/gpu-npd, run through a real helm, offline: `helm lint` and `helm template`
with the default values and each variant's, every rendered object validated against the Kubernetes
schemas (kubernetes-validate, strict), and each variant compared object by object with the kustomization
of deploy/ it stands for (`kubectl kustomize`), where the only differences are Helm's conventions, each
named below (HELM_LABELS, INSTANCE_SELECTORS, CONFIG_CHECKSUM, NAMESPACE_OBJECT). Then what the values
promise: Pod Security levels, node selection (never a KWOK node), read-only host mounts, rule files and
check settings given in values reaching the ConfigMap and the daemon's arguments (parsed by gpu-npd's own
CLI and loaded by its own loaders), the PodMonitor and ServiceMonitor, and values.schema.json refusing a
misspelt key.

helm comes from `make helm` (which `make test` runs) at .venv/tools/helm, or from PATH. The helpers
shared with the kustomize tests are imported from test_deploy_render.py."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import REPO
from detector.cli.main import build_parser
from detector.rules.sources import rule_paths
from detector.config import build_checks, load_check_settings
from detector.rules.loader import load_rules
from test_deploy_render import (  # noqa: F401  (kubectl and no_network are fixtures)
    CHECK_HOST_PATHS, CUSTOM_RESOURCES, DEPLOY, ENDPOINT_FIELDS, GFD_ONLY_NODE, GPU_OPERATOR_NODE, K8S_VERSIONS,
    KWOK_EXCLUSION, KWOK_GPU_NODE, CPU_NODE, NFD_DEFAULT_NODE, NFD_ONLY_NODE, PODMONITOR_SPEC_FIELDS, POD_KINDS,
    RELABEL_FIELDS, STATE_DIR, baseline_violations, host_mounts, kubectl, kwok_nodes_asking_for, no_network, node,
    objects, offline_env, one, only_container, pod_may_run_on, pod_spec, schema_failures, selector_matches,
    simulator_kwok_node,
    variant,
)

CHART = DEPLOY / "helm" / "gpu-npd"
RELEASE = NAMESPACE = "gpu-npd"     # a release named gpu-npd gives deploy/base's object names
HELM_CANDIDATES = (REPO / ".venv" / "tools" / "helm", REPO / ".venv" / "bin" / "helm")
HELM_MIN_MAJOR = 3                  # Chart.yaml apiVersion v2, values.schema.json
CHART_META = yaml.safe_load((CHART / "Chart.yaml").read_text(encoding="utf-8"))
MONITOR_KINDS = {**CUSTOM_RESOURCES, "ServiceMonitor": "monitoring.coreos.com/v1"}
CONFIG_DIR = "/etc/gpu-npd"

# --- The differences from deploy/ that Helm's conventions make, and nothing else

# 1. Every object carries Helm's recommended labels (app.kubernetes.io/name too, which deploy/base leaves
#    off the ServiceAccount, ClusterRole and ClusterRoleBinding); deploy/'s own labels are all kept.
HELM_LABELS = {
    "helm.sh/chart": f"{CHART_META['name']}-{CHART_META['version']}",
    "app.kubernetes.io/name": "gpu-npd",
    "app.kubernetes.io/instance": RELEASE,
    "app.kubernetes.io/version": CHART_META["appVersion"],
    "app.kubernetes.io/managed-by": "Helm",
}
# 2. What selects the pods also carries app.kubernetes.io/instance, so two releases never select each
#    other's pods: the DaemonSet's selector and pod labels, the Service's selector, the PodMonitor's.
INSTANCE_SELECTORS = (("DaemonSet", ("spec", "selector", "matchLabels")),
                      ("DaemonSet", ("spec", "template", "metadata", "labels")),
                      ("Service", ("spec", "selector")),
                      ("PodMonitor", ("spec", "selector", "matchLabels")),
                      ("NetworkPolicy", ("spec", "podSelector", "matchLabels")))
# 3. The pod template carries the ConfigMap's checksum, so a change of settings or rules rolls the pods.
CONFIG_CHECKSUM = "checksum/config"
# 4. The namespace is the release's: the chart renders it only with namespace.create, and then keeps it
#    on uninstall (helm.sh/resource-policy: keep).
NAMESPACE_OBJECT = ("Namespace", {"helm.sh/resource-policy": "keep"})

CUSTOM_LABEL_TERMS = [{"matchExpressions": [{"key": "example.com/gpu-node", "operator": "In", "values": ["true"]}]}]
SITE_RULE = {"name": "site-pcie-below-gen5", "check": "pcie", "when": "idle == false and current_gen < 5 and max_gen >= 5",
             "type": "GpuPcieDegraded", "reason": "PcieBelowSiteMinimum", "severity": "info", "action": "INSPECT",
             "report": "event", "message": "PCIe link runs at Gen{current_gen} while busy; this site expects Gen5"}
TEXT_RULE_FILE = """\
# kept: a rule file given as text keeps its comments
version: 1
rules:
  - name: site-pcie-below-gen4
    check: pcie
    when: idle == false and current_gen < 4 and max_gen >= 4
    type: GpuPcieDegraded
    reason: PcieBelowGen4
    severity: warning
    action: INSPECT
    report: event
    message: "PCIe link runs at Gen{current_gen} while busy"
"""
SITE_CHECKS = {"visibility": {"expected_gpus": 8}, "infiniband": {"enabled": False}, "xid": {"interval": 2.5},
               "driver": {"optional_modules": ["nvidia_peermem"]}}

# Each variant: its values, and the kustomization of deploy/ it must equal (None: no counterpart).
VARIANTS: dict[str, tuple[dict[str, Any], str | None]] = {
    "default": ({}, "base"),
    "namespace": ({"namespace": {"create": True}}, "base"),
    "unprivileged": ({"unprivileged": True, "namespace": {"create": True}}, "overlays/unprivileged"),
    "nvidia-runtime": ({"runtimeClassName": "nvidia"}, "overlays/nvidia-runtime"),
    "podmonitor": ({"podMonitor": {"enabled": True}}, "overlays/podmonitor"),
    "custom-node-label": ({"gpuNodeSelectorTerms": CUSTOM_LABEL_TERMS}, "overlays/custom-node-label"),
    "dra-taints": ({"draTaints": {"enabled": True}}, "overlays/dra-taints"),
    "networkpolicy": ({"networkPolicy": {"enabled": True}}, "overlays/networkpolicy"),
    "servicemonitor": ({"serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}}}, None),
    "prometheusrule": ({"podMonitor": {"enabled": True},
                        "prometheusRule": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}}}, None),
    "site": ({"rules": {"files": {"b-pcie.yaml": {"version": 1, "rules": [SITE_RULE]}, "a-text.yml": TEXT_RULE_FILE}},
              "checks": SITE_CHECKS, "extraArgs": ["--heartbeat", 120],
              "image": {"repository": "registry.example/gpu-npd", "tag": "0.1.1"}}, None),
    "own-rules-only": ({"rules": {"builtin": False, "files": {"site-rules.yaml": None,
                                                               "only.yaml": {"version": 1, "rules": [SITE_RULE]}}}}, None),
    "everything": ({"unprivileged": True, "namespace": {"create": True}, "runtimeClassName": "nvidia",
                    "podMonitor": {"enabled": True}, "gpuNodeSelectorTerms": CUSTOM_LABEL_TERMS,
                    "checks": SITE_CHECKS, "nodeSelector": {"kubernetes.io/arch": "amd64"},
                    "affinity": {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
                        {"weight": 1, "preference": {"matchExpressions": [
                            {"key": "nvidia.com/gpu.count", "operator": "Gt", "values": ["4"]}]}}]}},
                    "podAnnotations": {"example.com/team": "ml"}, "podLabels": {"team": "ml"},
                    "imagePullSecrets": [{"name": "registry"}], "extraEnv": [{"name": "X", "value": "1"}],
                    "service": {"annotations": {"example.com/a": "b"}},
                    "serviceAccount": {"annotations": {"example.com/role": "gpu-npd"}}}, None),
}
COUNTERPARTS = {name: kustomization for name, (_, kustomization) in VARIANTS.items() if kustomization}


# --- helm

def find_helm() -> str | None:
    for candidate in HELM_CANDIDATES:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return shutil.which("helm")


MISSING = ("helm not found at .venv/tools/helm nor on PATH: run `make helm` (`make test` runs it; it is "
           "`python tools/install_kubectl.py --tool helm --dest .venv/tools/helm`), then run the tests again")


def test_helm_is_installed():
    """Not a skip: `make test` installs it, so a missing helm is a broken setup."""
    assert find_helm(), MISSING


class Helm:
    """The helm binary, run offline with its cache, config and data in a scratch directory; each
    (release, variant) rendered once per module."""

    def __init__(self, path: str, home: Path):
        self.path, self.home = path, home
        self.env = offline_env()
        for key in ("HELM_CACHE_HOME", "HELM_CONFIG_HOME", "HELM_DATA_HOME"):
            self.env[key] = str(home / key.lower())
        self._rendered: dict[tuple[str, str], list[dict]] = {}

    def run(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([self.path, *args], capture_output=True, text=True, timeout=120, env=self.env)

    def values_file(self, values: dict[str, Any], name: str) -> Path:
        path = self.home / f"values-{name}.yaml"
        path.write_text(yaml.safe_dump(values, sort_keys=False), encoding="utf-8")
        return path

    def template(self, values: dict[str, Any], *extra: str, release: str = RELEASE, name: str = "x"
                 ) -> subprocess.CompletedProcess:
        return self.run("template", release, str(CHART), "--namespace", NAMESPACE,
                        "-f", str(self.values_file(values, name)), *extra)

    def render(self, name: str, release: str = RELEASE) -> list[dict]:
        key = (release, name)
        if key not in self._rendered:
            proc = self.template(VARIANTS[name][0], release=release, name=name)
            if proc.returncode != 0:
                pytest.fail(f"helm template ({name}): {proc.stderr.strip()}")
            docs = [d for d in yaml.safe_load_all(proc.stdout) if d is not None]
            assert docs, f"helm template ({name}) rendered nothing"
            self._rendered[key] = docs
        return self._rendered[key]

    def refusal(self, values: dict[str, Any], *extra: str) -> str:
        """helm template's error for values it must refuse."""
        proc = self.template(values, *extra, name="refused")
        assert proc.returncode != 0, f"helm template accepted {values} {extra}"
        return proc.stderr


@pytest.fixture(scope="module")
def helm(tmp_path_factory) -> Helm:
    path = find_helm()
    if path is None:
        pytest.fail(MISSING)
    home = tmp_path_factory.mktemp("helm")
    proc = subprocess.run([path, "version", "--short"], capture_output=True, text=True, timeout=60, env=offline_env())
    assert proc.returncode == 0, f"{path} version: {proc.stderr}"
    major = int(re.match(r"v(\d+)", proc.stdout.strip())[1])
    if major < HELM_MIN_MAJOR:
        pytest.fail(f"{path} is helm {proc.stdout.strip()}; the chart needs helm 3 or newer: run `make helm`")
    return Helm(path, home)


def daemonset(docs: list[dict]) -> dict:
    [found] = objects(docs, "DaemonSet")
    return found


def args_of(docs: list[dict]):
    return build_parser().parse_args(only_container(daemonset(docs))["args"])


def test_helm_is_the_pinned_one():
    """A regular file at .venv/tools/helm is what tools/install_kubectl.py installed: its digest is the pin."""
    sys.path.insert(0, str(REPO / "tools"))
    try:
        import install_kubectl
    finally:
        sys.path.remove(str(REPO / "tools"))
    installed = REPO / ".venv" / "tools" / "helm"
    if installed.is_file() and not installed.is_symlink():
        assert hashlib.sha256(installed.read_bytes()).hexdigest() == install_kubectl.TOOLS["helm"].sha256, \
            "not the pinned helm: run `make helm`"
    makefile = (REPO / "Makefile").read_text(encoding="utf-8")
    assert re.search(r"^test: .*\$\(HELM_STAMP\)", makefile, re.M), "make test must install helm first"


# --- Lint and schemas

@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_helm_lint_passes_strict(helm, name):
    proc = helm.run("lint", "--strict", str(CHART), "--namespace", NAMESPACE,
                    "-f", str(helm.values_file(VARIANTS[name][0], f"lint-{name}")))
    assert proc.returncode == 0, f"helm lint --strict ({name}):\n{proc.stdout}\n{proc.stderr}"


@pytest.mark.parametrize("name", sorted(VARIANTS))
@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_rendered_objects_validate_against_the_kubernetes_schema(helm, name, version):
    # monitors have no schema here: test_podmonitor_* and test_servicemonitor_* check them
    failures = schema_failures(helm.render(name), version, MONITOR_KINDS)
    assert not failures, f"helm template ({name}) against Kubernetes {version}:\n" + "\n".join(failures)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_namespaced_objects_live_in_the_release_namespace(helm, name):
    for doc in helm.render(name):
        where = f"{doc['kind']}/{doc['metadata']['name']}"
        if doc["kind"] in ("Namespace", "ClusterRole", "ClusterRoleBinding"):
            assert "namespace" not in doc["metadata"], where
        else:
            assert doc["metadata"]["namespace"] == NAMESPACE, where


@pytest.mark.parametrize("values, misspelt", [
    ({"imag": {"tag": "x"}}, "imag"),
    ({"image": {"tagg": "x"}}, "tagg"),
    ({"unpriviledged": True}, "unpriviledged"),
    ({"podMonitor": {"enable": True}}, "enable"),
    ({"rules": {"builtins": False}}, "builtins"),
    ({"checks": {"xdi": {"interval": 5}}}, "xdi"),
    ({"checks": {"xid": {"intervall": 5}}}, "intervall"),
    ({"rules": {"files": {"x.yaml": {"version": 1, "rules": [{**SITE_RULE, "sevrity": "info"}]}}}}, "sevrity"),
    ({"resources": {"limit": {"cpu": "1"}}}, "limit"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_values_schema_refuses_a_misspelt_key(helm, values, misspelt):
    error = helm.refusal(values)
    assert "schema" in error and misspelt in error, error


@pytest.mark.parametrize("values", [
    {"checks": {"xid": {"interval": 0}}},
    {"checks": {"visibility": {"expected_gpus": "eight"}}},
    {"rules": {"files": {"rules.json": "version: 1\nrules: []\n"}}},
    {"rules": {"files": {"config.yaml": "version: 1\nrules: []\n"}}},
    {"gpuNodeSelectorTerms": []},
    {"image": {"pullPolicy": "Sometimes"}},
    {"podMonitor": {"interval": "30 seconds"}},
])
def test_values_schema_refuses_a_wrong_value(helm, values):
    assert "schema" in helm.refusal(values)


def test_values_schema_knows_every_check_and_setting(registry):
    """The schema's checks section is the checks gpu-npd has, each with its settings and their types: a new
    check or setting must be added there, or the chart would refuse it (`.venv/bin/python tests/test_helm.py`
    adds what the code declares)."""
    schema = json.loads((CHART / "values.schema.json").read_text(encoding="utf-8"))
    checks = schema["properties"]["checks"]
    assert checks["additionalProperties"] is False
    assert set(checks["properties"]) == set(registry.names())
    types = {list: "array", int: "integer", float: "number", str: "string", bool: "boolean"}
    for name, section in checks["properties"].items():
        fields = registry.get(name).config_fields
        assert section["additionalProperties"] is False, name
        assert set(section["properties"]) == set(fields) | set(registry.get(name).schedule_fields()), name
        for key, field in fields.items():
            assert section["properties"][key]["type"] == types[field.kind], f"checks.{name}.{key}"


def test_every_value_is_explained_in_values_yaml_and_known_to_the_schema():
    schema = json.loads((CHART / "values.schema.json").read_text(encoding="utf-8"))
    values = yaml.safe_load((CHART / "values.yaml").read_text(encoding="utf-8"))
    assert set(values) <= set(schema["properties"]), sorted(set(values) - set(schema["properties"]))
    assert set(schema["properties"]) - set(values) <= {"global"}
    lines = [line for line in (CHART / "values.yaml").read_text(encoding="utf-8").splitlines() if line.strip()]
    for before, line in zip(lines, lines[1:]):
        if re.match(r"[A-Za-z]\w*:", line):        # a top-level value: comments above it teach it
            assert before.startswith("#") or line.startswith("fullnameOverride"), f"{line}: no comment above it"


# --- Object by object against deploy/

def differences(helm_side: Any, kustomize_side: Any, path: str = "") -> list[str]:
    if isinstance(helm_side, dict) and isinstance(kustomize_side, dict):
        found = []
        for key in sorted(set(helm_side) | set(kustomize_side)):
            where = f"{path}.{key}"
            if key not in kustomize_side:
                found.append(f"{where}: only in helm ({helm_side[key]!r})")
            elif key not in helm_side:
                found.append(f"{where}: only in kustomize ({kustomize_side[key]!r})")
            else:
                found += differences(helm_side[key], kustomize_side[key], where)
        return found
    if isinstance(helm_side, list) and isinstance(kustomize_side, list) and len(helm_side) == len(kustomize_side):
        return [d for i, pair in enumerate(zip(helm_side, kustomize_side)) for d in differences(*pair, f"{path}[{i}]")]
    return [] if helm_side == kustomize_side else [f"{path}: helm {helm_side!r}, kustomize {kustomize_side!r}"]


def dig(doc: dict, path: tuple[str, ...]) -> dict | None:
    for key in path:
        doc = (doc or {}).get(key)
    return doc


def without_helm_conventions(chart_doc: dict, deploy_doc: dict) -> tuple[dict, dict]:
    """Both objects with the named differences checked and taken out; what is left must be equal."""
    chart_doc, deploy_doc = json.loads(json.dumps(chart_doc)), json.loads(json.dumps(deploy_doc))
    where = f"{chart_doc['kind']}/{chart_doc['metadata']['name']}"
    # 1. HELM_LABELS
    labels, deploy_labels = chart_doc["metadata"].pop("labels", {}), deploy_doc["metadata"].pop("labels", {})
    assert {k: labels.get(k) for k in HELM_LABELS} == HELM_LABELS, f"{where}: Helm's labels"
    assert {k: v for k, v in labels.items() if k not in HELM_LABELS} == \
        {k: v for k, v in deploy_labels.items() if k not in HELM_LABELS}, f"{where}: labels other than Helm's"
    assert all(labels[k] == v for k, v in deploy_labels.items()), f"{where}: deploy/'s labels kept"
    # 2. INSTANCE_SELECTORS
    for kind, path in INSTANCE_SELECTORS:
        if chart_doc["kind"] == kind:
            selector = dig(chart_doc, path)
            assert selector.pop("app.kubernetes.io/instance") == RELEASE, f"{where}: {'.'.join(path)}"
    # 3. CONFIG_CHECKSUM
    if chart_doc["kind"] == "DaemonSet":
        template = chart_doc["spec"]["template"]["metadata"]
        assert re.fullmatch(r"[0-9a-f]{64}", template["annotations"].pop(CONFIG_CHECKSUM)), where
        if not template["annotations"]:
            del template["annotations"]
    # 4. NAMESPACE_OBJECT
    if chart_doc["kind"] == NAMESPACE_OBJECT[0]:
        annotations = chart_doc["metadata"].pop("annotations")
        assert annotations == NAMESPACE_OBJECT[1], where
    return chart_doc, deploy_doc


def key_of(doc: dict) -> tuple[str, str]:
    return doc["kind"], doc["metadata"]["name"]


@pytest.mark.parametrize("name", sorted(COUNTERPARTS))
def test_chart_renders_what_its_kustomization_does(helm, kubectl, name):
    """Same kinds and names, and each object equal to kustomize's (args, env, probes, resources, RBAC rules,
    volumes and mounts, securityContext, affinity, ConfigMap data...) once the named differences are out."""
    values, kustomization = VARIANTS[name]
    chart = {key_of(d): d for d in helm.render(name)}
    deploy = {key_of(d): d for d in variant(kubectl, kustomization)}
    if not values.get("namespace", {}).get("create"):
        deploy = {k: d for k, d in deploy.items() if k[0] != NAMESPACE_OBJECT[0]}   # 4. NAMESPACE_OBJECT
    assert set(chart) == set(deploy), f"helm only {sorted(set(chart) - set(deploy))}, " \
                                      f"kustomize only {sorted(set(deploy) - set(chart))}"
    found = []
    for key in sorted(chart):
        found += [f"{key[0]}/{key[1]}{d}" for d in differences(*without_helm_conventions(chart[key], deploy[key]))]
    assert not found, f"helm ({name}) against kubectl kustomize deploy/{kustomization}:\n" + "\n".join(found)


def test_default_render_is_deploy_base_in_each_part_the_brief_names(helm, kubectl):
    """The comparison above, spelt out for the parts that matter most, so a failure reads plainly."""
    chart, base = helm.render("default"), variant(kubectl, "base")
    assert sorted(key_of(d) for d in chart) == sorted(key_of(d) for d in base if d["kind"] != "Namespace")
    assert one(chart, "ClusterRole")["rules"] == one(base, "ClusterRole")["rules"]
    chart_ds, base_ds = daemonset(chart), one(base, "DaemonSet")
    for key in ("args", "env", "ports", "livenessProbe", "readinessProbe", "resources", "securityContext",
                "volumeMounts", "image", "imagePullPolicy"):
        assert only_container(chart_ds)[key] == only_container(base_ds)[key], key
    for key in ("volumes", "affinity", "tolerations", "priorityClassName", "serviceAccountName",
                "automountServiceAccountToken", "enableServiceLinks", "terminationGracePeriodSeconds"):
        assert pod_spec(chart_ds)[key] == pod_spec(base_ds)[key], key
    assert one(chart, "ConfigMap")["data"] == one(base, "ConfigMap")["data"]
    assert one(chart, "Service")["spec"]["ports"] == one(base, "Service")["spec"]["ports"]


def test_another_release_name_prefixes_every_name_and_keeps_the_references(helm):
    docs = helm.render("default", release="dev")
    names = {key_of(d) for d in docs}
    assert names == {("ServiceAccount", "dev-gpu-npd"), ("ClusterRole", "dev-gpu-npd"),
                     ("ClusterRoleBinding", "dev-gpu-npd"), ("ConfigMap", "dev-gpu-npd-config"),
                     ("DaemonSet", "dev-gpu-npd"), ("Service", "dev-gpu-npd-metrics")}
    spec = pod_spec(daemonset(docs))
    binding = one(docs, "ClusterRoleBinding")
    assert binding["roleRef"]["name"] == "dev-gpu-npd"
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": spec["serviceAccountName"], "namespace": NAMESPACE}]
    [config] = [v for v in spec["volumes"] if v["name"] == "config"]
    assert config["configMap"]["name"] == "dev-gpu-npd-config"
    service = one(docs, "Service")
    assert selector_matches({"matchLabels": service["spec"]["selector"]}, daemonset(docs)["spec"]["template"]["metadata"]["labels"])
    assert not selector_matches({"matchLabels": service["spec"]["selector"]},
                                daemonset(helm.render("default"))["spec"]["template"]["metadata"]["labels"]), \
        "one release's Service selects another's pods"


# --- Pod Security

@pytest.mark.parametrize("name, level", [("namespace", "privileged"), ("unprivileged", "baseline"),
                                         ("everything", "baseline")])
def test_namespace_pod_security_labels_fit_the_pods(helm, name, level):
    docs = helm.render(name)
    namespace = one(docs, "Namespace", NAMESPACE)
    for mode in ("enforce", "audit", "warn"):
        assert namespace["metadata"]["labels"][f"pod-security.kubernetes.io/{mode}"] == level, mode
    refused = baseline_violations(pod_spec(daemonset(docs)))
    if level == "baseline":
        assert refused == [], f"{name}: baseline refuses {refused}"
    else:
        assert refused, f"{name}: nothing needs `privileged`"


def test_unprivileged_runs_xid_and_visibility_without_host_access(helm, registry):
    docs = helm.render("unprivileged")
    args = args_of(docs)
    assert args.func.__name__ == "cmd_run"
    assert args.checks.split(",") == ["xid", "visibility"] and {"xid", "visibility"} <= set(registry.names())
    assert args.sysfs_root == Path("/sys") and args.state_dir == Path(STATE_DIR)
    spec = pod_spec(daemonset(docs))
    assert not any("hostPath" in v for v in spec["volumes"])
    assert "emptyDir" in next(v for v in spec["volumes"] if v["name"] == "state")
    context = only_container(daemonset(docs))["securityContext"]
    assert context["privileged"] is False and context["allowPrivilegeEscalation"] is False
    assert context["capabilities"] == {"drop": ["ALL"]} and context["seccompProfile"] == {"type": "RuntimeDefault"}


def test_default_namespace_is_left_to_the_release(helm):
    assert not objects(helm.render("default"), "Namespace"), "namespace.create is off by default"


# --- Host mounts and nodes

@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_host_mounts_are_what_a_check_reads_all_read_only_but_the_state_directory(helm, name):
    workload = daemonset(helm.render(name))
    mounts = host_mounts(workload)
    assert set(mounts) <= CHECK_HOST_PATHS | {STATE_DIR}, sorted(set(mounts) - CHECK_HOST_PATHS)
    for host_path, mount in mounts.items():
        assert mount.get("readOnly") is (None if host_path == STATE_DIR else True), f"{name}: {host_path}"
    if "/sys" in mounts:
        args = only_container(workload)["args"]
        assert args[args.index("--sysfs-root") + 1] == mounts["/sys"]["mountPath"]


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_no_pod_can_land_on_a_kwok_node(helm, name):
    spec = pod_spec(daemonset(helm.render(name)))
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    for term in terms:
        assert KWOK_EXCLUSION in term["matchExpressions"], f"{name}: a term without the KWOK exclusion"
    for candidate in (KWOK_GPU_NODE, simulator_kwok_node(), *kwok_nodes_asking_for(terms)):
        assert not pod_may_run_on(spec, candidate), f"{name}: {candidate['metadata']['name']}"
    assert not pod_may_run_on(spec, CPU_NODE)


def test_default_pods_go_to_gpu_nodes_whichever_labeller(helm):
    spec = pod_spec(daemonset(helm.render("default")))
    for gpu_node in (GPU_OPERATOR_NODE, GFD_ONLY_NODE, NFD_ONLY_NODE, NFD_DEFAULT_NODE):
        assert pod_may_run_on(spec, gpu_node), gpu_node["metadata"]["labels"]


def test_custom_node_label_replaces_the_gpu_labels(helm):
    spec = pod_spec(daemonset(helm.render("custom-node-label")))
    assert pod_may_run_on(spec, node("site-gpu", **{"example.com/gpu-node": "true"}))
    assert not pod_may_run_on(spec, GPU_OPERATOR_NODE)


def test_node_selector_and_affinity_values_add_to_the_terms(helm):
    spec = pod_spec(daemonset(helm.render("everything")))
    assert spec["nodeSelector"] == {"kubernetes.io/arch": "amd64"}
    assert spec["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]["weight"] == 1
    assert pod_may_run_on(spec, node("site-gpu", **{"example.com/gpu-node": "true", "kubernetes.io/arch": "amd64"}))
    assert not pod_may_run_on(spec, node("arm-gpu", **{"example.com/gpu-node": "true", "kubernetes.io/arch": "arm64"}))
    assert spec["runtimeClassName"] == "nvidia" and spec["imagePullSecrets"] == [{"name": "registry"}]
    assert {"name": "X", "value": "1"} in only_container(daemonset(helm.render("everything")))["env"]


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_runtime_class_only_where_asked_for(helm, name):
    expected = VARIANTS[name][0].get("runtimeClassName")
    assert pod_spec(daemonset(helm.render(name))).get("runtimeClassName") == expected


# --- Rules and check settings from values

def configmap_files(docs: list[dict], tmp_path: Path) -> dict[str, Path]:
    """The ConfigMap's files, written out where the pod would see them (under tmp_path)."""
    files = {}
    for key, text in one(docs, "ConfigMap")["data"].items():
        files[key] = tmp_path / key
        files[key].write_text(text, encoding="utf-8")
    return files


def mounted(docs: list[dict], tmp_path: Path, paths: list[str]) -> list[str]:
    """Paths under CONFIG_DIR in the pod's arguments, as the written-out ConfigMap files."""
    return [str(tmp_path / p[len(CONFIG_DIR) + 1:]) if p.startswith(CONFIG_DIR + "/") else p for p in paths]


def test_rule_files_in_values_reach_the_configmap_and_the_rules_arguments(helm, registry, tmp_path):
    docs = helm.render("site")
    data = one(docs, "ConfigMap")["data"]
    assert set(data) == {"config.yaml", "a-text.yml", "b-pcie.yaml", "site-rules.yaml"}
    assert data["a-text.yml"] == TEXT_RULE_FILE, "a rule file given as text goes in as it is"
    assert yaml.safe_load(data["b-pcie.yaml"]) == {"version": 1, "rules": [SITE_RULE]}
    args = args_of(docs)
    assert args.rules == ["builtin", f"{CONFIG_DIR}/a-text.yml", f"{CONFIG_DIR}/b-pcie.yaml",
                          f"{CONFIG_DIR}/site-rules.yaml"], "the bundled rules, then each file in name order"
    mounts = {m["name"]: m["mountPath"] for m in only_container(daemonset(docs))["volumeMounts"]}
    assert mounts["config"] == CONFIG_DIR
    configmap_files(docs, tmp_path)
    ruleset = load_rules(rule_paths(mounted(docs, tmp_path, args.rules)), registry.fields_by_check())
    names = {r.name for r in ruleset.rules}
    assert {"site-pcie-below-gen5", "site-pcie-below-gen4"} <= names and len(names) > 10, "bundled ones too"


def test_builtin_false_loads_the_given_files_only(helm, registry, tmp_path):
    docs = helm.render("own-rules-only")
    args = args_of(docs)
    assert args.rules == [f"{CONFIG_DIR}/only.yaml"], "a plain path replaces the bundled rules"
    assert set(one(docs, "ConfigMap")["data"]) == {"config.yaml", "only.yaml"}, "site-rules.yaml: null drops it"
    configmap_files(docs, tmp_path)
    ruleset = load_rules(rule_paths(mounted(docs, tmp_path, args.rules)), registry.fields_by_check())
    assert [r.name for r in ruleset.rules] == ["site-pcie-below-gen5"]


def test_a_rule_file_from_set_file(helm, tmp_path):
    rules = tmp_path / "mine.yaml"
    rules.write_text(TEXT_RULE_FILE, encoding="utf-8")
    proc = helm.template({}, "--set-file", f"rules.files.mine\\.yaml={rules}", name="set-file")
    assert proc.returncode == 0, proc.stderr
    docs = [d for d in yaml.safe_load_all(proc.stdout) if d]
    assert one(docs, "ConfigMap")["data"]["mine.yaml"] == TEXT_RULE_FILE
    assert f"{CONFIG_DIR}/mine.yaml" in args_of(docs).rules


def test_no_rules_at_all_is_refused(helm):
    error = helm.refusal({"rules": {"builtin": False, "files": {"site-rules.yaml": None}}})
    assert "rules.builtin is false and rules.files is empty" in error


def test_check_settings_reach_config_yaml_and_build(helm, registry, tmp_path):
    docs = helm.render("site")
    files = configmap_files(docs, tmp_path)
    assert args_of(docs).config == Path(f"{CONFIG_DIR}/config.yaml")
    file, settings = load_check_settings(files["config.yaml"])
    assert settings == SITE_CHECKS
    checks = {c.name: c for c in build_checks(registry, None, settings, file)}
    assert "infiniband" not in checks and "visibility" in checks
    # The defaults' config.yaml is deploy/base's: every check with its defaults.
    file, settings = load_check_settings(configmap_files(helm.render("default"), tmp_path)["config.yaml"])
    assert settings == {}


def test_config_change_rolls_the_pods(helm):
    checksum = lambda name: daemonset(helm.render(name))["spec"]["template"]["metadata"]["annotations"][CONFIG_CHECKSUM]
    assert checksum("default") != checksum("site")
    assert checksum("default") == checksum("nvidia-runtime")


def test_image_extra_args_and_the_rest_of_the_daemon(helm):
    docs = helm.render("site")
    container = only_container(daemonset(docs))
    assert container["image"] == "registry.example/gpu-npd:0.1.1"
    assert container["args"][-2:] == ["--heartbeat", "120"]
    args = args_of(docs)
    assert args.func.__name__ == "cmd_run" and args.heartbeat == 120
    assert only_container(daemonset(helm.render("default")))["image"] == f"gpu-npd:{CHART_META['appVersion']}", \
        "the tag defaults to the chart's appVersion"


# --- Prometheus Operator

def test_podmonitor_scrapes_this_release_s_pods(helm):
    docs = helm.render("podmonitor")
    monitor = one(docs, "PodMonitor")
    assert monitor["apiVersion"] == MONITOR_KINDS["PodMonitor"]
    spec = monitor["spec"]
    assert set(spec) <= PODMONITOR_SPEC_FIELDS
    assert selector_matches(spec["selector"], daemonset(docs)["spec"]["template"]["metadata"]["labels"])
    assert not selector_matches(spec["selector"], daemonset(helm.render("default", release="dev"))["spec"]["template"]
                                ["metadata"]["labels"]), "another release's pods"
    assert spec["namespaceSelector"]["matchNames"] == [NAMESPACE]
    [endpoint] = spec["podMetricsEndpoints"]
    assert set(endpoint) <= ENDPOINT_FIELDS and endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"
    for relabeling in endpoint["relabelings"]:
        assert set(relabeling) <= RELABEL_FIELDS
    assert {"sourceLabels": ["__meta_kubernetes_pod_node_name"], "targetLabel": "node", "action": "replace"} in \
        endpoint["relabelings"]


SERVICEMONITOR_SPEC_FIELDS = {"selector", "namespaceSelector", "endpoints", "jobLabel", "targetLabels",
                              "podTargetLabels", "sampleLimit", "targetLimit", "labelLimit", "attachMetadata",
                              "scrapeProtocols"}


def test_servicemonitor_scrapes_the_metrics_service(helm):
    docs = helm.render("servicemonitor")
    monitor = one(docs, "ServiceMonitor")
    assert monitor["apiVersion"] == MONITOR_KINDS["ServiceMonitor"] and not objects(docs, "PodMonitor")
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    spec = monitor["spec"]
    assert set(spec) <= SERVICEMONITOR_SPEC_FIELDS
    service = one(docs, "Service")
    assert selector_matches(spec["selector"], service["metadata"]["labels"])
    assert spec["namespaceSelector"]["matchNames"] == [NAMESPACE]
    [endpoint] = spec["endpoints"]
    assert set(endpoint) <= ENDPOINT_FIELDS and endpoint["path"] == "/metrics"
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert {"sourceLabels": ["__meta_kubernetes_pod_node_name"], "targetLabel": "node", "action": "replace"} in \
        endpoint["relabelings"]


def test_both_monitors_at_once_are_refused(helm):
    error = helm.refusal({"podMonitor": {"enabled": True}, "serviceMonitor": {"enabled": True}})
    assert "scraped twice" in error


def test_custom_resources_are_only_the_monitors(helm):
    for name in VARIANTS:
        for doc in helm.render(name):
            if doc["apiVersion"].split("/")[0].endswith(".coreos.com"):
                assert MONITOR_KINDS.get(doc["kind"]) == doc["apiVersion"], doc["kind"]


# --- NOTES.txt

@pytest.mark.parametrize("name, says", [("default", "pod-security.kubernetes.io/enforce=privileged"),
                                        ("unprivileged", "xid and visibility checks only")])
def test_notes_render(helm, name, says):
    proc = helm.run("install", "gpu-npd", str(CHART), "--dry-run=client", "--namespace", NAMESPACE,
                    "-f", str(helm.values_file(VARIANTS[name][0], f"notes-{name}")))
    assert proc.returncode == 0, proc.stderr
    notes = proc.stdout[proc.stdout.index("NOTES:"):]
    assert says in notes and "kubectl -n gpu-npd get pods" in notes


# --- `python tests/test_helm.py` brings the schema's checks section up to the code ---------------------------

def sync_schema_checks() -> list[str]:
    """Each check's settings in values.schema.json as the code declares them: new ones added (type and help from
    the ConfigField), gone ones removed, the entries already there (their wording, bounds) kept. Says what moved."""
    from detector.core.check import CheckRegistry

    path = CHART / "values.schema.json"
    schema = json.loads(path.read_text(encoding="utf-8"))
    registry = CheckRegistry.from_entry_points()
    types = {list: "array", int: "integer", float: "number", str: "string", bool: "boolean"}
    section = schema["properties"]["checks"]["properties"]
    moved = []
    for name in registry.names():
        cls = registry.get(name)
        old = section.get(name, {}).get("properties", {})
        known = set(cls.schedule_fields()) | set(cls.config_fields)
        new = {key: entry for key, entry in old.items() if key in known}
        for key, spec in cls.config_fields.items():
            if key not in new:
                new[key] = {"type": types[spec.kind], "description": spec.help}
                moved.append(f"added checks.{name}.{key}")
        moved += [f"removed checks.{name}.{key}" for key in set(old) - set(new)]
        section[name] = {"type": "object", "additionalProperties": False, "properties": new}
    path.write_text(json.dumps(schema, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return moved


if __name__ == "__main__":
    print("\n".join(sync_schema_checks()) or "values.schema.json: the checks section is up to date")
