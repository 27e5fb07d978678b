"""A fake `nvidia-smi` that reads a fake node's state, for CI machines without GPUs.

Code that shells out to nvidia-smi parses its text, so this fake copies the real tool's output
(driver 550 layout) rather than inventing its own: the same `-L` lines, the same `--query-gpu`
CSV (units, `[N/A]`, `, ` separators), the same box-drawing summary table, the same error
messages and exit codes (nvidia-smi(1), RETURN VALUE, https://docs.nvidia.com/deploy/nvidia-smi/index.html:
2 invalid argument, 6 not found, 9 driver not loaded, 15 GPU is lost). The lost-GPU line is the one real
drivers print (tests/fixtures/real_smi/gh-marian-nmt-marian-251.yaml).

Real-format facts it relies on:
- nvidia-smi prints its own errors on stdout, not stderr (scripts see them with `2>/dev/null`).
- A GPU it cannot get a handle for is reported as
  `Unable to determine the device handle for GPU0000:5D:00.0: GPU is lost.  Reboot the system to
  recover this GPU` -- "GPU" glued to NVML's legacy bus id (4-digit domain, upper case, which is
  `nvml_bus_id()` minus its first four zeros), two spaces after the full stop -- and the exit code
  is 15 (NVML_ERROR_GPU_IS_LOST). `-L` and `--query-gpu` print that line in the GPU's place and
  go on with the others; the summary table prints only such lines and no table.
- `-r`/`--gpu-reset` and `-pm`/`--persistence-mode` change the node: `run_smi` stays pure and returns what
  to change (`SmiResult.actions`), which the in-process runner injects into the fake node and `main` writes
  back to the state file. Their answers are the real tool's (tests/fixtures/gpu_reset/SOURCE.md): a GPU with
  a process on it or persistence mode on is `In use by another client` (exit 255, NVSentinel #1690), a node
  whose platform blocks resets `Resetting GPU ... is not supported.` (gpu-operator #1606; exit 3, "the
  requested operation is not available on target device", nvidia-smi(1) RETURN VALUE).
- `run_smi` is pure (no sleeping, no I/O); `main` adds the environment, the hang and the streams.

Usage: `fake-nvidia-smi -L` with GPU_NPD_FAKE_STATE (a state file) or GPU_NPD_FAKE_SCENARIO set.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Callable, Mapping

from detector.backends.pciaddr import normalize_bus_id, nvml_bus_id
from fake_nvml.identity import board_of
from fake_nvml.node import FakeGpu, NodeState
from fake_nvml.statefile import SCENARIO_ENV, STATE_ENV, load_state

# Exit codes from nvidia-smi(1), RETURN VALUE.
EXIT_OK = 0
EXIT_INVALID_ARGUMENT = 2
EXIT_NOT_AVAILABLE = 3                 # "The requested operation is not available on target device"
EXIT_NOT_FOUND = 6
EXIT_DRIVER_NOT_LOADED = 9
EXIT_GPU_IS_LOST = 15
EXIT_OTHER = 255                       # "Other error or internal driver error occurred" (nvidia-smi(1))

_HELP_HINT = "Please run 'nvidia-smi -h' for help."
_INVALID_COMBINATION = f"Invalid combination of input arguments. {_HELP_HINT}\n"
_NO_DRIVER = ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
              "Make sure that the latest NVIDIA driver is installed and running.\n\n")
_NO_DEVICES = "No devices were found\n"
# A user-space driver upgraded under a loaded kernel module (tests/fixtures/real_smi/gh-intel-llvm-17614.yaml)
_VERSION_MISMATCH = "Failed to initialize NVML: Driver/library version mismatch\nNVML library version: {}\n"
_FORMAT_OPTIONS = ("csv", "noheader", "nounits")


@dataclass(frozen=True)
class SmiResult:
    """What one nvidia-smi run leaves behind: its exit status and its two streams."""

    returncode: int
    stdout: str
    stderr: str
    actions: tuple[tuple[str, int, bool], ...] = ()   # (what, GPU index, value): "reset" or "persistence"


class _UsageError(Exception):
    """An argument nvidia-smi rejects before it talks to the driver (exit 2)."""


@dataclass(frozen=True)
class _Args:
    mode: str                         # "table", "list", "query", "help", "reset" or "persistence"
    ids: tuple[str, ...] | None       # -i/--id targets; None: every GPU
    fields: tuple[str, ...] = ()      # canonical --query-gpu field names
    header: bool = True
    units: bool = True
    persistence: bool = False         # -pm's value


# -- argument parsing -----------------------------------------------------------------------------

_FLAGS = {"-h": "help", "--help": "help", "-L": "list", "--list-gpus": "list", "-r": "reset", "--gpu-reset": "reset"}
_VALUED = {"-i": "id", "--id": "id", "--query-gpu": "query", "--format": "format", "-pm": "persistence",
           "--persistence-mode": "persistence"}
_PM_VALUES = {"0": False, "DISABLED": False, "1": True, "ENABLED": True}


def _tokens(argv: list[str]) -> list[tuple[str, str | None]]:
    """Split argv into (option, value) pairs, accepting `--opt=value` and `--opt value` as nvidia-smi does."""
    pairs: list[tuple[str, str | None]] = []
    rest = list(argv)
    while rest:
        arg = rest.pop(0)
        name, eq, inline = arg.partition("=")
        if arg in _FLAGS:
            pairs.append((_FLAGS[arg], None))
        elif name in _VALUED:
            if eq:
                value = inline
            elif rest and not rest[0].startswith("-"):
                value = rest.pop(0)
            else:
                raise _UsageError(f"ERROR: Option {name} is missing its value. {_HELP_HINT}\n\n")
            pairs.append((_VALUED[name], value))
        else:
            raise _UsageError(f"ERROR: Option {arg} is not recognized. {_HELP_HINT}\n\n")
    return pairs


def _parse_args(argv: list[str]) -> _Args:
    """Decide what to print; a repeated option or a lone --format is a bad combination, as for the real one."""
    opts: dict[str, str | None] = {}
    for key, value in _tokens(argv):
        if key in opts:
            raise _UsageError(_INVALID_COMBINATION)
        opts[key] = value
    ids = tuple(i.strip() for i in opts["id"].split(",")) if opts.get("id") is not None else None
    if "help" in opts:
        return _Args("help", None)
    if "reset" in opts or "persistence" in opts:
        return _change_args(opts, ids)
    if "query" in opts:
        return _query_args(opts["query"] or "", opts.get("format"), ids, "list" in opts)
    if "format" in opts:
        raise _UsageError(_INVALID_COMBINATION)            # --format means nothing without a query
    return _Args("list" if "list" in opts else "table", ids)


def _change_args(opts: dict[str, str | None], ids: tuple[str, ...] | None) -> _Args:
    """-r or -pm VALUE, each alone (with -i at most)."""
    if set(opts) - {"id"} not in ({"reset"}, {"persistence"}):
        raise _UsageError(_INVALID_COMBINATION)
    if "reset" in opts:
        return _Args("reset", ids)
    value = (opts["persistence"] or "").upper()
    if value not in _PM_VALUES:
        raise _UsageError(f"ERROR: Invalid value for persistence mode: {opts['persistence']}. {_HELP_HINT}\n\n")
    return _Args("persistence", ids, persistence=_PM_VALUES[value])


def _query_args(fields_text: str, format_text: str | None, ids: tuple[str, ...] | None,
                also_list: bool) -> _Args:
    """--query-gpu needs --format=csv[,noheader][,nounits]; every field must be one nvidia-smi knows."""
    if also_list or format_text is None:
        raise _UsageError(_INVALID_COMBINATION)
    options = [o.strip() for o in format_text.split(",") if o.strip()]
    if "csv" not in options or any(o not in _FORMAT_OPTIONS for o in options):
        raise _UsageError(_INVALID_COMBINATION)
    fields = []
    for name in (f.strip() for f in fields_text.split(",")):
        canonical = _ALIASES.get(name, name)
        if canonical not in _FIELDS:
            raise _UsageError(f'Field "{name}" is not a valid field to query.\n\n')
        fields.append(canonical)
    return _Args("query", ids, tuple(fields), header="noheader" not in options, units="nounits" not in options)


# -- GPU selection --------------------------------------------------------------------------------

def _lost_line(gpu: FakeGpu) -> str:
    """The real message for a GPU whose handle NVML refuses with GPU_IS_LOST."""
    legacy_bus_id = nvml_bus_id(gpu.pci_bus_id)[4:]          # 0000:5D:00.0, as nvidia-smi prints it
    return (f"Unable to determine the device handle for GPU{legacy_bus_id}: "
            "GPU is lost.  Reboot the system to recover this GPU\n")


def _matches(target: str, index: int, gpu: FakeGpu) -> bool:
    """-i takes an index, a UUID, a PCI bus id (any spelling) or a serial number, like the real one."""
    if target.isdigit():
        return int(target) == index
    if target in (gpu.uuid, gpu.serial):
        return True
    try:
        return normalize_bus_id(target) == gpu.pci_bus_id
    except ValueError:
        return False


def _select(state: NodeState, ids: tuple[str, ...] | None) -> list[tuple[int, FakeGpu]]:
    """(NVML index, GPU) pairs in NVML order; the index is the position among NVML-visible GPUs."""
    visible = list(enumerate(state.nvml_gpus()))
    if ids is None:
        return visible
    return [(i, g) for i, g in visible if any(_matches(t, i, g) for t in ids)]


# -- -L ---------------------------------------------------------------------------------------------

def _list_gpus(gpus: list[tuple[int, FakeGpu]]) -> SmiResult:
    lines = [_lost_line(g) if g.lost else f"GPU {i}: {g.model.name} (UUID: {g.uuid})\n" for i, g in gpus]
    return SmiResult(_lost_code(gpus), "".join(lines), "")


def _lost_code(gpus: list[tuple[int, FakeGpu]]) -> int:
    return EXIT_GPU_IS_LOST if any(g.lost for _, g in gpus) else EXIT_OK


# -- --query-gpu ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Field:
    """A --query-gpu field: its unit (shown in brackets in the header and after each value) and its value."""

    unit: str | None
    value: Callable[[NodeState, int, FakeGpu], str]


_NA = "[N/A]"


def _pci_part(gpu: FakeGpu, part: int, width: int) -> str:
    number = gpu.pci_bus_id.replace(".", ":").split(":")[part]
    return f"0x{int(number, 16):0{width}X}"


def _on_off(flag: bool) -> str:
    return "Enabled" if flag else "Disabled"


_FIELDS: dict[str, _Field] = {
    "count": _Field(None, lambda s, i, g: str(len(s.nvml_gpus()))),
    "index": _Field(None, lambda s, i, g: str(i)),
    "name": _Field(None, lambda s, i, g: g.model.name),
    "uuid": _Field(None, lambda s, i, g: g.uuid),
    "serial": _Field(None, lambda s, i, g: g.serial if board_of(g.model.key).has_inforom else _NA),
    "vbios_version": _Field(None, lambda s, i, g: g.vbios_version or board_of(g.model.key).vbios_version),
    "driver_version": _Field(None, lambda s, i, g: s.driver_version),
    "pci.bus_id": _Field(None, lambda s, i, g: nvml_bus_id(g.pci_bus_id)),
    "pci.domain": _Field(None, lambda s, i, g: _pci_part(g, 0, 4)),
    "pci.bus": _Field(None, lambda s, i, g: _pci_part(g, 1, 2)),
    "pci.device": _Field(None, lambda s, i, g: _pci_part(g, 2, 2)),
    "pci.device_id": _Field(None, lambda s, i, g: f"0x{g.model.pci_device_id:08X}"),
    "pcie.link.gen.current": _Field(None, lambda s, i, g: str(g.pcie_gen)),
    "pcie.link.gen.max": _Field(None, lambda s, i, g: str(g.pcie_max_gen)),
    "pcie.link.gen.gpumax": _Field(None, lambda s, i, g: str(g.model.pcie_max_gen)),
    "pcie.link.width.current": _Field(None, lambda s, i, g: str(g.pcie_width)),
    "pcie.link.width.max": _Field(None, lambda s, i, g: str(g.pcie_max_width)),
    "persistence_mode": _Field(None, lambda s, i, g: _on_off(g.persistence_mode)),
    "pstate": _Field(None, lambda s, i, g: "P0"),
    "compute_mode": _Field(None, lambda s, i, g: "Default"),
    "fan.speed": _Field("%", lambda s, i, g: _NA),
    "temperature.gpu": _Field(None, lambda s, i, g: str(g.temperature_c)),
    "memory.total": _Field("MiB", lambda s, i, g: str(g.model.memory_mib)),
    "memory.used": _Field("MiB", lambda s, i, g: str(g.memory_used_mib)),
    "memory.free": _Field("MiB", lambda s, i, g: str(g.model.memory_mib - g.memory_used_mib)),
    "utilization.gpu": _Field("%", lambda s, i, g: str(g.utilization_pct)),
    "power.draw": _Field("W", lambda s, i, g: f"{g.power_mw / 1000:.2f}"),
    "power.limit": _Field("W", lambda s, i, g: f"{g.model.power_limit_w:.2f}"),
    "ecc.mode.current": _Field(None, lambda s, i, g: _on_off(True) if g.model.ecc else _NA),
    "ecc.errors.corrected.volatile.total":
        _Field(None, lambda s, i, g: str(g.ecc_corrected) if g.model.ecc else _NA),
    "ecc.errors.uncorrected.volatile.total":
        _Field(None, lambda s, i, g: str(g.ecc_uncorrected) if g.model.ecc else _NA),
    "mig.mode.current": _Field(None, lambda s, i, g: _on_off(False) if g.model.mig else _NA),
}
# nvidia-smi's documented alternative names; the header shows the main name.
_ALIASES = {"gpu_name": "name", "gpu_uuid": "uuid", "gpu_serial": "serial", "gpu_bus_id": "pci.bus_id"}


def _query(state: NodeState, args: _Args, gpus: list[tuple[int, FakeGpu]]) -> SmiResult:
    lines = []
    if args.header:
        lines.append(", ".join(_header_name(f, args.units) for f in args.fields) + "\n")
    for index, gpu in gpus:
        if gpu.lost:
            lines.append(_lost_line(gpu))
        else:
            lines.append(", ".join(_cell(state, index, gpu, f, args.units) for f in args.fields) + "\n")
    return SmiResult(_lost_code(gpus), "".join(lines), "")


def _header_name(field: str, units: bool) -> str:
    unit = _FIELDS[field].unit
    return f"{field} [{unit}]" if unit and units else field


def _cell(state: NodeState, index: int, gpu: FakeGpu, field: str, units: bool) -> str:
    spec = _FIELDS[field]
    value = spec.value(state, index, gpu)
    if spec.unit and units and not value.startswith("["):
        return f"{value} {spec.unit}"
    return value


# -- the summary table (driver 550 layout: 91 columns, cells of 41, 24 and 22) ----------------------

_RULE = "+" + "-" * 89 + "+\n"
_GPU_RULE = "+" + "-" * 41 + "+" + "-" * 24 + "+" + "-" * 22 + "+\n"
_TABLE_HEAD = (
    "|" + "-" * 41 + "+" + "-" * 24 + "+" + "-" * 22 + "+\n"
    "| GPU  Name                 Persistence-M | Bus-Id          Disp.A | Volatile Uncorr. ECC |\n"
    "| Fan  Temp   Perf          Pwr:Usage/Cap |           Memory-Usage | GPU-Util  Compute M. |\n"
    "|                                         |                        |               MIG M. |\n"
    "|" + "=" * 41 + "+" + "=" * 24 + "+" + "=" * 22 + "|\n"
)
_PROCESS_HEAD = (
    "| Processes:                                                                              |\n"
    "|  GPU   GI   CI        PID   Type   Process name                              GPU Memory |\n"
    "|        ID   ID                                                               Usage      |\n"
    "|" + "=" * 89 + "|\n"
)
_PROCESS_NAME = "python3"      # the state keeps pid and memory only; a training job's usual name


def _table(state: NodeState, gpus: list[tuple[int, FakeGpu]], now: datetime) -> SmiResult:
    """The no-argument summary. Like the real one, a lost GPU aborts it: only the error lines print."""
    lost = [g for _, g in gpus if g.lost]
    if lost:
        return SmiResult(EXIT_GPU_IS_LOST, "".join(_lost_line(g) for g in lost), "")
    parts = [f"{now:%a %b} {now.day:>2} {now:%H:%M:%S %Y}       \n", _RULE, _version_row(state), _TABLE_HEAD]
    for index, gpu in gpus:
        parts += [_gpu_rows(index, gpu), _GPU_RULE]
    parts += [" " * 89 + "\n", _RULE, _PROCESS_HEAD, _process_rows(gpus), _RULE]
    return SmiResult(EXIT_OK, "".join(parts), "")


def _cuda_version(encoded: int) -> str:
    """12040 (nvmlSystemGetCudaDriverVersion) -> "12.4"."""
    return f"{encoded // 1000}.{encoded % 1000 // 10}"


def _version_row(state: NodeState) -> str:
    driver = state.driver_version
    return (f"| NVIDIA-SMI {driver:<23}Driver Version: {driver:<15}"
            f"CUDA Version: {_cuda_version(state.cuda_version):<9}|\n")


def _row(left: str, middle: str, right: str) -> str:
    return f"|{left}|{middle}|{right}|\n"


def _short_name(name: str) -> str:
    """Long product names are cut with an ellipsis to fit the Name column."""
    return name if len(name) <= 30 else name[:27] + "..."


def _gpu_rows(index: int, gpu: FakeGpu) -> str:
    model = gpu.model
    persistence = "On" if gpu.persistence_mode else "Off"
    ecc = str(gpu.ecc_uncorrected) if model.ecc else "N/A"
    temp, power, cap = f"{gpu.temperature_c}C", f"{round(gpu.power_mw / 1000)}W", f"{model.power_limit_w}W"
    used, total, util = f"{gpu.memory_used_mib}MiB", f"{model.memory_mib}MiB", f"{gpu.utilization_pct}%"
    first = _row(f"{index:>4}  {_short_name(model.name):<31}{persistence:<3} ",
                 f"   {nvml_bus_id(gpu.pci_bus_id)} Off ",
                 f"{ecc:>21} ")
    second = _row(f"{'N/A':>4}{temp:>6}{'P0':>6}{power:>16} / {cap:>5} ",      # fan, temp, perf, power
                  f"{used:>11} / {total:>9} ",
                  f"{util:>8}{'Default':>13} ")
    third = _row(" " * 41, " " * 24, f"{'Disabled' if model.mig else 'N/A':>21} ")
    return first + second + third


def _process_rows(gpus: list[tuple[int, FakeGpu]]) -> str:
    rows = [_process_row(index, pid, mib) for index, gpu in gpus for pid, mib in gpu.processes]
    if not rows:
        return "|  No running processes found" + " " * 61 + "|\n"
    return "".join(rows)


def _process_row(index: int, pid: int, mib: int) -> str:
    name = _PROCESS_NAME if len(_PROCESS_NAME) <= 42 else "..." + _PROCESS_NAME[-39:]
    return f"|{index:>5}   N/A  N/A{pid:>10}{'C':>7}   {name:<42}{str(mib) + 'MiB':>10} |\n"


# -- -r and -pm ------------------------------------------------------------------------------------

_IN_USE_TAIL = ("currently being used by one or more other processes (e.g., Fabric Manager, CUDA application, "
                "graphics application such as an X server, or a monitoring application such as another instance "
                "of nvidia-smi). Please first kill all processes using {} and all compute applications running "
                "in the system.\n")


def _reset(state: NodeState, gpus: list[tuple[int, FakeGpu]]) -> SmiResult:
    """Every GPU named is reset, or none: a GPU held by a process or by persistence mode refuses the lot."""
    lost = [g for _, g in gpus if g.lost]
    if lost:
        return SmiResult(EXIT_GPU_IS_LOST, "".join(_lost_line(g) for g in lost), "")
    if state.reset_unsupported:
        return SmiResult(EXIT_NOT_AVAILABLE, "".join(
            f"Resetting GPU {nvml_bus_id(g.pci_bus_id)} is not supported.\n" for _, g in gpus), "")
    held = [g for _, g in gpus if g.processes or g.persistence_mode]
    if held:
        one = len(held) == 1
        count = "1 device is" if one else f"{len(held)} devices are"
        return SmiResult(EXIT_OTHER, "The following GPUs could not be reset:\n" + "".join(
            f"  GPU {nvml_bus_id(g.pci_bus_id)}: In use by another client\n" for g in held)
            + f"\n{count} " + _IN_USE_TAIL.format("this device" if one else "these devices"), "")
    return SmiResult(EXIT_OK, "".join(f"GPU {nvml_bus_id(g.pci_bus_id)} was successfully reset.\n" for _, g in gpus)
                     + "All done.\n", "", tuple(("reset", g.index, True) for _, g in gpus))


def _persistence(gpus: list[tuple[int, FakeGpu]], on: bool) -> SmiResult:
    lines, actions = [], []
    for _, g in gpus:
        word = "Enabled" if on else "Disabled"
        if g.persistence_mode == on:
            lines.append(f"Persistence mode is already {word} for GPU {nvml_bus_id(g.pci_bus_id)}.\n")
        else:
            lines.append(f"{word} persistence mode for GPU {nvml_bus_id(g.pci_bus_id)}.\n")
            actions.append(("persistence", g.index, on))
    return SmiResult(EXIT_OK, "".join(lines) + "All done.\n", "", tuple(actions))


# -- help -------------------------------------------------------------------------------------------

def _help(state: NodeState) -> str:
    return (
        f"NVIDIA System Management Interface -- v{state.driver_version}\n\n"
        "(fake-nvidia-smi: a stand-in for tests; it answers from a fake node's state and\n"
        "implements only the options listed here.)\n\n"
        "nvidia-smi [OPTION1 [ARG1]] [OPTION2 [ARG2]] ...\n\n"
        "    -h,   --help                Print usage information and exit.\n\n"
        "  LIST OPTIONS:\n\n"
        "    -L,   --list-gpus           Display a list of GPUs connected to the system.\n\n"
        "  SUMMARY OPTIONS:\n\n"
        "    <no arguments>              Show a summary of GPUs connected to the system.\n\n"
        "    [plus any of]\n\n"
        "    -i,   --id=                 Target a specific GPU.\n\n"
        "  SELECTIVE QUERY OPTIONS:\n\n"
        "    --query-gpu=                Information about GPU (comma separated fields).\n"
        "    [mandatory]\n\n"
        "    --format=                   Comma separated list of format options:\n"
        "                                  csv - comma separated values (MANDATORY)\n"
        "                                  noheader - skip the first line with column headers\n"
        "                                  nounits - don't print units for numerical values\n\n"
        "    [plus any of]\n\n"
        "    -i,   --id=                 Target a specific GPU.\n\n"
        f"  Fields: {', '.join(sorted(_FIELDS))}\n"
    )


# -- entry points -----------------------------------------------------------------------------------

def run_smi(state: NodeState, argv: list[str], *, now: datetime | None = None) -> SmiResult:
    """What `nvidia-smi ARGV` prints on a node in `state`. Pure: no sleeping, no I/O.

    `now` stamps the summary table's first line (the wall clock when left out).
    Arguments are checked before the driver, as the real tool does, so `-h` and usage errors
    answer even on a node whose driver is not loaded.
    """
    try:
        args = _parse_args(argv)
    except _UsageError as e:
        return SmiResult(EXIT_INVALID_ARGUMENT, str(e), "")
    if args.mode == "help":
        return SmiResult(EXIT_OK, _help(state), "")
    if not state.driver_loaded:
        return SmiResult(EXIT_DRIVER_NOT_LOADED, _NO_DRIVER, "")
    if state.kernel_module_version and state.kernel_module_version != state.driver_version:
        library = ".".join(state.driver_version.split(".")[:2])
        return SmiResult(EXIT_OTHER, _VERSION_MISMATCH.format(library), "")
    gpus = _select(state, args.ids)
    if not gpus:
        return SmiResult(EXIT_NOT_FOUND, _NO_DEVICES, "")
    if args.mode == "list":
        return _list_gpus(gpus)
    if args.mode == "query":
        return _query(state, args, gpus)
    if args.mode == "reset":
        return _reset(state, gpus)
    if args.mode == "persistence":
        return _persistence(gpus, args.persistence)
    return _table(state, gpus, now or datetime.now())


class _NoNode(Exception):
    """No usable fake node in the environment: a one-line message, never a traceback."""


def _load_node_state(environ: Mapping[str, str]) -> NodeState:
    """The state named by $GPU_NPD_FAKE_STATE (a file), else a fresh build of $GPU_NPD_FAKE_SCENARIO."""
    state_path = environ.get(STATE_ENV)
    if state_path:
        try:
            return load_state(Path(state_path))
        except (OSError, ValueError, KeyError, TypeError) as e:   # missing, unreadable or corrupt
            raise _NoNode(f"cannot read fake node state from {STATE_ENV}={state_path}: "
                          f"{type(e).__name__}: {e}") from None
    scenario = environ.get(SCENARIO_ENV)
    if scenario:
        from fake_nvml.scenario import load_scenario     # YAML machinery only when needed
        try:
            return load_scenario(scenario).build().snapshot()
        except (OSError, ValueError, KeyError, TypeError) as e:   # SourceError is a ValueError
            raise _NoNode(f"cannot build fake node from {SCENARIO_ENV}={scenario}: {e}") from None
    raise _NoNode(f"no fake node to report on: set {STATE_ENV} to a state file "
                  f"or {SCENARIO_ENV} to a scenario name")


def main(argv: list[str] | None = None, *, sleep: Callable[[float], None] = time.sleep) -> int:
    """Console entry point: load the fake node, hang if it says so, print, return the exit code."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        state = _load_node_state(os.environ)
    except _NoNode as e:
        sys.stderr.write(f"fake-nvidia-smi: {e}\n")
        return EXIT_INVALID_ARGUMENT
    if state.smi_hang_s > 0:
        sleep(state.smi_hang_s)            # a wedged nvidia-smi: callers must time it out
    result = run_smi(state, argv)
    if result.actions and os.environ.get(STATE_ENV):
        _write_back(Path(os.environ[STATE_ENV]), state, result.actions)
    sys.stdout.write(result.stdout)
    sys.stderr.write(result.stderr)
    sys.stdout.flush()
    return result.returncode


def _write_back(path: Path, state: NodeState, actions: tuple[tuple[str, int, bool], ...]) -> None:
    """A reset or persistence change made by this process, saved where the next run reads the node."""
    from fake_nvml.node import FakeNode
    from fake_nvml.statefile import save_state
    node = FakeNode(state)
    for action in actions:
        node.inject(smi_fault(action))
    save_state(node, path)


def smi_fault(action: tuple[str, int, bool]) -> "object":
    """The fault that makes one of run_smi's actions happen on a fake node."""
    from fake_nvml.faults import Fault
    what, index, value = action
    if what == "reset":
        return Fault("gpu_reset", gpu=index)
    return Fault("persistence", gpu=index, params={"on": value})


if __name__ == "__main__":
    sys.exit(main())
