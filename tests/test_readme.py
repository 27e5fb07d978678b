"""Documentation truth: every shell command in README.md and in each docs/*.md page runs as written on a fresh
clone, or is excluded here with a reason; the check-settings table (docs/checks.md) and the table of what each
condition asks of whom (docs/remediation.md) are the code's; the emulator's packaged RBAC is deploy/'s.

How the pages (README.md, then docs/*.md) are read, each the same way:

- Commands come from fenced ```sh, ```bash, ```shell and ```console blocks. In a block where some line
  starts with a `$ ` prompt, only those lines are commands (the rest is their output); otherwise every
  line is one. A `#` outside quotes starts a comment (a line that is only a comment is skipped); a line
  ending in `\\` continues on the next.
- Each command is EXCLUDED (a pattern with the reason: it needs a GPU, a cluster or a container build,
  or it is what CI runs), or it is run. A command whose programs are neither in RUNNABLE_PROGRAMS nor
  stubbed (STUBS) and that no exclusion names fails the test, so a new command cannot be skipped silently.
- Every command of a block runs in order in one throw-away copy of the repository (tracked and untracked
  files, `.venv` linked), with a temporary HOME and TMPDIR, the project's venv first on PATH, no proxy and
  no KUBECONFIG, each with a timeout. It must exit 0 unless RUN says otherwise, citing the page.
  Long-running commands run in the background until their ready line, serve the block's later commands,
  and are stopped with SIGTERM at the end of the block (exit code checked too).
- Files a reader brings (FILES: the fleet file and the rule file shown in the docs, saved kernel logs)
  are made in the copy, the first two from the YAML blocks of whichever page shows them (docs/simulation.md,
  docs/rules.md), so those are checked as well.

`.venv/bin/python tests/test_readme.py` rewrites docs/checks.md's check-settings table from the code.
"""

from __future__ import annotations

import gzip
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import builtin_rules

REPO = Path(__file__).resolve().parent.parent
REPLAYED = REPO / "tests" / "fixtures" / "real_machines" / "h100-vm-580"
README = REPO / "README.md"
DOCS = REPO / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]      # every page whose commands are run, README first
SETTINGS_PAGE = DOCS / "checks.md"                 # holds the generated check-settings table
REMEDIATION_PAGE = DOCS / "remediation.md"         # holds the table of what each condition asks of whom
SHELL_LANGS = {"sh", "bash", "shell", "console"}

# --- What is not run, and why (first match wins; patterns are searched in the command) ----------------

EXCLUDED: list[tuple[str, str]] = [
    (r"^make (demo|test)\b", "what CI runs (.ci/run runs `make test`, which runs this suite; `make demo` "
                             "runs `gpu-npd demo`): running them here would run the suite inside itself"),
    (r"^(docker|podman|buildah)\b", "builds a container image"),
    (r"^(kubectl|helm|kind|kwokctl)\b", "needs a Kubernetes cluster"),
    (r"^kustomize\b", "kustomize is not installed by `make`; tests/test_deploy*.py check deploy/ offline"),
    (r"^cd deploy/\S* && kustomize\b", "edits deploy/'s kustomization, then `kubectl apply`s it to a cluster"),
    (r"--nvml real\b", "real NVML: needs an NVIDIA GPU and driver"),
    (r"^gpu-npd (diagnose|run|bundle)\b(?!.*--nvml (fake|replay):)(?!.*--kernel-log)",
     "real NVML (the default `--nvml real`): needs an NVIDIA GPU and driver"),
    (r"^gpu-npd simulate\b(?!.*--emulator)", "plays KWOK nodes on a real cluster (no --emulator)"),
    (r"^gpu-npd fleet\b(?!.*--kubeconfig)", "lists a real cluster's nodes ($KUBECONFIG or ~/.kube/config)"),
]

# Programs a command may run here (each stage of a pipeline, after VAR=value assignments).
RUNNABLE_PROGRAMS = {"gpu-npd", "fake-nvidia-smi", ".venv/bin/python", "curl"}

# Programs the test replaces with a stand-in on PATH, because what they read is the host's own.
KERNEL_LOG = [
    "Oct  6 17:59:20 gpu-node-7 kernel: Linux version 6.8.0-45-generic (buildd@lcy02-amd64-075)",
    "Oct  6 17:59:27 gpu-node-7 kernel: NVRM: GPU at PCI:0000:5d:00: GPU-6a2f6f6e-8a3c-4f4e-9d6b-0c2f7e6b1a03",
    "Oct  6 17:59:27 gpu-node-7 kernel: NVRM: Xid (PCI:0000:5d:00): 79, pid='<unknown>', name=<unknown>, "
    "GPU has fallen off the bus.",
]
STUBS: dict[str, tuple[str, str]] = {
    "journalctl": ("prints the kernel log of the host's previous boot, which a test machine may not have: "
                   "a stand-in prints a saved one holding an XID 79",
                   "#!/bin/sh\ncat <<'EOF'\n" + "\n".join(KERNEL_LOG) + "\nEOF\n"),
}
# Only where the machine has no curl (a fresh machine needs only Python and make): `curl [-X M] [-d D] URL`.
CURL_STAND_IN = f"""#!{sys.executable}
import sys, urllib.error, urllib.request
args, method, data, url = sys.argv[1:], None, None, None
while args:
    a = args.pop(0)
    if a == "-X":
        method = args.pop(0)
    elif a == "-d":
        data = args.pop(0).encode()
    else:
        url = a if "://" in a else "http://" + a
opener = urllib.request.build_opener(urllib.request.ProxyHandler({{}}))
try:
    with opener.open(urllib.request.Request(url, data=data, method=method), timeout=30) as r:
        sys.stdout.write(r.read().decode())
except urllib.error.HTTPError as e:
    sys.stdout.write(e.read().decode())
except OSError as e:
    sys.exit(f"curl: {{e}}")
"""


@dataclass(frozen=True)
class Spec:
    """How one documented command is run and judged. Placeholders in `subst` and `append`: {work} (the copy),
    {emulator_port}, {sim_port} (free loopback ports)."""

    exit: int = 0
    why: str = ""                                   # the page's word for a non-zero exit, or for subst/append
    subst: tuple[tuple[str, str], ...] = ()         # (as written, as run)
    append: str = ""                                # arguments added at the end
    background: str = ""                            # a regex: its ready line; stopped with SIGTERM at block end
    expect: str = ""                                # a regex its output must match
    creates: str = ""                               # a file it must leave in the copy
    timeout: float = 30.0


KERN_LOG = ("/var/log/kern.log", "{work}/var/log/kern.log")
FREE_EMULATOR_PORT = ("127.0.0.1:8080", "127.0.0.1:{emulator_port}")
FREE_SIM_PORT = ("localhost:9809", "localhost:{sim_port}")
EMULATOR_URL = r"^http://127\.0\.0\.1:\d+$"        # the emulator's first line on stdout: it is serving
EMULATOR_HTTPS_URL = r"^https://127\.0\.0\.1:\d+$"  # ... with --https
SCALED = "scaled down (the same code path; seconds instead of minutes)"

# Every documented command that is run with anything but the defaults (exit 0, as written, 30 s). Keyed by
# the command as the pages write it (comment removed); an entry no page has any more is an error.
RUN: dict[str, Spec] = {
    "gpu-npd diagnose --nvml fake:h100-sxm-8-xid79": Spec(
        exit=1, why="'a fake node whose GPU 3 fell off the bus'; exit code 1: a problem was found",
        expect=r"GpuMissing/GpuFellOffBus"),
    "gpu-npd diagnose --nvml fake:h100-sxm-8 -o json": Spec(expect=r'"healthy": true'),
    "gpu-npd diagnose --nvml fake:h100-sxm-8-slow-gpu --duration 120": Spec(
        exit=1, why="a watch of GPU 5, held at 400 W against its siblings' 700 W: a problem, exit 1",
        expect=r"GpuPerformanceDegraded/SlowerThanPeers  GPUs 5"),
    "gpu-npd diagnose --nvml fake:h100-sxm-8-nvlink-replay --duration 120": Spec(
        exit=1, why="a watch of GPU 3's rising NVLink replays: a problem, exit 1",
        expect=r"watched 120 of 120 s \(simulated time\)[\s\S]*NvlinkReplay"),
    "gpu-npd diagnose --nvml replay:nvidia-smi-q.xml":
        Spec(subst=(("replay:nvidia-smi-q.xml", f"replay:{REPLAYED}/nvidia-smi-q.xml"),),
             why="the real H100 VM's capture", expect="No problems found"),
    "gpu-npd diagnose --nvml replay:captured/":
        Spec(subst=(("replay:captured/", f"replay:{REPLAYED}/"),), why="the real H100 VM's capture folder",
             expect="No problems found"),
    "gpu-npd diagnose --kernel-log /var/log/kern.log": Spec(
        exit=1, subst=(KERN_LOG,), expect=r"XID 79|xid-79|GpuFellOffBus",
        why="the host's /var/log/kern.log is replaced by a saved log holding an XID 79: a problem, exit 1"),
    "gpu-npd diagnose --kernel-log '/var/log/kern.log*'": Spec(
        exit=1, subst=(KERN_LOG,), expect=r"\(3 files\)",
        why="kern.log, kern.log.1 and kern.log.2.gz saved in the copy, one holding an XID 79: exit 1"),
    "journalctl -k -b -1 | gpu-npd diagnose --kernel-log -": Spec(
        exit=1, expect=r"GpuFellOffBus", why="the journalctl stand-in prints an XID 79: a problem, exit 1"),
    "gpu-npd bundle --nvml fake:h100-sxm-8-remap-pending --out evidence": Spec(
        expect=r"^evidence$", why="docs/diagnose.md's bundle of a fake node; stdout is the folder written"),
    "gpu-npd diagnose --nvml replay:evidence": Spec(
        exit=1, expect=r"RowRemapPending", why="the bundle just written replays to the node's pending remap: exit 1"),
    "gpu-npd validate-rules +my-rules.yaml": Spec(
        expect=r"^OK: 260 rules in 18 file\(s\); rules: builtin \(259 rules\) \+ my-rules\.yaml \(1 rule\)$",
        why="my-rules.yaml is the example rule file of docs/rules.md, which quotes this line: a rule added to "
            "rules/ changes it there too"),
    "gpu-npd diagnose --nvml fake:h100-sxm-8-nvlink-down --checks nccl": Spec(
        exit=1, why="'240 GB/s, expected >= 460: fails'; exit code 1", expect=r"GpuNcclBandwidthDegraded"),
    "gpu-npd run --nvml fake:h100-sxm-8 --no-kube --node-name demo": Spec(
        background=r"metrics and health on http://",
        why="GPU_NPD_LISTEN and GPU_NPD_STATE_DIR (ENV) keep it off port 9808 and in the copy"),
    "gpu-npd clear GpuXidError": Spec(
        expect=r"nothing was held", why="answered by the daemon the block started (GPU_NPD_STATE_DIR in ENV)"),
    "gpu-npd clear --list": Spec(
        expect=r"nothing is held|GpuNodeUnverified/ChecksPending .* live",
        why="the daemon the block started may not have run every check yet: its readiness condition is live"),
    "gpu-npd emulator --listen 127.0.0.1:8080 --kubeconfig-out kc.yaml --node gpu-17": Spec(
        subst=(FREE_EMULATOR_PORT,), background=EMULATOR_URL, creates="kc.yaml",
        why="a free port instead of 8080, which may be taken"),
    "gpu-npd emulator --kubeconfig-out kc.yaml --node gpu-17": Spec(background=EMULATOR_URL, creates="kc.yaml"),
    "gpu-npd emulator --https --kubeconfig-out kc.yaml --node gpu-17": Spec(
        background=EMULATOR_HTTPS_URL, creates="kc.yaml"),
    "gpu-npd run --nvml fake:h100-sxm-8-xid79 --kubeconfig kc.yaml --node-name gpu-17": Spec(
        background=r"condition GpuXidError=True reason=Xid79GpuFellOffBus",
        why="against the emulator the block started (its kubeconfig): ready once it says GPU 3's XID 79"),
    "gpu-npd emulator --deploy-dir deploy": Spec(background=EMULATOR_URL, expect=r"RBAC from deploy/base$"),
    "gpu-npd emulator --rbac deploy/base --rbac deploy/kwok": Spec(
        background=EMULATOR_URL, expect=r"RBAC from deploy/base, deploy/kwok$"),
    "gpu-npd simulate --fleet fleet.yaml --emulator --kubeconfig-out drill.kubeconfig --duration 300": Spec(
        append="--listen 127.0.0.1:{sim_port}", background=r"nodes starting over", creates="drill.kubeconfig",
        why="fleet.yaml is docs/simulation.md's fleet file; a free port instead of 9809 (which the curl commands "
            "below use); stopped with SIGTERM once its nodes are up, instead of after 300 s"),
    'curl -X POST localhost:9809/faults -d \'{"node": "gpu-h100-0007", "kind": "xid", "gpu": 1, '
    '"params": {"code": 79}}\'': Spec(subst=(FREE_SIM_PORT,), expect=r'"node": "gpu-h100-0007"'),
    "curl localhost:9809/faults": Spec(subst=(FREE_SIM_PORT,), expect=r'"source": "command"'),
    ".venv/bin/python bench/scan_kernel_log.py": Spec(append="--size-mib 1", why=SCALED),
    ".venv/bin/python bench/scan_kernel_log.py --format json": Spec(append="--size-mib 1", why=SCALED),
    ".venv/bin/python bench/scan_kernel_log.py --flood": Spec(append="--size-mib 1 --flood-lines 2000", why=SCALED),
    ".venv/bin/python bench/live_flood.py": Spec(append="--lines 2000", why=SCALED),
    ".venv/bin/python bench/latency.py": Spec(append="-n 3", why=SCALED),
    ".venv/bin/python bench/footprint.py": Spec(append="--duration 1 --settle 1", why=SCALED),
    ".venv/bin/python bench/node_watch.py": Spec(append="--hour-s 2 --settle 360", why=SCALED),
    ".venv/bin/python bench/node_weight.py": Spec(append="--hour-s 2", why=SCALED, timeout=90),
    ".venv/bin/python bench/fleet.py": Spec(
        append="--nodes 10 --start-spread 1 --settle 1 --steady 1 --fault-timeout 60", why=SCALED, timeout=120),
    ".venv/bin/python bench/fleet.py --nodes 30000 --shards 4": Spec(
        subst=(("--nodes 30000", "--nodes 12"),),
        append="--start-spread 1 --settle 1 --steady 1 --fault-timeout 60",
        why=SCALED, timeout=120),
    "gpu-npd fleet --kubeconfig kc.yaml --context admin": Spec(
        expect=r"^nothing is wrong: 0 GPU nodes", why="the emulator the block started: gpu-17 has no GPU label"),
    ".venv/bin/python bench/fleet_view.py": Spec(append="--nodes 300 --runs 1", why=SCALED, timeout=60),
    ".venv/bin/python bench/endpoint_slowloris.py": Spec(append="--connections 200 --duration 1 --settle 1",
                                                         why=SCALED),
    ".venv/bin/python bench/flood.py": Spec(append="--lines 3000 --xid-every 500", why=SCALED, timeout=120),
    ".venv/bin/python bench/api_faults.py": Spec(append="--quick", why=SCALED, timeout=90),
    ".venv/bin/python bench/api_faults.py --scenario gone --seconds 180": Spec(
        subst=(("--seconds 180", "--seconds 3"),), why=SCALED, timeout=60),
}

# Redirected for every command: fixed ports and root-owned paths the documented commands default to.
ENV = {
    "GPU_NPD_LISTEN": "127.0.0.1:0",            # gpu-npd run's default 0.0.0.0:9808 may be taken
    "GPU_NPD_STATE_DIR": "{work}/state",        # run and clear: the DaemonSet's /var/lib/gpu-npd
    "NO_PROXY": "localhost,127.0.0.1", "no_proxy": "localhost,127.0.0.1",
}
DROPPED_ENV = ("KUBECONFIG", "NODE_NAME", "PYTHONPATH", "http_proxy", "https_proxy", "all_proxy",
               "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY")

# --- Reading the pages --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Block:
    lang: str
    line: int                      # the opening fence's line, 1-based
    lines: tuple[str, ...]
    before: str                    # the paragraph just above the fence
    page: str = "README.md"        # the page holding it, relative to the repository
    alone: bool = False            # one command of a block, run on its own (at line + 1)

    @property
    def at(self) -> str:
        return f"{self.page}:{self.line + 1 if self.alone else self.line}"


@dataclass(frozen=True)
class Command:
    text: str
    line: int
    block: int
    page: str = "README.md"

    @property
    def at(self) -> str:
        return f"{self.page}:{self.line}"


def read_blocks(text: str, page: str = "README.md") -> list[Block]:
    blocks: list[Block] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)", lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = len(m.group(1)), m.group(2), m.group(3).lower()
        para: list[str] = []
        for prev in reversed(lines[:i]):
            if not prev.strip():
                if para:
                    break
                continue
            para.insert(0, prev.strip())
        body: list[str] = []
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            body.append(lines[j][indent:] if lines[j][:indent].isspace() else lines[j])
            j += 1
        blocks.append(Block(lang, i + 1, tuple(body), " ".join(para), page))
        i = j + 1
    return blocks


def strip_comment(line: str) -> str:
    """The line without a trailing `# comment` (a `#` at the start or after blank space, outside quotes)."""
    quote, escaped = "", False
    for k, ch in enumerate(line):
        if escaped:
            escaped = False
        elif ch == "\\" and quote != "'":
            escaped = True
        elif quote:
            if ch == quote:
                quote = ""
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (k == 0 or line[k - 1].isspace()):
            return line[:k].rstrip()
    return line.rstrip()


def block_commands(block: Block) -> list[Command]:
    prompted = any(line.startswith("$ ") for line in block.lines)
    commands: list[Command] = []
    pending, start = "", 0
    for n, raw in enumerate(block.lines, start=block.line + 1):
        if pending:
            line = raw.strip()
        elif prompted:
            if not raw.startswith("$ "):
                continue
            line, start = raw[2:], n
        else:
            line, start = raw, n
        line = strip_comment(line)
        if line.endswith("\\"):
            pending += line[:-1].rstrip() + " "
            continue
        text = (pending + line).strip()
        pending = ""
        if text:
            commands.append(Command(text, start, block.line, block.page))
    assert not pending, f"{block.page}:{start}: a command ends with a line continuation"
    return commands


BLOCKS = [b for page in PAGES for b in read_blocks(page.read_text(), str(page.relative_to(REPO)))]
SHELL_BLOCKS = [b for b in BLOCKS if b.lang in SHELL_LANGS]
COMMANDS = [c for b in SHELL_BLOCKS for c in block_commands(b)]


def programs(text: str) -> list[str]:
    """The program of each stage of a command line (`a | b && c`), after VAR=value assignments."""
    lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    out, expect_program = [], True
    for token in lexer:
        if token in ("|", "||", "&&", ";", "&", "|&"):
            expect_program = True
        elif expect_program and not re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", token):
            out.append(token)
            expect_program = False
    return out


def exclusion(text: str) -> str | None:
    for pattern, reason in EXCLUDED:
        if re.search(pattern, text):
            return reason
    return None


def yaml_after(marker: str) -> str:
    """The YAML block, on whichever page, whose paragraph above it ends with `marker`."""
    found = [b for b in BLOCKS if b.lang in ("yaml", "yml") and b.before.endswith(marker)]
    assert len(found) == 1, (f"README.md and docs/: expected one YAML block after {marker!r}, found "
                             f"{[f'{b.page}:{b.line}' for b in found]}")
    return "\n".join(found[0].lines) + "\n"


# Files the documented commands name that a reader brings; made in the copy before any command runs.
def make_files(work: Path) -> None:
    (work / "fleet.yaml").write_text(yaml_after("The fleet file:"))
    (work / "my-rules.yaml").write_text(yaml_after("user's rule file has the same form:"))
    logs = work / "var" / "log"
    logs.mkdir(parents=True)
    (logs / "kern.log").write_text("\n".join(KERNEL_LOG) + "\n")
    (logs / "kern.log.1").write_text(KERNEL_LOG[0] + "\n")
    (logs / "kern.log.2.gz").write_bytes(gzip.compress((KERNEL_LOG[0] + "\n").encode()))


# --- The catalogue: every command is run or excluded ---------------------------------------------------


def test_readme_has_shell_commands():
    assert len(SHELL_BLOCKS) >= 5 and len(COMMANDS) >= 20
    assert {README, SETTINGS_PAGE, REMEDIATION_PAGE} <= set(PAGES)
    assert {"README.md", "docs/diagnose.md", "docs/simulation.md"} <= {c.page for c in COMMANDS}


def test_every_readme_command_is_run_or_excluded():
    unknown = []
    for c in COMMANDS:
        if exclusion(c.text):
            continue
        missing = [p for p in programs(c.text) if p not in RUNNABLE_PROGRAMS and p not in STUBS]
        if missing:
            unknown.append(f"{c.at}: {c.text!r} runs {', '.join(missing)}, which this test "
                           "neither runs nor excludes: add a pattern with its reason to EXCLUDED, or make it "
                           "runnable (RUNNABLE_PROGRAMS, STUBS)")
    assert not unknown, "\n".join(unknown)


def test_run_entries_name_readme_commands():
    texts = {c.text for c in COMMANDS}
    stale = [key for key in RUN if key not in texts]
    assert not stale, f"RUN has entries for commands no page has any more: {stale}"
    excluded = [key for key in RUN if exclusion(key)]
    assert not excluded, f"RUN entries that EXCLUDED also matches (never run): {excluded}"


def test_non_shell_blocks_hide_no_commands():
    """A command in an untagged block would never be run: tag the block ```sh."""
    hidden = [f"{b.page}:{b.line}: {line!r}" for b in BLOCKS if b.lang not in SHELL_LANGS
              for line in b.lines if re.match(r"^\$ |^(gpu-npd|make|kubectl|docker|curl) [a-z-]", line)]
    assert not hidden, "\n".join(hidden)


def test_comment_and_continuation_parsing():
    block = Block("sh", 1, ("a 'x # y' # z", "# only a comment", "b \\", "  c  # d", "", "e#f"), "")
    assert [c.text for c in block_commands(block)] == ["a 'x # y'", "b c", "e#f"]
    console = Block("console", 1, ("$ gpu-npd checks", "output # not a command", "$ x \\", "y"), "")
    assert [c.text for c in block_commands(console)] == ["gpu-npd checks", "x y"]
    assert programs("A=1 journalctl -k | gpu-npd diagnose --kernel-log - && curl x") == \
        ["journalctl", "gpu-npd", "curl"]


# --- Running them -----------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def working_copy(tmp: Path) -> Path:
    """Tracked and untracked (not ignored) files of the repository, as a fresh clone has them."""
    work = tmp / "repo"
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                                capture_output=True, check=True).stdout.decode().split("\0")
    except (OSError, subprocess.CalledProcessError):         # not a git checkout: everything but build outputs
        shutil.copytree(REPO, work, symlinks=True, ignore=shutil.ignore_patterns(
            ".git", ".venv", "__pycache__", "*.egg-info", ".pytest_cache", ".ruff_cache", "build", "dist"))
        listed = []
    for name in filter(None, listed):
        source = REPO / name
        if not source.exists() and not source.is_symlink():          # deleted in the work tree
            continue
        target = work / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_symlink():
            target.symlink_to(os.readlink(source))
        elif source.is_file():
            shutil.copy2(source, target)
    (work / ".venv").symlink_to(Path(sys.prefix))                     # the venv `make` builds
    return work


class Background:
    """A command left running: its output collected, until its ready line, then SIGTERM."""

    def __init__(self, argv: list[str], cwd: Path, env: dict, ready: str):
        self.proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        self.lines: list[str] = []
        self.ready = threading.Event()
        self._pattern = re.compile(ready)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            if self._pattern.search(line.rstrip("\n")):
                self.ready.set()

    def output(self) -> str:
        return "".join(self.lines)

    def stop(self, timeout: float = 15.0) -> int | None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            return None
        self._reader.join(5)
        return self.proc.returncode


def environment(tmp: Path, work: Path, values: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in DROPPED_ENV and not k.startswith("GPU_NPD_")}
    stubs = tmp / "stubs"
    stubs.mkdir()
    scripts = {name: script for name, (_, script) in STUBS.items()}
    if shutil.which("curl") is None:
        scripts["curl"] = CURL_STAND_IN
    for name, script in scripts.items():
        (stubs / name).write_text(script)
        (stubs / name).chmod(0o755)
    for name in ("home", "tmp"):
        (tmp / name).mkdir()
    env.update(HOME=str(tmp / "home"), TMPDIR=str(tmp / "tmp"),
               PATH=os.pathsep.join([str(Path(sys.prefix) / "bin"), str(stubs), env.get("PATH", "")]))
    env.update({k: v.format(**values) for k, v in ENV.items()})
    return env


def as_run(c: Command, spec: Spec, values: dict) -> str:
    text = c.text
    for old, new in spec.subst:
        assert old in text, f"{c.at}: RUN's substitution {old!r} is not in {text!r}"
        text = text.replace(old, new.format(**values))
    if spec.append:
        text += " " + spec.append.format(**values)
    return text


def tail(text: str, n: int = 3000) -> str:
    return text if len(text) <= n else "..." + text[-n:]


def runnable_blocks() -> list[Block]:
    """Each block to run as one test, in order; a block of benchmark runs alone (each bench script stands on
    its own) is one test per command, so that the test runner's workers share them out."""
    blocks: list[Block] = []
    for b in SHELL_BLOCKS:
        commands = [c for c in block_commands(b) if not exclusion(c.text)]
        if commands and all(c.text.startswith(".venv/bin/python bench/") for c in commands):
            blocks += [Block(b.lang, c.line - 1, (c.text,), b.before, b.page, alone=True) for c in commands]
        elif commands:
            blocks.append(b)
    return blocks


@pytest.mark.parametrize("block", runnable_blocks(), ids=lambda b: b.at)
def test_readme_block_runs(block: Block, tmp_path: Path):
    work = working_copy(tmp_path)
    make_files(work)
    values = {"work": str(work), "emulator_port": free_port(), "sim_port": free_port()}
    env = environment(tmp_path, work, values)
    failures: list[str] = []
    running: list[tuple[Command, Spec, Background]] = []
    try:
        for c in block_commands(block):
            if exclusion(c.text):
                continue
            spec = RUN.get(c.text, Spec())
            text = as_run(c, spec, values)
            where = f"{c.at}: {c.text}" + (f"\n  run as: {text}" if text != c.text else "")
            if spec.background:
                bg = Background(["bash", "-c", "exec " + text], work, env, spec.background)
                if not bg.ready.wait(spec.timeout) or bg.proc.poll() is not None:
                    failures.append(f"{where}\n  no ready line /{spec.background}/ within {spec.timeout:g} s "
                                    f"(exit code {bg.proc.poll()}):\n{tail(bg.output())}")
                    bg.stop()
                    continue
                running.append((c, spec, bg))
                out = bg.output()
            else:
                try:
                    done = subprocess.run(["bash", "-o", "pipefail", "-c", text], cwd=work, env=env,
                                          capture_output=True, text=True, timeout=spec.timeout)
                except subprocess.TimeoutExpired as e:
                    failures.append(f"{where}\n  still running after {spec.timeout:g} s:\n"
                                    f"{tail(str(e.stdout or '') + str(e.stderr or ''))}")
                    continue
                out = done.stdout + done.stderr
                if done.returncode != spec.exit:
                    failures.append(f"{where}\n  exit code {done.returncode}, expected {spec.exit}"
                                    f"{' (' + spec.why + ')' if spec.why else ''}:\n{tail(out)}")
                    continue
            if spec.expect and not re.search(spec.expect, out, re.MULTILINE):
                failures.append(f"{where}\n  output does not match /{spec.expect}/:\n{tail(out)}")
            if spec.creates and not (work / spec.creates).exists():
                failures.append(f"{where}\n  did not create {spec.creates}")
    finally:
        for c, spec, bg in reversed(running):
            code = bg.stop()
            if code != spec.exit:
                failures.append(f"{c.at}: {c.text}\n  exit code {code} after SIGTERM, expected "
                                f"{spec.exit}:\n{tail(bg.output())}")
    assert not failures, "\n\n".join(failures)


# --- The emulator's RBAC: packaged, identical to deploy/'s, found from any directory -----------------

PACKAGED_RBAC = ("base/rbac.yaml", "kwok/rbac.yaml", "overlays/dra-taints/rbac.yaml")


def test_packaged_rbac_is_deploys():
    """kube_emulator/deploy/ holds copies of deploy/'s RBAC (the emulator's default): byte for byte."""
    packaged = REPO / "kube_emulator" / "deploy"
    assert sorted(str(p.relative_to(packaged)) for p in packaged.rglob("*") if p.is_file()) == list(PACKAGED_RBAC)
    differ = [name for name in PACKAGED_RBAC if (packaged / name).read_bytes() != (REPO / "deploy" / name).read_bytes()]
    assert not differ, (f"kube_emulator/deploy/ differs from deploy/ in {differ}: copy deploy/{{base,kwok}}/rbac.yaml "
                        "to kube_emulator/deploy/ (the RBAC the emulator enforces when installed)")


def installed_files() -> list[str]:
    """kube_emulator's files as an installed package has them: its modules and its package-data globs."""
    import tomllib

    globs = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["kube_emulator"]
    package = REPO / "kube_emulator"
    files = {str(p.relative_to(package)) for p in package.glob("*.py")}
    files |= {str(p.relative_to(package)) for g in globs for p in package.glob(g)}
    return sorted(files)


def test_packaged_rbac_is_package_data():
    assert {f"deploy/{name}" for name in PACKAGED_RBAC} <= set(installed_files())


def api_status(kubeconfig: Path, path: str) -> int:
    """The HTTP status of GET `path` as the kubeconfig's user (loopback, no proxy)."""
    import urllib.error
    import urllib.request

    import yaml

    config = yaml.safe_load(kubeconfig.read_text())
    server, token = config["clusters"][0]["cluster"]["server"], config["users"][0]["user"]["token"]
    request = urllib.request.Request(server + path, headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(request, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as e:
        return e.code


def run_emulator(argv: list[str], cwd: Path, env: dict | None = None) -> tuple[Background, str]:
    bg = Background(argv, cwd, env if env is not None else dict(os.environ), EMULATOR_URL)
    if not bg.ready.wait(20):
        bg.stop()
        pytest.fail(f"{' '.join(argv)}: not serving within 20 s:\n{bg.output()}")
    return bg, bg.output()


def test_emulator_runs_outside_the_repository(tmp_path: Path):
    """From any directory the emulator enforces deploy/base's RBAC: the service account may get its node, not list."""
    from kube_emulator.rbac import packaged_deploy_dir

    gpu_npd = str(Path(sys.prefix) / "bin" / "gpu-npd")
    bg, out = run_emulator([gpu_npd, "emulator", "--kubeconfig-out", "kc.yaml", "--node", "gpu-17"], tmp_path)
    try:
        assert f"RBAC from {packaged_deploy_dir() / 'base'}" in out
        assert api_status(tmp_path / "kc.yaml", "/api/v1/nodes/gpu-17") == 200
        assert api_status(tmp_path / "kc.yaml", "/api/v1/namespaces/default/pods") == 403
    finally:
        assert bg.stop() == 0


def test_emulator_deploy_dir(tmp_path: Path):
    """--deploy-dir DIR enforces DIR/base: a deploy/ whose ClusterRole lacks `get nodes` is obeyed."""
    deploy = tmp_path / "deploy"
    (deploy / "base").mkdir(parents=True)
    text = (REPO / "deploy" / "base" / "rbac.yaml").read_text()
    assert 'verbs: ["get", "list", "watch"]' in text
    (deploy / "base" / "rbac.yaml").write_text(text.replace('verbs: ["get", "list", "watch"]', 'verbs: ["list"]', 1))
    gpu_npd = str(Path(sys.prefix) / "bin" / "gpu-npd")
    bg, out = run_emulator([gpu_npd, "emulator", "--deploy-dir", str(deploy), "--kubeconfig-out", "kc.yaml",
                            "--node", "gpu-17"], tmp_path)
    try:
        assert f"RBAC from {deploy / 'base'}" in out
        assert api_status(tmp_path / "kc.yaml", "/api/v1/nodes/gpu-17") == 403
        assert api_status(tmp_path / "kc.yaml", "/api/v1/nodes") == 200
    finally:
        assert bg.stop() == 0
    empty = tmp_path / "empty"
    empty.mkdir()
    done = subprocess.run([gpu_npd, "emulator", "--deploy-dir", str(empty)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=30)
    assert done.returncode == 2 and "no base/ directory" in done.stderr
    (empty / "base").mkdir()
    done = subprocess.run([gpu_npd, "emulator", "--deploy-dir", str(empty)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=30)
    assert done.returncode == 2 and "no RBAC role bindings" in done.stderr


def test_emulator_as_installed(tmp_path: Path):
    """Only the files an install carries (modules and package data), no repository: it still enforces the RBAC."""
    site = tmp_path / "site"
    for name in installed_files():
        target = site / "kube_emulator" / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / "kube_emulator" / name, target)
    env = {**os.environ, "PYTHONPATH": str(site)}
    bg, out = run_emulator([sys.executable, "-m", "kube_emulator", "--kubeconfig-out", "kc.yaml", "--node", "n1"],
                           tmp_path, env)
    try:
        assert f"RBAC from {site / 'kube_emulator' / 'deploy' / 'base'}" in out
        assert api_status(tmp_path / "kc.yaml", "/api/v1/nodes/n1") == 200
        assert api_status(tmp_path / "kc.yaml", "/api/v1/namespaces/default/pods") == 403
    finally:
        assert bg.stop() == 0


# --- The check-settings table is the code's ----------------------------------------------------------

SETTINGS_BEGIN = ("<!-- check-settings: generated from each check's config_fields by "
                  "`.venv/bin/python tests/test_readme.py`; tests/test_readme.py fails when they differ -->")
SETTINGS_END = "<!-- /check-settings -->"
KIND_NAMES = {bool: "true/false", int: "integer", float: "number", str: "string"}


def _yaml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}"
    if value == "":
        return '""'
    return str(value)


def settings_table() -> str:
    """Every check's settings as a Markdown table: interval, timeout and enabled, then its own."""
    from detector.core.check import SCHEDULE_FIELDS, CheckRegistry

    registry = CheckRegistry.from_entry_points()
    classes = sorted((registry.get(n) for n in registry.names()), key=lambda c: (not c.enabled_by_default, c.name))
    rows = ["| setting | type | default | meaning |", "| --- | --- | --- | --- |"]
    for cls in classes:
        schedule = {"interval": (float, cls.default_interval_s), "timeout": (float, cls.default_timeout_s),
                    "enabled": (bool, cls.enabled_by_default)}
        entries = [(key, kind, default, SCHEDULE_FIELDS[key]) for key, (kind, default) in schedule.items()
                   if key in cls.schedule_fields()]
        entries += [(key, spec.kind, spec.default, spec.help) for key, spec in cls.config_fields.items()]
        for key, kind, default, meaning in entries:
            meaning = meaning.replace("|", "\\|")
            rows.append(f"| `checks.{cls.name}.{key}` | {KIND_NAMES.get(kind, kind.__name__)} | "
                        f"`{_yaml_value(default)}` | {meaning} |")
    return "\n".join([SETTINGS_BEGIN, *rows, SETTINGS_END])


def readme_settings_table(text: str) -> str | None:
    start, end = text.find(SETTINGS_BEGIN), text.find(SETTINGS_END)
    if start < 0 or end < start:
        return None
    return text[start:end + len(SETTINGS_END)]


def test_readme_settings_table_is_the_codes():
    found = readme_settings_table(SETTINGS_PAGE.read_text())
    assert found is not None, (f"{SETTINGS_PAGE.relative_to(REPO)} has no check-settings table (between "
                               f"{SETTINGS_BEGIN!r} and {SETTINGS_END!r})")
    assert found == settings_table(), (f"{SETTINGS_PAGE.relative_to(REPO)}'s check-settings table differs from "
                                       "the checks' code: run .venv/bin/python tests/test_readme.py to regenerate it")
    others = [str(p.relative_to(REPO)) for p in PAGES if p != SETTINGS_PAGE and SETTINGS_BEGIN in p.read_text()]
    assert not others, f"a second check-settings table, which nothing regenerates: {others}"


def test_readme_settings_example_is_valid(tmp_path: Path):
    """The example config file in the settings section loads, with every key known to the checks."""
    from detector.config import build_checks, load_check_settings
    from detector.core.check import CheckRegistry

    path = tmp_path / "config.yaml"
    path.write_text(yaml_after("takes the same keys:"))
    file, settings = load_check_settings(path)
    checks = build_checks(CheckRegistry.from_entry_points(), None, settings, file)
    assert settings and {c.name for c in checks} >= set(settings)


def test_no_check_settings_from_the_environment():
    """docs/checks.md says check settings come only from the config file: keep it so, or document the variables."""
    offenders = [f"{p.relative_to(REPO)}:{n}" for p in sorted((REPO / "detector").rglob("*.py"))
                 for n, line in enumerate(p.read_text().splitlines(), 1)
                 if re.search(r"environ[^\n]*['\"](GPU_NPD_)?CHECK_", line)]
    assert not offenders, offenders


if __name__ == "__main__":               # rewrite docs/checks.md's check-settings table from the code
    text = SETTINGS_PAGE.read_text()
    old = readme_settings_table(text)
    if old is None:
        sys.exit(f"{SETTINGS_PAGE.relative_to(REPO)} has no {SETTINGS_BEGIN!r} ... {SETTINGS_END!r} markers to fill")
    SETTINGS_PAGE.write_text(text.replace(old, settings_table()))
    print(f"{SETTINGS_PAGE.relative_to(REPO)}: check-settings table "
          + ("unchanged" if old == settings_table() else "rewritten"))


def test_remediation_table_names_every_condition_type(registry):
    """docs/remediation.md's table of what each condition asks of whom covers every condition type the bundled
    rules can set, and names none they cannot."""

    text = REMEDIATION_PAGE.read_text(encoding="utf-8")
    table = text.split("<!-- remediation-table -->", 1)[1].split("<!-- /remediation-table -->", 1)[0]
    named = {t for line in table.splitlines()[2:] for t in re.findall(r"`([A-Z][A-Za-z]+)`", line.split("|")[1])}
    assert named == builtin_rules().types()
