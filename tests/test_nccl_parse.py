"""all_reduce_perf output parsing (`detector.checks.nccl.parse`) and its verdict as a ProbeResult.

1. Every fixture (tests/fixtures/nccl/README.md): header, ranks, rows, footers, failures, and the
   ProbeResult for how the process ended (ok with figures; failed/timeout with a one-line error).
2. The same figures come out through launcher tags, lost `#`, indentation, CRLF, NCCL log lines between
   every line, and a row split in two by NCCL log lines.
3. Garbage never raises: it is a failed result that says what was missing.
"""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest

from detector.checks.nccl.parse import AllReducePerfParser, Row, parse_all_reduce_perf
from detector.checks.nccl.probe import FAILED, OK, TIMEOUT
from detector.checks.nccl.process import ProcessOutcome

FIXTURES = Path(__file__).parent / "fixtures" / "nccl"
G8 = 8 * 1024 ** 3


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


def exited(rc: int | None = 0, output: str = "", status: str = "exited", error: str = "") -> ProcessOutcome:
    return ProcessOutcome(status, rc, output, 2.5, error)


def verdict(text: str, rc: int | None = 0, **kw):
    return parse_all_reduce_perf(text).to_result(exited(rc, text, **kw))


# --------------------------------------------------------------------------------------------------
# 1. Fixtures
# --------------------------------------------------------------------------------------------------

def test_h100_pass_figures_ranks_and_row():
    run = parse_all_reduce_perf(fixture("h100x8-pass.txt"))
    assert (run.nthreads, run.ngpus, run.min_bytes, run.max_bytes) == (1, 8, G8, G8)
    assert (run.warmup_iters, run.iters, run.validation) == (5, 20, 1)
    assert [r.rank for r in run.ranks] == list(range(8))
    assert [r.bus_id for r in run.ranks] == ["0x18", "0x2a", "0x3a", "0x5d", "0x9a", "0xab", "0xba", "0xdb"]
    first = run.ranks[0]
    assert (first.host, first.device, first.gpu_name, first.group, first.pid) == \
        ("h100-node-07", 0, "NVIDIA H100 80GB HBM3", 0, 412233)
    assert run.rows == [Row(G8, G8 // 4, "float", "sum", -1, 31281.0, 274.61, 480.56, 0,
                            31254.0, 274.84, 480.97, 0)]
    assert (run.out_of_bounds, run.avg_busbw_gbps, run.failures, run.warnings) == (0, 480.767, [], [])

    result = run.to_result(exited(0), ranks=8, size_bytes=G8)
    assert result.status == OK and result.error == ""
    assert (result.backend, result.transport, result.ranks, result.size_bytes) == ("nccl-tests", "nccl", 8, G8)
    assert (result.avg_busbw_gbps, result.min_busbw_gbps, result.busbw_gbps) == (480.767, 480.56, 480.767)
    assert result.wrong == 0 and result.duration_s == 2.5


def test_h100_degraded_newest_layout():
    run = parse_all_reduce_perf(fixture("h100x8-degraded.txt"))
    assert (run.ngpus, run.validation, len(run.ranks)) == (8, 1, 8)
    assert run.ranks[7].bus_id == "0000:db:00" and run.ranks[7].gpu_name == "NVIDIA H100 80GB HBM3"
    [row] = run.rows
    assert (row.oop_time_us, row.oop_busbw_gbps, row.ip_time_us, row.ip_busbw_gbps) == \
        (65307.3, 230.18, 65240.8, 230.41)
    result = run.to_result(exited(0))
    assert result.status == OK
    assert (result.busbw_gbps, result.min_busbw_gbps, result.wrong) == (230.297, 230.18, 0)


def test_h100_wrong_values_are_figures_not_a_failure():
    """#wrong printed with %5g (3.35544e+07) is still a count; exit 1 from the wrong values is not a failure."""
    text = fixture("h100x8-wrong.txt")
    run = parse_all_reduce_perf(text)
    [row] = run.rows
    assert (row.oop_wrong, row.ip_wrong, row.wrong) == (33554400, 131072, 33554400 + 131072)
    assert run.out_of_bounds == 2 and run.failures == []
    result = run.to_result(exited(1, text))
    assert result.status == OK and result.error == ""
    assert result.wrong == 33685472
    assert result.busbw_gbps == 480.023 and result.min_busbw_gbps == 479.81


def test_h100_aborted_names_the_first_failure():
    text = fixture("h100x8-aborted.txt")
    run = parse_all_reduce_perf(text)
    assert len(run.ranks) == 8 and run.rows == []
    assert run.avg_busbw_gbps is None and run.out_of_bounds is None
    assert run.failures[0].startswith("h100-node-03: Test NCCL failure common.cu:1005 'unhandled cuda error")
    assert run.failures[1] == ".. h100-node-03 pid 77120: Test failure common.cu:891"
    assert len(run.failures) == 7
    assert run.warnings == ["Cuda failure 'uncorrectable NVLink error detected during the execution'"] * 2
    result = run.to_result(exited(3, text))
    assert result.status == FAILED
    assert result.error.startswith("all_reduce_perf failed (exit 3): h100-node-03: Test NCCL failure common.cu:1005 "
                                   "'unhandled cuda error")
    assert "first NCCL WARN: Cuda failure 'uncorrectable NVLink error" in result.error
    assert "\n" not in result.error and len(result.error) <= 300
    assert (result.busbw_gbps, result.avg_busbw_gbps, result.min_busbw_gbps, result.wrong) == (None,) * 4
    assert (result.ranks, result.size_bytes) == (8, G8)       # from the header, when the caller gives none


def test_a100_multisize_old_layout():
    run = parse_all_reduce_perf(fixture("a100x8-multisize.txt"))
    assert (run.ngpus, run.warmup_iters, run.iters, run.validation) == (8, 5, 20, 1)
    assert [(r.rank, r.group, r.pid, r.device, r.bus_id) for r in run.ranks[:2]] == \
        [(0, None, 26528, 0, "0x07"), (1, None, 26528, 1, "0x0f")]
    assert run.ranks[0].gpu_name == "NVIDIA A100-SXM4-80GB"
    assert [r.size_bytes for r in run.rows] == [32 * 1024 ** 2 * 2 ** k for k in range(9)]
    assert all(r.root is None and r.oop_wrong is None and r.ip_wrong is None for r in run.rows)
    assert run.rows[0].oop_time_us == 388.4 and run.rows[-1].ip_busbw_gbps == 236.25
    result = run.to_result(exited(0))
    assert result.status == OK
    assert result.avg_busbw_gbps == 215.379
    assert result.min_busbw_gbps == 150.84                # the smallest size's in-place busbw
    assert result.wrong == 0                              # the `error` column is no count: out-of-bounds it is
    assert result.size_bytes == G8                        # the largest (last) size when the caller gives none


def test_validation_off_has_no_wrong_count():
    run = parse_all_reduce_perf(fixture("validation-off.txt"))
    assert run.validation == 0
    [row] = run.rows
    assert (row.oop_wrong, row.ip_wrong) == (None, None)
    assert row.describe() == "8589934592 B: busbw 480.8 GB/s out-of-place, 481.2 GB/s in-place, not validated"
    result = run.to_result(exited(0))
    assert result.status == OK and result.wrong is None and result.busbw_gbps == 480.99


@pytest.mark.parametrize("name", ["h100x8-pass.txt", "h100x8-degraded.txt", "h100x8-wrong.txt",
                                  "a100x8-multisize.txt", "validation-off.txt"])
def test_every_complete_fixture_is_ok_whatever_the_exit_code(name):
    for rc in (0, 1):
        assert verdict(fixture(name), rc).status == OK


def test_row_describe_in_plain_words():
    [row] = parse_all_reduce_perf(fixture("h100x8-pass.txt")).rows
    assert row.describe() == "8589934592 B: busbw 480.6 GB/s out-of-place, 481.0 GB/s in-place, 0 wrong"


# --------------------------------------------------------------------------------------------------
# 1b. How the process ended
# --------------------------------------------------------------------------------------------------

def test_killed_by_signal_is_failed_even_with_figures():
    text = fixture("h100x8-pass.txt")
    result = verdict(text, -11)
    assert result.status == FAILED
    assert result.error.startswith("all_reduce_perf killed by signal SIGSEGV (11); last output: ")
    assert result.busbw_gbps is None


def test_signal_names_the_failure_line_when_there_is_one():
    result = verdict(fixture("h100x8-aborted.txt"), -6)
    assert result.error.startswith("all_reduce_perf killed by signal SIGABRT (6): h100-node-03: Test NCCL failure")


def test_timeout_keeps_the_outcome_error_and_the_last_output():
    text = "\n".join(fixture("h100x8-pass.txt").splitlines()[:14])      # header, ranks, some INFO
    result = verdict(text, -15, status="timeout", error="killed after 300s (the whole process group)")
    assert result.status == TIMEOUT
    assert result.error == ("all_reduce_perf killed after 300s (the whole process group); "
                            "last output: NCCL version 2.21.5+cuda12.4")


def test_timeout_after_rows_says_how_far_it_got():
    text = "\n".join(fixture("a100x8-multisize.txt").splitlines()[:18])
    result = verdict(text, -15, status="timeout", error="killed after 60s (the whole process group)")
    assert result.status == TIMEOUT
    assert result.error.startswith("all_reduce_perf killed after 60s (the whole process group) after 3 result row(s); "
                                   "last output: 134217728")


def test_could_not_start():
    result = verdict("", None, status="error", error="cannot run /opt/x/all_reduce_perf: No such file or directory")
    assert (result.status, result.error) == (FAILED, "cannot run /opt/x/all_reduce_perf: No such file or directory")


def test_rows_without_footer_are_an_aborted_run():
    lines = fixture("a100x8-multisize.txt").splitlines()
    text = "\n".join(line for line in lines if "Avg bus bandwidth" not in line and "Out of bounds" not in line)
    run = parse_all_reduce_perf(text)
    assert len(run.rows) == 9 and not run.complete
    result = run.to_result(exited(0, text))
    assert result.status == FAILED
    assert result.error.startswith("all_reduce_perf stopped after 9 result row(s) without the '# Avg bus bandwidth' "
                                   "footer; last output: 8589934592")


def test_header_only_and_non_zero_exit():
    text = "\n".join(fixture("h100x8-pass.txt").splitlines()[:11])
    assert verdict(text, 0).error == (                                   # spaces squeezed
        "all_reduce_perf printed no result rows; last output: "
        "# Rank 7 Group 0 Pid 412233 on h100-node-07 device 7 [0xdb] NVIDIA H100 80GB HBM3")
    assert verdict(text, 2).error.startswith("all_reduce_perf exited 2 without results; last output: # Rank 7")


def test_invalid_option_is_a_failure_even_with_exit_0():
    text = "invalid option 'x'\nUSAGE: all_reduce_perf \n\t[-t,--nthreads <num threads>] \n\t[-h,--help]\n"
    result = verdict(text, 0)
    assert (result.status, result.error) == (FAILED, "all_reduce_perf failed: invalid option 'x'")


def test_a_failed_line_after_a_complete_table_is_a_failure():
    text = fixture("h100x8-pass.txt") + "h100-node-07: Test CUDA failure common.cu:1290 'unknown error'\n"
    result = verdict(text, 2)
    assert result.status == FAILED
    assert result.error == \
        "all_reduce_perf failed (exit 2): h100-node-07: Test CUDA failure common.cu:1290 'unknown error'"


def test_min_bw_check_footer_is_a_figure_not_a_failure():
    """NCCL_TESTS_MIN_BW makes the average footer say OK/FAILED and the exit 1; our thresholds judge busbw."""
    text = fixture("h100x8-degraded.txt").replace("Avg bus bandwidth    : 230.297 ",
                                                  "Avg bus bandwidth    : 230.297 FAILED")
    run = parse_all_reduce_perf(text)
    assert run.failures == [] and run.avg_busbw_gbps == 230.297
    assert run.to_result(exited(1, text)).status == OK


def test_out_of_bounds_fallback_when_wrong_is_na_but_validation_on():
    text = fixture("validation-off.txt").replace("validation: 0", "validation: 1").replace(
        "Out of bounds values : 0 OK", "Out of bounds values : 1 FAILED")
    assert verdict(text, 1).wrong == 1


def test_csv_era_minus_one_means_not_validated():
    line = ("  8589934592    2147483648     float     sum      -1    31266  274.74  480.79     -1"
            "    31240  274.97  481.19     -1")
    [row] = parse_all_reduce_perf(line).rows
    assert (row.oop_wrong, row.ip_wrong) == (None, None)


# --------------------------------------------------------------------------------------------------
# 2. Noise and launcher variants
# --------------------------------------------------------------------------------------------------

def figures(text: str):
    run = parse_all_reduce_perf(text)
    return (run.ngpus, run.validation, [(r.rank, r.host, r.device, r.bus_id, r.gpu_name) for r in run.ranks],
            run.rows, run.out_of_bounds, run.avg_busbw_gbps, run.failures, run.to_result(exited(0)).status)


@pytest.mark.parametrize("name", ["h100x8-pass.txt", "h100x8-wrong.txt", "h100x8-degraded.txt",
                                  "a100x8-multisize.txt", "validation-off.txt", "h100x8-aborted.txt"])
@pytest.mark.parametrize("variant", [
    pytest.param(lambda line: "[1,0]<stdout>:" + line, id="openmpi-tag-output"),
    pytest.param(lambda line: "[0] " + line, id="bracket-rank"),
    pytest.param(lambda line: "0: " + line, id="srun-label"),
    pytest.param(lambda line: line[1:] if line.startswith("#") else line, id="no-hash"),
    pytest.param(lambda line: "    " + line, id="indented"),
    pytest.param(lambda line: line + "\r", id="crlf"),
    pytest.param(lambda line: line + "\ngpu-1:4242:4250 [3] NCCL INFO Channel 07/0 : 3[3] -> 4[4] via P2P/CUMEM/read",
                 id="nccl-info-between-every-line"),
])
def test_same_figures_through_noise(name, variant):
    text = fixture(name)
    noisy = "\n".join(variant(line) for line in text.splitlines())
    assert figures(noisy) == figures(text)


def test_row_split_by_nccl_log_lines():
    """With NCCL_DEBUG=INFO the row's start is printed before the collective, its figures after."""
    text = (
        "  8589934592    2147483648     float     sum      -1"
        "h100-node-07:1:2 [0] NCCL INFO 8589934592 Bytes -> Algo 1\n"
        "h100-node-07:1:2 [0] NCCL INFO 8589934592 Bytes -> Algo 1 proto 2 time 31000.1\n"
        "    31281  274.61  480.56      0h100-node-07:1:2 [0] NCCL INFO 8589934592 Bytes -> Algo 1\n"
        "[0]     31254  274.84  480.97      0\n"
        "# Out of bounds values : 0 OK\n# Avg bus bandwidth    : 480.767 \n")
    run = parse_all_reduce_perf(text)
    assert run.rows == parse_all_reduce_perf(fixture("h100x8-pass.txt")).rows
    assert run.to_result(exited(0)).status == OK


def test_failure_glued_to_a_row_start():
    text = ("  8589934592    2147483648     float     sum      -1h100-node-03: Test NCCL failure common.cu:1005 "
            "'unhandled cuda error'\n .. h100-node-03 pid 77120: Test failure common.cu:891\n")
    run = parse_all_reduce_perf(text)
    assert run.rows == []
    assert run.failures[0] == "h100-node-03: Test NCCL failure common.cu:1005 'unhandled cuda error'"


def test_headings_without_hash_are_not_the_last_output():
    text = "\n".join(line.lstrip("#") for line in fixture("h100x8-pass.txt").splitlines()[:21])
    assert verdict(text, 1).error == \
        "all_reduce_perf exited 1 without results; last output: NCCL version 2.21.5+cuda12.4"


def test_failure_glued_to_a_complete_row_is_kept():
    glued = "480.97      0h100-node-07: Test CUDA failure common.cu:1290 'unknown error'\n"
    text = fixture("h100x8-pass.txt").replace("480.97      0\n", glued)
    run = parse_all_reduce_perf(text)
    assert len(run.rows) == 1 and run.failures == ["h100-node-07: Test CUDA failure common.cu:1290 'unknown error'"]
    assert run.to_result(exited(2, text)).status == FAILED


def test_oldest_rank_line_and_rccl_bus_format():
    text = ("#   Rank  0 on     node03 device  0 [0x00] Tesla P100-PCIE-16GB\n"
            "#   Rank  1 Pid  21284 on deep-visionscaper3 device  1 [0000:03:00.0] AMD Instinct MI100\n")
    ranks = parse_all_reduce_perf(text).ranks
    assert [(r.rank, r.pid, r.host, r.bus_id, r.gpu_name) for r in ranks] == [
        (0, None, "node03", "0x00", "Tesla P100-PCIE-16GB"),
        (1, 21284, "deep-visionscaper3", "0000:03:00.0", "AMD Instinct MI100")]


def test_old_header_printed_once_per_process_is_read_once():
    header = ("# nThread 1 nGpus 1 minBytes 1310720000 maxBytes 1310720000 step: 1048576(bytes) "
              "warmup iters: 5 iters: 20 validation: 1\n")
    run = parse_all_reduce_perf(header + header.replace("nGpus 1", "nGpus 4"))
    assert (run.ngpus, run.min_bytes, run.validation) == (1, 1310720000, 1)


def test_large_times_and_exponent_figures():
    line = ("  8589934592    2147483648     float     sum      -1  1.2e+08    0.07    0.13  1.67772e+07"
            "  12345678    0.70    1.22       0")
    [row] = parse_all_reduce_perf(line).rows
    assert (row.oop_time_us, row.oop_wrong, row.ip_time_us, row.ip_wrong) == (1.2e8, 16777200, 12345678.0, 0)


def test_per_iteration_columns_and_timestamps():
    names = ("#       size         count      type   redop    root     time   algbw   busbw  #wrong    i_min    i_max"
             "    i_p99    i_cv%     time   algbw   busbw  #wrong    i_min    i_max    i_p99    i_cv%\n")
    row = ("  8589934592    2147483648     float     sum      -1  31281.0  274.61  480.56       0  31100.2  31502.9"
           "  31490.0     0.31  31254.0  274.84  480.97       3  31080.0  31470.1  31460.2     0.28"
           "  2025-10-06 17:59:27\n")
    [parsed] = parse_all_reduce_perf(names + row).rows
    assert (parsed.oop_busbw_gbps, parsed.oop_wrong, parsed.ip_busbw_gbps, parsed.ip_wrong) == (480.56, 0, 480.97, 3)
    plain = ("  8589934592    2147483648     float     sum      -1    31281  274.61  480.56      0    31254  274.84"
             "  480.97      0  2025-10-06 17:59:27\n")
    assert parse_all_reduce_perf(plain).rows[0].ip_busbw_gbps == 480.97


def test_streaming_parser_reports_what_to_show():
    parser = AllReducePerfParser()
    shown = [seen for line in fixture("h100x8-aborted.txt").splitlines() if (seen := parser.feed(line))]
    assert [s.kind for s in shown] == ["warning", "warning"] + ["failure"] * 7
    parser = AllReducePerfParser()
    shown = [seen for line in fixture("h100x8-pass.txt").splitlines() if (seen := parser.feed(line))]
    assert [(s.kind, s.text) for s in shown] == [
        ("row", "8589934592 B: busbw 480.6 GB/s out-of-place, 481.0 GB/s in-place, 0 wrong"),
        ("summary", "all_reduce_perf done: avg busbw 480.767 GB/s, 0 out-of-bounds")]


# --------------------------------------------------------------------------------------------------
# 3. Garbage
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, error", [
    ("", "no all_reduce_perf header or results in the output (is it nccl-tests?); no output"),
    ("\n\n#\n", "no all_reduce_perf header or results in the output (is it nccl-tests?); no output"),
    ("Hello world\nthis is not nccl-tests\n",
     "no all_reduce_perf header or results in the output (is it nccl-tests?); last output: this is not nccl-tests"),
    ("bash: all_reduce_perf: command not found\n",
     "no all_reduce_perf header or results in the output (is it nccl-tests?); last output: bash: all_reduce_perf: "
     "command not found"),
    ("# Avg bus bandwidth    : nan \n", "no all_reduce_perf header or results in the output (is it nccl-tests?); "
     "last output: # Avg bus bandwidth : nan"),
    ("  8589934592    2147483648     float     sum      -1    N/A  N/A  N/A  0  N/A  N/A  N/A  0\n"
     "# Avg bus bandwidth    : 1 \n", "no all_reduce_perf header or results in the output (is it nccl-tests?); "
     "last output: # Avg bus bandwidth : 1"),
])
def test_garbage_is_a_clear_failure(text, error):
    result = verdict(text, 0)
    assert (result.status, result.error) == (FAILED, error)


def test_random_input_never_raises():
    rng = random.Random(20251006)
    pieces = fixture("h100x8-pass.txt").split() + fixture("h100x8-aborted.txt").split() + \
        ["#", "N/A", "-1", "1e+400", "nan", "[1,0]<stdout>:", "Rank", "Group", "on", "device", "[", "]", ":", "\x00",
         "\ufffd", "Avg", "bus", "bandwidth", "Out", "of", "bounds", "values", "FAILED", "OK", "\t",
         "99999999999999999999"]
    for _ in range(300):
        lines = [" ".join(rng.choice(pieces) for _ in range(rng.randint(0, 16))) for _ in range(rng.randint(0, 30))]
        text = "\n".join(lines)
        run = parse_all_reduce_perf(text)
        result = run.to_result(exited(rng.choice([0, 1, 3, -11, None]), text))
        assert result.status in (OK, FAILED)
        assert "\n" not in result.error and len(result.error) <= 300
        if result.status == OK:
            assert run.rows and result.busbw_gbps is not None


def test_error_is_one_bounded_line():
    text = "h100: Test NCCL failure common.cu:1 '" + "x" * 1000 + "'\n"
    error = verdict(text, 3).error
    assert len(error) == 300 and error.endswith("…")
    assert re.match(r"^all_reduce_perf failed \(exit 3\): h100: ", error)
