"""The acceptance drill of issue 32: a GB200 NVL72 rack (18 `gb200-nvl72-4` trays in one NVLink domain)
simulated against the emulator, one link failing on node 5's GPU 1 (XID 149 there, the downstream XID 145
on the other 71 GPUs, as on marin-community/marin #9086's rack), and `gpu-npd fleet -o json`, run as a
person with deploy/fleet-viewer's read-only RBAC, naming that node and GPU as the domain's origin."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from detector.cli.main import main
from detector.cli.simulate import SIMULATOR_USER
from detector.core.nvlink_domain import CLIQUE_LABEL
from detector.daemon.local import REPO_DEPLOY
from fake_nvml.scenario import NvlinkDomain
from kube_emulator import Emulator

REPO = Path(__file__).resolve().parent.parent
FLEET_VIEWER = REPO / "deploy" / "fleet-viewer"
VIEWER, VIEWERS = "jane", "gpu-npd:fleet-viewers"
RACK = {"version": 1, "seed": 32, "nodes": [
    {"scenario": "gb200-nvl72-4", "count": 18, "name": "gb200-{index:02d}", "nvlink_domain": "nvl72-a"}],
    "faults": [{"at": 2, "kind": "nvlink_domain_fault", "node": "gb200-05", "gpu": 1, "link": 14}]}


@pytest.fixture
def rack(tmp_path):
    """The rack played by `gpu-npd simulate --kubeconfig` (the command a person runs) against the emulator."""
    fleet_file = tmp_path / "rack.yaml"
    fleet_file.write_text(yaml.safe_dump(RACK))
    with Emulator(rbac_paths=(REPO_DEPLOY, REPO_DEPLOY.parent / "kwok", FLEET_VIEWER)) as emulator:
        simulator = emulator.write_kubeconfig(tmp_path / "simulator.kubeconfig", user=SIMULATOR_USER)
        viewer = emulator.write_kubeconfig(tmp_path / "viewer.kubeconfig", user=VIEWER)
        emulator.token_for(VIEWER, groups=[VIEWERS, "system:authenticated"])
        log = tmp_path / "simulate.log"
        with log.open("w") as stderr:
            proc = subprocess.Popen([sys.executable, "-m", "detector.cli.main", "simulate", "--fleet",
                                     str(fleet_file), "--kubeconfig", str(simulator), "--listen", "127.0.0.1:0",
                                     "--start-spread", "0", "--workers", "2", "--qps", "500", "--burst", "500",
                                     "--duration", "300"], cwd=REPO, stderr=stderr)
        try:
            deadline = time.monotonic() + 30          # listening: its stop-signal handlers are in place
            while "/faults on http://" not in log.read_text() and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
            assert "/faults on http://" in log.read_text(), log.read_text()
            yield emulator, viewer
        finally:
            proc.terminate()
            assert proc.wait(30) == 0


def fleet_json(viewer: Path, capsys) -> tuple[int, dict]:
    code = main(["fleet", "--kubeconfig", str(viewer), "-o", "json"])
    out, err = capsys.readouterr()
    assert code in (0, 1), err
    return code, json.loads(out)


def test_the_fleet_names_node_5_gpu_1_as_the_origin_of_the_racks_fault_within_a_minute(rack, capsys):
    emulator, viewer = rack
    domain = NvlinkDomain.named("nvl72-a")
    started, deadline, seen = time.monotonic(), time.monotonic() + 60, {}
    while time.monotonic() < deadline:
        code, seen = fleet_json(viewer, capsys)
        domains = seen["domains"]
        if domains and domains[0]["origin"] and domains[0]["gpus_affected"] == 72:
            break
        time.sleep(0.5)
    else:
        pytest.fail(f"no origin within a minute: {json.dumps(seen.get('domains'), indent=1)}")
    took = time.monotonic() - started
    assert code == 1 and len(seen["domains"]) == 1, seen["domains"]
    d = seen["domains"][0]
    assert (d["cluster_uuid"], d["clique_id"]) == (domain.cluster_uuid, domain.clique_id)
    assert d["nodes"] == [f"gb200-{i:02d}" for i in range(18)]
    assert d["origin"]["node"] == "gb200-05" and d["origin"]["gpu"] == 1, d
    assert (d["origin"]["xid"], d["origin"]["link"], d["origin"]["fatal"]) == ("149.37", 14, True), d
    assert d["verdict"] == "origin" and d["downstream_only"] == 71 and d["candidates"] == [d["origin"]]
    assert "gb200-05 GPU 1" in d["explanation"] and "71 GPUs show only downstream XIDs" in d["explanation"]
    # Every tray got the clique label the DRA driver would have written (none was there to reuse).
    labels = {n["metadata"]["name"]: n["metadata"]["labels"].get(CLIQUE_LABEL) for n in emulator.nodes()}
    assert set(labels.values()) == {f"{domain.cluster_uuid}.{domain.clique_id}"}, labels
    assert took < 60
    assert main(["fleet", "--kubeconfig", str(viewer)]) == 1
    table = capsys.readouterr().out.splitlines()
    head = next(i for i, line in enumerate(table) if line.startswith("NVLINK DOMAIN"))
    row = table[head + 1].split()
    assert row[:5] == [f"{domain.cluster_uuid}/1", "18", "72", "gb200-05", "GPU"] and row[5] == "1", table[head + 1]


def remediation_asks(emulator) -> dict[str, tuple[str, str]]:
    return {n["metadata"]["name"]: next(((c["status"], c["message"]) for c in n["status"].get("conditions", [])
                                         if c["type"] == "GpuNodeNeedsRemediation"), ("", ""))
            for n in emulator.nodes()}


def test_only_the_origin_tray_asks_for_remediation_the_downstream_trays_hold(rack):
    emulator, _ = rack
    deadline, asks = time.monotonic() + 60, {}
    while time.monotonic() < deadline:
        asks = remediation_asks(emulator)
        if asks.get("gb200-05", ("", ""))[0] == "True" and all(status == "False" for name, (status, _) in asks.items()
                                                 if name != "gb200-05") and len(asks) == 18:
            break
        time.sleep(0.5)
    else:
        pytest.fail(f"asks: {asks}")
    message = asks["gb200-05"][1]
    assert "this node holds the likely origin of a fault in its NVLink domain: GPU 1 (XID 149" in message, message
    assert "link 14)" in message and "remediate this tray, not the rack" in message
    # The others hold, their GPUs fenced; why they ask for nothing yet is an Event on each.
    deadline, held = time.monotonic() + 30, set()
    while time.monotonic() < deadline and len(held) < 17:
        held = {e["involvedObject"]["name"] for e in emulator.events() if e.get("reason") == "DownstreamLinkFault"}
        time.sleep(0.5)
    assert held == {f"gb200-{i:02d}" for i in range(18)} - {"gb200-05"}
    event = next(e for e in emulator.events() if e.get("reason") == "DownstreamLinkFault")
    assert "only with the downstream XID 145" in event["message"] and "gpu-npd fleet names" in event["message"]
