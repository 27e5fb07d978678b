"""deploy/monitoring: the PrometheusRule's alerts and recording rules and the Grafana dashboard, against
what gpu-npd really exports.

Every rule expression and every panel query is parsed with promql_parser. Every metric they name, and
every label they match, group or join by, must be in the /metrics of a real daemon (the Daemon of
`gpu-npd run` on a fake 8x H100 node, reporting to the Kubernetes API emulator) driven so that the
labelled series exist: a successful NCCL probe, then an XID 79 (a failed GPU), a PCIe link trained at
x8 (a degraded GPU) and an API request answered 503; and of a V100 node, for retired pages (pre-Ampere
GPUs only). What else a series may carry is what the PodMonitor's scrape adds (`node` from its
relabeling, and the operator's target labels); `up` is Prometheus's own; recording rules' outputs are
known with the labels their expressions leave. The selectors that stand for rule sets (critical
conditions, reset-class XIDs) are checked against rules/, and the kustomization is rendered with
kubectl (`make kubectl`, which `make test` runs)."""

from __future__ import annotations

import json
import re
import subprocess
import urllib.request
from typing import Any, Iterator

import promql_parser
import psutil
import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from conftest import builtin_rules, REPO
from detector.agent.metrics import AgentMetrics
from detector.core.check import CheckRegistry
from detector.daemon.local import REPO_DEPLOY, local_daemon
from detector.daemon.run import DaemonSettings
from fake_nvml.faults import Fault
from kube_emulator import Emulator
from test_deploy_render import offline_env, require_kubectl

MONITORING = REPO / "deploy" / "monitoring"
RULE_FILE = MONITORING / "prometheusrule.yaml"
DASHBOARD_FILE = MONITORING / "dashboard.json"
PODMONITOR_FILE = REPO / "deploy" / "components" / "podmonitor" / "podmonitor.yaml"
NAMESPACE = "gpu-npd"
JOB = "gpu-npd/gpu-npd"          # the Prometheus Operator's job for a PodMonitor: <namespace>/<name>
# Labels a PodMonitor scrape puts on every series: the operator's target labels, and `node` from the
# relabeling of deploy/components/podmonitor (test_rules_select_the_podmonitor_s_job_and_node checks it).
SCRAPE_LABELS = {"job", "instance", "namespace", "pod", "container", "endpoint", "node"}
PROMETHEUS_OWN = {"up": set(SCRAPE_LABELS)}
# Grafana's variables, as a query reaches Prometheus.
GRAFANA_VARIABLES = {"$__rate_interval": "2m", "$__interval": "1m", "$__range": "6h", "$job": JOB, "$node": ".*"}
SEVERITIES = {"critical", "warning", "info"}
RULE_KEYS = {"alert", "record", "expr", "for", "keep_firing_for", "labels", "annotations"}
DURATION = re.compile(r"(\d+(ms|s|m|h|d|w|y))+")
METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
LAST_APPLIED_LIMIT = 262144       # kubectl apply keeps the object in an annotation; annotations are capped
# Alerts named by an issue rather than by this file's GpuNpd* convention (issue 31 names this one).
NAMED_ELSEWHERE = {"GpuSlowerThanFleetPeers"}


# --- The files

def prometheus_rule() -> dict[str, Any]:
    [doc] = [d for d in yaml.safe_load_all(RULE_FILE.read_text(encoding="utf-8")) if d is not None]
    return doc


def rules() -> list[dict[str, Any]]:
    return [r for g in prometheus_rule()["spec"]["groups"] for r in g["rules"]]


def rule_name(rule: dict[str, Any]) -> str:
    return rule.get("alert") or rule.get("record") or "?"


def alert(name: str) -> dict[str, Any]:
    [found] = [r for r in rules() if r.get("alert") == name]
    return found


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD_FILE.read_text(encoding="utf-8"))


def panels() -> list[dict[str, Any]]:
    out = []
    for p in dashboard()["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))          # a collapsed row keeps its panels inside
    return out


def panel_queries() -> list[tuple[str, str]]:
    """(where, query) for every panel target and every query variable."""
    queries = [(f"panel {p['title']!r} target {t['refId']}", t["expr"])
               for p in panels() if p["type"] != "row" for t in p["targets"]]
    for v in dashboard()["templating"]["list"]:
        if v["type"] == "query":
            m = re.fullmatch(r"label_values\((.*), *(\w+)\)", v["query"]["query"])
            assert m, f"variable {v['name']}: only label_values(selector, label) queries are checked"
            queries.append((f"variable {v['name']}", f"{m[1]}"))
    return queries


def grafana_to_promql(query: str) -> str:
    for variable, value in sorted(GRAFANA_VARIABLES.items(), key=lambda kv: -len(kv[0])):
        query = query.replace(variable, value)
    assert "$" not in query, f"a Grafana variable this test does not know: {query}"
    return query


def all_queries() -> list[tuple[str, str]]:
    return [(f"rule {rule_name(r)}", r["expr"]) for r in rules()] + \
        [(where, grafana_to_promql(q)) for where, q in panel_queries()]


def parse(where: str, query: str) -> promql_parser.Expr:
    try:
        return promql_parser.parse(query)
    except Exception as e:           # the parser's own error type varies; the message is what matters
        pytest.fail(f"{where}: PromQL does not parse: {e}\n{query}")


# --- The real exporter's output

def scrape(address: str) -> str:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as response:
        return response.read().decode()


def fast_settings() -> DaemonSettings:
    settings = DaemonSettings(listen="127.0.0.1:0")
    settings.agent.start_spread_s = 0.0
    settings.reporter.backoff_base_s, settings.reporter.backoff_cap_s = 0.01, 0.2
    return settings


@pytest.fixture(scope="module")
def expositions(tmp_path_factory) -> dict[str, str]:
    """/metrics of real daemons once every labelled series the rules and the dashboard use exists: an
    H100 node driven through faults, and a V100 node for the metrics only pre-Ampere GPUs have."""
    checks = {"nccl": {"enabled": True, "timeout": 20}, "xid": {"interval": 0.5}, "pcie": {"interval": 0.5},
              "visibility": {"interval": 0.5}, "performance": {"interval": 0.5}}
    workdir = tmp_path_factory.mktemp("monitoring")
    with Emulator(rbac_paths=(REPO_DEPLOY,)) as emulator:
        h100 = local_daemon("h100-sxm-8", "gpu-mon", settings=fast_settings(), check_settings=checks, emulator=emulator,
                            workdir=workdir).start()
        v100 = local_daemon("v100-sxm-8-retired-pages", "gpu-v100", checks=["memory"], emulator=emulator,
                            workdir=workdir, settings=fast_settings()).start()
        try:
            address = h100.daemon.endpoints.address
            # The probe first: with a GPU off the bus it fails and exports no bandwidth.
            assert h100.wait_for(lambda: "gpu_npd_nccl_bus_bandwidth_gbps{" in scrape(address), 20), scrape(address)
            emulator.fail(503, count=1, match="/nodes/gpu-mon/")
            h100.node.inject(Fault("xid", gpu=3, params={"code": 79}))
            h100.node.inject(Fault("pcie", gpu=5, params={"width": 8}))
            wanted = ('state="failed"', 'state="degraded"', "gpu_npd_xid_total{", 'code="503"',
                      'gpu_npd_problem_gauge{reason="Xid79GpuFellOffBus"', "process_resident_memory_bytes",
                      "gpu_npd_gpu_busy_sm_clock_mhz{")    # GPU 5 works under its PCIe fault: a busy clock
            assert h100.wait_for(lambda: all(w in scrape(address) for w in wanted), 20), \
                [w for w in wanted if w not in scrape(address)]
            v100_address = v100.daemon.endpoints.address
            assert v100.wait_for(lambda: "gpu_npd_retired_pages{" in scrape(v100_address), 20)
            return {"h100": scrape(address), "v100": scrape(v100_address)}
        finally:
            v100.stop()
            h100.stop()


@pytest.fixture(scope="module")
def exposition(expositions) -> str:
    return expositions["h100"]


@pytest.fixture(scope="module")
def exported(expositions) -> dict[str, list[dict[str, str]]]:
    """Sample name (as PromQL sees it: counters with _total) -> the label sets of its series."""
    series: dict[str, list[dict[str, str]]] = {}
    for text in expositions.values():
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                series.setdefault(sample.name, []).append(dict(sample.labels))
    return series


@pytest.fixture(scope="module")
def known(exported) -> dict[str, set[str]]:
    """Every metric a query may name, with the labels its series can carry in Prometheus."""
    labels = {name: {k for s in sets for k in s} | SCRAPE_LABELS for name, sets in exported.items()}
    labels.update(PROMETHEUS_OWN)
    for rule in rules():                         # in order: a rule may use the outputs before it
        if "record" in rule:
            problems: list[str] = []
            out = labels_of(promql_parser.parse(rule["expr"]), labels, problems)
            labels[rule["record"]] = (out or set()) | set(rule.get("labels") or {})
    return labels


# --- What a PromQL expression names, and the labels its result carries

def selectors(expr: promql_parser.Expr) -> list[promql_parser.VectorSelector]:
    found = []

    def visit(node):
        if isinstance(node, promql_parser.VectorSelector):
            found.append(node)
    promql_parser.walk(expr, visit)
    return found


def matchers(selector: promql_parser.VectorSelector) -> Iterator[promql_parser.Matcher]:
    yield from selector.matchers.matchers
    for group in selector.matchers.or_matchers or []:
        yield from group


def matches(matcher: promql_parser.Matcher, value: str) -> bool:
    op = matcher.op
    if op == promql_parser.MatchOp.Equal:
        return value == matcher.value
    if op == promql_parser.MatchOp.NotEqual:
        return value != matcher.value
    hit = re.fullmatch(matcher.value, value) is not None          # PromQL anchors its regexes
    return hit if op == promql_parser.MatchOp.Re else not hit


SET_OPS = {"and", "or", "unless"}
KEEP_LABEL_AGGREGATIONS = {"topk", "bottomk", "limitk", "limit_ratio"}


def labels_of(node: Any, known: dict[str, set[str]], problems: list[str]) -> set[str] | None:
    """The labels the result of `node` can carry (None: a scalar or string), appending to `problems` each
    metric not in `known` and each label matched, grouped or joined on that its operand cannot have."""
    kind = type(node).__name__
    if kind == "VectorSelector":
        have = known.get(node.name)
        if have is None:
            problems.append(f"{node.name}: no such metric in gpu-npd's /metrics, nor a recording rule")
            have = set()
        for m in matchers(node):
            if m.name != "__name__" and m.name not in have:
                problems.append(f"{node.name}{{{m.name}...}}: {node.name} has no label {m.name!r}")
        return set(have)
    if kind == "MatrixSelector":
        return labels_of(node.vector_selector, known, problems)
    if kind in ("ParenExpr", "UnaryExpr", "SubqueryExpr"):
        return labels_of(node.expr, known, problems)
    if kind in ("NumberLiteral", "StringLiteral"):
        return None
    if kind == "Call":
        args = [labels_of(a, known, problems) for a in node.args]
        name = node.func.name
        if name in ("absent", "absent_over_time"):
            [arg] = node.args
            vs = arg.vector_selector if type(arg).__name__ == "MatrixSelector" else arg
            return {m.name for m in matchers(vs) if m.op == promql_parser.MatchOp.Equal and m.name != "__name__"}
        if name in ("vector", "time", "scalar", "pi"):
            return set() if name == "vector" else None
        if name == "label_replace":
            return (args[0] or set()) | {node.args[1].val}
        if name == "histogram_quantile":
            return (args[1] or set()) - {"le"}
        vectors = [a for a in args if a is not None]
        return vectors[0] if vectors else None
    if kind == "AggregateExpr":
        inner = labels_of(node.expr, known, problems) or set()
        op = str(node.op)
        modifier = node.modifier
        if modifier is None:
            return inner if op in KEEP_LABEL_AGGREGATIONS else set()
        grouping = set(modifier.labels)
        for label in sorted(grouping - inner):
            problems.append(f"{op} {'by' if 'By' in str(modifier.type) else 'without'} ({label}): "
                            f"no operand carries {label!r}")
        if op in KEEP_LABEL_AGGREGATIONS:
            return inner
        return grouping if "By" in str(modifier.type) else inner - grouping
    if kind == "BinaryExpr":
        lhs, rhs = labels_of(node.lhs, known, problems), labels_of(node.rhs, known, problems)
        if lhs is None or rhs is None:
            return rhs if lhs is None else lhs
        op = str(node.op)
        modifier = node.modifier
        matching = modifier.matching if modifier else None
        on = set(matching.labels) if matching else set()
        including = matching is not None and "Include" in str(matching.type)
        for label in sorted(on):
            if including and (label not in lhs or label not in rhs):
                problems.append(f"{op} on ({label}): {'left' if label not in lhs else 'right'} side lacks it")
            if not including and label not in lhs | rhs:
                problems.append(f"{op} ignoring ({label}): neither side carries it")
        card = str(modifier.card) if modifier else "OneToOne"
        group = set(modifier.group_labels or []) if modifier else set()
        if "ManyToOne" in card:
            for label in sorted(group - rhs):
                problems.append(f"group_left ({label}): the right side lacks it")
            return lhs | group
        if "OneToMany" in card:
            for label in sorted(group - lhs):
                problems.append(f"group_right ({label}): the left side lacks it")
            return rhs | group
        if op == "or":
            return lhs | rhs
        if op in SET_OPS:
            return lhs
        if matching is None:
            return lhs
        return on if including else lhs - on
    raise AssertionError(f"a PromQL node this test does not know: {kind}")


# --- Parsing

@pytest.mark.parametrize("where, query", all_queries(), ids=[w for w, _ in all_queries()])
def test_every_rule_and_panel_query_parses(where, query):
    parse(where, query)


def test_a_query_that_does_not_parse_fails_with_its_name():
    with pytest.raises(pytest.fail.Exception, match="rule GpuNpdBroken"):
        parse("rule GpuNpdBroken", 'sum by (node (gpu_npd_gpu_health == 2)')


# --- Metrics and labels against the real exporter

def test_every_metric_and_label_used_is_exported(known):
    problems = []
    for where, query in all_queries():
        found: list[str] = []
        labels_of(parse(where, query), known, found)
        problems += [f"{where}: {p}" for p in found]
    assert not problems, "\n".join(problems)


def test_the_label_check_catches_a_wrong_metric_or_label(known):
    for query, expected in (("sum by (gpu) (gpu_npd_xid)", "no such metric"),             # the _total suffix
                            ("count by (severity) (gpu_npd_problem_gauge)", "no operand carries 'severity'"),
                            ('gpu_npd_gpu_health{state="failed", model="H100"}', "has no label 'model'"),
                            ("gpu_npd_reporting unless on (gpu) gpu_npd_gpu_health", "left side lacks it")):
        problems: list[str] = []
        labels_of(promql_parser.parse(query), known, problems)
        assert any(expected in p for p in problems), (query, problems)


def test_annotations_and_legends_name_only_labels_the_result_has(known):
    problems = []
    for rule in rules():
        if "alert" not in rule:
            continue
        out = (labels_of(promql_parser.parse(rule["expr"]), known, []) or set()) | set(rule["labels"])
        for text in rule["annotations"].values():
            problems += [f"{rule['alert']}: $labels.{label}" for label in re.findall(r"\$labels\.(\w+)", text)
                         if label not in out]
    for p in panels():
        for t in p.get("targets", []):
            out = labels_of(promql_parser.parse(grafana_to_promql(t["expr"])), known, []) or set()
            legend = t.get("legendFormat", "")
            problems += [f"panel {p['title']!r}: {{{{{label}}}}}" for label in re.findall(r"\{\{ *(\w+) *\}\}", legend)
                         if label not in out]
    assert not problems, "labels the result does not carry:\n" + "\n".join(problems)


def test_queries_in_annotations_name_exported_metrics_and_labels(known):
    """An annotation may quote other series through a `query` template (GpuSlowerThanFleetPeers quotes the
    GPU's clock and power limit and its model's medians): each must name what the daemon exports, with the
    labels it selects by (tests/test_promtool.py checks what they print)."""
    problems, queries = [], 0
    for rule in rules():
        for text in (rule.get("annotations") or {}).values():
            for template in re.findall(r'printf "([^"]*)"[^|}]*\| *query', text):
                queries += 1
                found: list[str] = []
                labels_of(parse(rule_name(rule), template.replace("%q", '"x"')), known, found)
                problems += [f"{rule_name(rule)}: {p}" for p in found]
    assert queries >= 5 and not problems, "\n".join(problems)


def test_health_states_have_the_values_the_rules_use(exposition):
    """The rules count failed GPUs with == 2 and degraded ones with == 1: the exporter's values."""
    values: dict[str, set[float]] = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            if sample.name == "gpu_npd_gpu_health":
                values.setdefault(sample.labels["state"], set()).add(sample.value)
    assert values == {"healthy": {0.0}, "degraded": {1.0}, "failed": {2.0}}, values


def test_api_error_codes_in_the_rules_match_what_the_daemon_counts(exported):
    """The 503 driven above is counted with its code, which the error selector matches; the daemon's
    successes are not, nor the 404 and 409 its events get in normal running."""
    [selector] = [s for s in selectors(promql_parser.parse(alert("GpuNpdApiErrors")["expr"]))
                  if any(m.name == "code" for m in matchers(s))]
    [code] = [m for m in matchers(selector) if m.name == "code"]
    codes = {s["code"] for s in exported["gpu_npd_api_requests_total"]}
    assert "503" in codes and matches(code, "503")
    assert all(matches(code, c) for c in ("error", "401", "403", "429", "500", "504"))
    assert not any(matches(code, c) for c in codes if c.startswith("2"))
    assert not matches(code, "404") and not matches(code, "409")      # expired events, a create that landed


def test_process_metrics_come_from_the_agent_s_own_registry():
    """The dashboard's footprint panels read the process collector's series: the daemon's registry has
    them, reading this process; a registry handed in (which may have its own) is left alone."""
    text = generate_latest(AgentMetrics().registry).decode()
    values = {f.name: f.samples[0].value for f in text_string_to_metric_families(text)
              if f.name.startswith("process_")}
    rss = psutil.Process().memory_info().rss
    assert 0.5 * rss < values["process_resident_memory_bytes"] < 2 * rss
    assert values["process_cpu_seconds"] > 0
    given = CollectorRegistry()
    assert b"process_" not in generate_latest(AgentMetrics(given).registry)


# --- The selectors that stand for rule sets

def condition_rules() -> list:
    registry = CheckRegistry.from_entry_points()
    return [r for r in builtin_rules().rules if r.report == "condition"]


def test_critical_condition_alert_selects_exactly_the_critical_conditions():
    """gpu_npd_problem_gauge carries no severity: the alert names the critical (type, reason) pairs, and
    a rule added or changed in rules/ must be reflected there."""
    expr = promql_parser.parse(alert("GpuNpdCriticalCondition")["expr"])
    gauges = [s for s in selectors(expr) if s.name == "gpu_npd_problem_gauge"]
    assert gauges
    pairs = {(r.type, r.reason) for r in condition_rules()}
    critical = {(r.type, r.reason) for r in condition_rules()
                if r.severity.value == "critical" and r.type != "GpuNodeNeedsRemediation"}   # for remediators
    selected = {(t, reason) for t, reason in pairs
                if any(all(matches(m, {"type": t, "reason": reason}[m.name]) for m in matchers(s)) for s in gauges)}
    assert selected == critical, {"selected, not critical": sorted(selected - critical),
                                  "critical, not selected": sorted(critical - selected)}


def test_reset_class_xid_codes_are_the_ones_rules_escalate():
    [escalation] = [r for r in condition_rules() if r.name == "xid-fatal-repeated"]
    escalated = set(re.search(r"code in \[([\d, ]+)\]", escalation.when.source)[1].replace(" ", "").split(","))
    expr = promql_parser.parse(alert("GpuNpdResetClassXidOnManyNodes")["expr"])
    [code] = [m for s in selectors(expr) for m in matchers(s) if m.name == "code"]
    assert set(code.value.split("|")) == escalated
    assert all(matches(code, c) for c in escalated) and not matches(code, "13") and not matches(code, "4")
    critical_xids = {r.reason for r in condition_rules() if r.type == "GpuXidError" and r.severity.value == "critical"}
    assert all(any(reason.startswith(f"Xid{c}") for reason in critical_xids) for c in escalated)


def test_rules_select_the_podmonitor_s_job_and_node():
    """The operator names a PodMonitor's job <namespace>/<name> unless it sets jobLabel, and the `node`
    every rule groups by is the PodMonitor's relabeling."""
    [monitor] = [d for d in yaml.safe_load_all(PODMONITOR_FILE.read_text(encoding="utf-8")) if d]
    assert "jobLabel" not in monitor["spec"]
    assert f"{monitor['metadata']['namespace']}/{monitor['metadata']['name']}" == JOB
    relabel = {r["targetLabel"]: r["sourceLabels"] for e in monitor["spec"]["podMetricsEndpoints"]
               for r in e.get("relabelings", [])}
    assert relabel["node"] == ["__meta_kubernetes_pod_node_name"]
    jobs = {m.value for _, q in all_queries() for s in selectors(parse("", q)) if s.name == "up"
            for m in matchers(s) if m.name == "job"}
    assert jobs == {JOB}


# --- The PrometheusRule's shape (monitoring.coreos.com/v1: no schema in kubernetes-validate)

def test_prometheus_rule_structure():
    doc = prometheus_rule()
    assert doc["apiVersion"] == "monitoring.coreos.com/v1" and doc["kind"] == "PrometheusRule"
    assert set(doc) == {"apiVersion", "kind", "metadata", "spec"} and set(doc["spec"]) == {"groups"}
    assert doc["metadata"]["name"] == "gpu-npd" and doc["metadata"]["namespace"] == NAMESPACE
    groups = doc["spec"]["groups"]
    assert len({g["name"] for g in groups}) == len(groups), "group names must be unique"
    names = []
    for group in groups:
        assert set(group) <= {"name", "interval", "rules", "limit", "partial_response_strategy"}, group["name"]
        assert group["rules"], f"group {group['name']} has no rules"
        if "interval" in group:
            assert DURATION.fullmatch(group["interval"])
        for rule in group["rules"]:
            name = rule_name(rule)
            assert set(rule) <= RULE_KEYS, f"{name}: unknown keys {sorted(set(rule) - RULE_KEYS)}"
            assert ("alert" in rule) != ("record" in rule), f"{name}: exactly one of alert and record"
            assert isinstance(rule["expr"], str) and rule["expr"].strip(), f"{name}: no expr"
            for key in ("for", "keep_firing_for"):
                if key in rule:
                    assert DURATION.fullmatch(rule[key]), f"{name}: {key} {rule[key]!r} is not a duration"
            assert all(isinstance(v, str) for v in (rule.get("labels") or {}).values()), name
            if "record" in rule:
                assert METRIC_NAME.fullmatch(rule["record"]) and rule["record"].count(":") == 2, \
                    f"{name}: recording rules are named level:metric:operations"
                assert not {"for", "annotations"} & set(rule), f"{name}: a recording rule has no for or annotations"
            else:
                assert re.fullmatch(r"GpuNpd[A-Z][A-Za-z]+", rule["alert"]) or rule["alert"] in NAMED_ELSEWHERE, name
                assert rule["labels"]["severity"] in SEVERITIES, name
                assert {"summary", "description", "runbook"} <= set(rule["annotations"]), name
                for text in rule["annotations"].values():
                    assert text.count("{{") == text.count("}}"), f"{name}: unbalanced template"
            names.append(name)
    assert len(names) == len(set(names)), "rule names must be unique"


def test_the_alerts_asked_for_are_there():
    by_name = {r["alert"]: r for r in rules() if "alert" in r}
    assert by_name["GpuNpdGpuDegraded"]["for"] == "30m"
    exprs = {name: r["expr"] for name, r in by_name.items()}
    assert "gpu_npd_gpu_health == 2" in exprs["GpuNpdGpuFailed"]
    assert "cluster:gpu_npd_gpus_failed:ratio" in exprs["GpuNpdFleetGpusFailed"]
    assert "gpu_npd_problem_gauge" in exprs["GpuNpdCriticalCondition"]
    assert "node:gpu_npd_xid:increase1h" in exprs["GpuNpdResetClassXidOnManyNodes"]
    assert exprs["GpuNpdDown"].strip() == f'up{{job="{JOB}"}} == 0'
    assert exprs["GpuNpdAbsent"].strip() == f'absent(up{{job="{JOB}"}})'
    assert exprs["GpuNpdNotReporting"].strip() == "gpu_npd_reporting == 0"
    assert "gpu_npd_api_requests_total" in exprs["GpuNpdApiErrors"]
    assert "gpu:gpu_npd_gpu_busy_sm_clock_mhz:ratio_to_model_median" in exprs["GpuSlowerThanFleetPeers"]
    assert {r["labels"]["severity"] for r in by_name.values()} == {"critical", "warning"}


def test_thresholds_are_explained_in_comments():
    """Each alert's block in the file is preceded by a comment saying why its threshold is what it is."""
    lines = RULE_FILE.read_text(encoding="utf-8").splitlines()
    for i, line in enumerate(lines):
        if line.strip().startswith("- alert:"):
            assert lines[i - 1].strip().startswith("#"), f"{line.strip()}: no comment above it"


# --- The dashboard

def test_dashboard_structure():
    d = dashboard()
    assert d["schemaVersion"] >= 39 and d["uid"] and d["title"]
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["node"]["type"] == "query" and variables["node"]["multi"] and variables["node"]["includeAll"]
    assert variables["node"]["allValue"] == ".*"
    ids = [p["id"] for p in panels()]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    cells: set[tuple[int, int]] = set()
    for p in panels():
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, p["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, f"panel {p['title']!r} overlaps another"
        cells |= mine
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"], p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            assert t["datasource"] == p["datasource"] and t["expr"].strip()
            if "process_" in t["expr"] or "up{" in t["expr"]:
                assert 'job=~"$job"' in t["expr"], f"{p['title']}: other exporters have these too"
            assert 'node=~"$node"' in t["expr"], f"{p['title']}: the node variable filters every panel"


def test_dashboard_covers_the_fleet_view():
    used = {s.name for _, q in panel_queries() for s in selectors(parse("", grafana_to_promql(q)))}
    assert {"gpu_npd_gpu_health", "gpu_npd_xid_total", "gpu_npd_pcie_link_width", "gpu_npd_pcie_link_max_width",
            "gpu_npd_nccl_bus_bandwidth_gbps", "gpu_npd_ecc_volatile_uncorrected",
            "gpu_npd_gpu_thermal_slowdown_percent", "process_resident_memory_bytes", "process_cpu_seconds_total",
            "gpu_npd_api_requests_total", "gpu_npd_problem_gauge", "gpu_npd_gpu_info"} <= used


# --- kubectl kustomize deploy/monitoring



@pytest.fixture(scope="module")
def rendered() -> list[dict[str, Any]]:
    proc = subprocess.run([require_kubectl(), "kustomize", str(MONITORING)], capture_output=True, text=True,
                          timeout=120, env=offline_env())           # offline: a remote base would fail at once
    assert proc.returncode == 0, f"kubectl kustomize deploy/monitoring: {proc.stderr}"
    return [d for d in yaml.safe_load_all(proc.stdout) if d is not None]


def test_kustomization_renders_the_rule_and_the_dashboard_configmap(rendered):
    by_kind = {d["kind"]: d for d in rendered}
    assert sorted(by_kind) == ["ConfigMap", "PrometheusRule"] and len(rendered) == 2
    assert by_kind["PrometheusRule"] == prometheus_rule()
    configmap = by_kind["ConfigMap"]
    assert configmap["metadata"]["name"] == "gpu-npd-dashboard"            # no hash suffix
    assert configmap["metadata"]["namespace"] == NAMESPACE
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert configmap["data"] == {"gpu-npd.json": DASHBOARD_FILE.read_text(encoding="utf-8")}
    for doc in rendered:
        assert len(json.dumps(doc)) < LAST_APPLIED_LIMIT, f"{doc['kind']} too big for kubectl apply"
