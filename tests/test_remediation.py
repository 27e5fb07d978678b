"""deploy/remediation: the medik8s NodeHealthCheck (the kustomization) and the draino alternative, offline.

The NodeHealthCheck is validated against the CRD medik8s publishes (tests/fixtures/remediation/, SOURCE.md
there says from where), strictly: an unknown field fails as it would with the API server's strict field
validation, rather than being pruned in silence. What NHC's webhook adds to the schema (exactly one of
minHealthy and maxUnhealthy, one remediation reference) is checked by hand, and the template it names is
checked against Self Node Remediation's CRD. draino's objects are validated against the Kubernetes schemas
(kubernetes-validate, strict), its flags against those planetlabs/draino defines, its RBAC against what its
code calls. Every condition either acts on must be one of gpu-npd's rules, and only the node-level ones:
one bad GPU is fenced with a device taint, never a reboot. The kustomization is rendered with kubectl
(`make kubectl`) as in test_deploy_render.py."""

from __future__ import annotations

import copy
import math
import re
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from conftest import builtin_rules, REPO
from detector.rules.loader import RuleSet
from test_deploy_render import (  # noqa: F401  (kubectl and no_network are fixtures)
    CPU_NODE, GFD_ONLY_NODE, GPU_OPERATOR_NODE, K8S_VERSIONS, KWOK_GPU_NODE, NFD_ONLY_NODE, baseline_violations,
    kubectl, no_network, node, pod_may_run_on, pod_spec, render, selector_matches, simulator_kwok_node,
)

REMEDIATION = REPO / "deploy" / "remediation"
FIXTURES = REPO / "tests" / "fixtures" / "remediation"
NHC_CRD = FIXTURES / "nodehealthchecks.remediation.medik8s.io.yaml"
SNR_TEMPLATE_CRD = FIXTURES / "selfnoderemediationtemplates.self-node-remediation.medik8s.io.yaml"

# The condition a node remediator acts on, and gpu-npd's other node-level verdicts, which it must not.
NEEDS_REMEDIATION = "GpuNodeNeedsRemediation"
REMEDIATION_LOOP = "GpuRemediationLoop"
FLAKY = "GpuFlaky"
MIN_DURATION_S = 60.0

# planetlabs/draino's flags, from cmd/draino/draino.go (the same at 450a853, the image's commit, and at
# the repository's last commit, 9d39b53): name -> takes a value (False: a boolean flag).
DRAINO_FLAGS = {
    "debug": False, "listen": True, "kubeconfig": True, "master": True, "dry-run": False,
    "max-grace-period": True, "eviction-headroom": True, "drain-buffer": True, "node-label": True,
    "node-label-expr": True, "namespace": True, "leader-election-lease-duration": True,
    "leader-election-renew-deadline": True, "leader-election-retry-period": True,
    "leader-election-token-name": True, "skip-drain": False, "evict-daemonset-pods": False,
    "evict-statefulset-pods": False, "evict-emptydir-pods": False, "evict-unreplicated-pods": False,
    "protected-pod-annotation": True,
}
DRAINO_DURATION_FLAGS = {"max-grace-period", "eviction-headroom", "drain-buffer", "leader-election-lease-duration",
                         "leader-election-renew-deadline", "leader-election-retry-period"}
# Exclusion by hand: the label medik8s' NodeHealthCheck honours (medik8s/common, labels.go).
EXCLUDE_LABEL = "remediation.medik8s.io/exclude-from-remediation"


def load_yaml_docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d is not None]


def go_duration_s(text: str) -> float:
    """A Go time.ParseDuration string ("300s", "5m", "1h30m", "1.5h") in seconds."""
    units = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)", text)
    assert parts and "".join(n + u for n, u in parts) == text, f"not a Go duration: {text!r}"
    return sum(float(n) * units[u] for n, u in parts)


def test_go_duration_parser():
    assert go_duration_s("300s") == go_duration_s("5m") == 300.0
    assert go_duration_s("1h30m") == go_duration_s("1.5h") == 5400.0
    assert go_duration_s("0s") == 0.0
    for bad in ("300", "5 m", "5min", ""):
        with pytest.raises(AssertionError):
            go_duration_s(bad)


# --- Fixtures

@pytest.fixture(scope="module")
def ruleset(registry) -> RuleSet:
    return builtin_rules()


@pytest.fixture(scope="module")
def nhc() -> dict[str, Any]:
    [doc] = load_yaml_docs(REMEDIATION / "nodehealthcheck.yaml")
    return doc


@pytest.fixture(scope="module")
def nhc_crd() -> dict[str, Any]:
    [crd] = load_yaml_docs(NHC_CRD)
    return crd


@pytest.fixture(scope="module")
def draino_docs() -> list[dict[str, Any]]:
    return load_yaml_docs(REMEDIATION / "draino.yaml")


def one_of(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


@pytest.fixture(scope="module")
def draino(draino_docs) -> dict[str, Any]:
    return one_of(draino_docs, "Deployment", "draino")


def draino_container(deployment: dict[str, Any]) -> dict[str, Any]:
    [container] = pod_spec(deployment)["containers"]
    return container


def draino_args(deployment: dict[str, Any]) -> tuple[dict[str, str | None], list[str]]:
    """The flags (name -> value, None for a boolean one) and the positional arguments (conditions)."""
    container = draino_container(deployment)
    assert container["command"] == ["/draino"], "the image's binary; arguments in args"
    flags: dict[str, str | None] = {}
    positional = []
    for arg in container["args"]:
        if arg.startswith("--"):
            name, _, value = arg[2:].partition("=")
            assert name not in flags, f"--{name} given twice"
            flags[name] = value if "=" in arg else None
        else:
            positional.append(arg)
    return flags, positional


def draino_conditions(deployment: dict[str, Any]) -> list[tuple[str, str, float]]:
    """Positional arguments as draino's ParseConditions reads them: `Type=Status,Duration`, or a bare
    `Type` meaning True with no minimum duration."""
    parsed = []
    for arg in draino_args(deployment)[1]:
        kind, sep, rest = arg.partition("=")
        status, duration = rest.split(",", 1) if sep else ("True", "0s")
        parsed.append((kind, status, go_duration_s(duration)))
    return parsed


# --- The NodeHealthCheck against medik8s' CRD

def served_schema(crd: dict[str, Any], api_version: str) -> dict[str, Any]:
    group, version = api_version.split("/")
    assert crd["spec"]["group"] == group, f"{api_version}: the CRD is for {crd['spec']['group']}"
    [v] = [v for v in crd["spec"]["versions"] if v["name"] == version]
    assert v["served"], f"{api_version} is not served"
    return v["schema"]["openAPIV3Schema"]


def strict(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema with every object that lists its properties closed to others: the API server prunes
    unknown fields of a structural schema (or refuses them with strict field validation), so a misspelt
    field would be dropped silently there. x-kubernetes-preserve-unknown-fields and free maps stay open."""
    schema = copy.deepcopy(schema)

    def close(node: Any) -> None:
        if isinstance(node, dict):
            if ("properties" in node and "additionalProperties" not in node
                    and not node.get("x-kubernetes-preserve-unknown-fields")):
                node["additionalProperties"] = False
            for value in node.values():
                close(value)
        elif isinstance(node, list):
            for value in node:
                close(value)

    close(schema)
    return schema


def crd_errors(doc: dict[str, Any], crd: dict[str, Any]) -> list[str]:
    validator = jsonschema.Draft7Validator(strict(served_schema(crd, doc["apiVersion"])))
    return [f"{'.'.join(str(p) for p in e.absolute_path) or '(root)'}: {e.message}"
            for e in validator.iter_errors(doc)]


def test_nodehealthcheck_validates_against_the_crd(nhc, nhc_crd):
    assert nhc["kind"] == nhc_crd["spec"]["names"]["kind"] == "NodeHealthCheck"
    assert nhc["apiVersion"] == "remediation.medik8s.io/v1alpha1"
    errors = crd_errors(nhc, nhc_crd)
    assert not errors, "\n".join(errors)
    # Cluster-scoped: a namespace would be refused.
    assert nhc_crd["spec"]["scope"] == "Cluster" and "namespace" not in nhc["metadata"]
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", nhc["metadata"]["name"])


@pytest.mark.parametrize("breakage", [
    "duration as a number", "maxUnhealthy as a fraction", "status missing", "misspelt field",
    "duration not a Go duration", "percentage over 100", "selector operator as a list",
])
def test_crd_validation_refuses_a_broken_copy(nhc, nhc_crd, breakage):
    """The check above would prove little if anything passed."""
    broken = copy.deepcopy(nhc)
    spec = broken["spec"]
    if breakage == "duration as a number":
        spec["unhealthyConditions"][0]["duration"] = 300
    elif breakage == "maxUnhealthy as a fraction":
        spec["maxUnhealthy"] = 0.1
    elif breakage == "status missing":                     # required in each unhealthyCondition
        del spec["unhealthyConditions"][0]["status"]
    elif breakage == "misspelt field":
        spec["maxUnhealty"] = spec.pop("maxUnhealthy")
    elif breakage == "duration not a Go duration":
        spec["unhealthyConditions"][0]["duration"] = "5 minutes"
    elif breakage == "percentage over 100":
        spec["maxUnhealthy"] = "110%"
    elif breakage == "selector operator as a list":
        spec["selector"]["matchExpressions"][0]["operator"] = ["In"]
    assert crd_errors(broken, nhc_crd), f"{breakage}: accepted"


def test_crd_fixture_is_the_published_one(nhc_crd):
    """SOURCE.md names where the fixture came from; the fixture is the file itself, not an excerpt."""
    source = (FIXTURES / "SOURCE.md").read_text(encoding="utf-8")
    assert "medik8s/node-healthcheck-operator" in source
    assert "config/crd/bases/remediation.medik8s.io_nodehealthchecks.yaml" in source
    assert re.search(r"\b[0-9a-f]{40}\b", source), "no commit"
    assert nhc_crd["metadata"]["name"] == "nodehealthchecks.remediation.medik8s.io"
    spec = served_schema(nhc_crd, "remediation.medik8s.io/v1alpha1")["properties"]["spec"]["properties"]
    assert {"selector", "unhealthyConditions", "minHealthy", "maxUnhealthy", "remediationTemplate",
            "escalatingRemediations", "pauseRequests"} <= set(spec)


def test_nodehealthcheck_passes_what_nhc_s_webhook_checks(nhc):
    """What the schema leaves to NHC's validation (api/v1alpha1/validation.go) and docs: exactly one of
    minHealthy and maxUnhealthy, exactly one of remediationTemplate and escalatingRemediations, a
    non-empty selector, and a template reference with apiVersion, kind, name and namespace."""
    spec = nhc["spec"]
    assert ("minHealthy" in spec) != ("maxUnhealthy" in spec), "one circuit breaker, not both, not none"
    assert ("remediationTemplate" in spec) != ("escalatingRemediations" in spec)
    assert spec["selector"].get("matchExpressions") or spec["selector"].get("matchLabels")
    template = spec["remediationTemplate"]
    assert {"apiVersion", "kind", "name", "namespace"} <= set(template)
    assert template["kind"].endswith("Template"), "NHC creates the remediation as the kind less 'Template'"
    assert not spec.get("pauseRequests"), "shipped paused"


def test_remediation_template_is_self_node_remediation_s(nhc):
    """The reference names a kind and version Self Node Remediation's CRD serves, namespaced as it is."""
    [crd] = load_yaml_docs(SNR_TEMPLATE_CRD)
    template = nhc["spec"]["remediationTemplate"]
    assert template["kind"] == crd["spec"]["names"]["kind"] == "SelfNodeRemediationTemplate"
    served_schema(crd, template["apiVersion"])
    assert crd["spec"]["scope"] == "Namespaced" and template["namespace"]
    # SNR's default template (api/v1alpha1/selfnoderemediationtemplate_types.go: defaultTemplateName).
    assert template["name"] == "self-node-remediation-automatic-strategy-template"


def test_crd_fixtures_are_named_in_source_md():
    source = (FIXTURES / "SOURCE.md").read_text(encoding="utf-8")
    for path in FIXTURES.glob("*.yaml"):
        assert path.name in source, f"{path.name}: not in SOURCE.md"


# --- What the NodeHealthCheck acts on

def unhealthy_types(nhc: dict[str, Any]) -> set[str]:
    return {c["type"] for c in nhc["spec"]["unhealthyConditions"]}


def test_remediation_conditions_are_gpu_npd_s(ruleset):
    """The three node-level verdicts are conditions gpu-npd's rules report (rules/remediation.yaml)."""
    missing = {NEEDS_REMEDIATION, REMEDIATION_LOOP, FLAKY} - ruleset.types()
    assert not missing, f"gpu-npd's rules report no condition {sorted(missing)} (rules/: {sorted(ruleset.types())})"


def test_nodehealthcheck_remediates_on_gpu_node_needs_remediation_only(nhc, ruleset):
    types = unhealthy_types(nhc)
    assert types == {NEEDS_REMEDIATION}
    assert types <= ruleset.types(), f"not gpu-npd's: {sorted(types - ruleset.types())}"
    [condition] = nhc["spec"]["unhealthyConditions"]
    assert condition["status"] == "True"
    # Nothing else gpu-npd reports is a reason to reboot the node: not a loop (inspect), not a flaky GPU
    # (replace it), not a per-GPU condition (device taint).
    others = ruleset.types() - {NEEDS_REMEDIATION}
    assert not types & (others | {REMEDIATION_LOOP, FLAKY})


def test_unhealthy_conditions_wait_at_least_a_minute(nhc):
    for condition in nhc["spec"]["unhealthyConditions"]:
        assert go_duration_s(condition["duration"]) >= MIN_DURATION_S, condition


def nhc_allowed_unhealthy(spec: dict[str, Any], nodes: int) -> int:
    """How many selected nodes may be unhealthy while NHC still starts remediations: getMinHealthy in
    internal/controller/nodehealthcheck_controller.go, which scales percentages rounding up."""
    def scaled(value: int | str) -> int:
        if isinstance(value, str) and value.endswith("%"):
            return math.ceil(int(value[:-1]) * nodes / 100)
        return int(value)
    if "minHealthy" in spec:
        return nodes - scaled(spec["minHealthy"])
    return scaled(spec["maxUnhealthy"])


def test_circuit_breaker_stops_a_fleet_wide_fault_and_still_lets_a_small_fleet_remediate(nhc):
    spec = nhc["spec"]
    assert "minHealthy" in spec or "maxUnhealthy" in spec
    for nodes in (1, 2, 5, 10, 16, 64, 100, 1000):
        allowed = nhc_allowed_unhealthy(spec, nodes)
        assert allowed >= 1, f"{nodes} GPU nodes: no remediation ever"
        assert allowed <= max(1, math.ceil(nodes * 0.05)), f"{nodes} GPU nodes: {allowed} at once"
        # A correlated fault on a tenth of the fleet stops it (with at least 20 nodes to be a tenth of).
        if nodes >= 20:
            assert math.ceil(nodes * 0.1) > allowed, f"{nodes} GPU nodes: a fault on a tenth of them is remediated"


def test_nhc_model_follows_its_rounding():
    assert nhc_allowed_unhealthy({"maxUnhealthy": "10%"}, 4) == 1          # ceil(0.4)
    assert nhc_allowed_unhealthy({"minHealthy": "90%"}, 4) == 0            # ceil(3.6) = 4 must be healthy
    assert nhc_allowed_unhealthy({"minHealthy": 3}, 4) == 1
    assert nhc_allowed_unhealthy({"maxUnhealthy": 2}, 100) == 2


GPU_CONTROL_PLANE_NODE = node("gpu-cp", **{**GPU_OPERATOR_NODE["metadata"]["labels"],
                                           "node-role.kubernetes.io/control-plane": ""})
EXCLUDED_BY_HAND = node("gpu-inspect", **{**GPU_OPERATOR_NODE["metadata"]["labels"], EXCLUDE_LABEL: "true"})


def base_daemonset() -> dict[str, Any]:
    docs = load_yaml_docs(REPO / "deploy" / "base" / "daemonset.yaml")
    return one_of(docs, "DaemonSet", "gpu-npd")


def test_nodehealthcheck_selects_the_gpu_nodes_gpu_npd_runs_on(nhc):
    selector = nhc["spec"]["selector"]

    def selected(n: dict[str, Any]) -> bool:
        return selector_matches(selector, n["metadata"]["labels"])

    assert selected(GPU_OPERATOR_NODE) and selected(GFD_ONLY_NODE)
    assert selected(EXCLUDED_BY_HAND), "excluded by NHC itself (and counted), not by the selector"
    for other in (CPU_NODE, KWOK_GPU_NODE, simulator_kwok_node(), GPU_CONTROL_PLANE_NODE):
        assert not selected(other), other["metadata"]["name"]
    # Only nodes with a gpu-npd pod: any other would count as healthy and dilute maxUnhealthy.
    daemon = pod_spec(base_daemonset())
    for candidate in (GPU_OPERATOR_NODE, GFD_ONLY_NODE, NFD_ONLY_NODE, CPU_NODE, KWOK_GPU_NODE,
                      simulator_kwok_node(), GPU_CONTROL_PLANE_NODE):
        if selected(candidate):
            assert pod_may_run_on(daemon, candidate), f"{candidate['metadata']['name']}: selected, no gpu-npd"


def comment_above(lines: list[str], index: int) -> bool:
    indent = len(lines[index]) - len(lines[index].lstrip())
    return index > 0 and lines[index - 1].startswith(" " * indent + "#")


def test_every_field_of_the_spec_says_why(nhc):
    """Each field under spec: (and the template's namespace, which a site must adapt) has a comment."""
    lines = (REMEDIATION / "nodehealthcheck.yaml").read_text(encoding="utf-8").splitlines()
    keyed = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"^  (\w+):", line))}
    assert set(nhc["spec"]) <= set(keyed)
    for key in nhc["spec"]:
        assert comment_above(lines, keyed[key]), f"spec.{key}: no comment above it"
    duration = next(i for i, line in enumerate(lines) if line.strip().startswith("duration:"))
    namespace = next(i for i, line in enumerate(lines) if line.strip().startswith("namespace:"))
    assert comment_above(lines, duration) and comment_above(lines, namespace)


# --- The kustomization

def test_kustomization_lists_the_nodehealthcheck_only():
    k = yaml.safe_load((REMEDIATION / "kustomization.yaml").read_text(encoding="utf-8"))
    assert (k["apiVersion"], k["kind"]) == ("kustomize.config.k8s.io/v1beta1", "Kustomization")
    assert k["resources"] == ["nodehealthcheck.yaml"], "draino.yaml is the alternative, not an addition"
    assert "namespace" not in k, "a NodeHealthCheck is cluster-scoped"
    assert not (REMEDIATION / "README.md").exists()


def test_kustomization_renders_the_nodehealthcheck(kubectl, nhc, nhc_crd):
    [rendered] = render(kubectl, REMEDIATION)
    assert rendered == nhc
    errors = crd_errors(rendered, nhc_crd)
    assert not errors, "\n".join(errors)


# --- draino

@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_draino_objects_validate_against_the_kubernetes_schema(draino_docs, version):
    assert {(d["kind"], d["metadata"]["name"]) for d in draino_docs} == {
        ("Namespace", "draino"), ("ServiceAccount", "draino"), ("ClusterRole", "draino"),
        ("ClusterRoleBinding", "draino"), ("Role", "draino-leader-election"),
        ("RoleBinding", "draino-leader-election"), ("Deployment", "draino")}
    failures = []
    for doc in draino_docs:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            failures.append(f"{doc['kind']}/{doc['metadata']['name']}: "
                            f"{'.'.join(str(p) for p in e.path)}: {e.message}")
    assert not failures, "\n".join(failures)


def test_draino_validation_is_strict(draino):
    broken = copy.deepcopy(draino)
    draino_container(broken)["securityContext"]["readOnlyRootFileSystem"] = True       # misspelt
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSIONS[0], strict=True)


def test_draino_namespaced_objects_share_its_namespace(draino_docs):
    for doc in draino_docs:
        if doc["kind"] in ("Namespace", "ClusterRole", "ClusterRoleBinding"):
            assert "namespace" not in doc["metadata"], doc["kind"]
        else:
            assert doc["metadata"]["namespace"] == "draino", f"{doc['kind']}/{doc['metadata']['name']}"


def test_draino_runs_as_non_root_with_a_read_only_root_filesystem(draino, draino_docs):
    spec = pod_spec(draino)
    pod_context = spec.get("securityContext") or {}
    context = draino_container(draino)["securityContext"]
    assert context.get("runAsNonRoot", pod_context.get("runAsNonRoot")) is True
    uid = context.get("runAsUser", pod_context.get("runAsUser"))
    assert isinstance(uid, int) and uid != 0, "the image's USER is a name: runAsNonRoot needs a numeric uid"
    assert context["readOnlyRootFilesystem"] is True
    assert context["allowPrivilegeEscalation"] is False
    assert context["capabilities"] == {"drop": ["ALL"]}
    # Pod Security `restricted`, which its namespace enforces: baseline, plus the above and seccomp.
    assert not baseline_violations(spec)
    seccomp = (context.get("seccompProfile") or pod_context.get("seccompProfile") or {}).get("type")
    assert seccomp in ("RuntimeDefault", "Localhost")
    assert not spec.get("volumes"), "restricted allows few volume types; draino needs none"
    labels = one_of(draino_docs, "Namespace", "draino")["metadata"]["labels"]
    for mode in ("enforce", "audit", "warn"):
        assert labels[f"pod-security.kubernetes.io/{mode}"] == "restricted"
    assert draino_container(draino)["image"].startswith("planetlabs/draino:")
    assert not draino_container(draino)["image"].endswith(":latest")


def test_draino_flags_are_draino_s(draino):
    flags, _ = draino_args(draino)
    unknown = set(flags) - set(DRAINO_FLAGS)
    assert not unknown, f"planetlabs/draino has no flag {sorted(unknown)}"
    for name, value in flags.items():
        if DRAINO_FLAGS[name]:
            assert value, f"--{name} takes a value"
        else:
            assert value is None, f"--{name} is a boolean flag: no =value"
        if name in DRAINO_DURATION_FLAGS:
            go_duration_s(value)
    assert "dry-run" not in flags and "skip-drain" not in flags, "shipped acting, as documented"
    assert "node-label" not in flags, "deprecated, and it cannot exclude (use --node-label-expr)"
    # DaemonSet pods (gpu-npd itself, the GPU operator's) stay on the node.
    assert "evict-daemonset-pods" not in flags
    assert "evict-emptydir-pods" in flags, "GPU pods use emptyDir (/dev/shm): they would never leave"
    # The only rate limit: drains at least this far apart.
    assert go_duration_s(flags["drain-buffer"]) >= 600


def test_draino_selects_gpu_nodes_only(draino):
    """--node-label-expr (antonmedv/expr): the GPU label, and no KWOK, control-plane or excluded node."""
    expression = draino_args(draino)[0]["node-label-expr"]
    terms = [t.strip() for t in expression.split("&&")]
    assert terms == [
        "metadata.labels['nvidia.com/gpu.present'] == 'true'",
        "metadata.labels['type'] != 'kwok'",
        "'node-role.kubernetes.io/control-plane' not in metadata.labels",
        f"metadata.labels['{EXCLUDE_LABEL}'] != 'true'",
    ]


def test_draino_acts_on_gpu_npd_s_node_level_conditions_only(draino, ruleset):
    conditions = draino_conditions(draino)
    types = [kind for kind, _, _ in conditions]
    assert len(types) == len(set(types))
    assert set(types) <= ruleset.types(), f"not gpu-npd's: {sorted(set(types) - ruleset.types())}"
    by_type = {kind: (status, duration) for kind, status, duration in conditions}
    assert by_type[NEEDS_REMEDIATION][0] == "True"
    assert by_type[NEEDS_REMEDIATION][1] >= MIN_DURATION_S
    # A loop only keeps the node cordoned (draino never reboots); nothing else empties the node.
    assert set(types) <= {NEEDS_REMEDIATION, REMEDIATION_LOOP}
    assert by_type.get(REMEDIATION_LOOP, ("True", 0))[0] == "True"
    assert FLAKY not in by_type


def test_draino_waits_as_long_as_the_nodehealthcheck(draino, nhc):
    [condition] = nhc["spec"]["unhealthyConditions"]
    draino_wait = {kind: duration for kind, _, duration in draino_conditions(draino)}[NEEDS_REMEDIATION]
    assert draino_wait == go_duration_s(condition["duration"])


def grants(role: dict[str, Any]) -> set[tuple[str, str, str, tuple[str, ...]]]:
    granted = set()
    for rule in role["rules"]:
        assert set(rule) <= {"apiGroups", "resources", "verbs", "resourceNames"}, rule
        for key in ("apiGroups", "resources", "verbs"):
            assert not any("*" in v for v in rule[key]), f"wildcard in {key}: {rule}"
        names = tuple(rule.get("resourceNames", ()))
        granted |= {(g, r, v, names) for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}
    return granted


def test_draino_rbac_is_what_its_code_calls(draino_docs, draino):
    """planetlabs/draino's calls: the node watch (list, watch), cordon and uncordon (get, update),
    MarkDrain (nodes/status update), the drain (pods list by node, eviction create, pods get while
    waiting), the DaemonSet filter (daemonsets get; the StatefulSet one is off with
    --evict-statefulset-pods), Events, and the Endpoints leader-election lock in --namespace."""
    cluster = grants(one_of(draino_docs, "ClusterRole", "draino"))
    assert cluster == {
        ("", "nodes", "get", ()), ("", "nodes", "list", ()), ("", "nodes", "watch", ()),
        ("", "nodes", "update", ()), ("", "nodes/status", "update", ()),
        ("", "pods", "get", ()), ("", "pods", "list", ()), ("", "pods/eviction", "create", ()),
        ("apps", "daemonsets", "get", ()), ("", "events", "create", ()), ("", "events", "patch", ()),
    }
    flags, _ = draino_args(draino)
    assert "evict-statefulset-pods" in flags, "else draino gets statefulsets, which the role does not grant"
    lock_name = flags.get("leader-election-token-name") or "draino"
    role = one_of(draino_docs, "Role", "draino-leader-election")
    assert role["metadata"]["namespace"] == flags["namespace"] == draino["metadata"]["namespace"]
    assert grants(role) == {("", "endpoints", "get", (lock_name,)), ("", "endpoints", "update", (lock_name,)),
                            ("", "endpoints", "create", ())}
    account = {"kind": "ServiceAccount", "name": pod_spec(draino)["serviceAccountName"], "namespace": "draino"}
    one_of(draino_docs, "ServiceAccount", account["name"])
    for kind, role_kind, name in (("ClusterRoleBinding", "ClusterRole", "draino"),
                                  ("RoleBinding", "Role", "draino-leader-election")):
        binding = one_of(draino_docs, kind, name)
        assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": role_kind, "name": name}
        assert binding["subjects"] == [account]


def test_draino_probe_and_port_are_its_listen_address(draino):
    flags, _ = draino_args(draino)
    port = int((flags.get("listen") or ":10002").rsplit(":", 1)[1])
    container = draino_container(draino)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    probe = container["livenessProbe"]["httpGet"]
    assert probe["path"] == "/healthz" and ports[probe["port"]] == port


def test_draino_prefers_nodes_it_does_not_drain(draino):
    preferred = pod_spec(draino)["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    expressions = [e for p in preferred for e in p["preference"]["matchExpressions"]]
    assert {"key": "nvidia.com/gpu.present", "operator": "NotIn", "values": ["true"]} in expressions
