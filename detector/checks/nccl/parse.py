"""Read what nccl-tests' `all_reduce_perf` prints, in every format it has printed since 2018.

The output is meant for people, so it is read line by line, tolerating what real runs put in between:
NCCL INFO/WARN lines (NCCL_DEBUG), launcher tags (`[1,0]<stdout>:`, `[0] `, `0: `), lines whose `#`
mpirun or a copy-paste lost, and a row whose first half and second half were split by NCCL log lines
(the row's size/count/type/redop/root are printed before the collective runs, the figures after).

Formats (src/common.cu, src/util.cu):
- header `# nThread 1 nGpus 8 minBytes .. maxBytes .. step: ..(bytes) warmup iters: 5 iters: 20
  agg iters: 1 validation: 1 graph: 0` (older: no `agg iters`/`graph`; newest: `unalign: 0`);
- `#  Rank  0 Group  0 Pid 412233 on HOST device  0 [0x18] NAME` (older: no `Group`, oldest no `Pid`;
  newest: bus `[0000:18:00]`);
- rows `size count type redop root` + out-of-place and in-place `time algbw busbw #wrong`, where
  `#wrong` is a count (`%5g`, so large counts read `3.35544e+07`), `N/A` when validation is off; older
  tables have no `root` and an `error` column (a max delta, not a count);
- footers `# Out of bounds values : N OK|FAILED` and `# Avg bus bandwidth    : X [OK|FAILED]`;
- failures `HOST: Test NCCL failure common.cu:N '...'`, ` .. HOST pid N: Test failure common.cu:N`.
"""

from __future__ import annotations

import math
import re
import signal
from dataclasses import dataclass, field

from detector.checks.nccl.probe import FAILED, OK, TIMEOUT, ProbeResult
from detector.checks.nccl.process import ProcessOutcome

BACKEND = "nccl-tests"
MAX_ERROR_CHARS = 300

_TAG = re.compile(r"^\s*(?:\[\d+(?:,\d+)*\](?:<std(?:out|err)>)?:?|\d+:(?=\s))\s?")
_HEADER = re.compile(r"^#?\s*nThread\s+(?P<nthreads>\d+)\s+nGpus\s+(?P<ngpus>\d+)"
                     r"\s+minBytes\s+(?P<min>\d+)\s+maxBytes\s+(?P<max>\d+)")
_WARMUP = re.compile(r"warmup iters:\s*(\d+)")
_ITERS = re.compile(r"warmup iters:\s*\d+\s+iters:\s*(\d+)")
_VALIDATION = re.compile(r"validation:\s*(\d+)")
_RANK = re.compile(r"^#?\s*Rank\s+(?P<rank>\d+)\s+(?:Group\s+(?P<group>\d+)\s+)?(?:Pid\s+(?P<pid>\d+)\s+)?"
                   r"on\s+(?P<host>\S+)\s+device\s+(?P<device>\d+)\s+\[(?P<bus>[^\]]*)\]\s*(?P<name>.*?)\s*$")
_COLUMNS = re.compile(r"^#?\s*size\s+count\s+type\b")
_OOB = re.compile(r"^#?\s*Out of bounds values\s*:\s*(?P<n>-?\d+)\s*(?:OK|FAILED)?\s*$")
_AVG = re.compile(r"^#?\s*Avg bus bandwidth\s*:\s*(?P<bw>\S+)\s*(?:OK|FAILED)?\s*$")
_PREAMBLE = re.compile(r"^\s*(?P<size>\d+)\s+(?P<count>\d+)\s+(?P<type>[A-Za-z][\w]*)\s+(?P<redop>[A-Za-z][\w]*)")
# One figure; it may be glued to an NCCL log line that followed it without a newline.
_VALUE = re.compile(r"\s*(N/A|[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)(?![\d.])")
_NCCL_LOG = re.compile(r"\bNCCL (?P<level>INFO|WARN|TRACE|ABORT)\b")
_FAILURE = re.compile(
    r"Test (?:CUDA |NCCL )?failure|Test timeout|\bNCCL failure\b|\bFAILED\b"
    r"|Segmentation fault|core dumped|Process received signal|exited on signal|terminate called"
    r"|^invalid option\b|invalid size specified|invalid sizes for|Invalid number of GPUs")
_HEADINGS = re.compile(r"out-of-place\s+in-place|\(elements\)|^Using devices$")   # table headings, '#' lost
_DROPPED = re.compile(r"^\.\.\. \d+ lines not kept \.\.\.$")     # process.py's marker for a cut output


@dataclass(frozen=True)
class RankLine:
    """One `# Rank` line: which GPU a rank ran on."""

    rank: int
    host: str
    device: int
    bus_id: str              # as printed: "0x18" (PCI bus only) or "0000:18:00"
    gpu_name: str
    group: int | None = None
    pid: int | None = None


@dataclass(frozen=True)
class Row:
    """One size of the results table; `*_wrong` is None when not validated (N/A, or an old `error` column)."""

    size_bytes: int
    count: int
    type: str
    redop: str
    root: int | None
    oop_time_us: float
    oop_algbw_gbps: float
    oop_busbw_gbps: float
    oop_wrong: int | None
    ip_time_us: float
    ip_algbw_gbps: float
    ip_busbw_gbps: float
    ip_wrong: int | None

    @property
    def wrong(self) -> int | None:
        known = [w for w in (self.oop_wrong, self.ip_wrong) if w is not None]
        return sum(known) if known else None

    def describe(self) -> str:
        """The row in plain words, for progress output."""
        wrong = self.wrong
        checked = f"{wrong} wrong" if wrong is not None else "not validated"
        return (f"{self.size_bytes} B: busbw {self.oop_busbw_gbps:.1f} GB/s out-of-place, "
                f"{self.ip_busbw_gbps:.1f} GB/s in-place, {checked}")


@dataclass(frozen=True)
class Seen:
    """What one output line turned out to be (only the lines worth showing while the probe runs)."""

    kind: str                # row | failure | warning | summary
    text: str
    row: Row | None = None


@dataclass
class AllReducePerfRun:
    """Everything one all_reduce_perf output said; `to_result` judges it together with how it exited."""

    nthreads: int | None = None
    ngpus: int | None = None
    min_bytes: int | None = None
    max_bytes: int | None = None
    warmup_iters: int | None = None
    iters: int | None = None
    validation: int | None = None           # the -c check count; 0 = not validated
    ranks: list[RankLine] = field(default_factory=list)
    rows: list[Row] = field(default_factory=list)
    out_of_bounds: int | None = None        # tests (not elements) that had wrong values
    avg_busbw_gbps: float | None = None
    failures: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)    # NCCL WARN lines: context, not a verdict
    header_seen: bool = False
    last_line: str = ""                     # the last line that was not NCCL chatter, for errors

    @property
    def complete(self) -> bool:
        """The table and its summary footer were printed: the run measured to the end."""
        return bool(self.rows) and self.avg_busbw_gbps is not None

    @property
    def min_busbw_gbps(self) -> float | None:
        if not self.rows:
            return None
        return min(min(r.oop_busbw_gbps, r.ip_busbw_gbps) for r in self.rows)

    @property
    def wrong(self) -> int | None:
        """Wrong elements over every row, out-of-place and in-place; None when nothing was validated.
        Falls back to the out-of-bounds count where rows carry no count (N/A, old `error` column)."""
        if self.validation == 0:
            return None
        counts = [r.wrong for r in self.rows if r.wrong is not None]
        if counts:
            return sum(counts)
        return self.out_of_bounds

    def to_result(self, outcome: ProcessOutcome, ranks: int | None = None,
                  size_bytes: int | None = None) -> ProbeResult:
        """The verdict: ok when the table and footer are there (wrong values are figures, not a failure,
        even though all_reduce_perf then exits 1); failed or timeout otherwise, with a one-line error."""
        if ranks is None:
            ranks = len(self.ranks) or (self.nthreads or 1) * (self.ngpus or 0)
        if size_bytes is None:
            size_bytes = self.rows[-1].size_bytes if self.rows else (self.max_bytes or 0)
        base = dict(backend=BACKEND, transport="nccl", ranks=ranks, size_bytes=size_bytes,
                    duration_s=outcome.duration_s)
        status, error = self._verdict(outcome)
        if status != OK:
            return ProbeResult(status=status, error=_one_line(error), **base)
        return ProbeResult(status=OK, avg_busbw_gbps=self.avg_busbw_gbps, min_busbw_gbps=self.min_busbw_gbps,
                           busbw_gbps=self.avg_busbw_gbps, wrong=self.wrong, **base)

    def _verdict(self, outcome: ProcessOutcome) -> tuple[str, str]:
        if outcome.status == "error":
            return FAILED, outcome.error or "all_reduce_perf could not be started"
        if outcome.status == "timeout":
            done = f" after {len(self.rows)} result row(s)" if self.rows else ""
            return TIMEOUT, f"all_reduce_perf {outcome.error or 'timed out'}{done}{self._last_output()}"
        rc = outcome.returncode
        if rc is not None and rc < 0:
            cause = f": {self.failures[0]}" if self.failures else self._last_output()
            return FAILED, f"all_reduce_perf killed by signal {_signal_name(-rc)}{cause}"
        exited = f" (exit {rc})" if rc else ""
        if self.failures:
            return FAILED, f"all_reduce_perf failed{exited}: {self.failures[0]}{self._first_warning()}"
        if self.complete:
            return OK, ""
        if rc:
            return FAILED, f"all_reduce_perf exited {rc} without results{self._last_output()}"
        if self.rows:
            return FAILED, (f"all_reduce_perf stopped after {len(self.rows)} result row(s) without the "
                            f"'# Avg bus bandwidth' footer{self._last_output()}")
        if self.header_seen:
            return FAILED, f"all_reduce_perf printed no result rows{self._last_output()}"
        return FAILED, f"no all_reduce_perf header or results in the output (is it nccl-tests?){self._last_output()}"

    def _last_output(self) -> str:
        return f"; last output: {self.last_line}" if self.last_line else "; no output"

    def _first_warning(self) -> str:
        return f" (first NCCL WARN: {self.warnings[0]})" if self.warnings else ""


class AllReducePerfParser:
    """Fed one line at a time, as the probe prints (so progress can be shown); `run` holds the result."""

    def __init__(self) -> None:
        self.run = AllReducePerfRun()
        self._columns_seen = False
        self._has_root = True            # the table layout, from the column-name line when seen
        self._error_column = False       # old tables: `error` (a max delta), not `#wrong` (a count)
        self._per_iter = False           # newest, with per-iteration timing: 8 figures per half
        self._pending: tuple[re.Match[str], list[str]] | None = None   # a row waiting for its figures

    def feed(self, raw: str) -> Seen | None:
        line = _TAG.sub("", raw.rstrip("\r\n"), count=1)
        text = line.strip()
        if not text or _DROPPED.match(text):
            return None
        run = self.run
        if m := _OOB.match(text):
            self._pending = None
            run.out_of_bounds = int(m["n"])
            run.last_line = text
            return None
        if m := _AVG.match(text):
            self._pending = None
            run.avg_busbw_gbps = _finite(m["bw"])
            run.last_line = text
            if run.avg_busbw_gbps is None:
                return None
            oob = "" if run.out_of_bounds is None else f", {run.out_of_bounds} out-of-bounds"
            return Seen("summary", f"all_reduce_perf done: avg busbw {run.avg_busbw_gbps:g} GB/s{oob}")
        if m := _HEADER.match(text):
            self._header(m, text)
            run.last_line = text
            return None
        if m := _RANK.match(text):
            run.ranks.append(RankLine(int(m["rank"]), m["host"], int(m["device"]), m["bus"], m["name"],
                                      _int(m["group"]), _int(m["pid"])))
            run.last_line = text
            return None
        if _COLUMNS.match(text):
            names = text.lstrip("#").split()
            self._has_root = "root" in names
            self._error_column = "error" in names and "#wrong" not in names
            self._per_iter = "i_min" in names
            self._columns_seen = True
            self._pending = None
            return None
        row, rest = self._table(line)
        other = self._other(rest.strip())
        if row is None:
            return other
        run.rows.append(row)
        run.last_line = text
        return Seen("row", row.describe(), row)

    def _header(self, m: re.Match[str], text: str) -> None:
        run = self.run
        if run.header_seen:        # old MPI builds print the header once per process
            return
        run.header_seen = True
        run.nthreads, run.ngpus = int(m["nthreads"]), int(m["ngpus"])
        run.min_bytes, run.max_bytes = int(m["min"]), int(m["max"])
        run.warmup_iters = _int(_group(_WARMUP, text))
        run.iters = _int(_group(_ITERS, text))
        run.validation = _int(_group(_VALIDATION, text))

    def _table(self, line: str) -> tuple[Row | None, str]:
        """Consume a row, its start, or figures continuing a started one. Returns the row when it is
        complete, and what is left of the line (all of it when it is no part of the table)."""
        if m := _PREAMBLE.match(line):
            values, end = _values(line, m.end())
            self._pending = (m, values)
        elif self._pending is not None:
            values, end = _values(line, 0)
            if not values:
                return None, line
            self._pending[1].extend(values)
        else:
            return None, line
        row = self._complete_row()
        if row is not None:
            self._pending = None
        return row, line[end:]

    def _complete_row(self) -> Row | None:
        assert self._pending is not None
        m, values = self._pending
        root: int | None = None
        if self._has_root:
            if not values:
                return None
            root = _int_or_none(values[0])
            if root is not None or self._columns_seen:
                values = values[1:]     # without the column names, a non-integer here is a time: no root
        half = 8 if self._per_iter else 4
        if len(values) < 2 * half:
            return None
        oop, ip = values[:4], values[half:half + 4]
        try:
            figures = [float(v) for v in (oop[:3] + ip[:3])]
        except ValueError:          # a figure was N/A: not a row this parser can use
            self._pending = None
            return None
        return Row(int(m["size"]), int(m["count"]), m["type"], m["redop"], root,
                   figures[0], figures[1], figures[2], self._wrong(oop[3]),
                   figures[3], figures[4], figures[5], self._wrong(ip[3]))

    def _wrong(self, token: str) -> int | None:
        if self._error_column or token == "N/A":
            return None
        value = _finite(token)
        if value is None or value < 0:       # -1: the CSV-era "not validated"
            return None
        return int(round(value))

    def _other(self, text: str) -> Seen | None:
        if not text:
            return None
        run = self.run
        log = _NCCL_LOG.search(text)
        if log:
            if log["level"] in ("WARN", "ABORT"):
                message = text[log.end():].strip()
                run.warnings.append(message)
                return Seen("warning", text)
            return None
        if text.startswith("# error:"):        # newest: ncclGetLastError() after the footer
            run.warnings.append(text[len("# error:"):].strip())
            run.last_line = text
            return Seen("warning", text)
        if not text.startswith("#") and not _HEADINGS.search(text):    # headings say nothing of the end
            run.last_line = text
        if _FAILURE.search(text):
            run.failures.append(text)
            return Seen("failure", text)
        return None


def parse_all_reduce_perf(text: str) -> AllReducePerfRun:
    """Parse a whole all_reduce_perf output. Never raises: what it cannot read, it leaves out."""
    parser = AllReducePerfParser()
    for line in text.splitlines():
        parser.feed(line)
    return parser.run


def _values(line: str, pos: int) -> tuple[list[str], int]:
    values: list[str] = []
    while m := _VALUE.match(line, pos):
        values.append(m.group(1))
        pos = m.end()
    return values, pos


def _finite(token: str) -> float | None:
    try:
        value = float(token)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _int_or_none(token: str) -> int | None:
    value = _finite(token)
    return int(value) if value is not None and value == int(value) else None


def _int(text: str | None) -> int | None:
    return int(text) if text is not None else None


def _group(pattern: re.Pattern[str], text: str) -> str | None:
    m = pattern.search(text)
    return m.group(1) if m else None


def _signal_name(number: int) -> str:
    try:
        return f"{signal.Signals(number).name} ({number})"
    except ValueError:
        return str(number)


def _one_line(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS - 1] + "…"
