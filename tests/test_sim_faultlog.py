"""The fault log: one flushed JSON line per fault (readable while the run goes on), a copy in memory,
safe from many threads."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from detector.sim.faultlog import FaultLog, read_fault_log
from detector.sim.timeline import PlannedFault
from detector.yamlsource import SourceError
from fake_nvml.faults import Fault

XID = Fault("xid", 3, {"code": 79})


def test_a_record_is_one_flushed_json_line(tmp_path: Path) -> None:
    path = tmp_path / "faults.jsonl"
    log = FaultLog(path)
    record = log.record(1_700_000_060.5, 60.5, "gpu-h100-0017", XID, "scripted")
    expected = {"time": 1_700_000_060.5, "at_s": 60.5, "node": "gpu-h100-0017", "kind": "xid", "gpu": 3,
                "params": {"code": 79}, "source": "scripted", "fault": "xid on GPU 3 (code=79)"}
    assert record == expected
    # Another process tailing the file sees the line before the log is closed.
    assert path.read_text().endswith("\n")
    assert [json.loads(line) for line in path.read_text().splitlines()] == [expected]
    log.record(1_700_000_100.0, 100.0, "gpu-h100-0001", Fault("driver_unloaded"), "command")
    assert read_fault_log(path)[1]["gpu"] is None and read_fault_log(path)[1]["fault"] == "driver_unloaded"
    log.close()


def test_records_are_kept_in_memory_as_copies() -> None:
    log = FaultLog(None)
    returned = log.record(10.0, 0.0, "n1", XID, "random")
    returned["params"]["code"] = 43
    first = log.records()
    first[0]["node"] = "changed"
    first.append({})
    assert log.records() == [{"time": 10.0, "at_s": 0.0, "node": "n1", "kind": "xid", "gpu": 3,
                              "params": {"code": 79}, "source": "random", "fault": "xid on GPU 3 (code=79)"}]


def test_a_planned_fault_is_recorded_as_planned() -> None:
    log = FaultLog(None)
    log.record_planned(1000.0, PlannedFault(300.0, "n2", Fault("pcie", 0, {"width": 8}), "correlated"))
    (record,) = log.records()
    assert (record["at_s"], record["node"], record["source"], record["params"]) == (300.0, "n2", "correlated",
                                                                                  {"width": 8})


def test_an_unknown_source_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown fault source 'chaos'"):
        FaultLog(None).record(0.0, 0.0, "n1", XID, "chaos")


def test_the_log_appends_to_an_existing_file(tmp_path: Path) -> None:
    path = tmp_path / "faults.jsonl"
    with FaultLog(path) as log:
        log.record(1.0, 1.0, "n1", XID, "scripted")
    with FaultLog(path) as log:
        log.record(2.0, 2.0, "n2", XID, "scripted")
        assert len(log.records()) == 1                      # memory holds this run's faults only
    assert [r["node"] for r in read_fault_log(path)] == ["n1", "n2"]


def test_many_threads_write_whole_lines(tmp_path: Path) -> None:
    path = tmp_path / "faults.jsonl"
    log = FaultLog(path)

    def write(worker: int) -> None:
        for i in range(200):
            log.record(float(i), float(i), f"node-{worker}", Fault("kernel_line", None, {"message": "x" * 500}),
                       "random")

    threads = [threading.Thread(target=write, args=(w,)) for w in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    log.close()
    records = read_fault_log(path)
    assert len(records) == len(log.records()) == 1600
    assert {r["node"] for r in records} == {f"node-{w}" for w in range(8)}


def test_reading_skips_a_line_still_being_written(tmp_path: Path) -> None:
    path = tmp_path / "faults.jsonl"
    path.write_text('{"node": "n1"}\n\n{"node": "n2"}\n{"node": "n3", "ki')
    assert read_fault_log(path) == [{"node": "n1"}, {"node": "n2"}]


def test_reading_a_broken_line_names_it(tmp_path: Path) -> None:
    path = tmp_path / "faults.jsonl"
    path.write_text('{"node": "n1"}\nnot json\n{"node": "n2"}\n')
    with pytest.raises(SourceError) as e:
        read_fault_log(path)
    assert (e.value.file, e.value.line) == (str(path), 2)
    path.write_text('{"node": "n1"}\n[1, 2]\n')
    with pytest.raises(SourceError, match="expected an object"):
        read_fault_log(path)
    with pytest.raises(SourceError, match="cannot read"):
        read_fault_log(tmp_path / "missing.jsonl")
