"""`gpu-npd fleet` against a hostile API server (issue 30, findings 6-8): any gpu-npd service account may
patch any node's status, so one compromised pod can plant huge annotations, conditions and GPU counts on
every node; a broken proxy can answer any shape and loop on a continue token. The view stays small, its
counts stay true, the listing ends, and no answer makes a traceback: each malformed shape is one line and
the documented exit code (3: the API server could not be read, or not all of it).

The server is a few lines of http.server on 127.0.0.1 that answers each LIST from a function of the test."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable
from urllib.parse import parse_qs, urlsplit

import pytest

import detector.kube.fleet_view as fleet_view
from detector.cli.main import main
from detector.kube.annotations import UNHEALTHY_GPUS
from detector.kube.api import ApiError, KubeApi
from detector.kube.conditions import MARKER
from detector.kube.stamps import rfc3339

REPO = Path(__file__).resolve().parent.parent
GPU_LABELS = {"nvidia.com/gpu.present": "true"}
KIB = 1024

Answer = Callable[[dict[str, str]], Any]          # the LIST's query -> a JSON value, or bytes sent as they are


class Hostile(ThreadingHTTPServer):
    """An "API server" that answers every GET with what `answer` makes of its query, and counts them."""

    daemon_threads = True

    def __init__(self, answer: Answer):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.answer, self.requests = answer, 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        server: Hostile = self.server                                   # type: ignore[assignment]
        server.requests += 1
        query = {k: v[0] for k, v in parse_qs(urlsplit(self.path).query).items()}
        value = server.answer(query)
        body = value if isinstance(value, bytes) else json.dumps(value).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def serve(tmp_path):
    """serve(answer) -> (the server, a kubeconfig that reaches it)."""
    servers: list[Hostile] = []

    def start(answer: Answer) -> tuple[Hostile, Path]:
        server = Hostile(answer)
        threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
        servers.append(server)
        kubeconfig = tmp_path / f"kc-{len(servers)}.yaml"
        kubeconfig.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "c",
            "clusters": [{"name": "h", "cluster": {"server": server.url}}],
            "users": [{"name": "u", "user": {"token": "t"}}],
            "contexts": [{"name": "c", "context": {"cluster": "h", "user": "u"}}]}))
        return server, kubeconfig

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def one_page(*items: Any) -> Answer:
    return lambda query: {"kind": "NodeList", "items": list(items), "metadata": {}}


def node(name: str, annotation: str | None = None, conditions: list | None = None, **status: Any) -> dict:
    meta: dict[str, Any] = {"name": name, "labels": dict(GPU_LABELS)}
    if annotation is not None:
        meta["annotations"] = {UNHEALTHY_GPUS: annotation}
    now = time.time()
    own = [{"type": "GpuXidError", "status": "False", "reason": "NoGpuXidError", "message": MARKER + "fine",
            "lastHeartbeatTime": rfc3339(now), "lastTransitionTime": rfc3339(now - 60)}]
    return {"metadata": meta, "spec": {},
            "status": {"capacity": {"nvidia.com/gpu": "8"}, "conditions": own + (conditions or []), **status}}


def healthy(name: str = "gpu-ok") -> dict:
    return node(name)


def failed_gpu_3(name: str = "gpu-bad") -> dict:
    entry = {"index": 3, "pciBusId": "0000:5d:00.0", "uuid": "GPU-3", "state": "failed", "action": "RESTART_BM",
             "since": "2026-03-02T10:41:07Z"}
    return node(name, json.dumps([entry], separators=(",", ":")))


def fleet(kubeconfig: Path, *args: str, capsys) -> tuple[int, str, str]:
    code = main(["fleet", "--kubeconfig", str(kubeconfig), *args])
    out, err = capsys.readouterr()
    return code, out, err


# -- finding 6: cells and annotations bounded, counts true -----------------------------------------------

def planted(size: int) -> list[dict]:
    """Four nodes, each with a `size`-character annotation of another kind, and junk in every text."""
    big = "x" * size
    return [
        node("gpu-0", json.dumps([{"index": 3, "uuid": big, "state": "failed"}])),      # one huge cell
        node("gpu-1", json.dumps([{"state": "failed"}] * (size // 19))),                 # thousands of GPUs
        node("gpu-2", "[" * size),                                                      # nested past the decoder
        node("gpu-3", big, conditions=[{"type": "Gpu" + big, "status": "True", "reason": big, "message": MARKER + big,
                                        "lastHeartbeatTime": big, "lastTransitionTime": big}]),
    ]


PEAK = ("import re, sys\nfrom detector.cli.main import main\ncode = main(sys.argv[1:])\n"
        "print('peak_kib', re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read()).group(1), file=sys.stderr)\n"
        "sys.exit(code)")


def test_four_nodes_with_250_kib_annotations_make_a_small_table_in_little_memory(serve):
    nodes = planted(250 * KIB)
    nodes[3]["spec"]["taints"] = [{"key": "k" * 250 * KIB, "effect": "NoSchedule"}]
    server, kubeconfig = serve(one_page(*nodes))
    done = subprocess.run([sys.executable, "-c", PEAK, "fleet", "--kubeconfig", str(kubeconfig)],
                          capture_output=True, text=True, cwd=REPO, timeout=60)
    assert done.returncode == 1, done.stderr                       # nodes listed: their annotations unreadable
    assert "Traceback" not in done.stderr
    peak_mib = int(done.stderr.split("peak_kib ")[1].split()[0]) / 1024
    assert peak_mib < 200, peak_mib
    lines = done.stdout.splitlines()
    assert len(done.stdout) < 8 * KIB and max(map(len, lines)) < 1000, done.stdout[:2000]
    assert lines[-1] == "4 nodes to look at: 4 GPU nodes, 32 GPUs, 0 failed, 0 degraded, 0 not reporting"
    states = {(line.split()[0], line.split()[5]) for line in lines[1:-1]}
    assert {("gpu-0", "unreadable"), ("gpu-1", "unreadable"), ("gpu-2", "unreadable"), ("gpu-3", "unreadable")} <= states
    gpu_3 = [line for line in lines if line.startswith("gpu-3")]
    assert any("Gpuxxx" in line and "…" in line for line in gpu_3)                # its condition, cut
    assert any("kkk" in line and line.endswith("…") for line in gpu_3)            # its taint, cut
    assert server.requests == 1


def test_the_json_of_planted_nodes_is_bounded_and_says_why_each_annotation_was_not_read(serve, capsys):
    _, kubeconfig = serve(one_page(*planted(250 * KIB)))
    code, out, err = fleet(kubeconfig, "-o", "json", capsys=capsys)
    doc = json.loads(out)
    assert code == 1 and err == "" and len(out) < 16 * KIB
    why = {n["name"]: n["annotationError"] for n in doc["nodes"]}
    assert all("over the 16,384 gpu-npd writes at most" in why[f"gpu-{i}"] for i in range(4))   # none parsed
    condition = next(n for n in doc["nodes"] if n["name"] == "gpu-3")["conditions"][0]
    assert len(condition["type"]) == 256 and len(condition["message"]) == 1024 and condition["since"] is None


def test_an_annotation_claiming_200001_failed_gpus_is_not_counted(serve, capsys):
    many = json.dumps([{"state": "failed"}] * 200_001, separators=(",", ":"))        # 3.8 MB, not even parsed
    under_the_cap = json.dumps([{"index": i, "state": "failed"} for i in range(500)], separators=(",", ":"))
    twice = json.dumps([{"index": 3, "state": "failed"}] * 8, separators=(",", ":"))
    liar = node("gpu-liar", capacity={"nvidia.com/gpu": "200001"})
    _, kubeconfig = serve(one_page(node("gpu-many", many), node("gpu-500", under_the_cap), node("gpu-twice", twice),
                                   liar, failed_gpu_3()))
    code, out, err = fleet(kubeconfig, "-o", "json", "--all", capsys=capsys)
    doc = json.loads(out)
    assert code == 1 and err == ""
    assert doc["summary"]["failed"] == 1                                           # gpu-bad's GPU 3 alone
    assert doc["summary"]["gpus"] == 4 * 8                                         # gpu-liar's count not taken
    assert doc["summary"]["nodesWithoutGpuCount"] == 1                             # but said to be unknown
    why = {n["name"]: n["annotationError"] for n in doc["nodes"]}
    assert "lists 500 GPUs, more than the 64 a node can have" in why["gpu-500"]
    assert "the same GPU twice" in why["gpu-twice"] and "over the 16,384" in why["gpu-many"]
    assert next(n for n in doc["nodes"] if n["name"] == "gpu-liar")["gpus"] is None


def test_many_true_conditions_on_one_node_are_kept_to_a_bound(serve, capsys):
    now = rfc3339(time.time())
    junk = [{"type": f"Gpu{i}", "status": "True", "reason": "Planted", "message": MARKER, "lastHeartbeatTime": now}
            for i in range(10_000)]
    _, kubeconfig = serve(one_page(node("gpu-0", conditions=junk)))
    code, out, err = fleet(kubeconfig, capsys=capsys)
    lines = out.splitlines()
    assert code == 1 and err == "" and len(lines) == 1 + fleet_view.MAX_CONDITIONS + 1 + 1
    assert lines[-2].split()[5:7] == [f"+{10_000 - fleet_view.MAX_CONDITIONS}", "conditions"]


def test_a_long_node_name_is_cut_in_the_table_and_whole_in_the_json(serve, capsys):
    name = "gpu-" + "a" * 240
    _, kubeconfig = serve(one_page(failed_gpu_3(name)))
    code, out, _ = fleet(kubeconfig, capsys=capsys)
    assert code == 1 and out.splitlines()[1].startswith("gpu-aaa") and out.splitlines()[1].split()[0].endswith("…")
    assert len(out.splitlines()[1].split()[0]) == 64
    code, out, _ = fleet(kubeconfig, "-o", "json", capsys=capsys)
    assert code == 1 and json.loads(out)["nodes"][0]["name"] == name


# -- finding 7: the listing ends ---------------------------------------------------------------------------

def test_a_repeated_continue_token_stops_the_list_with_exit_3(serve, capsys):
    server, kubeconfig = serve(lambda query: {"items": [healthy(f"gpu-{query.get('continue', 'first')}")],
                                              "metadata": {"continue": "again"}})
    t0 = time.monotonic()
    code, out, err = fleet(kubeconfig, capsys=capsys)
    assert code == 3 and out == "" and time.monotonic() - t0 < 5
    assert err == "gpu-npd: cannot list nodes: the API server repeated a continue token (page 2): stopped, as the " \
                  "list would never end\n"
    assert server.requests == 2


def test_a_continue_token_seen_pages_before_stops_the_list_too(serve, capsys):
    cycle = {"": "a", "a": "b", "b": "c", "c": "a"}
    server, kubeconfig = serve(lambda query: {"items": [], "metadata": {"continue": cycle[query.get("continue", "")]}})
    code, _, err = fleet(kubeconfig, capsys=capsys)
    assert code == 3 and "repeated a continue token (page 4)" in err and server.requests == 4


def test_fresh_continue_tokens_forever_stop_after_max_pages(serve, capsys, monkeypatch):
    monkeypatch.setattr(fleet_view, "MAX_PAGES", 5)
    server, kubeconfig = serve(lambda query: {"items": [], "metadata": {"continue": query.get("continue", "") + "x"}})
    code, _, err = fleet(kubeconfig, capsys=capsys)
    assert code == 3 and "more than 5 pages of 500 nodes: stopped" in err and server.requests == 5


# -- finding 8: malformed answers ----------------------------------------------------------------------------

def with_field(path: str, value: Any) -> dict:
    """A GPU node whose field at `path` (dotted) is `value`."""
    item = healthy("gpu-junk")
    *parents, last = path.split(".")
    target = item
    for key in parents:
        target = target.setdefault(key, {})
    target[last] = value
    return item


MALFORMED_NODES = {
    "a node that is a string": ("gpu-junk", "page 1, item 2: the node is a string, not an object"),
    "a node that is a number": (7, "the node is a number, not an object"),
    "a node that is null": (None, "the node is null, not an object"),
    "metadata a list": ({"metadata": ["gpu-junk"]}, "metadata is a list, not an object"),
    "no name": ({"metadata": {"labels": GPU_LABELS}}, "metadata.name is missing, not a node's name"),
    "a name that is a number": ({"metadata": {"name": 7}}, "metadata.name is a number, not a node's name"),
    "status a string": (with_field("status", "Ready"), "node gpu-junk: status is a string, not an object"),
    "spec a list": (with_field("spec", []), "node gpu-junk: spec is a list, not an object"),
    "conditions a string": (with_field("status.conditions", "Ready"),
                            "node gpu-junk: status.conditions is a string, not a list"),
    "conditions an object": (with_field("status.conditions", {"type": "Ready"}),
                             "node gpu-junk: status.conditions is an object, not a list"),
    "a condition that is a list": (with_field("status.conditions", [["Ready"]]),
                                   "node gpu-junk: a condition is a list, not an object"),
    "a condition type that is an object": (with_field("status.conditions", [{"type": {"a": 1}}]),
                                           "node gpu-junk: a condition's type is an object, not a string"),
    "a condition message that is a number": (with_field("status.conditions", [{"type": "Ready", "message": 5}]),
                                             "node gpu-junk: a condition's message is a number, not a string"),
    "annotations a list": (with_field("metadata.annotations", [UNHEALTHY_GPUS]),
                           "node gpu-junk: metadata.annotations is a list, not an object"),
    "the annotation a list": (with_field("metadata.annotations", {UNHEALTHY_GPUS: [{"state": "failed"}]}),
                              f"node gpu-junk: annotation {UNHEALTHY_GPUS} is a list, not a string"),
    "labels a string": (with_field("metadata.labels", "gpu"), "node gpu-junk: metadata.labels is a string, not an object"),
    "a label that is a boolean": (with_field("metadata.labels", {"nvidia.com/gpu.present": True}),
                                  "node gpu-junk: label nvidia.com/gpu.present is a boolean, not a string"),
    "taints an object": (with_field("spec.taints", {"key": "a"}), "node gpu-junk: spec.taints is an object, not a list"),
    "a taint key that is a number": (with_field("spec.taints", [{"key": 1}]),
                                     "node gpu-junk: a taint's key is a number, not a string"),
    "unschedulable a string": (with_field("spec.unschedulable", "yes"),
                               "node gpu-junk: spec.unschedulable is a string, not true or false"),
    "capacity a list": (with_field("status.capacity", [8]), "node gpu-junk: status.capacity is a list, not an object"),
    "a GPU capacity that is a number": (with_field("status.capacity", {"nvidia.com/gpu": 8}),
                                        "node gpu-junk: status.capacity nvidia.com/gpu is a number, not a string"),
}


@pytest.mark.parametrize("item, why", MALFORMED_NODES.values(), ids=MALFORMED_NODES.keys())
def test_a_malformed_node_is_one_line_and_exit_3_while_the_others_are_still_judged(serve, capsys, item, why):
    _, kubeconfig = serve(one_page(failed_gpu_3(), item, healthy()))
    code, out, err = fleet(kubeconfig, capsys=capsys)
    assert code == 3
    assert err.count("\n") == 1 and err.startswith("gpu-npd: 1 node had a malformed shape and was skipped; first: page 1, "
                                                   "item 2: ") and why in err, err
    lines = out.splitlines()
    assert [line.split()[:2] for line in lines[1:-1]] == [["gpu-bad", "3"]]
    assert lines[-1] == ("1 node to look at: 2 GPU nodes, 16 GPUs, 1 failed, 0 degraded, 0 not reporting, "
                         "1 malformed (skipped)")


def test_many_malformed_nodes_are_one_line_and_the_json_says_so(serve, capsys):
    _, kubeconfig = serve(one_page("junk", healthy(), *(["junk"] * 998), with_field("status", 1)))
    code, out, err = fleet(kubeconfig, "-o", "json", capsys=capsys)
    doc = json.loads(out)
    assert code == 3 and err.count("\n") == 1
    assert err.startswith("gpu-npd: 1000 nodes had a malformed shape and were skipped; first: page 1, item 1: the node")
    assert doc["malformed"] == {"nodes": 1000, "first": "page 1, item 1: the node is a string, not an object"}
    assert doc["summary"]["listed"] == 1001 and doc["summary"]["nodes"] == 1 and doc["nothingWrong"] is False


MALFORMED_PAGES = {
    "items an object": ({"items": {"a": healthy()}}, "page 1 of the node list: items is an object, not a list"),
    "items a string": ({"items": "nodes"}, "page 1 of the node list: items is a string, not a list"),
    "a page that is a list": ([healthy()], "answer is a JSON list, not an object"),
    "metadata a string": ({"items": [], "metadata": "x"}, "page 1 of the node list: metadata is a string, not an object"),
    "a continue token that is a number": ({"items": [healthy()], "metadata": {"continue": 2}},
                                          "page 1 of the node list: metadata.continue is a number, not a string"),
    "a continue token that is an object": ({"items": [], "metadata": {"continue": {"a": 1}}},
                                           "metadata.continue is an object, not a string"),
    "a continue token of 1 MB": ({"items": [], "metadata": {"continue": "t" * 1_000_000}},
                                 "its continue token is 1000000 characters, more than 4096"),
    "not JSON": (b"<html>gateway</html>", "BadResponse: the API server's answer is not JSON"),
    "JSON nested too deeply": (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
}


@pytest.mark.parametrize("page, why", MALFORMED_PAGES.values(), ids=MALFORMED_PAGES.keys())
def test_a_malformed_page_is_one_line_and_exit_3(serve, capsys, page, why):
    _, kubeconfig = serve(lambda query: page)
    code, out, err = fleet(kubeconfig, capsys=capsys)
    assert code == 3 and out == "" and err.count("\n") == 1
    assert err.startswith("gpu-npd: cannot list nodes: ") and why in err, err


def test_a_node_whose_texts_hold_junk_never_raises(serve, capsys):
    now = rfc3339(time.time())
    junk = [{"type": "GpuXidError", "status": "True", "reason": "\x00\u202e", "message": MARKER + "\udcff",
             "lastHeartbeatTime": "2026-13-45T99:99:99Z"},
            {"type": "Ready", "status": "\n" * 300, "message": ""},
            {"type": "GpuMissing", "status": "True", "message": MARKER, "lastHeartbeatTime": now,
             "lastTransitionTime": "yesterday"}]
    item = node("gpu-junk", "[" * 5000, conditions=junk)           # under the cap, nested past the decoder
    item["metadata"]["labels"].update({"nvidia.com/gpu.count": "²", "x" * 5000: "y" * 5000})
    item["status"]["capacity"] = {"nvidia.com/gpu": "-8"}
    item["spec"]["taints"] = [{}, {"key": "a", "value": None, "effect": "\t"}]
    _, kubeconfig = serve(one_page(item))
    code, out, err = fleet(kubeconfig, capsys=capsys)
    assert code == 1 and err == "" and out.splitlines()[-1].startswith("1 node to look at: 1 GPU node, GPU count unknown")
    code, out, err = fleet(kubeconfig, "-o", "json", capsys=capsys)
    seen = json.loads(out)["nodes"][0]
    assert code == 1 and err == "" and seen["gpus"] is None and "nested too deeply" in seen["annotationError"]
    assert [c["type"] for c in seen["conditions"]] == ["GpuXidError", "GpuMissing"] and seen["reporting"] is True


# -- deadlines: a request that took too long, an answer too large --------------------------------------------

@pytest.mark.parametrize("reason, hint", [("Timeout", "a smaller --chunk-size makes each page quicker to send"),
                                          ("TooLarge", "a smaller --chunk-size makes each page smaller")])
def test_a_list_past_its_deadline_or_too_large_is_one_line_and_exit_3(serve, capsys, monkeypatch, reason, hint):
    """api.py raises ApiError(0, "Timeout") past a request's overall deadline and ApiError(0, "TooLarge")
    over its cap on an answer; either, on any page, ends gpu-npd fleet with one line and exit 3."""
    _, kubeconfig = serve(lambda query: {"items": [healthy()], "metadata": {"continue": "" if "continue" in query else "next"}})
    real = KubeApi.list_node_page

    def second_page_fails(self, selector: str = "", limit: int = 500, token: str = "") -> dict:
        if token:
            raise ApiError(0, reason, "no answer within 30 s", None, "list", "nodes")
        return real(self, selector, limit, token)

    monkeypatch.setattr(KubeApi, "list_node_page", second_page_fails)
    code, out, err = fleet(kubeconfig, capsys=capsys)
    assert code == 3 and out == "" and err.count("\n") == 1
    assert err.startswith(f"gpu-npd: cannot list nodes: list nodes: no response {reason}: ") and hint in err, err


def test_the_docs_give_the_bounds_the_code_has():
    from detector.cli.fleet import CELL_MAX, TAINTS_MAX

    text = " ".join((REPO / "docs" / "deploying.md").read_text().split())
    for said in (f"read only up to {fleet_view.ANNOTATION_MAX // KIB} KiB", f"more than {fleet_view.MAX_GPUS} GPUs",
                 f"over {fleet_view.MAX_GPUS} is not taken", f"At most {fleet_view.MAX_CONDITIONS} True gpu-npd",
                 f"and {fleet_view.MAX_TAINTS} taints", f"kept to {fleet_view.TEXT_MAX} characters",
                 f"to {fleet_view.MESSAGE_MAX:,})", f"cut to {CELL_MAX} characters", f"TAINTS, to {TAINTS_MAX}.",
                 f"more than {fleet_view.MAX_PAGES:,} pages", f"so do {fleet_view.MAX_PAGES:,} pages"):
        assert said in text, said


def test_the_newest_heartbeat_is_found_however_the_times_are_written():
    """Times as the API server writes them are compared as text and only the newest parsed; one written
    otherwise (an offset, a fraction) or not a time at all makes each be parsed."""
    from detector.kube.fleet_view import fleet_node
    from detector.kube.stamps import parse_rfc3339

    def newest(*beats: str) -> str | None:
        item = node("gpu-0", conditions=[{"type": f"Gpu{i}", "message": MARKER, "lastHeartbeatTime": b}
                                         for i, b in enumerate(beats)])
        item["status"]["conditions"] = item["status"]["conditions"][1:]
        seen = fleet_node(item, frozenset(), parse_rfc3339("2026-03-02T12:00:00Z"), 900)
        return seen.last_heartbeat

    assert newest("2026-03-02T11:50:00Z", "2026-03-02T11:58:00Z", "2026-03-02T11:40:00Z") == "2026-03-02T11:58:00Z"
    assert newest("2026-03-02T11:50:00Z", "2026-03-02T13:55:00+02:00") == "2026-03-02T13:55:00+02:00"
    assert newest("2026-03-02T11:50:00Z", "2026-03-02T11:59:00.5Z") == "2026-03-02T11:59:00.5Z"
    assert newest("2026-13-45T99:99:99Z", "2026-03-02T11:50:00Z") == "2026-03-02T11:50:00Z"
    assert newest("yesterday", "x" * 100_000) is None and newest() is None


def test_what_a_terminal_would_act_on_is_shown_as_question_marks(serve, capsys):
    now = rfc3339(time.time())
    item = node("gpu-0", conditions=[{"type": "GpuXidError", "status": "True", "reason": "\x1b[2J\nfake row\u202e",
                                      "message": MARKER, "lastHeartbeatTime": now}])
    item["spec"]["taints"] = [{"key": "evil\r", "value": "\x9b31m", "effect": "NoSchedule"}]
    _, kubeconfig = serve(one_page(item, {"metadata": {"name": "gpu-\x1b]0;owned\x07"}, "status": 1}))
    code, out, err = fleet(kubeconfig, capsys=capsys)
    assert code == 3 and len(out.splitlines()) == 3 and err.count("\n") == 1
    row = out.splitlines()[1].split()
    assert row[5:8] == ["GpuXidError", "?[2J?fake", "row?"] and row[-1] == "evil?=?31m:NoSchedule"
    assert "node gpu-?]0;owned?: status is a number" in err
    assert not any(ch in out + err.rstrip("\n") for ch in "\x1b\x07\x9b\r\u202e")
