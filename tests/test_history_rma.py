"""`gpu-npd history --rma`: the node's GPUs to send back, with their incidents and the evidence bundles that
name them, from a history the real History class writes and bundle manifests written here (a corrupt, a
linked and a misshapen one among them, and a bundle of another board in the same slot that must not be
attached); then from the real daemon, run against the emulator."""

from __future__ import annotations

import calendar
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import stop_process
from detector import __version__
from detector.checks.node.history import HISTORY_FILE, GpuRecord, History, Incident, read_history
from detector.cli.main import main
from fake_nvml.faults import Fault
from fake_nvml.scenario import load_scenario
from kube_emulator import Emulator
from test_daemon_e2e import FAST_CHECKS, emulator, fast_settings, running  # noqa: F401 - fixtures

REPO = Path(__file__).resolve().parent.parent
DAY = 86400.0
NOW = time.time()
SERIAL_A, SERIAL_C = "1654922006536", "1654922006981"
UUID_A = "GPU-13719f71-412c-d11e-b236-a262f5300003"
UUID_B = "GPU-8fb2a7c4-0d4e-4f4b-9f3e-5d0c1a2b3c4d"
BUS_A, BUS_B, BUS_C = "00000000:5D:00.0", "00000000:3A:00.0", "00000000:DB:00.0"


def write_history(state: Path) -> None:
    """GPU A: incidents on 3 boots within 30 days (flaky); C: 2 boots, one 40 days ago; B: one incident, lost
    before its serial was read (kept by UUID)."""
    history = History(state / HISTORY_FILE, retention_s=90 * DAY)
    a = GpuRecord(SERIAL_A, SERIAL_A, UUID_A, BUS_A, 3)
    for n, age in enumerate((20, 10, 1)):
        history.note_incident(a, Incident(NOW - age * DAY, f"boot-a{n}-6f1c2e0a", "Xid48DoubleBitEccError",
                                          "RESET_GPU", "GPU 3: XID 48 double-bit ECC error"))
    c = GpuRecord(SERIAL_C, SERIAL_C, "GPU-c", BUS_C, 7)
    for n, age in enumerate((40, 2)):
        history.note_incident(c, Incident(NOW - age * DAY, f"boot-c{n}-1d2e3f4a", "Xid79GpuFellOffBus", "RESTART_BM"))
    history.note_incident(GpuRecord(UUID_B, None, UUID_B, BUS_B, 1),
                          Incident(NOW - 3600, "boot-b0-9a8b7c6d", "RowRemapFailure", "CONTACT_SUPPORT"))
    history.save()


def manifest(gpus: list[dict], created: str, **extra) -> dict:
    return {"version": 1, "created": created, "node": "gpu-7", "boot_id": "boot-a2-6f1c2e0a", "reason": "xid",
            "incident": "GpuXidError/Xid48DoubleBitEccError", "gpus": gpus,
            "files": [{"name": "nvidia-smi-q.xml", "bytes": 90000}, {"name": "kernel.log", "bytes": 4000}],
            "bytes": 94000, "redacted": True, "truncated": [], **extra}


def write_bundles(state: Path) -> dict[str, Path]:
    root = state / "bundles"
    paths = {}

    def bundle(name: str, content: str | None) -> Path:
        path = root / name
        path.mkdir(parents=True)
        if content is not None:
            (path / "manifest.json").write_text(content)
        paths[name] = path
        return path

    bundle("20260301T101500Z-xid", json.dumps(manifest(
        [{"index": 0, "serial": "1654922000000", "uuid": "GPU-0", "pci_bus_id": "0000:18:00.0", "model": "other"},
         {"index": 3, "serial": SERIAL_A, "uuid": UUID_A, "pci_bus_id": BUS_A, "model": "NVIDIA H100 80GB HBM3"}],
        "2026-03-01T10:15:00Z")))
    bundle("20260302T080000Z-remap", json.dumps(manifest(        # GPU B, lost: the bundle knows its UUID only
        [{"index": 1, "serial": None, "uuid": UUID_B, "pci_bus_id": "0000:3a:00.0"}], "2026-03-02T08:00:00Z")))
    # A new board in GPU A's slot (the same bus id, another serial): its bundle is not GPU A's evidence.
    bundle("20260303T090000Z-xid", json.dumps(manifest(
        [{"index": 3, "serial": "1654922099999", "uuid": "GPU-new", "pci_bus_id": "0000:5d:00.0"}],
        "2026-03-03T09:00:00Z")))
    bundle("20260304T000000Z-torn", '{"version": 1, "created": "2026-03-04T00:00:00Z", "gpus": [{"ind')
    bundle("20260305T000000Z-shape", json.dumps(manifest("GPU 3", "2026-03-05T00:00:00Z")))     # type: ignore
    linked = bundle("20260306T000000Z-link", None)
    (state / "elsewhere.json").write_text(json.dumps(manifest([{"serial": SERIAL_A}], "2026-03-06T00:00:00Z")))
    os.symlink(state / "elsewhere.json", linked / "manifest.json")
    bundle("20260307T000000Z-writing", None)                   # no manifest yet
    fifo = bundle("20260308T000000Z-fifo", None)
    os.mkfifo(fifo / "manifest.json")                          # never waited on
    return paths


def rma(state: Path, *args: str, capsys) -> tuple[int, str, str]:
    code = main(["history", "--state-dir", str(state), "--rma", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_rma_lists_each_gpu_most_incidents_first_with_its_bundles_and_skips_bad_manifests(tmp_path, capsys):
    write_history(tmp_path)
    paths = write_bundles(tmp_path)
    code, out, err = rma(tmp_path, "-o", "json", "--node-name", "gpu-7", capsys=capsys)
    assert code == 0, err
    doc = json.loads(out)
    assert doc["node"] == "gpu-7" and doc["gpu_npd_version"] == __version__
    assert abs(calendar.timegm(time.strptime(doc["generated_at"], "%Y-%m-%dT%H:%M:%SZ")) - time.time()) < 60
    assert doc["flaky_rule"] == {"flaky_boots": 3, "flaky_window_seconds": 30 * DAY}
    a, c, b = doc["gpus"]
    assert (a["serial"], a["uuid"], a["pci_bus_id"], a["index"]) == (SERIAL_A, UUID_A, BUS_A, 3)
    assert (a["incident_count"], a["boots"], a["boots_in_window"], a["flaky"]) == (3, 3, 3, True)
    assert a["model"] == "NVIDIA H100 80GB HBM3" and a["note"] is None
    assert [i["reason"] for i in a["incidents"]] == ["Xid48DoubleBitEccError"] * 3
    assert a["incidents"][0]["message"] == "GPU 3: XID 48 double-bit ECC error"
    assert [x["path"] for x in a["bundles"]] == [str(paths["20260301T101500Z-xid"])]   # not the new board's
    assert a["bundles"][0] == {"path": str(paths["20260301T101500Z-xid"]), "created": "2026-03-01T10:15:00Z",
                               "bytes": 94000, "reason": "xid", "redacted": True, "truncated": []}
    assert (c["serial"], c["boots"], c["boots_in_window"], c["flaky"], c["bundles"]) == (SERIAL_C, 2, 1, False, [])
    assert (b["serial"], b["uuid"], b["flaky"]) == (None, UUID_B, False)
    assert "serial unknown" in b["note"]
    assert [x["path"] for x in b["bundles"]] == [str(paths["20260302T080000Z-remap"])]
    notes = "\n".join(doc["notes"])
    assert len(doc["notes"]) == 5, notes
    assert f"{paths['20260304T000000Z-torn']}: manifest.json unreadable (JSONDecodeError" in notes
    assert f"{paths['20260305T000000Z-shape']}: manifest.json unreadable (ValueError: gpus is a string" in notes
    assert "is a symbolic link" in notes and "a FIFO, not a regular file" in notes
    assert f"{paths['20260307T000000Z-writing']}: no manifest.json" in notes


def test_rma_table_has_a_header_and_one_block_per_gpu(tmp_path, capsys):
    write_history(tmp_path)
    write_bundles(tmp_path)
    code, out, _ = rma(tmp_path, capsys=capsys)        # no --node-name: the bundles' node
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == "gpu-npd RMA evidence" and lines[1].split() == ["node:", "gpu-7"]
    assert lines[3].split()[0] == "gpu-npd:" and "3 distinct boots within 30d" in lines[5]
    blocks = [line for line in lines if line.startswith("GPU ")]
    assert blocks == [f"GPU 3  serial {SERIAL_A}  FLAKY: send it back", f"GPU 7  serial {SERIAL_C}",
                      "GPU 1  serial unknown"]
    assert "3 on 3 boot(s); 3 boot(s) within 30d" in out and "2 on 2 boot(s); 1 boot(s) within 30d" in out
    assert "91.8 KiB" in out and "bundles:    none kept for this GPU" in out
    assert sum(line.startswith("note: skipped") for line in lines) == 5


def test_nothing_recorded_says_so_and_exits_0(tmp_path, capsys):
    code, out, err = rma(tmp_path, capsys=capsys)
    assert code == 0 and err == "" and "no GPU incidents recorded" in out and "node:          unknown" in out
    code, out, _ = rma(tmp_path, "-o", "json", capsys=capsys)
    assert code == 0 and json.loads(out)["gpus"] == [] and json.loads(out)["notes"] == []
    assert main(["history", "--state-dir", str(tmp_path)]) == 0
    assert f"no history recorded in {tmp_path} yet" in capsys.readouterr().out


def test_the_flaky_rule_is_the_daemons_config(tmp_path, capsys):
    write_history(tmp_path)
    config = tmp_path / "config.yaml"
    config.write_text("checks:\n  node:\n    flaky_boots: 2\n    flaky_window: 3542400\n")   # 41 days
    code, out, _ = rma(tmp_path, "-o", "json", "--config", str(config), capsys=capsys)
    flaky = {g["serial"]: g["flaky"] for g in json.loads(out)["gpus"]}
    assert code == 0 and flaky == {SERIAL_A: True, SERIAL_C: True, None: False}
    config.write_text("checks:\n  node:\n    flaky_boots: 0\n")
    code, _, err = rma(tmp_path, "--config", str(config), capsys=capsys)
    assert code == 2 and f"{config}:3: field 'checks.node.flaky_boots': must be at least 1" in err
    config.write_text("checks:\n  node:\n    flaky_window: soon\n")
    code, _, err = rma(tmp_path, "--config", str(config), capsys=capsys)
    assert code == 2 and "checks.node.flaky_window" in err


def test_rma_for_one_gpu_and_a_state_dir_that_is_not_there(tmp_path, capsys):
    write_history(tmp_path)
    code, out, _ = rma(tmp_path, "--gpu", UUID_B, "-o", "json", capsys=capsys)
    assert code == 0 and [g["uuid"] for g in json.loads(out)["gpus"]] == [UUID_B]
    code, _, err = rma(tmp_path / "absent", capsys=capsys)
    assert code == 2 and "no such directory" in err


# -- the real daemon --------------------------------------------------------------------------------------

def _history_gpus(state: Path) -> dict:
    return read_history(state)[0].gpus if (state / HISTORY_FILE).exists() else {}


def _kept_bundles(state: Path) -> list[Path]:
    """Bundles the daemon finished (a manifest is written last)."""
    return sorted((state / "bundles").glob("*/manifest.json"))


def test_daemon_then_history_rma_names_gpu_3_by_serial(running, tmp_path, capsys):
    """GPU 3 falls off the bus (XID 79) after the daemon read its serial: history --rma names it by serial,
    and lists a bundle where the daemon kept one."""
    state = tmp_path / "state"
    local = running(state_dir=state, checks=[*FAST_CHECKS, "node"])
    serial = local.node.snapshot().gpus[3].serial
    # healthy first: judged, and a problem never seen on the node is not written (issue 34)
    assert local.wait_for(lambda: local.settled("GpuXidError") and "GpuXidError" not in local.conditions())
    local.node.inject(Fault("xid", gpu=3, params={"code": 79}))
    assert local.wait_for(lambda: any(g.serial == serial for g in _history_gpus(state).values()), 20)
    assert local.wait_for(lambda: bool(_kept_bundles(state)), 60)       # the evidence kept for the incident
    code, out, err = rma(state, "-o", "json", capsys=capsys)
    assert code == 0, err
    [gpu] = json.loads(out)["gpus"]
    assert (gpu["serial"], gpu["index"], gpu["uuid"]) == (serial, 3, local.node.snapshot().gpus[3].uuid)
    assert [i["reason"] for i in gpu["incidents"]] == ["Xid79GpuFellOffBus"]
    assert [b["path"] for b in gpu["bundles"]] == [str(p.parent) for p in _kept_bundles(state)], out


def test_gpu_npd_run_xid79_then_history_rma_lists_gpu_3_by_serial(tmp_path):
    """The issue's acceptance, as a person runs it: `gpu-npd run --nvml fake:h100-sxm-8-xid79 --state-dir S`
    against the emulator, then `gpu-npd history --state-dir S --rma`. GPU 3 is lost before the daemon's first
    NVML read, so NVML never gives its serial: the driver's `NVRM: GPU Board Serial Number:` line, printed
    before the GPU's first Xid, does."""
    state = tmp_path / "state"
    env = {**os.environ, "NODE_NAME": "", "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    with Emulator(rbac_paths=(REPO / "deploy" / "base",)) as emu:
        emu.create_node("gpu-9", labels={"nvidia.com/gpu.present": "true"})
        kubeconfig = emu.write_kubeconfig(tmp_path / "kubeconfig")
        proc = subprocess.Popen([sys.executable, "-m", "detector.cli.main", "run", "--nvml",
                                 "fake:h100-sxm-8-xid79", "--node-name", "gpu-9", "--kubeconfig", str(kubeconfig),
                                 "--listen", "127.0.0.1:0", "--start-spread", "0", "--state-dir", str(state)],
                                cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=(tmp_path / "log").open("wb"))
        try:
            deadline = time.monotonic() + 60
            while not (_history_gpus(state) and _kept_bundles(state)) and time.monotonic() < deadline \
                    and proc.poll() is None:
                time.sleep(0.2)
            assert _history_gpus(state) and _kept_bundles(state), (tmp_path / "log").read_text()[-3000:]
        finally:
            stop_process(proc)
    result = subprocess.run([sys.executable, "-m", "detector.cli.main", "history", "--state-dir", str(state),
                             "--rma", "-o", "json"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    [gpu] = json.loads(result.stdout)["gpus"]
    board = load_scenario("h100-sxm-8-xid79").build("gpu-9").snapshot().gpus[3]
    assert (gpu["index"], gpu["serial"], gpu["uuid"]) == (3, board.serial, board.uuid)
    assert gpu["pci_bus_id"].lower().endswith("5d:00.0") and gpu["note"] is None
    assert "Xid79GpuFellOffBus" in {i["reason"] for i in gpu["incidents"]}
    assert [b["path"] for b in gpu["bundles"]] == [str(p.parent) for p in _kept_bundles(state)], result.stdout
    table = subprocess.run([sys.executable, "-m", "detector.cli.main", "history", "--state-dir", str(state),
                            "--rma"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert f"GPU 3  serial {board.serial}" in table.stdout, table.stdout