"""deploy/readiness and the chart's readiness.* values: the NodeReadinessRule that keeps a readiness taint on
a GPU node until gpu-npd has verified it (GpuNodeUnverified=False), offline.

Both rules (the kustomization's, rendered with `kubectl kustomize`, and the chart's, with `helm template`)
are validated against the CRD of kubernetes-sigs/node-readiness-controller (tests/fixtures/node_readiness/,
SOURCE.md there says from where), strictly, as tests/test_remediation.py validates the NodeHealthCheck.
The CRD's x-kubernetes-validations (CEL) are not JSON Schema: each create-time rule is checked here by a
small function keyed by the rule's exact text, so a rule the fixture gains without a check fails. What the
controller's admission webhook adds (a non-empty nodeSelector; no defaultStatus and no anyOf with
bootstrap-only) is checked by hand, since the webhook is optional. Then what gpu-npd needs of the rule:
its condition is one gpu-npd's rules report, in problem polarity, it gates only nodes gpu-npd runs on,
and gpu-npd tolerates its taint (else a gated node is never verified)."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml

from conftest import builtin_rules, REPO
from test_deploy_render import (  # noqa: F401  (kubectl and no_network are fixtures)
    CPU_NODE, GFD_ONLY_NODE, GPU_OPERATOR_NODE, KWOK_GPU_NODE, NFD_ONLY_NODE, kubectl, no_network, node, one,
    pod_may_run_on, pod_spec, render, selector_matches, simulator_kwok_node, variant,
)
from test_helm import RELEASE, helm, without_helm_conventions  # noqa: F401  (helm is a fixture)
from test_remediation import crd_errors, load_yaml_docs, served_schema

READINESS = REPO / "deploy" / "readiness"
FIXTURES = REPO / "tests" / "fixtures" / "node_readiness"
CRD = FIXTURES / "nodereadinessrules.readiness.node.x-k8s.io.yaml"
API_VERSION = "readiness.node.x-k8s.io/v1alpha1"
UNVERIFIED = "GpuNodeUnverified"
TAINT_PREFIX = "readiness.k8s.io/"
ENABLED = {"readiness": {"enabled": True}}

Taint = dict[str, str]


# --- Fixtures

@pytest.fixture(scope="module")
def crd() -> dict[str, Any]:
    [doc] = load_yaml_docs(CRD)
    return doc


@pytest.fixture(scope="module")
def rule() -> dict[str, Any]:
    [doc] = load_yaml_docs(READINESS / "nodereadinessrule.yaml")
    return doc


def helm_rule(helm, values: dict[str, Any], name: str = "readiness") -> dict[str, Any]:
    proc = helm.template(values, name=name)
    assert proc.returncode == 0, f"helm template {values}: {proc.stderr}"
    rules = [d for d in yaml.safe_load_all(proc.stdout) if d and d["kind"] == "NodeReadinessRule"]
    assert len(rules) == 1, f"helm template {values}: {len(rules)} NodeReadinessRules"
    return rules[0]


@pytest.fixture(scope="module")
def chart_rule(helm) -> dict[str, Any]:
    return helm_rule(helm, ENABLED)


# --- The CRD's CEL rules (x-kubernetes-validations), each as a check of `self` on create

def name_part(key: str) -> str:
    """CEL's self.key.split('/')[1]; an index out of range is an evaluation error, which refuses."""
    parts = key.split("/")
    if len(parts) < 2:
        raise IndexError(f"{key!r} has no '/'")
    return parts[1]


def holds(check: Callable[[Any], bool], value: Any) -> bool:
    try:
        return bool(check(value))
    except (IndexError, KeyError, TypeError):
        return False


# Keyed by (where the rule sits in the schema, the rule exactly as the CRD writes it).
CEL_CHECKS: dict[tuple[str, str], Callable[[Any], bool]] = {
    ("spec.taint", "self.key.startsWith('readiness.k8s.io/')"):
        lambda t: t["key"].startswith(TAINT_PREFIX),
    ("spec.taint", "self.key.size() <= 253"):
        lambda t: len(t["key"]) <= 253,
    ("spec.taint", "size(self.key.split('/')) == 2"):
        lambda t: len(t["key"].split("/")) == 2,
    ("spec.taint", "size(self.key.split('/')[1]) > 0 && size(self.key.split('/')[1]) <= 63"):
        lambda t: 0 < len(name_part(t["key"])) <= 63,
    ("spec.taint", "self.key.split('/')[1].matches('^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$')"):
        lambda t: re.search(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$", name_part(t["key"])) is not None,
    ("spec.taint", "!has(self.value) || self.value.size() <= 63"):
        lambda t: "value" not in t or len(t["value"]) <= 63,
    ("spec.taint", "self.effect in ['NoSchedule', 'PreferNoSchedule', 'NoExecute']"):
        lambda t: t["effect"] in ("NoSchedule", "PreferNoSchedule", "NoExecute"),
}
# Transition rules (they compare with oldSelf, so they judge updates only): what they make immutable.
IMMUTABLE = {"spec": "conditionPolicy", "spec.conditions": "conditions", "spec.enforcementMode": "enforcementMode",
             "spec.nodeSelector": "nodeSelector", "spec.taint": "taint key, effect and value"}


def cel_rules(schema: dict[str, Any], path: str = "") -> list[tuple[str, str]]:
    """Every x-kubernetes-validations rule under `schema`, with the dotted path of the object it judges."""
    found = [(path, v["rule"]) for v in schema.get("x-kubernetes-validations", [])]
    for key, sub in (schema.get("properties") or {}).items():
        found += cel_rules(sub, f"{path}.{key}" if path else key)
    if "items" in schema:
        found += cel_rules(schema["items"], f"{path}[]")
    return found


def at(doc: dict[str, Any], path: str) -> Any:
    for key in path.split("."):
        doc = doc.get(key) if isinstance(doc, dict) else None
    return doc


def cel_failures(doc: dict[str, Any], crd: dict[str, Any]) -> list[str]:
    failures = []
    for path, text in cel_rules(served_schema(crd, API_VERSION)):
        if "oldSelf" in text:
            continue
        value = at(doc, path)
        if value is not None and not holds(CEL_CHECKS[(path, text)], value):
            failures.append(f"{path}: {text}")
    return failures


def test_every_create_time_cel_rule_of_the_crd_has_its_check(crd):
    rules = cel_rules(served_schema(crd, API_VERSION))
    on_create = {(path, text) for path, text in rules if "oldSelf" not in text}
    assert on_create == set(CEL_CHECKS), (f"CEL rules without a check here: {sorted(on_create - set(CEL_CHECKS))}; "
                                          f"checks for rules the CRD lacks: {sorted(set(CEL_CHECKS) - on_create)}")
    # What the comments in deploy/readiness and values.yaml call immutable is what the CRD makes so.
    assert {path for path, text in rules if "oldSelf" in text} == set(IMMUTABLE)


@pytest.mark.parametrize("taint, refused_by", [
    ({"key": "gpu-npd-unverified", "effect": "NoSchedule"}, "startsWith"),
    ({"key": "node.kubernetes.io/gpu-npd-unverified", "effect": "NoSchedule"}, "startsWith"),
    ({"key": "readiness.k8s.io/gpu/npd", "effect": "NoSchedule"}, "== 2"),
    ({"key": "readiness.k8s.io/", "effect": "NoSchedule"}, "<= 63"),
    ({"key": "readiness.k8s.io/" + "g" * 64, "effect": "NoSchedule"}, "<= 63"),
    ({"key": "readiness.k8s.io/-gpu", "effect": "NoSchedule"}, "matches"),
    ({"key": "readiness.k8s.io/gpu npd", "effect": "NoSchedule"}, "matches"),
    ({"key": "readiness.k8s.io/gpu", "value": "v" * 64, "effect": "NoSchedule"}, "self.value.size()"),
    ({"key": "readiness.k8s.io/gpu", "effect": "NoScheduled"}, "self.effect in"),
], ids=lambda v: v if isinstance(v, str) else v["key"][:40])
def test_each_cel_check_refuses_what_its_rule_refuses(rule, crd, taint, refused_by):
    broken = copy.deepcopy(rule)
    broken["spec"]["taint"] = taint
    failures = cel_failures(broken, crd)
    assert any(refused_by in f for f in failures), f"{taint}: accepted ({failures})"


# --- deploy/readiness against the CRD

def test_crd_fixture_is_the_published_one(crd):
    source = (FIXTURES / "SOURCE.md").read_text(encoding="utf-8")
    assert "kubernetes-sigs/node-readiness-controller" in source
    assert "config/crd/bases/readiness.node.x-k8s.io_nodereadinessrules.yaml" in source
    assert re.search(r"\b[0-9a-f]{40}\b", source), "no commit"
    for path in FIXTURES.glob("*.yaml"):
        assert path.name in source, f"{path.name}: not in SOURCE.md"
    assert crd["metadata"]["name"] == "nodereadinessrules.readiness.node.x-k8s.io"
    assert crd["spec"]["names"]["kind"] == "NodeReadinessRule" and crd["spec"]["scope"] == "Cluster"
    spec = served_schema(crd, API_VERSION)["properties"]["spec"]
    assert set(spec["required"]) == {"conditions", "enforcementMode", "nodeSelector", "taint"}


def check_rule(doc: dict[str, Any], crd: dict[str, Any]) -> None:
    """Schema (strict), CEL rules, and the controller's admission webhook (internal/webhook/
    nodereadinessgaterule_webhook.go, validateSpec)."""
    assert doc["apiVersion"] == API_VERSION and doc["kind"] == "NodeReadinessRule"
    errors = crd_errors(doc, crd) + cel_failures(doc, crd)
    assert not errors, "\n".join(errors)
    assert "namespace" not in doc["metadata"], "cluster-scoped"
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", doc["metadata"]["name"])
    spec = doc["spec"]
    selector = spec["nodeSelector"]
    assert selector.get("matchLabels") or selector.get("matchExpressions"), "webhook: nodeSelector must not be empty"
    if spec["enforcementMode"] == "bootstrap-only":
        assert not any("defaultStatus" in c for c in spec["conditions"]), \
            "webhook: defaultStatus should not be used with bootstrap-only enforcementMode"
        assert spec.get("conditionPolicy", "allOf") == "allOf", \
            "webhook: anyOf conditionPolicy is not supported with bootstrap-only enforcementMode"


def test_rule_validates_against_the_crd(rule, crd):
    check_rule(rule, crd)


@pytest.mark.parametrize("breakage", [
    "misspelt field", "status in lower case", "unknown mode", "no nodeSelector", "no conditions",
    "condition without type",
])
def test_crd_validation_refuses_a_broken_copy(rule, crd, breakage):
    """The validation above would prove little if anything passed."""
    broken = copy.deepcopy(rule)
    spec = broken["spec"]
    if breakage == "misspelt field":
        spec["enforcmentMode"] = spec.pop("enforcementMode")
    elif breakage == "status in lower case":
        spec["conditions"][0]["requiredStatus"] = "false"
    elif breakage == "unknown mode":
        spec["enforcementMode"] = "bootstrap"
    elif breakage == "no nodeSelector":
        del spec["nodeSelector"]
    elif breakage == "no conditions":
        spec["conditions"] = []
    elif breakage == "condition without type":
        del spec["conditions"][0]["type"]
    assert crd_errors(broken, crd), f"{breakage}: accepted"


@pytest.mark.parametrize("breakage", ["defaultStatus", "anyOf", "empty selector"])
def test_webhook_checks_refuse_what_the_webhook_refuses(rule, crd, breakage):
    broken = copy.deepcopy(rule)
    spec = broken["spec"]
    if breakage == "defaultStatus":
        spec["conditions"][0]["defaultStatus"] = "False"
    elif breakage == "anyOf":
        spec["conditionPolicy"] = "anyOf"
    else:
        spec["nodeSelector"] = {"matchExpressions": []}
    with pytest.raises(AssertionError, match="webhook"):
        check_rule(broken, crd)


def test_kustomization_renders_the_rule_alone(kubectl, rule, crd):
    k = yaml.safe_load((READINESS / "kustomization.yaml").read_text(encoding="utf-8"))
    assert (k["apiVersion"], k["kind"]) == ("kustomize.config.k8s.io/v1beta1", "Kustomization")
    assert k["resources"] == ["nodereadinessrule.yaml"] and "namespace" not in k
    [rendered] = render(kubectl, READINESS)
    assert rendered == rule
    check_rule(rendered, crd)


# --- What gpu-npd needs of the rule

def test_rule_gates_on_gpu_npd_s_verdict_in_problem_polarity(rule):
    """GpuNodeUnverified False, nothing else (nodereadinessrule.yaml says why not GpuNodeNeedsRemediation
    too); each gpu-npd condition is a problem, so False is the state to wait for."""
    spec = rule["spec"]
    assert spec["conditions"] == [{"type": UNVERIFIED, "requiredStatus": "False"}]
    assert spec["enforcementMode"] == "bootstrap-only"
    assert spec["taint"]["effect"] == "NoSchedule", "new pods wait; nothing is evicted"
    assert spec["taint"]["key"].startswith(TAINT_PREFIX)
    assert not spec.get("dryRun"), "shipped in dry run: it would gate nothing"
    assert "conditionPolicy" not in spec, "unknown to the v0.5.0 CRD (SOURCE.md)"


def test_rule_conditions_are_ones_gpu_npd_s_rules_report(rule, registry):
    """Read through detector.rules.loader: a condition no rule file produces would keep every gated node
    tainted for good (an absent condition is Unknown, never False)."""
    reported = builtin_rules().types()
    wanted = {c["type"] for c in rule["spec"]["conditions"]}
    assert wanted <= reported, f"no rule in rules/ reports {sorted(wanted - reported)}"


GPU_CONTROL_PLANE_NODE = node("gpu-cp", **{**GPU_OPERATOR_NODE["metadata"]["labels"],
                                           "node-role.kubernetes.io/control-plane": ""})
CANDIDATES = (GPU_OPERATOR_NODE, GFD_ONLY_NODE, NFD_ONLY_NODE, CPU_NODE, KWOK_GPU_NODE, GPU_CONTROL_PLANE_NODE)


def gated_nodes(doc: dict[str, Any]) -> set[str]:
    selector = doc["spec"]["nodeSelector"]
    return {n["metadata"]["name"] for n in (*CANDIDATES, simulator_kwok_node())
            if selector_matches(selector, n["metadata"]["labels"])}


def test_rule_gates_gpu_nodes_only_and_only_where_gpu_npd_runs(kubectl, rule):
    """A gated node without a gpu-npd pod would never be verified: every node the rule selects must be one
    deploy/base's DaemonSet runs on. Never KWOK's fake nodes, never a CPU node."""
    gated = gated_nodes(rule)
    assert {"gpu-a", "gpu-b", "gpu-cp"} <= gated
    assert not gated & {"cpu-a", "kwok-gpu-0001", "kwok-gpu-0042"}
    daemon = pod_spec(one(variant(kubectl, "base"), "DaemonSet", "gpu-npd"))
    for candidate in CANDIDATES:
        if candidate["metadata"]["name"] in gated:
            assert pod_may_run_on(daemon, candidate), f"{candidate['metadata']['name']}: gated, no gpu-npd"


def tolerates(tolerations: list[dict[str, Any]], taint: Taint) -> bool:
    """Kubernetes' Toleration.ToleratesTaint: an empty key with Exists matches every key, an empty effect
    every effect; Exists ignores the value, Equal (the default) compares it."""
    for t in tolerations or []:
        operator = t.get("operator", "Equal")
        if t.get("effect") and t["effect"] != taint["effect"]:
            continue
        if t.get("key") and t["key"] != taint["key"]:
            continue
        if not t.get("key") and operator != "Exists":
            continue
        if operator == "Exists" or t.get("value", "") == taint.get("value", ""):
            return True
    return False


def test_toleration_model_follows_kubernetes():
    taint = {"key": "readiness.k8s.io/x", "value": "pending", "effect": "NoSchedule"}
    assert tolerates([{"operator": "Exists"}], taint)
    assert tolerates([{"operator": "Exists", "effect": "NoSchedule"}], taint)
    assert not tolerates([{"operator": "Exists", "effect": "NoExecute"}], taint)
    assert tolerates([{"key": "readiness.k8s.io/x", "operator": "Exists"}], taint)
    assert tolerates([{"key": "readiness.k8s.io/x", "value": "pending"}], taint)
    assert not tolerates([{"key": "readiness.k8s.io/x", "value": "done"}], taint)
    assert not tolerates([{"key": "other", "operator": "Exists"}], taint)
    assert not tolerates([], taint)


@pytest.mark.parametrize("name", ["base", "overlays/unprivileged", "overlays/dra-taints"])
def test_gpu_npd_tolerates_the_readiness_taint(kubectl, rule, name):
    """Else gpu-npd never starts on a node registered with the taint, and the node is never verified."""
    daemon = pod_spec(one(variant(kubectl, name), "DaemonSet", "gpu-npd"))
    assert tolerates(daemon["tolerations"], rule["spec"]["taint"])


def test_rule_says_how_nodes_register_with_the_taint(rule):
    """The controller's docs: register nodes with the taint so no pod lands before the rule sees them. The
    comment's kubelet flag must name this very taint."""
    text = (READINESS / "nodereadinessrule.yaml").read_text(encoding="utf-8")
    taint = rule["spec"]["taint"]
    flag = f"--register-with-taints={taint['key']}={taint['value']}:{taint['effect']}"
    assert flag in text, f"no `{flag}` in the comments"


# --- The chart

def test_chart_renders_no_rule_by_default(helm):
    proc = helm.template({}, name="readiness-off")
    assert proc.returncode == 0, proc.stderr
    assert not [d for d in yaml.safe_load_all(proc.stdout) if d and d["kind"] == "NodeReadinessRule"]


def test_chart_rule_is_deploy_readiness_s(chart_rule, rule, crd):
    """readiness.enabled renders deploy/readiness's rule, with Helm's labels (test_helm.py's conventions)."""
    check_rule(chart_rule, crd)
    differences = without_helm_conventions(chart_rule, rule)
    assert differences[0] == differences[1]
    assert chart_rule["metadata"]["name"] == RELEASE


def test_chart_default_tolerations_tolerate_the_chart_s_taint(helm, chart_rule):
    proc = helm.template(ENABLED, name="readiness-ds")
    [daemonset] = [d for d in yaml.safe_load_all(proc.stdout) if d and d["kind"] == "DaemonSet"]
    assert tolerates(pod_spec(daemonset)["tolerations"], chart_rule["spec"]["taint"])


@pytest.mark.parametrize("values", [
    {"enforcementMode": "continuous"},
    {"dryRun": True},
    {"taint": {"key": "readiness.k8s.io/gpu-not-verified", "value": "", "effect": "NoExecute"}},
    {"taint": {"key": "readiness.k8s.io/g", "value": "x", "effect": "PreferNoSchedule"}},
    {"nodeSelector": {"matchLabels": {"example.com/gpu-node": "true"}}},
], ids=["continuous", "dry-run", "noexecute", "short-key", "own-label"])
def test_chart_overrides_render_a_valid_rule(helm, crd, values):
    rendered = helm_rule(helm, {"readiness": {"enabled": True, **values}}, name="readiness-override")
    check_rule(rendered, crd)
    spec = rendered["spec"]
    for key, value in values.items():
        if key == "taint":
            assert spec["taint"]["key"] == value["key"] and spec["taint"]["effect"] == value["effect"]
            assert spec["taint"].get("value", "") == value.get("value", "")
        else:
            assert spec[key] == value, key


@pytest.mark.parametrize("readiness", [
    {"taint": {"key": "gpu-npd-unverified", "effect": "NoSchedule"}},
    {"taint": {"key": "readiness.k8s.io/a/b", "effect": "NoSchedule"}},
    {"taint": {"key": "readiness.k8s.io/" + "g" * 64, "effect": "NoSchedule"}},
    {"taint": {"key": "readiness.k8s.io/gpu.", "effect": "NoSchedule"}},
    {"taint": {"key": "readiness.k8s.io/gpu", "value": "v" * 64, "effect": "NoSchedule"}},
    {"taint": {"key": "readiness.k8s.io/gpu", "effect": "NoScheduled"}},
    {"enforcementMode": "always"},
    {"nodeSelector": {"matchLabels": {}, "matchExpressions": []}},
    {"nodeSelector": {"matchExpressions": [{"key": "a", "operator": "Gt", "values": ["1"]}]}},
    {"enforcmentMode": "continuous"},
], ids=["no-prefix", "two-slashes", "long-name", "ends-with-dot", "long-value", "effect", "mode",
        "empty-selector", "gt-operator", "misspelt"])
def test_chart_refuses_what_the_crd_or_its_webhook_would(helm, readiness):
    """Refused at `helm install` rather than by the API server (values.schema.json), or not at all (the
    webhook is optional)."""
    error = helm.refusal({"readiness": {"enabled": True, **readiness}})
    assert "schema" in error or "readiness" in error, error


def test_chart_refuses_tolerations_that_leave_gpu_npd_off_the_gated_nodes(helm):
    error = helm.refusal({**ENABLED, "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}]})
    assert "readiness.k8s.io/gpu-npd-unverified" in error and "tolerations" in error, error
    ok = helm.template({**ENABLED, "tolerations": [{"key": "readiness.k8s.io/gpu-npd-unverified",
                                                   "operator": "Exists", "effect": "NoSchedule"}]}, name="tol")
    assert ok.returncode == 0, ok.stderr


def test_chart_empty_selector_is_refused_by_the_template_too(helm):
    error = helm.refusal({"readiness": {"enabled": True, "nodeSelector": {"matchExpressions": []}}})
    assert "readiness.nodeSelector is empty" in error, error
