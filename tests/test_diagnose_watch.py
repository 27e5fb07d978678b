"""`gpu-npd diagnose --duration`: a watch of the node that judges windows and counter rates as the daemon
does, on the fake node's simulated time (so two minutes pass in a moment), and the one-sweep diagnose that
says it judged totals."""

from __future__ import annotations

import json

import pytest

from conftest import Clock
from detector.agent.oneshot import diagnose_over
from detector.cli.main import main
from detector.core.check import Check, CheckOutput
from detector.core.sweep import SweepContext
from detector.core.types import Observation
from detector.rules.sources import load_ruleset
from fake_nvml.host import fake_host
from fake_nvml.scenario import load_scenario

# Issue 31's acceptance: the GPU each scenario's problem must name after a two-minute watch.
NAMED_AFTER_WATCH = {
    "h100-sxm-8-nvlink-replay": 3,
    "h100-sxm-8-hw-slowdown": 2,
    "h100-sxm-8-slow-gpu": 5,
    "h100-sxm-8-nvlink-recovering": 3,
    "h100-sxm-8-pcie-replays": 2,
    "h100-sxm-8-sbe-storm": 6,
    "h100-sxm-8-nvml-slow": 7,
    "h100-sxm-8-init-failed": 4,
    "h100-sxm-8-gsp-timeout": 1,
    "h100-sxm-8-aer": 0,
}
ONLY_A_WATCH_SEES = ["h100-sxm-8-nvlink-replay", "h100-sxm-8-hw-slowdown", "h100-sxm-8-pcie-replays",
                     "h100-sxm-8-sbe-storm"]   # rates and shares of a window
HEALTHY_OVER_WATCH = ["h100-sxm-8", "h100-sxm-8-power-capped", "h100-sxm-8-ecc-corrected", "h100-sxm-8-throttle-blip"]


def watch_json(capsys, scenario: str, *extra: str) -> tuple[int, dict]:
    code = main(["diagnose", "--nvml", f"fake:{scenario}", "--duration", "120", "-q", "-o", "json", *extra])
    return code, json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("scenario", ONLY_A_WATCH_SEES)
def test_one_sweep_cannot_see_a_rate(capsys, scenario):
    assert main(["diagnose", "--nvml", f"fake:{scenario}", "-q", "-o", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["watch"] is None


@pytest.mark.parametrize("scenario,gpu", sorted(NAMED_AFTER_WATCH.items()))
def test_a_two_minute_watch_names_the_gpu(capsys, scenario, gpu):
    code, out = watch_json(capsys, scenario)
    assert code == 1
    details = [g for p in out["problems"] for g in p["gpu_details"]]
    assert gpu in {g["index"] for g in details}, out["problems"]
    # Every problem is about that GPU: a GPU NVML does not enumerate has no NVML index, so the visibility
    # check names it by bus id alone (the xid check's driver line numbers it by PCI bus order, and says so).
    assert {g["pci_bus_id"] for g in details} == {load_scenario(scenario).pci_bus_ids[gpu]}, out["problems"]
    assert out["watch"] == {"duration_s": 120.0, "watched_s": 120.0, "sweeps": out["watch"]["sweeps"],
                            "time": "simulated", "interrupted": False}
    assert out["watch"]["sweeps"] >= 9          # the 15 s thermal interval over 120 s, both ends included


@pytest.mark.parametrize("scenario", HEALTHY_OVER_WATCH)
def test_look_alikes_stay_healthy_over_the_watch(capsys, scenario):
    code, out = watch_json(capsys, scenario)
    assert (code, out["problems"]) == (0, [])


def test_the_table_says_what_was_watched_and_a_single_sweep_says_it_judged_totals(capsys):
    assert main(["diagnose", "--nvml", "fake:h100-sxm-8-nvlink-replay", "--duration", "120", "-q"]) == 1
    table = capsys.readouterr().out
    assert "watched 120 of 120 s (simulated time)" in table and "NvlinkReplay" in table
    assert main(["diagnose", "--nvml", "fake:h100-sxm-8", "-q"]) == 0
    assert "one sweep: counters are judged as totals since the driver loaded" in capsys.readouterr().out


@pytest.mark.parametrize("duration", ["0", "-5", "90000", "nan"])
def test_a_duration_out_of_range_is_a_usage_error(capsys, duration):
    assert main(["diagnose", "--nvml", "fake:h100-sxm-8", "--duration", duration, "-q"]) == 2
    assert "--duration must be more than 0 and at most 86400 seconds" in capsys.readouterr().err


def test_a_saved_log_cannot_be_watched(capsys, tmp_path):
    log = tmp_path / "kern.log"
    log.write_text("")
    assert main(["diagnose", "--kernel-log", str(log), "--duration", "60", "-q"]) == 2
    assert "a saved kernel log or a replayed capture does not change" in capsys.readouterr().err


class Counting(Check):
    """Records the host-clock time of each of its runs."""

    name = "counting"
    description = "test"
    fields = {"runs": "runs so far"}
    default_interval_s = 60.0

    def __init__(self, config=None, clock=None, interval: float = 60.0):
        super().__init__({"interval": interval} | (config or {}), clock or (lambda: 0.0))
        self.times: list[float] = []

    def run(self, ctx: SweepContext) -> CheckOutput:
        self.times.append(self._clock())
        return CheckOutput([Observation(self.name, {"runs": len(self.times)})])


def _host_on(clock: Clock, sleeps: list[float] | None = None, interrupt_after: int | None = None):
    host = fake_host(load_scenario("h100-sxm-8").build(clock=clock), threaded=False)

    def sleep(seconds: float) -> None:
        if interrupt_after is not None and len(sleeps) >= interrupt_after:
            raise KeyboardInterrupt
        sleeps.append(seconds)
        clock.now += seconds
    host.clock, host.sleep = clock, sleep
    return host


def test_each_check_runs_on_its_own_interval_first_at_the_start_and_last_at_the_end(registry):
    clock, sleeps = Clock(1000.0), []
    fast, slow = Counting(clock=clock, interval=15.0), Counting(clock=clock, interval=60.0)
    slow.name = "slow"
    host = _host_on(clock, sleeps)
    sweep, problems, watch = diagnose_over(host, [fast, slow], load_ruleset(None, registry), 100.0)
    host.close()
    assert [t - 1000.0 for t in fast.times] == [0, 15, 30, 45, 60, 75, 90, 100]
    assert [t - 1000.0 for t in slow.times] == [0, 60, 100]
    assert (watch.watched_s, watch.sweeps, watch.interrupted) == (100.0, 8, False)
    assert [r.name for r in sweep.runs] == ["counting", "slow"]
    assert sweep.runs[0].observations[0].fields["runs"] == 8


def test_ctrl_c_ends_the_watch_early_and_judges_what_was_seen(registry):
    clock, sleeps = Clock(0.0), []
    check = Counting(clock=clock, interval=15.0)
    host = _host_on(clock, sleeps, interrupt_after=2)
    sweep, problems, watch = diagnose_over(host, [check], load_ruleset(None, registry), 600.0)
    host.close()
    assert (watch.interrupted, watch.sweeps, watch.watched_s) == (True, 3, 30.0)
    assert sweep.runs[0].observations[0].fields["runs"] == 3


def test_without_its_package_metadata_gpu_npd_says_how_to_install_in_one_line(monkeypatch, capsys):
    """A checkout run with PYTHONPATH alone (no entry points): one line and exit 2, never a traceback."""
    monkeypatch.setattr("detector.core.check.entry_points", lambda group: [])
    assert main(["diagnose", "--nvml", "fake:h100-sxm-8", "-q"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "gpu-npd: error: no checks registered" in err and "make install" in err
