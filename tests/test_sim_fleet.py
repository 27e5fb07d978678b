"""The fleet simulator against the emulator: 50 nodes with a scripted timeline; every injected fault
shows as the right condition on the right node and nothing else shows; faults by command; the shared
scheduler; `gpu-npd simulate` as a process."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from conftest import builtin_rules, REPO
from detector.cli.simulate import SIMULATOR_USER, _inject
from detector.core.check import CheckRegistry
from detector.daemon.local import REPO_DEPLOY
from detector.kube.api import KubeApi
from detector.sim.faultlog import FaultLog
from detector.sim.fleet import KWOK_ANNOTATION, Fleet, FleetSettings, fleet_check_defaults
from detector.sim.fleetfile import fleet_from_dict
from detector.sim.scheduler import Scheduler, Task
from kube_emulator import Emulator

# What each scripted fault must show on its node (the builtin rules' condition types).
# XID 48 is an uncorrectable ECC error: the xid check reports the line, the memory check the count it raised.
EXPECTED = {"xid": {79: {"GpuXidError", "GpuMissing"}, 48: {"GpuXidError", "GpuMemoryError"}},
            "pcie": {"GpuPcieDegraded"},
            "nvml_invisible": {"GpuMissing"}}

FLEET = {
    "version": 1, "seed": 11,
    "nodes": [{"scenario": "h100-sxm-8", "count": 40, "name": "sim-h100-{index:04d}", "racks": 4},
              {"scenario": "a100-pcie-4", "count": 10, "name": "sim-a100-{index:04d}", "racks": 1}],
    "faults": [
        {"at": 1.0, "node": "sim-h100-0007", "kind": "xid", "gpu": 3, "code": 79},
        {"at": 1.5, "node": "sim-h100-0021", "kind": "pcie", "gpu": 5, "width": 8},
        {"at": 2.0, "node": "sim-a100-0004", "kind": "xid", "gpu": 1, "code": 48},
        {"at": 2.5, "rack": "rack-02", "kind": "pcie", "gpu": 0, "width": 4},       # sim-h100-0020..0029
        {"at": 3.0, "node": "sim-h100-0033", "kind": "nvml_invisible", "gpu": 6},
    ],
}


@pytest.fixture
def emulator():
    with Emulator(rbac_paths=(REPO_DEPLOY, REPO_DEPLOY.parent / "kwok")) as emu:
        yield emu


@pytest.fixture
def fleet_on(emulator, tmp_path):
    fleets: list[Fleet] = []

    def start(data: dict, **settings) -> Fleet:
        kubeconfig = emulator.write_kubeconfig(tmp_path / "sim.kubeconfig", user=SIMULATOR_USER)
        api = KubeApi.from_kubeconfig(str(kubeconfig), qps=500.0, burst=500, pool_size=4)
        registry = CheckRegistry.from_entry_points()
        ruleset = builtin_rules()
        fleet = Fleet(fleet_from_dict(data), api, ruleset, registry,
                      FleetSettings(workers=4, start_spread_s=settings.get("start_spread_s", 1.0)),
                      FaultLog(tmp_path / "faults.jsonl"))
        fleets.append(fleet)
        fleet.start()
        return fleet

    yield start
    for fleet in fleets:
        fleet.stop()


def true_conditions(emulator: Emulator) -> dict[str, set[str]]:
    return {n["metadata"]["name"]: {c["type"] for c in n["status"].get("conditions", [])
                                    if c["type"].startswith("Gpu") and c["status"] == "True"}
            for n in emulator.nodes()}


def expected_from(records: list[dict]) -> dict[str, set[str]]:
    expected: dict[str, set[str]] = {}
    for r in records:
        types = EXPECTED[r["kind"]]
        types = types[r["params"]["code"]] if isinstance(types, dict) else types
        expected.setdefault(r["node"], set()).update(types)
    return expected


def wait_for(predicate, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


def test_fifty_nodes_show_exactly_the_faults_injected(emulator, fleet_on):
    fleet = fleet_on(FLEET)
    assert len(emulator.nodes()) == 50
    assert wait_for(lambda: len(fleet.fault_log.records()) == 14)           # 4 scripted + a rack of 10
    records = fleet.fault_log.records()
    assert all(r["source"] in ("scripted", "correlated") and r["time"] >= fleet.started_at for r in records)
    expected = expected_from(records)
    assert set(expected) == {"sim-h100-0007", "sim-h100-0021", "sim-a100-0004", "sim-h100-0033",
                             *(f"sim-h100-{i:04d}" for i in range(20, 30))}

    def shows_exactly() -> bool:
        shown = true_conditions(emulator)
        return all(shown[name] == expected.get(name, set()) for name in shown)
    assert wait_for(shows_exactly), {n: t for n, t in true_conditions(emulator).items() if t}

    for node in emulator.nodes():
        conditions = node["status"]["conditions"]
        types = [c["type"] for c in conditions]
        assert len(types) == len(set(types)), node["metadata"]["name"]            # no duplicate condition
        # every node judged (a problem never seen on a node is not written there: issue 34)
        assert fleet.nodes[node["metadata"]["name"]].reporter.settled(["GpuXidError", "GpuMissing", "GpuPcieDegraded"])
        assert node["metadata"]["annotations"][KWOK_ANNOTATION] == "fake"
        assert node["metadata"]["labels"]["type"] == "kwok"
    xid = next(c for c in emulator.node("sim-h100-0007")["status"]["conditions"] if c["type"] == "GpuXidError")
    assert xid["reason"] == "Xid79GpuFellOffBus" and "GPU 3" in xid["message"]
    assert emulator.request_count(code=403) == 0 and emulator.request_count(code=422) == 0


def test_faults_by_command_are_logged_and_shown(emulator, fleet_on):
    fleet = fleet_on({"version": 1, "nodes": [{"scenario": "h100-sxm-8", "count": 3, "name": "cmd-{index}"}]})
    assert wait_for(lambda: all(node.reporter.settled(["GpuXidError"]) for node in fleet.nodes.values()))   # judged
    code, body, _ = _inject(fleet, json.dumps({"node": "cmd-1", "kind": "xid", "gpu": 2,
                                               "params": {"code": 79}}).encode())
    assert code == 200 and json.loads(body)["source"] == "command"
    assert wait_for(lambda: true_conditions(emulator)["cmd-1"] == {"GpuXidError", "GpuMissing"})
    assert true_conditions(emulator)["cmd-0"] == set()
    assert _inject(fleet, b'{"node": "cmd-9", "kind": "xid", "gpu": 2, "params": {"code": 79}}')[0] == 404
    code, body, _ = _inject(fleet, b'{"node": "cmd-0", "kind": "melt"}')
    assert code == 400 and "unknown fault kind" in json.loads(body)["error"]
    assert [r["node"] for r in fleet.fault_log.records()] == ["cmd-1"]


def test_adopting_existing_kwok_nodes(emulator, tmp_path):
    for i in range(3):
        emulator.create_node(f"kwok-{i}", labels={"type": "kwok"})
    emulator.create_node("real-gpu", labels={"type": "real"})
    kubeconfig = emulator.write_kubeconfig(tmp_path / "sim.kubeconfig", user=SIMULATOR_USER)
    registry = CheckRegistry.from_entry_points()
    fleet = Fleet(fleet_from_dict({"version": 1, "nodes": [{"scenario": "h100-sxm-8", "count": 3}],
                                   "faults": [{"at": 0.5, "node": "h100-sxm-8-0001", "kind": "pcie", "gpu": 0,
                                               "width": 8}]}),
                  KubeApi.from_kubeconfig(str(kubeconfig), qps=100, burst=100),
                  builtin_rules(), registry,
                  FleetSettings(workers=2, start_spread_s=0.0, create_nodes=False, adopt_selector="type=kwok"))
    fleet.start()
    try:
        assert sorted(fleet.nodes) == ["kwok-0", "kwok-1", "kwok-2"]
        assert wait_for(lambda: true_conditions(emulator)["kwok-1"] == {"GpuPcieDegraded"})
        assert true_conditions(emulator)["real-gpu"] == set() and len(emulator.nodes()) == 4
        assert fleet.fault_log.records()[0]["node"] == "kwok-1"        # the fleet file's node 1, adopted
    finally:
        fleet.stop()


def test_fleet_nodes_poll_slowly_and_a_fleet_file_overrides_one_setting_at_a_time(emulator, tmp_path):
    """Injections run the checks at once, so a fleet's nodes poll every 5 minutes (thermal every minute,
    its window needs samples); a fleet file's setting for a check changes only what it names."""
    kubeconfig = emulator.write_kubeconfig(tmp_path / "sim.kubeconfig", user=SIMULATOR_USER)
    registry = CheckRegistry.from_entry_points()
    fleet = Fleet(fleet_from_dict({"version": 1, "nodes": [{"scenario": "h100-sxm-8", "count": 1}],
                                   "checks": {"visibility": {"timeout": 5}, "pcie": {"interval": 30}}},
                                  registry=registry),
                  KubeApi.from_kubeconfig(str(kubeconfig), qps=100, burst=100),
                  builtin_rules(), registry, FleetSettings(workers=1))
    fleet.start()
    try:
        [node] = fleet.nodes.values()
        intervals = {c.name: c.interval_s for c in node.agent.checks}
        assert intervals["thermal"] == 60.0 and intervals["pcie"] == 30.0
        assert intervals["visibility"] == intervals["xid"] == intervals["nvlink"] == 300.0
        assert {c.name: c.timeout_s for c in node.agent.checks}["visibility"] == 5.0
        assert fleet_check_defaults(registry)["nccl"] == {"interval": 6 * 3600.0}   # a longer one is kept
    finally:
        fleet.stop()


class Counting(Task):
    def __init__(self, clock, period: float | None, seconds: float = 0.0):
        super().__init__()
        self.clock, self.period, self.seconds, self.times = clock, period, seconds, []
        self.active, self.overlap = 0, False

    def run(self):
        self.active += 1
        self.overlap |= self.active > 1
        self.times.append(self.clock())
        time.sleep(self.seconds)
        self.active -= 1
        return None if self.period is None else self.clock() + self.period


def test_scheduler_runs_many_tasks_on_few_threads_never_one_task_twice_at_once():
    scheduler = Scheduler(workers=4)
    tasks = [Counting(time.time, 0.05) for _ in range(200)]
    slow = Counting(time.time, None, seconds=0.2)
    for task in tasks:
        scheduler.wake(task)
    scheduler.start()
    workers = [t for t in threading.enumerate() if t.name.startswith("sim-worker-")]
    assert len(workers) == 4                                          # no thread per task
    scheduler.wake(slow)
    time.sleep(0.05)
    scheduler.wake(slow)                                              # woken while running: runs again after
    scheduler.wake(slow)
    time.sleep(0.6)
    scheduler.stop()
    assert all(len(t.times) >= 3 for t in tasks)
    assert len(slow.times) == 2 and not slow.overlap
    assert slow.times[1] - slow.times[0] >= 0.2


def test_earlier_wake_up_wins_and_later_one_is_ignored():
    clock = [100.0]
    scheduler = Scheduler(workers=1, clock=lambda: clock[0])
    task = Counting(lambda: clock[0], None)
    scheduler.wake(task, 200.0)
    scheduler.wake(task, 150.0)
    scheduler.wake(task, 300.0)
    scheduler.start()
    clock[0] = 160.0
    assert wait_for(lambda: len(task.times) == 1, 3)
    clock[0] = 250.0
    time.sleep(0.7)
    scheduler.stop()
    assert task.times == [160.0]                                       # the 200 entry was superseded


def test_gpu_npd_simulate_runs_a_fleet_and_takes_faults_over_http(tmp_path):
    fleet_file = tmp_path / "fleet.yaml"
    fleet_file.write_text("version: 1\nnodes:\n  - {scenario: h100-sxm-8, count: 5, name: 'n-{index}'}\n"
                          "faults:\n  - {at: 1, node: n-2, kind: xid, gpu: 0, code: 79}\n")
    log = tmp_path / "faults.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "detector.cli.main", "simulate", "--fleet", str(fleet_file),
                             "--emulator", "--listen", "127.0.0.1:0", "--start-spread", "0.5", "--duration", "30",
                             "--fault-log", str(log)], cwd=REPO, stderr=subprocess.PIPE, text=True)
    try:
        address = None
        for line in proc.stderr:
            if "/faults on http://" in line:
                address = line.rsplit("http://", 1)[1].strip()
                break
        assert address, "simulate never said where it listens"
        assert wait_for(lambda: log.exists() and len(log.read_text().splitlines()) == 1, 15)
        request = urllib.request.Request(f"http://{address}/faults", method="POST", data=json.dumps(
            {"node": "n-4", "kind": "pcie", "gpu": 1, "params": {"width": 8}}).encode())
        with urllib.request.urlopen(request, timeout=10) as response:
            assert json.loads(response.read())["node"] == "n-4"
        with urllib.request.urlopen(f"http://{address}/faults", timeout=10) as response:
            assert [r["node"] for r in json.loads(response.read())] == ["n-2", "n-4"]
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
            assert "gpu_npd_sim_nodes 5.0" in response.read().decode()
    finally:
        proc.terminate()
        assert proc.wait(15) == 0


@pytest.mark.parametrize("trouble, expected", [
    ("no-binding", "cannot register the fleet's nodes: the API server forbids gpu-npd to create nodes (403 Forbidden): "
                   "grant it as deploy/kwok/rbac.yaml does"),
    ("bad-token", "cannot register the fleet's nodes: the API server does not accept gpu-npd's credentials "
                  "(create nodes: 401 Unauthorized"),
    ("down", "cannot register the fleet's nodes: create nodes: no response ConnectionFailed"),
])
def test_simulate_says_an_api_refusal_in_one_line(tmp_path, capsys, trouble, expected):
    from detector.cli.main import main

    fleet_file = tmp_path / "fleet.yaml"
    fleet_file.write_text("version: 1\nnodes:\n  - {scenario: h100-sxm-8, count: 2, name: 'n-{index}'}\n")
    with Emulator(rbac_paths=(REPO_DEPLOY,)) as emu:           # the DaemonSet's RBAC only: no simulator binding
        kubeconfig = emu.write_kubeconfig(tmp_path / "kubeconfig", user=SIMULATOR_USER)
        if trouble == "bad-token":
            kubeconfig.write_text(kubeconfig.read_text().replace(emu.token_for(SIMULATOR_USER), "not-a-token"))
        if trouble == "down":
            emu.down()
        code = main(["simulate", "--fleet", str(fleet_file), "--kubeconfig", str(kubeconfig),
                     "--listen", "127.0.0.1:0", "--duration", "1"])
    err = capsys.readouterr().err
    assert code == 2
    assert f"gpu-npd: error: {expected}" in err, err
    assert "Traceback" not in err
