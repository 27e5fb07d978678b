"""`gpu-npd demo` (what `make demo` runs) tells the story it promises: one failed GPU of eight is fenced by a
device taint without asking for a reboot, two failed GPUs ask for the node, and a problem that comes back
after each of three reboots turns into GpuRemediationLoop, which stops the node asking for remediation."""

from __future__ import annotations

from detector.cli.main import main


def test_demo_fences_one_gpu_and_ends_a_remediation_loop(capsys):
    assert main(["demo", "--fault-after", "0.5", "--timeout", "30"]) == 0
    out = capsys.readouterr().out
    fenced = next(line for line in out.splitlines() if "one device taint visible" in line)
    assert "GpuNodeNeedsRemediation=False" in fenced
    assert "DeviceTaintRule gpu-npd-demo-node-gpu-3: gpu-npd.io/gpu-unhealthy=failed:NoExecute on gpu.nvidia.com " \
           "demo-node/gpu-3" in out
    assert "DeviceTaintRule gpu-npd-demo-node-gpu-3 deleted" in out
    assert "condition GpuNodeNeedsRemediation=True reason=GpusFailed" in out          # GPUs 5 and 6
    assert "condition GpuNodeNeedsRemediation=True reason=NodeWideProblem" in out     # nvidia_uvm
    assert out.count(">>> remediator: reboot") == 4
    assert "condition GpuRemediationLoop=True reason=RemediationLoop" in out
    assert "GpuDriverUnhealthy DriverModulesMissing came back after each of 3 reboots within 24h" in out
    assert "kubelet's own conditions, never touched by gpu-npd: DiskPressure=False, MemoryPressure=False, " \
           "PIDPressure=False, Ready=True" in out
    assert out.rstrip().endswith("demo finished")
    # The story, not drowned: its 8 steps, and none of the readiness countdown or the first False of each
    # condition (gpu-npd demo -v prints those; tests/test_tour.py has the Watcher's two modes).
    assert out.count(">>> ") == 8
    assert "ChecksPending" not in out and "NoGpuNodeUnverified" not in out
    assert "reason=NoGpuXidError" in out                      # a cure is told ...
    assert out.count("condition GpuXidError=False") == 2      # ... once per cure, never the first False
    assert "RecoveryVerified" in out
    assert len(out.splitlines()) < 100, out
