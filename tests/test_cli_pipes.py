"""Every command behaves at a terminal and in a pipe (issue 34, item 1).

- Every example each subcommand's --help teaches (the two-space-indented lines of its epilog that run
  gpu-npd) runs as a real process, its output read as `| head -1` reads it: one line, then the pipe is
  closed and the process waited for. Whenever the pipe closes, there is no traceback and stderr holds only
  gpu-npd's own lines. What a test machine lacks is stood in for, each with its reason (ENVIRONMENT,
  SUBSTITUTES, STDIN): a fake node for the real NVML (no GPU here), the in-process API emulator for a
  cluster, temporary folders for /tmp and /var, a saved kernel log for journalctl. A subcommand whose
  --help has no examples yet is run with FALLBACK_EXAMPLES, and a test says which ones those are.
- A pipe closed before the first write ends a command quietly (141); a full disk (/dev/full) is one line
  on stderr and exit code 2; Ctrl-C while a check reads stdin exits 130, not in a Python abort.
- No `None`, `null` or Python repr in diagnose's table of any real machine's capture; `ok` in the checks
  line only for a check that found nothing; columns that follow their widest cell; the fleet's summary
  agrees with its rows.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import select
import shlex
import signal
import subprocess
import sys
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from detector.checks.node.history import HISTORY_FILE, GpuRecord, History, Incident
from detector.cli.fleet import render_fleet, summary_line
from detector.cli.main import main
from detector.cli.render import columns
from detector.cli.rma import render_rma, rma_report
from detector.daemon.local import REPO_DEPLOY
from detector.kube.annotations import UnhealthyGpu
from detector.kube.conditions import MARKER
from detector.kube.fleet_view import FleetNode, FleetView
from detector.kube.stamps import rfc3339
from kube_emulator import Emulator

REPO = Path(__file__).resolve().parent.parent
REAL_MACHINES = REPO / "tests" / "fixtures" / "real_machines"
FAKE_ALL_REDUCE_PERF = REPO / "tests" / "fixtures" / "nccl" / "fake_all_reduce_perf.py"
GPU_NPD = [sys.executable, "-m", "detector.cli.main"]
KUBECTL_PLUGIN = [sys.executable, "-c", "import sys; from detector.cli.fleet import kubectl_plugin; "
                                        "sys.exit(kubectl_plugin())"]
EXIT_PIPE_CLOSED = 141
FIRST_LINE_S = 120.0             # a one-shot example's first line (a sweep of every check takes a second or two)
READY_S = 60.0                   # a server's "http://" line
EXIT_S = 60.0                    # from the pipe closed (or the stop signal) to the exit

# Subcommands that serve until stopped: read as far as their ready line, then stopped with Ctrl-C (SIGINT).
SERVERS = {"run", "emulator", "simulate"}
# Subcommands whose --help has no examples yet; their files are another change's (the test below names them).
FALLBACK_EXAMPLES: dict[str, list[str]] = {}     # every subcommand's --help has examples of its own

KERNEL_LOG = (
    "Oct  6 17:59:20 gpu-node-7 kernel: Linux version 6.8.0-45-generic (buildd@lcy02-amd64-075)\n"
    "Oct  6 17:59:27 gpu-node-7 kernel: NVRM: Xid (PCI:0000:5d:00): 79, pid='<unknown>', name=<unknown>, "
    "GPU has fallen off the bus.\n")
MY_RULES = """version: 1
rules:
  - name: site-pcie-below-x16
    check: pcie
    when: current_width < 16
    type: GpuPcieDegraded
    reason: PcieLinkBelowX16
    severity: warning
    action: RESTART_BM
    message: "PCIe link trained at x{current_width}; this site's GPUs need x16"
"""
FLEET_FILE = """version: 1
nodes:
  - scenario: h100-sxm-8
    count: 2
    name: "{prefix}-{{index}}"
    labels: {{type: kwok}}
"""


@pytest.fixture(scope="module")
def cluster():
    """The API server the cluster examples reach (the project's emulator): gpu-17 with GPU 3 failed, as the
    daemon writes it, on rack-07, and a demo node."""
    with Emulator(rbac_paths=(REPO_DEPLOY,)) as emulator:
        now = time.time()
        condition = {"type": "GpuXidError", "status": "True", "reason": "Xid79GpuFellOffBus",
                     "message": MARKER + "GPU 3 (0000:5d:00.0): XID 79", "lastHeartbeatTime": rfc3339(now),
                     "lastTransitionTime": rfc3339(now - 60)}
        emulator.create_node("gpu-17", labels={"nvidia.com/gpu.present": "true", "gpu-npd.io/rack": "rack-07"},
                             capacity={"nvidia.com/gpu": "8"}, conditions=[condition])
        emulator.create_node("demo", labels={"nvidia.com/gpu.present": "true"})
        yield emulator


@dataclass
class Example:
    """An example line of a subcommand's --help, and how it runs here."""

    sub: str                       # the subcommand whose --help shows it
    line: str                      # as --help prints it
    argv: list[str] = field(default_factory=list)
    stdin: str | None = None       # what the example pipes into gpu-npd
    serves: bool = False           # runs until stopped
    skip: str = ""                 # why it is not run here

    @property
    def runs(self) -> str:
        """The subcommand the example runs (the kubectl plugin's one is fleet)."""
        if self.argv[:len(KUBECTL_PLUGIN)] == KUBECTL_PLUGIN:
            return "fleet"
        return next(iter(self.argv[len(GPU_NPD):]), "")


def help_text(*words: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        main([*words, "--help"])
    return out.getvalue()


def subcommands() -> list[str]:
    """The commands `gpu-npd --help` lists."""
    return re.findall(r"^    ([a-z][a-z-]*)", help_text(), re.M)


def example_lines(sub: str) -> list[str]:
    """The epilog's two-space-indented lines (after the options): the commands its --help teaches."""
    text = help_text(sub)
    start = text.find("\n\n", text.index("\noptions:"))
    epilog = text[start:] if start >= 0 else ""
    return [line[2:] for line in epilog.splitlines() if re.match(r"^  [^ -]", line)]


def all_examples() -> list[Example]:
    found = []
    for sub in subcommands():
        lines = example_lines(sub)
        found += [parse(sub, line) for line in (lines if any(_runs_gpu_npd(l) for l in lines)
                                                 else FALLBACK_EXAMPLES.get(sub, []))]
    return found


def _runs_gpu_npd(line: str) -> bool:
    return "gpu-npd" in shlex.split(line, comments=True)


# What the examples name that a test machine has not, and what stands in for it.
ENVIRONMENT = {
    "GPU_NPD_NVML": "fake:h100-sxm-8",        # --nvml's documented default: no GPU here, a fake node instead
    "GPU_NPD_LISTEN": "127.0.0.1:0",          # run's documented default: a free port, not 9808
    "NODE_NAME": "gpu-17",                    # as in the daemon's pod
}
STDIN = {"journalctl": KERNEL_LOG}            # the previous boot's kernel log: a saved one holding an XID 79


def substitutes(tmp: Path) -> dict[str, str]:
    """Paths of a real node and a support case, moved into the example's own folder."""
    return {
        "replay:/tmp/gpu-case-1234": f"replay:{REAL_MACHINES / 'h100-vm-580'}",  # a real capture for the bundle
        "/tmp/gpu-case-1234": str(tmp / "gpu-case-1234"),
        "/tmp/b": str(tmp / "b"),
        "/var/log/kern.log": str(tmp / "kern.log"),
        "/var/lib/gpu-npd": str(tmp / "state"),
        "/etc/gpu-npd/config.yaml": str(tmp / "config.yaml"),
        "/opt/nccl-tests/build/all_reduce_perf": str(FAKE_ALL_REDUCE_PERF),
        "~/.kube/config": str(tmp / "home" / ".kube" / "config"),
    }


def parse(sub: str, line: str) -> Example:
    """The example as this test runs it: its gpu-npd stage, what it pipes in, whether it serves."""
    example = Example(sub, line)
    tokens = shlex.split(line, comments=True)
    stages, stage = [], []
    for token in tokens:
        if token == "|":
            stages.append(stage)
            stage = []
        else:
            stage.append(token)
    stages.append(stage)
    ours = next((i for i, s in enumerate(stages) if "gpu-npd" in s), None)
    if ours is None:
        example.skip = f"runs {stages[0][0]}, not gpu-npd (a cluster's or the shell's command)"
        return example
    if ours > 0:                               # something piped in: a stand-in where the test has one
        producer = stages[ours - 1][0]
        if producer not in STDIN:
            example.skip = f"pipes in {producer}'s output, for which the test has no stand-in"
            return example
        example.stdin = STDIN[producer]
    words = stages[ours]
    if words[-1:] == ["&"]:                    # in the background: a server
        words = words[:-1]
    if ">" in words:                           # a redirect: the test's pipe is the output instead
        words = words[:words.index(">")]
    # The program: gpu-npd, `kubectl gpu-npd` (the plugin), or after `kubectl exec ... --` (the daemon's pod
    # is this machine here).
    start = next(i for i, word in enumerate(words) if word == "gpu-npd" and (i == 0 or words[i - 1] == "--"
                                                                           or words[:i] == ["kubectl"]))
    plugin = words[:start] == ["kubectl"]
    args = words[start + 1:]
    example.argv = [*(KUBECTL_PLUGIN if plugin else GPU_NPD), *args]
    example.serves = not plugin and bool(args) and args[0] in SERVERS
    if args[:1] == ["simulate"] and "--listen" not in args:
        example.argv += ["--listen", "127.0.0.1:0"]     # not 9809: other tests and drills use it
    if args[:1] == ["clear"] and "--wait" not in args:
        example.argv += ["--wait", "1"]     # no daemon runs here to answer: its 15 s default would add nothing
    return example


EXAMPLES = all_examples()


def prepare(tmp: Path, cluster: Emulator, example: Example) -> tuple[list[str], dict[str, str]]:
    """The example's folder (its files, a HOME of its own) and its command line and environment there."""
    home = tmp / "home"
    (home / ".kube").mkdir(parents=True)
    write_history(tmp / "state")
    (tmp / "kern.log").write_text(KERNEL_LOG)
    (tmp / "my-rules.yaml").write_text(MY_RULES)
    (tmp / "config.yaml").write_text("checks: {}\n")
    (tmp / "fleet.yaml").write_text(FLEET_FILE.format(prefix=f"sim-{zlib.crc32(example.line.encode())}"))
    for name in ("kc.yaml", "emulator.kubeconfig", "KC", "home/.kube/config"):
        cluster.write_kubeconfig(tmp / name, user="admin")
    subst = substitutes(tmp)
    argv = [subst.get(arg, arg) for arg in example.argv]
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy") and k != "PYTHONPATH"}
    env.update(ENVIRONMENT, HOME=str(home), KUBECONFIG=str(tmp / "kc.yaml"), GPU_NPD_STATE_DIR=str(tmp / "state"),
               NO_PROXY="127.0.0.1,localhost")
    return argv, env


def write_history(state: Path) -> None:
    """The GPU history `gpu-npd history --gpu 1654922006536` asks for: XID 48 on three boots this month."""
    state.mkdir()
    history = History(state / HISTORY_FILE, retention_s=90 * 86400.0)
    gpu = GpuRecord("1654922006536", "1654922006536", "GPU-13719f71-412c-d11e-b236-a262f5300003", "00000000:5D:00.0", 3)
    for n, days in enumerate((20, 10, 1)):
        history.note_incident(gpu, Incident(time.time() - days * 86400.0, f"boot-{n}-6f1c2e0a",
                                            "Xid48DoubleBitEccError", "RESET_GPU", "GPU 3: XID 48 (double-bit ECC)"))
    history.save()


def first_line(proc: subprocess.Popen, timeout_s: float, ready: Path | None = None) -> bytes:
    """What `head -1` reads: up to the first newline, or all there is if the process ends first; "" after
    `timeout_s`. With `ready` (a server's stderr file), also stop once it says where it listens."""
    fd, line, deadline = proc.stdout.fileno(), b"", time.monotonic() + timeout_s
    while time.monotonic() < deadline and b"\n" not in line:
        if ready is not None and b"http://" in ready.read_bytes():
            break
        readable, _, _ = select.select([fd], [], [], 0.2)
        if readable:
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            line += chunk
    return line.partition(b"\n")[0]


@dataclass
class Ended:
    code: int
    first: str
    stderr: str


def run_like_head(argv: list[str], env: dict[str, str], cwd: Path, stdin: str | None = None,
                  serves: bool = False) -> Ended:
    """`argv | head -1`: read one line, close the pipe, wait; a server is stopped with Ctrl-C once ready."""
    err = cwd / "stderr.txt"
    with err.open("wb") as stderr:              # a file: a server's log never fills a pipe nobody reads
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.PIPE if stdin is not None else
                                subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=stderr)
    try:
        if stdin is not None:
            proc.stdin.write(stdin.encode())
            proc.stdin.close()
        first = first_line(proc, READY_S if serves else FIRST_LINE_S, err if serves else None)
        proc.stdout.close()                     # head -1 is done
        if serves:
            proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=EXIT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return Ended(code, first.decode(errors="replace"), err.read_text(errors="replace"))


def assert_clean(stderr: str) -> None:
    """No traceback, no 'Exception ignored', nothing said of the closed pipe."""
    for noise in ("Traceback", "Exception ignored", "Fatal Python error", "Broken pipe", "BrokenPipeError"):
        assert noise not in stderr, stderr


# ---- every example of every --help, piped into head -1 -------------------------------------------------

@pytest.mark.parametrize("example", EXAMPLES, ids=[f"{e.sub}: {e.line}" for e in EXAMPLES])
def test_every_example_piped_into_head(example: Example, cluster, tmp_path):
    if example.skip:
        pytest.skip(example.skip)
    argv, env = prepare(tmp_path, cluster, example)
    ended = run_like_head(argv, env, tmp_path, example.stdin, example.serves)
    assert_clean(ended.stderr)
    if example.serves:                          # stopped by Ctrl-C: its log is its output, on stderr
        assert ended.code in (0, 130), (ended.code, ended.stderr)
        return
    # A one-shot command: something on stdout, and on stderr only its own lines (what it is doing, or one
    # error): never a usage error, which would say the example is wrong.
    assert ended.first.strip(), (ended.code, ended.stderr)
    assert ended.code in (0, 1, EXIT_PIPE_CLOSED), (ended.code, ended.first, ended.stderr)
    assert all(line.startswith("gpu-npd") for line in ended.stderr.splitlines()), ended.stderr


def test_every_subcommand_has_an_example_that_runs_it():
    """Each subcommand runs at least one of its own examples above (one from FALLBACK_EXAMPLES where its
    --help has none yet)."""
    exercised = {e.sub for e in EXAMPLES if not e.skip and e.runs == e.sub}
    assert not set(subcommands()) - exercised, set(subcommands()) - exercised


def test_only_the_subcommands_named_lack_examples_in_their_help():
    """The project expects a --help that teaches: a subcommand without examples must be named in
    FALLBACK_EXAMPLES (their files are other changes'), and one that gained them may leave it."""
    untaught = {sub for sub in subcommands() if not any(_runs_gpu_npd(line) for line in example_lines(sub))}
    assert untaught <= set(FALLBACK_EXAMPLES), untaught - set(FALLBACK_EXAMPLES)


# ---- a closed pipe, a full disk, Ctrl-C -----------------------------------------------------------------

ONE_SHOT = [["checks"], ["scenarios"], ["scenarios", "--faults"], ["--help"], ["diagnose", "--help"],
            ["diagnose", "--nvml", "fake:h100-sxm-8-xid79"],
            ["diagnose", "--nvml", "fake:h100-sxm-8-xid79", "-o", "json"]]


@pytest.mark.parametrize("args", ONE_SHOT, ids=" ".join)
def test_a_pipe_closed_before_the_first_write_ends_quietly(args):
    """As `gpu-npd checks | head -0`: no traceback, nothing said, exit 141 as a tool SIGPIPE ended."""
    read, write = os.pipe()
    os.close(read)
    try:
        proc = subprocess.run([*GPU_NPD, *args], cwd=REPO, stdout=write, stderr=subprocess.PIPE, text=True,
                              timeout=120)
    finally:
        os.close(write)
    assert proc.returncode == EXIT_PIPE_CLOSED, proc.stderr
    assert_clean(proc.stderr)
    assert all(line.startswith("gpu-npd: rules: ") for line in proc.stderr.splitlines()), proc.stderr


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full here")
@pytest.mark.parametrize("args", ONE_SHOT, ids=" ".join)
def test_a_full_disk_is_one_line_and_exit_2(args):
    with open("/dev/full", "w") as full:
        proc = subprocess.run([*GPU_NPD, *args], cwd=REPO, stdout=full, stderr=subprocess.PIPE, text=True,
                              timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines()[-1] == "gpu-npd: error: cannot write output: No space left on device"
    assert all(line.startswith("gpu-npd: rules: ") for line in proc.stderr.splitlines()[:-1]), proc.stderr


def test_ctrl_c_while_a_check_reads_stdin_exits_130_without_an_abort():
    """`journalctl -k | gpu-npd diagnose --kernel-log -` while journalctl has not finished: the xid check's
    thread is blocked reading stdin when Ctrl-C comes, and Python must not abort closing stdin at exit."""
    proc = subprocess.Popen([*GPU_NPD, "diagnose", "--checks", "xid", "--kernel-log", "-"], cwd=REPO,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        proc.stdin.write(KERNEL_LOG)
        proc.stdin.flush()                      # and no end of file: the reader waits for more
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not _reading_stdin(proc.pid):
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130 and out == "", (proc.returncode, err)
    assert_clean(err)


def _reading_stdin(pid: int) -> bool:
    """A thread of `pid` is blocked in read(2) on fd 0 (Linux: /proc/PID/task/TID/syscall, read is 0)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            if (task / "syscall").read_text().split()[:2] == ["0", "0x0"]:
                return True
    return False


# ---- human output: no None, ok means healthy, columns follow their content -------------------------------

@pytest.mark.parametrize("machine", sorted(p.name for p in REAL_MACHINES.iterdir() if p.is_dir()))
def test_no_none_null_or_repr_in_the_table_of_a_real_machine(machine, capsys):
    main(["diagnose", "--nvml", f"replay:{REAL_MACHINES / machine}", "-q"])
    table = capsys.readouterr().out
    found = re.findall(r".*(?:\bNone\b|\bnull\b|\{'|\['|<\w[\w.]* object at 0x).*", table)
    assert not found, "\n".join(found)


def test_the_checks_line_says_ok_only_for_a_check_that_found_nothing(capsys):
    assert main(["diagnose", "--nvml", "fake:h100-sxm-8-xid79", "-q"]) == 1
    checks = _checks_line(capsys.readouterr().out)
    assert re.search(r"\bxid found 1 problem \(\d+ ms\)", checks) and "xid ok" not in checks, checks
    assert re.search(r"\bvisibility found 1 problem \(\d+ ms\)", checks), checks
    assert re.search(r"\bpcie ok \(\d+ ms\)", checks), checks
    assert main(["diagnose", "--nvml", "fake:h100-sxm-8", "-q"]) == 0
    healthy = _checks_line(capsys.readouterr().out)
    assert "found" not in healthy and re.search(r"\bxid ok \(\d+ ms\)", healthy), healthy


def _checks_line(table: str) -> str:
    return next(line for line in table.splitlines() if line.startswith("checks: "))


def test_columns_follow_their_widest_cell():
    rows = [("NAME", "DESCRIPTION"), ("a-very-long-scenario-name-" * 3, "x"), ("b", "y")]
    lines = columns(rows)
    assert len({line.index(cell) for line, (_, cell) in zip(lines, rows)}) == 1, lines


def test_scenarios_keep_their_columns(capsys):
    assert main(["scenarios"]) == 0
    lines = capsys.readouterr().out.splitlines()
    starts = {len(line) - len(line.split(None, 1)[1]) for line in lines}
    assert len(starts) == 1 and min(len(line.split()[0]) for line in lines) + 2 <= starts.pop(), lines[:3]


def test_the_fleet_table_keeps_its_columns_for_a_long_node_name():
    view = _view(_node("gpu-" + "x" * 60, gpus=8, failed=[3]), _node("g", gpus=8, failed=[1]))
    lines = render_fleet(view).splitlines()
    header, rows = lines[0], lines[1:-1]
    assert all(row.index("failed") == header.index("STATE") for row in rows), lines


def test_the_rma_report_keeps_its_columns_for_a_long_action_or_reason():
    gpu = GpuRecord("1654922006536", "1654922006536", "GPU-1", "00000000:5D:00.0", 3, incidents=[
        Incident(1_700_000_000.0, "boot-a", "Xid79GpuFellOffBus", "RESTART_BM", "GPU 3 fell off the bus"),
        Incident(1_700_086_400.0, "boot-b", "NvlinkFabricRegistrationFailedWithAVeryLongReason",
                 "CHECK_MECHANICALS", "GPU 3 again")])
    report = rma_report([gpu], [], node="gpu-17", now=1_700_100_000.0, version="test", state_dir=Path("/state"),
                        flaky_boots=3, flaky_window_s=30 * 86400.0, notes=[])
    lines = render_rma(report, "30d").splitlines()
    header = next(line for line in lines if "WHEN (UTC)" in line)
    rows = [line for line in lines if "boot-" in line]
    assert len(rows) == 2 and all(row.index("boot-") == header.index("BOOT") for row in rows), lines
    assert all(row.index("GPU 3") == header.index("MESSAGE") for row in rows), lines


# ---- the fleet's summary agrees with its rows -----------------------------------------------------------

def test_a_node_that_does_not_say_how_many_gpus_is_not_counted_as_0():
    """The README's tour: the emulator's gpu-17 (no device plugin, so no nvidia.com/gpu capacity) with
    GPU 3 failed was `1 GPU node, 0 GPUs, 1 failed`."""
    tour = _view(_node("gpu-17", gpus=None, failed=[3]))
    assert summary_line(tour) == ("1 node to look at: 1 GPU node, GPU count unknown, 1 failed, 0 degraded, "
                                  "0 not reporting")
    assert tour.summary()["gpus"] == 0 and tour.summary()["nodesWithoutGpuCount"] == 1
    mixed = _view(_node("gpu-17", gpus=None, failed=[3]), _node("gpu-18", gpus=8, failed=[]))
    assert summary_line(mixed).endswith(": 2 GPU nodes, 8+ GPUs (1 node without a GPU count), 1 failed, "
                                        "0 degraded, 0 not reporting")
    counted = _view(_node("gpu-18", gpus=8, failed=[]), _node("gpu-19", gpus=4, failed=[]))
    assert summary_line(counted) == "nothing is wrong: 2 GPU nodes, 12 GPUs, 0 failed, 0 degraded, 0 not reporting"


def _node(name: str, gpus: int | None, failed: list[int]) -> FleetNode:
    unhealthy = tuple(UnhealthyGpu(index=i, pci_bus_id=f"0000:{i:02x}:00.0", uuid=f"GPU-{i}", serial=None,
                                   state="failed", action="RESTART_BM", since=None) for i in failed)
    return FleetNode(name=name, ready="True", unschedulable=False, taints=(), gpus=gpus, unhealthy=unhealthy,
                     conditions=(), last_heartbeat=rfc3339(time.time()), reporting=True)


def _view(*nodes: FleetNode) -> FleetView:
    view = FleetView()
    for node in nodes:
        view.add(node, keep_all=False)
    return view
