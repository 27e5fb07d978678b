"""The xid check as a consumer of typed driver events (issue 31): live on the fake node (kmsg), over many
sweeps, and on saved logs; the fake node's driver-line faults and scenarios."""

from __future__ import annotations

from conftest import diagnose_host, diagnose_scenario, node_for
from detector.backends.pci import SysfsPciBus
from detector.checks.xid import XidCheck
from detector.core.sweep import run_sweep
from fake_nvml.driver_lines import upstream_port
from fake_nvml.faults import Fault
from fake_nvml.host import fake_host
from fake_nvml.pci import write_sysfs


def line(message: str) -> Fault:
    return Fault("kernel_line", None, {"message": message})


def observations(node, check=None):
    check = check or XidCheck()
    return [o for o in run_sweep(fake_host(node), [check]).runs[0].observations]


# --- scenarios: each names its GPU with exit 1; the look-alikes stay quiet -------------------------------

def test_init_failed_names_gpu_4_by_pci_order_and_says_so(registry):
    out = diagnose_scenario("h100-sxm-8-init-failed", registry)
    problem = out.by_rule()["gpu-init-failed"]
    [gpu] = problem.gpus
    assert (gpu.index, gpu.pci_bus_id) == (4, node_for("h100-sxm-8").snapshot().gpus[4].pci_bus_id)
    assert problem.severity.value == "critical" and problem.action == "RESTART_BM"
    assert "PCI bus order (NVML does not enumerate it)" in problem.message and "reboots" in problem.message
    assert "gpu-not-visible-to-nvml" in out.rules()


def test_gsp_timeout_is_one_incident_with_its_xid_119_on_gpu_1(registry):
    out = diagnose_scenario("h100-sxm-8-gsp-timeout", registry)
    assert out.rules() == {"xid-119"}                  # the heartbeat lines joined the XID, no second problem
    [gpu] = out.by_rule()["xid-119"].gpus
    assert gpu.index == 1 and out.by_rule()["xid-119"].action == "RESET_GPU"
    run = next(r for r in out.sweep.runs if r.name == "xid")
    [gsp] = [o for o in run.observations if o.fields["kind"] == "gsp_timeout"]
    assert (gsp.fields["follows"], gsp.fields["incidents"], gsp.gpu.index) == (119, 0, 1)


def test_gsp_timeout_without_an_xid_is_critical_reset_gpu(registry):
    node = node_for("h100-sxm-8")
    node.inject(Fault("gsp_timeout", 2, {"xid": False}))
    out = diagnose_host(fake_host(node), registry, checks=["xid"])
    problem = out.by_rule()["gpu-gsp-timeout"]
    assert problem.severity.value == "critical" and problem.action == "RESET_GPU"


def test_aer_corrected_burst_is_a_warning_then_the_uncorrected_one_critical(registry):
    node = node_for("h100-sxm-8")
    node.inject(Fault("pcie_aer", 0, {"severity": "corrected", "count": 12}))
    out = diagnose_host(fake_host(node), registry, checks=["xid"])
    assert out.rules() == {"gpu-pcie-aer-corrected-rate"}
    [gpu] = out.problems[0].gpus
    assert gpu.index == 0 and "12 corrected PCIe errors" in out.problems[0].message
    node.inject(Fault("pcie_aer", 0, {"severity": "uncorrected"}))
    out = diagnose_host(fake_host(node), registry, checks=["xid"])
    assert "gpu-pcie-aer-uncorrected" in out.rules()


def test_a_few_corrected_errors_are_recorded_not_warned(registry):
    node = node_for("h100-sxm-8")
    node.inject(Fault("pcie_aer", 5, {"severity": "corrected", "count": 3}))
    out = diagnose_host(fake_host(node), registry, checks=["xid"])
    assert out.rules() == {"gpu-pcie-aer-corrected"} and out.problems[0].severity.value == "info"


def test_a_port_line_alone_is_tied_to_the_gpu_below_through_sysfs(registry):
    """Live, the port's own report (no endpoint line) is the GPU's: the PCI bus says the port is above it."""
    node = node_for("h100-sxm-8")
    gpu = node.snapshot().gpus[6]
    port = upstream_port(gpu)
    node.inject(line(f"pcieport {port}: AER: Uncorrectable (Fatal) error message received from {port}"))
    node.inject(line(f"pcieport {port}: PCIe Bus Error: severity=Uncorrectable (Fatal), type=Transaction Layer, "
                     "(Receiver ID)"))
    node.inject(line(f"pcieport {port}:    [ 5] SDES                   (First)"))
    out = diagnose_host(fake_host(node), registry, checks=["xid"])
    problem = out.by_rule()["gpu-pcie-aer-fatal"]
    assert [g.index for g in problem.gpus] == [6] and port in problem.message


def test_a_port_above_no_gpu_is_not_a_gpu_problem(registry):
    node = node_for("h100-sxm-8")
    node.inject(line("pcieport 0000:00:1c.4: AER: Multiple Corrected error received: 0000:00:1c.4"))
    node.inject(line("pcieport 0000:00:1c.4: PCIe Bus Error: severity=Uncorrected (Fatal), type=Physical Layer"))
    node.inject(line("iwlwifi 0000:02:00.0: AER: can't recover (no error_detected callback)"))
    out = diagnose_host(fake_host(node), registry, checks=["xid"])
    assert out.problems == []


def test_peermem_failure_is_a_node_level_warning(registry):
    node = node_for("h100-sxm-8")
    node.inject(Fault("peermem_failed", None, {}))
    out = diagnose_host(fake_host(node), registry, checks=["xid"])
    problem = out.by_rule()["nvidia-peermem-load-failed"]
    assert problem.severity.value == "warning" and problem.gpus == () and "GPUDirect RDMA" in problem.message


def test_assertions_are_info_and_a_warning_when_they_recur(registry, tmp_path):
    log = tmp_path / "kern.log"
    log.write_text("".join(f"Oct  {d} 10:00:00 node kernel: NVRM: GPU 0000:18:00.0: nvAssertFailedNoLog: Assertion "
                           f"failed: 0 @ rs_server.c:259\n" for d in (1, 4, 5, 5)).replace("Oct  5 10:00:00 node",
                                                                                         "Oct  5 11:00:00 node", 1))
    out = diagnose_host(fake_host(node_for("h100-sxm-8")), registry, checks=["xid"],
                        settings={"xid": {"kernel_log_file": str(log)}})
    assert out.rules() == {"gpu-driver-assertion"}             # Oct 1, 4, 5 and 5: at most 2 within 24 h
    log.write_text(log.read_text() + "Oct  5 12:00:00 node kernel: NVRM: GPU 0000:18:00.0: nvAssertFailed: "
                                     "Assertion failed: 0 @ g_kern_gmmu_nvoc.h:1967\n")
    out = diagnose_host(fake_host(node_for("h100-sxm-8")), registry, checks=["xid"],
                        settings={"xid": {"kernel_log_file": str(log)}})
    assert out.rules() == {"gpu-driver-assertion", "gpu-driver-assertion-recurring"}


def test_xid_count_over_the_window_is_a_warning(registry, tmp_path):
    """10 XID 119 incidents in an hour on one GPU (each a minute and more apart): the rate rule names it;
    5 in 5 hours do not."""
    def log(n: int, step_min: int) -> str:
        return "".join(f"Oct  6 {10 + (i * step_min) // 60:02d}:{(i * step_min) % 60:02d}:00 node kernel: NVRM: Xid "
                       f"(PCI:0000:2a:00): 119, pid='<unknown>', name=<unknown>, Timeout after 6s\n" for i in range(n))
    path = tmp_path / "kern.log"
    path.write_text(log(10, 5))
    out = diagnose_host(fake_host(node_for("h100-sxm-8")), registry, checks=["xid"],
                        settings={"xid": {"kernel_log_file": str(path)}})
    assert "xid-rate" in out.rules() and [g.index for g in out.by_rule()["xid-rate"].gpus] == [1]
    path.write_text(log(5, 60))
    out = diagnose_host(fake_host(node_for("h100-sxm-8")), registry, checks=["xid"],
                        settings={"xid": {"kernel_log_file": str(path)}})
    assert "xid-rate" not in out.rules()


def test_corrected_aer_reports_spread_out_stay_below_the_rate(registry, tmp_path):
    """12 corrected reports, one every 10 s: 6 within any minute, below DCGM's 8 a minute; every 2 s: above."""
    def log(step_s: int) -> str:
        out = []
        for i in range(12):
            t = f"Oct  6 10:{(i * step_s) // 60:02d}:{(i * step_s) % 60:02d} node kernel: "
            out += [t + "pcieport 0000:17:00.0: AER: Correctable error message received from 0000:18:00.0",
                    t + "nvidia 0000:18:00.0: PCIe Bus Error: severity=Correctable, type=Data Link Layer, (Receiver ID)",
                    t + "nvidia 0000:18:00.0:   device [10de:2330] error status/mask=00000080/0000e000"]
        return "\n".join(out) + "\n"
    path = tmp_path / "kern.log"
    for step, rule in ((10, "gpu-pcie-aer-corrected"), (2, "gpu-pcie-aer-corrected-rate")):
        path.write_text(log(step))
        out = diagnose_host(fake_host(node_for("h100-sxm-8")), registry, checks=["xid"],
                            settings={"xid": {"kernel_log_file": str(path)}})
        assert rule in out.rules(), (step, out.rules())
        assert all(g.index == 0 for p in out.problems for g in p.gpus)
    assert "gpu-pcie-aer-corrected-rate" not in diagnose_host(
        fake_host(node_for("h100-sxm-8")), registry, checks=["xid"],
        settings={"xid": {"kernel_log_file": str(path), "aer_window_s": 10.0}}).rules()


def test_sysfs_says_which_ports_are_above_a_gpu(tmp_path):
    state = node_for("h100-sxm-8").snapshot()
    write_sysfs(state, tmp_path)
    gpus = {d.bus_id: d for d in SysfsPciBus(tmp_path).devices()}
    for g in state.gpus:
        assert gpus[g.pci_bus_id].upstream == (upstream_port(g),)


def test_look_alike_scenarios_stay_quiet(registry):
    for name in ("h100-sxm-8", "h100-sxm-8-power-capped", "h100-sxm-8-ecc-corrected", "h100-sxm-8-throttle-blip"):
        assert diagnose_scenario(name, registry, checks=["xid"]).problems == [], name
