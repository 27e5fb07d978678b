"""The tour and the drills as a new user meets them (issue 34, item 3): where kubectl comes from, a local drill
kubectl can watch (`gpu-npd simulate --emulator --kubeconfig-out`) that says what it does while it runs and
what the fleet showed at the end, an example fleet whose faults land inside the run it is documented for, one
default state directory for run, history and clear (and bundle), and a demo whose story is not drowned."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

import pytest
import yaml

from detector.cli.daemon import ROOT_STATE_DIR, default_state_dir, node_state_dir
from detector.cli.demo import Watcher
from detector.cli.main import main
from detector.cli.simulate import progress_line, summary, timeline_line
from detector.sim.fleetfile import fleet_from_dict
from detector.sim.tally import FleetTally
from detector.sim.timeline import PlannedFault, plan_faults
from detector.agent.active import ConditionStatus
from fake_nvml.faults import Fault
from test_deploy_render import find_kubectl

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()
SIMULATION = (REPO / "docs" / "simulation.md").read_text()
DOCUMENTED_DRILL = "gpu-npd simulate --fleet fleet.yaml --emulator --kubeconfig-out drill.kubeconfig --duration 300"


def gpu_npd(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "detector.cli.main", *args], cwd=REPO, capture_output=True,
                          text=True, env=env, timeout=timeout)


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without proxies, KUBECONFIG or gpu-npd's own variables, plus `extra`."""
    env = {k: v for k, v in os.environ.items()
           if not k.lower().endswith("_proxy") and k != "KUBECONFIG" and not k.startswith("GPU_NPD_")}
    env.update(NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost", **extra)
    return env


# --- kubectl: where it comes from ---------------------------------------------------------------------------

def test_the_tour_says_where_kubectl_comes_from():
    tour = README.split("## A five-minute tour", 1)[1].split("### 1.", 1)[0]
    assert ".venv/tools" in tour and "make kubectl" in tour, tour
    assert "export PATH=$PWD/.venv/bin:$PWD/.venv/tools:$PATH" in tour
    assert "kubectl into .venv/tools" in README.split("## A five-minute tour", 1)[0]


def test_make_demo_and_make_test_install_kubectl():
    makefile = (REPO / "Makefile").read_text()
    targets = {m[1]: m[2] for m in re.finditer(r"^([a-z-]+):(.*)$", makefile, re.M)}
    assert "$(KUBECTL_STAMP)" in targets["demo"] and "$(KUBECTL_STAMP)" in targets["test"]
    assert re.search(r"^KUBECTL := \$\(VENV\)/tools/kubectl$", makefile, re.M)


def test_deploying_starts_from_building_and_pushing_the_image():
    """The first commands of docs/deploying.md build and push the image; the first apply comes after, naming it."""
    page = (REPO / "docs" / "deploying.md").read_text()
    commands = [line.split("#")[0].strip() for block in re.findall(r"```sh\n(.*?)```", page, re.S)
                for line in block.splitlines() if line.strip()]
    assert commands[:3] == ["docker build -t registry.example/gpu-npd:0.1.0 .",
                            "docker push registry.example/gpu-npd:0.1.0", "kubectl apply -k my-site"]
    first_section = page.split("\n## ", 2)[1]
    assert first_section.startswith("First: build and push the image")
    assert "newName: registry.example/gpu-npd" in first_section
    assert "--set image.repository=registry.example/gpu-npd" in " ".join(first_section.split())


# --- gpu-npd simulate: --kubeconfig-out, progress, summary --------------------------------------------------

def test_simulate_help_shows_kubeconfig_out_with_an_example():
    done = gpu_npd("simulate", "--help")
    assert done.returncode == 0
    assert "--kubeconfig-out FILE" in done.stdout
    assert re.search(r"^  gpu-npd simulate .*--emulator --kubeconfig-out kc\.yaml", done.stdout, re.M), done.stdout
    assert re.search(r"^  kubectl --kubeconfig kc\.yaml get nodes", done.stdout, re.M)
    assert "--progress-every S" in done.stdout


def test_kubeconfig_out_needs_the_emulator(tmp_path):
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text("version: 1\nnodes:\n  - {scenario: h100-sxm-8}\n")
    done = gpu_npd("simulate", "--fleet", str(fleet), "--kubeconfig-out", str(tmp_path / "kc"), env=clean_env())
    assert done.returncode == 2 and "--kubeconfig-out needs --emulator" in done.stderr
    assert not (tmp_path / "kc").exists()


class Drill:
    """`gpu-npd simulate --emulator --kubeconfig-out` as a person runs it; its stderr read line by line."""

    def __init__(self, tmp_path: Path, fleet: str, *args: str):
        (tmp_path / "fleet.yaml").write_text(fleet)
        self.kubeconfig = tmp_path / "drill.kubeconfig"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "detector.cli.main", "simulate", "--fleet", str(tmp_path / "fleet.yaml"),
             "--emulator", "--kubeconfig-out", str(self.kubeconfig), "--listen", "127.0.0.1:0",
             "--log-level", "warning", *args],
            cwd=REPO, stderr=subprocess.PIPE, text=True, env=clean_env(HOME=str(tmp_path)))
        self.lines: list[str] = []
        self._seen = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            with self._seen:
                self.lines.append(line.rstrip("\n"))
                self._seen.notify_all()
        with self._seen:
            self._seen.notify_all()

    def wait_for(self, pattern: str, timeout_s: float = 60) -> str:
        """The first line matching `pattern`; fails with everything said so far when none comes."""
        regex = re.compile(pattern)
        with self._seen:
            found = self._seen.wait_for(lambda: next((l for l in self.lines if regex.search(l)), None)
                                        or self.proc.poll() is not None, timeout_s)
            line = next((l for l in self.lines if regex.search(l)), None)
        assert line, f"no line /{pattern}/ (found {found!r}):\n" + "\n".join(self.lines)
        return line

    def stop(self) -> str:
        """SIGTERM, as Ctrl-C: the summary follows. Everything it said."""
        self.proc.terminate()
        assert self.proc.wait(30) == 0, "\n".join(self.lines)
        with self._seen:
            self._seen.wait_for(lambda: self.lines and self.lines[-1].lstrip().startswith("asking for"), 10)
            return "\n".join(self.lines)


SMALL_FLEET = """\
version: 1
nodes:
  - {scenario: h100-sxm-8, count: 3, name: "gpu-{index}"}
faults:
  - {at: 1, node: gpu-1, kind: xid, gpu: 3, code: 79}
  - {at: 1, node: gpu-2, kind: xid, gpu: 1, code: 79}
  - {at: 1, node: gpu-2, kind: xid, gpu: 2, code: 79}
"""


def test_a_local_drill_is_watched_with_kubectl_and_says_what_the_fleet_showed(tmp_path):
    kubectl = find_kubectl()
    if kubectl is None:
        pytest.skip("no kubectl: `make kubectl` (which `make test` and `make demo` run) installs it in .venv/tools")
    drill = Drill(tmp_path, SMALL_FLEET, "--duration", "600", "--start-spread", "0", "--progress-every", "1",
                  "--verify-sweeps", "1")
    try:
        said = drill.wait_for(r"kubeconfig for kubectl")
        assert str(drill.kubeconfig) in said and "get nodes" in said
        assert re.search(r"emulator at https://127\.0\.0\.1:\d+$", drill.wait_for(r"emulator at "))
        assert "3 of the 3 planned faults fall within --duration 10m00s, at 1s" in \
            drill.wait_for(r"planned faults fall within")
        # What a person sees with kubectl while the drill runs: the fleet's nodes, then their conditions.
        env = clean_env(HOME=str(tmp_path))
        listed = subprocess.run([kubectl, "--kubeconfig", str(drill.kubeconfig), "get", "nodes", "-o", "name"],
                                capture_output=True, text=True, env=env, timeout=60)
        assert listed.returncode == 0 and listed.stderr == "", listed.stderr
        assert listed.stdout.split() == ["node/gpu-0", "node/gpu-1", "node/gpu-2"]
        drill.wait_for(r": 3 of 3 nodes reporting; 3 faults injected \(xid 3\); conditions True: .*GpuXidError 2.*; "
                       r"1 node asking for remediation$")
        columns = subprocess.run([kubectl, "--kubeconfig", str(drill.kubeconfig), "get", "nodes", "-o",
                                  'custom-columns=NAME:.metadata.name,XID:.status.conditions[?(@.type=="GpuXidError")]'
                                  '.status'], capture_output=True, text=True, env=env, timeout=60)
        rows = dict(line.split() for line in columns.stdout.splitlines()[1:])
        assert rows["gpu-1"] == rows["gpu-2"] == "True", columns.stdout
        view = gpu_npd("fleet", "--kubeconfig", str(drill.kubeconfig), "-o", "json", env=env)
        assert view.returncode == 1, view.stderr
        assert {n["name"] for n in json.loads(view.stdout)["nodes"]} == {"gpu-1", "gpu-2"}
    finally:
        out = drill.stop()
    end = out.split("what the fleet showed:", 1)[1].splitlines()
    rows = {line.split(":", 1)[0].strip(): line.split(":", 1)[1].strip() for line in end if ":" in line}
    assert rows["nodes"] == "3, 3 of them reporting"
    assert rows["faults injected"] == "3: xid 3 (by source: scripted 3)"
    turned = dict(item.rsplit(" ", 1) for item in rows["conditions turned True"].split(", "))
    assert turned["GpuXidError"] == turned["GpuMissing"] == "2" and turned["GpuNodeNeedsRemediation"] == "1"
    assert rows["asking for remediation"] == "1 node at the end (gpu-2); 1 asked during the run"
    assert "ChecksPending" not in out and "Traceback" not in out


# --- what the lines say, from figures ------------------------------------------------------------------------

def statuses(**active: str) -> list[ConditionStatus]:
    return [ConditionStatus(t, True, reason, "") for t, reason in active.items()]


def test_the_tally_counts_turns_to_true_and_leaves_the_countdown_out():
    tally = FleetTally()
    tally.conditions("a", statuses(GpuNodeUnverified="ChecksPending"))
    tally.conditions("a", statuses(GpuXidError="Xid79GpuFellOffBus", GpuMissing="GpuFellOffBus"))
    tally.conditions("a", statuses(GpuXidError="Xid79GpuFellOffBus", GpuMissing="GpuFellOffBus"))   # no change
    tally.conditions("b", statuses(GpuXidError="Xid79GpuFellOffBus", GpuNodeNeedsRemediation="GpusFailed"))
    tally.conditions("b", [])                                                                       # cured
    tally.conditions("b", statuses(GpuXidError="Xid79GpuFellOffBus"))                              # again
    tally.conditions("c", statuses(GpuNodeNeedsRemediation="NodeWideProblem"))
    seen = tally.snapshot()
    assert seen.nodes_reporting == 3
    assert seen.turned_true == Counter(GpuXidError=3, GpuMissing=1, GpuNodeNeedsRemediation=2)
    assert seen.true_now == Counter(GpuXidError=2, GpuMissing=1, GpuNodeNeedsRemediation=1)
    assert seen.asking_now == ("c",) and seen.ever_asked == 2


def test_progress_and_summary_lines():
    tally = FleetTally()
    tally.conditions("gpu-7", statuses(GpuXidError="Xid79GpuFellOffBus", GpuNodeNeedsRemediation="GpusFailed"))
    records = [{"kind": "xid", "source": "scripted"}, {"kind": "pcie", "source": "correlated"},
               {"kind": "pcie", "source": "correlated"}]
    assert progress_line(125, 50, records, tally.snapshot()) == (
        "2m05s: 1 of 50 nodes reporting; 3 faults injected (pcie 2, xid 1); conditions True: "
        "GpuNodeNeedsRemediation 1, GpuXidError 1; 1 node asking for remediation")
    assert summary(300, 50, [], FleetTally().snapshot()).splitlines() == [
        "gpu-npd simulate: stopped after 5m00s; what the fleet showed:",
        "  nodes:                   50, 0 of them reporting",
        "  faults injected:         0",
        "  conditions turned True:  none",
        "  True at the end:         none",
        "  asking for remediation:  0 nodes at the end; 0 asked during the run"]


def test_the_start_says_which_planned_faults_the_run_will_see():
    planned = [PlannedFault(at, "n", Fault("xid", 0, {"code": 79}), "scripted") for at in (30, 120, 290, 400)]
    assert timeline_line(planned, 300) == ("3 of the 4 planned faults fall within --duration 5m00s, at 30s to "
                                           "4m50s; 1 of them in its last 1m00s, too late for the fleet to show much")
    assert timeline_line(planned[:2], 300) == "2 of the 2 planned faults fall within --duration 5m00s, at 30s to 2m00s"
    assert timeline_line(planned, None) == "4 faults planned, the first at 30s"
    assert timeline_line([], 300).startswith("the fleet file plans no faults")


# --- the example fleet fits the run it is documented for ----------------------------------------------------

def documented_fleet() -> dict:
    [block] = re.findall(r"The fleet file:\n\n```yaml\n(.*?)```", SIMULATION, re.S)
    return yaml.safe_load(block)


def test_the_documented_drill_runs_the_example_fleet_for_300_s():
    assert DOCUMENTED_DRILL in README and DOCUMENTED_DRILL in SIMULATION
    assert "`fleet.yaml` is the example fleet file in\n[docs/simulation.md]" in README


def test_the_example_fleets_faults_land_well_inside_its_documented_run():
    duration = float(re.search(r"--duration (\d+)", DOCUMENTED_DRILL)[1])
    planned = plan_faults(fleet_from_dict(documented_fleet()), 24 * 3600)
    assert planned, "the example fleet plans no faults"
    assert all(p.at_s <= duration - 60 for p in planned), [(p.at_s, p.node) for p in planned]
    kinds = Counter(p.source for p in planned)
    assert kinds["scripted"] == 1 and kinds["correlated"] == 64 and kinds["random"] >= 1, kinds
    randoms = [p.at_s for p in planned if p.source == "random"]
    assert all(150 <= t <= 240 for t in randoms), randoms       # as the page says
    assert "random XIDs between 2m30s and 4m" in " ".join(SIMULATION.split())


# --- one default state directory ----------------------------------------------------------------------------

def test_the_default_state_directory():
    assert default_state_dir({}, euid=0) == ROOT_STATE_DIR == Path("/var/lib/gpu-npd")
    assert default_state_dir({"HOME": "/home/ann"}, euid=1000) == Path("/home/ann/.local/state/gpu-npd")
    assert default_state_dir({"HOME": "/home/ann", "XDG_STATE_HOME": "/xdg"}, euid=1000) == Path("/xdg/gpu-npd")
    assert default_state_dir({"HOME": "/home/ann", "XDG_STATE_HOME": "rel"}, euid=1000) == \
        Path("/home/ann/.local/state/gpu-npd")                  # a relative XDG_STATE_HOME is ignored, as XDG says
    assert default_state_dir({"GPU_NPD_STATE_DIR": "/s", "HOME": "/home/ann"}, euid=0) == Path("/s")


def test_run_keeps_state_in_the_default_for_real_gpus_and_none_for_a_fake_node(tmp_path):
    assert node_state_dir("real", None, tmp_path) == tmp_path
    assert node_state_dir("real", tmp_path / "given", tmp_path) == tmp_path / "given"
    assert node_state_dir("fake:h100-sxm-8", None, tmp_path) is None
    assert node_state_dir("replay:x", None, tmp_path) is None
    assert node_state_dir("fake:h100-sxm-8", tmp_path / "given", tmp_path) == tmp_path / "given"


def parser_defaults(monkeypatch, env: dict[str, str]) -> dict[str, Path]:
    from detector.cli.main import build_parser

    for name in ("GPU_NPD_STATE_DIR", "XDG_STATE_HOME"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    parser = build_parser()
    history = parser.parse_args(["history"])
    return {"history": history.default_state_dir, "clear": parser.parse_args(["clear"]).state_dir}


def test_history_and_clear_look_where_run_keeps_it(monkeypatch, tmp_path):
    defaults = parser_defaults(monkeypatch, {"GPU_NPD_STATE_DIR": str(tmp_path / "s")})
    assert defaults == {"history": tmp_path / "s", "clear": tmp_path / "s"}
    defaults = parser_defaults(monkeypatch, {"XDG_STATE_HOME": str(tmp_path / "xdg")})
    assert set(defaults.values()) == {default_state_dir()} == {node_state_dir("real", None)}
    help_text = gpu_npd("run", "--help").stdout
    assert "~/.local/state/gpu-npd" in " ".join(help_text.split()).replace("- ", "-")


def test_history_with_nothing_recorded_says_so_and_exits_0(tmp_path):
    absent = tmp_path / "never-made"
    done = gpu_npd("history", env=clean_env(GPU_NPD_STATE_DIR=str(absent)))     # the default: nothing yet
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert done.stdout.startswith(f"no history recorded in {absent} yet: gpu-npd run keeps it there")
    assert not absent.exists()                                                 # history writes nothing
    done = gpu_npd("history", "--state-dir", str(tmp_path), env=clean_env())   # a directory without a history
    assert done.returncode == 0 and f"no history recorded in {tmp_path} yet" in done.stdout
    done = gpu_npd("history", "--state-dir", str(absent), env=clean_env())     # a directory named on purpose
    assert done.returncode == 2 and "no such directory" in done.stderr


def test_run_says_where_it_keeps_state_or_why_not(tmp_path, monkeypatch, caplog):
    """Without --state-dir a fake node keeps nothing and real GPUs keep it in the default, and the log says
    which; a default that cannot be made costs only the state (a warning), a --state-dir that cannot is an error."""
    import logging

    from detector.cli.daemon import _run_state_dir
    from detector.config import UsageError

    monkeypatch.setenv("GPU_NPD_STATE_DIR", str(tmp_path / "default"))
    with caplog.at_level(logging.INFO, logger="gpu_npd"):
        assert _run_state_dir("fake:h100-sxm-8", None) is None
        assert _run_state_dir("fake:h100-sxm-8", tmp_path / "kept") == tmp_path / "kept"
        assert _run_state_dir("real", None) == tmp_path / "default"
        (tmp_path / "file").write_text("")
        monkeypatch.setenv("GPU_NPD_STATE_DIR", str(tmp_path / "file" / "sub"))
        assert _run_state_dir("real", None) is None
    said = [r.getMessage() for r in caplog.records if r.name == "gpu_npd"]
    assert said[0].startswith("no state kept across restarts: a fake node keeps none unless given --state-dir")
    assert said[1] == f"state kept in {tmp_path / 'kept'}" and (tmp_path / "kept").is_dir()
    assert said[2] == f"state kept in {tmp_path / 'default'} (the default; gpu-npd history reads it)"
    assert said[3].startswith(f"cannot keep state in {tmp_path / 'file' / 'sub'} (") and "give --state-dir" in said[3]
    with pytest.raises(UsageError, match="--state-dir .*sub: "):
        _run_state_dir("real", tmp_path / "file" / "sub")


def test_bundle_reads_the_history_where_run_keeps_it(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    (state / "history.json").write_text(json.dumps({"version": 1, "boots": [], "gpus": []}))
    done = gpu_npd("bundle", "--nvml", "fake:h100-sxm-8", "--out", str(tmp_path / "b"), "-q",
                   env=clean_env(GPU_NPD_STATE_DIR=str(state)))
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "b" / "history.json").exists()


# --- the demo: the story, not the countdown ----------------------------------------------------------------

class FakeLocal:
    """What the demo's Watcher reads of a LocalDaemon: conditions and events, as set by the test."""

    def __init__(self) -> None:
        self.now: dict[str, dict] = {}
        self.events_now: list[dict] = []
        self.emulator = self

    def conditions(self) -> dict[str, dict]:
        return dict(self.now)

    def events(self) -> list[dict]:
        return list(self.events_now)

    def device_taint_rules(self) -> list[dict]:
        return []

    def set(self, type_: str, status: str, reason: str, message: str) -> None:
        self.now[type_] = {"status": status, "reason": reason, "message": message}

    def event(self, name: str, reason: str, message: str, count: int = 1) -> None:
        self.events_now = [e for e in self.events_now if e["metadata"]["name"] != name]
        self.events_now.append({"metadata": {"name": name}, "type": "Normal", "reason": reason,
                                "message": message, "count": count})


def watch_a_boot(verbose: bool, capsys) -> str:
    """A start, an XID, a reboot and a cure, as the demo's node shows them; what the Watcher printed."""
    local = FakeLocal()
    w = Watcher(local, verbose=verbose)
    local.set("Ready", "True", "KubeletReady", "kubelet is posting ready status")
    for pending in (10, 4, 1):
        local.set("GpuNodeUnverified", "True", "ChecksPending", f"gpu-npd: {pending} check(s) have not run")
        local.event("e1", "ChecksPending", f"{pending} check(s) have not run")
        w.look()
    local.set("GpuNodeUnverified", "False", "NoGpuNodeUnverified", "gpu-npd: no problem found")
    local.set("GpuNodeNeedsRemediation", "False", "NoGpuNodeNeedsRemediation", "gpu-npd: no problem found")
    local.event("e2", "NoGpuNodeUnverified", "GpuNodeUnverified cleared: no problem found")
    w.look()
    local.set("GpuXidError", "True", "Xid79GpuFellOffBus", "gpu-npd: GPU 3: XID 79")
    local.event("e3", "Xid79GpuFellOffBus", "GPU 3: XID 79")
    w.look()
    for rounds in (0, 1, 2):
        local.set("GpuXidError", "True", "Xid79GpuFellOffBus", f"gpu-npd: GPU 3: XID 79 [verifying: {rounds} of 3]")
        w.look()
    local.set("GpuXidError", "False", "NoGpuXidError", "gpu-npd: no problem found")
    local.event("e4", "NoGpuXidError", "GpuXidError cleared: no problem found")
    local.event("e5", "RecoveryVerified", "GpuXidError Xid79GpuFellOffBus on GPU 3 is over")
    w.look()
    return capsys.readouterr().out


def test_the_demo_watcher_tells_what_matters_and_v_tells_everything(capsys):
    quiet = watch_a_boot(False, capsys)
    told = [line.split("] ", 1)[1] for line in quiet.splitlines() if "] " in line]
    assert told == ["condition GpuXidError=True reason=Xid79GpuFellOffBus",
                    "condition GpuXidError=False reason=NoGpuXidError",
                    "event Normal RecoveryVerified (count 1): GpuXidError Xid79GpuFellOffBus on GPU 3 is over"], quiet
    everything = watch_a_boot(True, capsys)
    assert everything.count("reason=ChecksPending") == 3 and "event Normal ChecksPending" in everything
    assert "condition Ready=True" in everything and "GpuNodeNeedsRemediation=False" in everything
    assert everything.count("condition GpuXidError=True") == 4          # the first, then each verified round
    assert "GpuXidError cleared" in everything and "event Normal Xid79GpuFellOffBus" in everything
