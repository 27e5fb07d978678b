"""The torch.distributed all-reduce probe, run as its own program so that the daemon never imports torch:
`python -m detector.checks.nccl.torch_worker --transport nccl|gloo --ranks N --size-bytes B`.

The launcher process stays torch-free (fast to start, nothing to fork-corrupt) and spawns one process per
rank; the ranks rendezvous through a file in a private temporary directory, so no TCP port is picked.
Rank 0 prints one `GPU_NPD_TORCH_PROBE {json}` line on stdout; progress and errors go to stderr."""

from __future__ import annotations

import argparse
import json
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass
from multiprocessing.process import BaseProcess
from types import ModuleType
from typing import Any, Sequence

PROG = "torch_worker"
RESULT_MARKER = "GPU_NPD_TORCH_PROBE"
ERROR_PREFIX = f"{PROG}: error: "          # argparse's own format, reused for rank failures
RANK_FAILED = 1                             # a rank that reported its own error exits with this
FAIL_RANK_ENV = "GPU_NPD_TORCH_PROBE_FAIL_RANK"   # fault injection: that rank raises after rendezvous
TRANSPORTS = ("nccl", "gloo")


@dataclass(frozen=True)
class WorkerArgs:
    transport: str
    ranks: int
    size_bytes: int
    warmup: int
    iterations: int
    timeout_s: float                        # process-group timeout: a rank never waits longer on a peer


@dataclass(frozen=True)
class ProbeLine:
    """The one result line rank 0 prints; the backend parses it with `parse`."""

    ranks: int
    transport: str
    size_bytes: int
    busbw_gbps: list[float]            # per rank, in rank order
    wrong: int                         # mismatching elements of the validation all-reduce, all ranks
    iterations: int

    def line(self) -> str:
        return f"{RESULT_MARKER} {json.dumps(asdict(self))}"

    @classmethod
    def parse(cls, line: str) -> ProbeLine | None:
        """None unless `line` is a well-formed result line."""
        marker, _, payload = line.strip().partition(" ")
        if marker != RESULT_MARKER:
            return None
        try:
            data = json.loads(payload)
            return cls(int(data["ranks"]), str(data["transport"]), int(data["size_bytes"]),
                       [float(b) for b in data["busbw_gbps"]], int(data["wrong"]), int(data["iterations"]))
        except (ValueError, KeyError, TypeError):
            return None


def parse_args(argv: Sequence[str] | None = None) -> WorkerArgs:
    """Refuses what would measure nothing: one rank has no bus bandwidth, a partial float has no element."""
    parser = argparse.ArgumentParser(prog=PROG, description="torch.distributed all-reduce bandwidth probe")
    parser.add_argument("--transport", choices=TRANSPORTS, default="nccl")
    parser.add_argument("--ranks", type=int, required=True, help="processes, one per GPU for nccl")
    parser.add_argument("--size-bytes", type=int, required=True, help="message size, a multiple of 4 (float32)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--timeout-s", type=float, default=120.0, help="process-group timeout")
    ns = parser.parse_args(argv)
    if ns.ranks < 2:
        parser.error(f"--ranks must be at least 2, got {ns.ranks}: all-reduce bus bandwidth over one rank is 0")
    if ns.size_bytes <= 0 or ns.size_bytes % 4:
        parser.error(f"--size-bytes must be a positive multiple of 4 (float32 elements), got {ns.size_bytes}")
    if ns.warmup < 0:
        parser.error(f"--warmup must be 0 or more, got {ns.warmup}")
    if ns.iterations < 1:
        parser.error(f"--iterations must be at least 1, got {ns.iterations}")
    if ns.timeout_s <= 0:
        parser.error(f"--timeout-s must be positive, got {ns.timeout_s:g}")
    return WorkerArgs(ns.transport, ns.ranks, ns.size_bytes, ns.warmup, ns.iterations, ns.timeout_s)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    # run_process ends the probe with SIGTERM to the whole group: exit through `finally` to clean up.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    workdir = tempfile.mkdtemp(prefix="gpu-npd-torch-")
    try:
        _say(f"starting {args.ranks} {args.transport} ranks, {args.size_bytes} bytes per all-reduce")
        return _run_ranks(args, os.path.join(workdir, "rendezvous"))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _run_ranks(args: WorkerArgs, rendezvous: str) -> int:
    """Start every rank, and at the first one that fails stop the rest rather than let them wait."""
    if args.transport == "gloo":
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")   # one node: gloo's data connections stay on loopback
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_rank_main, args=(rank, args, rendezvous), name=f"rank-{rank}", daemon=True)
             for rank in range(args.ranks)]
    try:
        for proc in procs:
            proc.start()
        running = {proc.sentinel: rank for rank, proc in enumerate(procs)}
        while running:
            for sentinel in multiprocessing.connection.wait(list(running)):
                rank = running.pop(sentinel)
                procs[rank].join()            # reaped, so exitcode is set
                code = procs[rank].exitcode
                if code == 0:
                    continue
                if code != RANK_FAILED:       # died without reporting (a signal, a hard exit)
                    _say(ERROR_PREFIX + f"rank {rank}: {_describe_exit(code)}")
                return 1
        return 0
    finally:
        _stop(procs)


def _stop(procs: list[BaseProcess]) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    for proc in procs:
        proc.join(timeout=2.0)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=2.0)


def _describe_exit(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


def _rank_main(rank: int, args: WorkerArgs, rendezvous: str) -> None:
    """One rank, in its own spawned process: any exception becomes one error line and exit code 1.
    The line is written before the process group is torn down, so the root cause comes out ahead of
    the peers' "connection reset" that the teardown causes."""
    try:
        _probe(rank, args, rendezvous)
    except Exception as e:  # noqa: BLE001 - every failure must become the one line the backend reports
        _say(ERROR_PREFIX + f"rank {rank}: {type(e).__name__}: {_first_line(str(e))}")
        sys.exit(RANK_FAILED)


def _probe(rank: int, args: WorkerArgs, rendezvous: str) -> None:
    # torch built without numpy warns at import; that line would only be noise in the probe's progress.
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    import datetime

    import torch
    import torch.distributed as dist

    from detector.checks.nccl.probe import all_reduce_busbw

    n, nccl = args.ranks, args.transport == "nccl"
    if nccl:
        _check_cuda(torch, dist, rank)
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        torch.set_num_threads(1)          # ranks share the CPUs; gloo's own threads do the transport
        device = torch.device("cpu")
    dist.init_process_group(args.transport, init_method=f"file://{rendezvous}", rank=rank, world_size=n,
                            timeout=datetime.timedelta(seconds=args.timeout_s))
    if rank == 0:
        _say(f"rendezvous done: {n} ranks")
    if os.environ.get(FAIL_RANK_ENV) == str(rank):
        raise RuntimeError(f"failure injected by {FAIL_RANK_ENV}")
    buffer = torch.zeros(args.size_bytes // 4, dtype=torch.float32, device=device)
    for _ in range(args.warmup):
        dist.all_reduce(buffer)
    if nccl:
        torch.cuda.synchronize()
    if rank == 0:
        _say(f"warm-up done: {args.warmup} iterations")
    seconds = _timed(dist, torch, buffer, args.iterations, nccl, rank) / args.iterations
    busbw = all_reduce_busbw(args.size_bytes, seconds, n)
    buffer.fill_(rank + 1)
    dist.all_reduce(buffer)
    wrong = int((buffer != n * (n + 1) // 2).sum().item())
    stats = torch.tensor([busbw, float(wrong)], dtype=torch.float64, device=device)
    gathered = [torch.zeros_like(stats) for _ in range(n)]
    dist.all_gather(gathered, stats)
    if rank == 0:
        rows = [g.tolist() for g in gathered]
        result = ProbeLine(n, args.transport, args.size_bytes, [row[0] for row in rows],
                           int(sum(row[1] for row in rows)), args.iterations)
        _say(f"timed {args.iterations} iterations: busbw min {min(result.busbw_gbps):.2f}, "
             f"avg {sum(result.busbw_gbps) / n:.2f} GB/s; {result.wrong} wrong elements")
        print(result.line(), flush=True)
    dist.destroy_process_group()


def _check_cuda(torch: ModuleType, dist: ModuleType, rank: int) -> None:
    """Say plainly what is missing, rather than torch's own error from deep inside set_device."""
    if not torch.cuda.is_available():
        raise RuntimeError(f"CUDA is not available to torch {torch.__version__} "
                           f"(built for CUDA {torch.version.cuda or 'none: a CPU build'})")
    if not dist.is_nccl_available():
        raise RuntimeError(f"torch {torch.__version__} was built without NCCL")
    if rank >= torch.cuda.device_count():
        raise RuntimeError(f"needs GPU {rank} but only {torch.cuda.device_count()} CUDA devices are visible")


def _timed(dist: ModuleType, torch: ModuleType, buffer: Any, iterations: int, nccl: bool, rank: int) -> float:
    """Seconds for `iterations` all-reduces, started together. On GPUs CUDA events time the stream
    itself; on CPUs the calls are synchronous, so the wall clock does."""
    if nccl:
        dist.barrier(device_ids=[rank])
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iterations):
            dist.all_reduce(buffer)
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1000.0
    dist.barrier()
    began = time.perf_counter()
    for _ in range(iterations):
        dist.all_reduce(buffer)
    return time.perf_counter() - began


def _say(message: str) -> None:
    """One write per line: stderr writes through, so print()'s separate newline could let another rank's
    line land between a message and its end (an error then reads 'failed...rendezvous done')."""
    sys.stderr.write(message + "\n")
    sys.stderr.flush()


def _first_line(text: str, limit: int = 300) -> str:
    line = next((part.strip() for part in text.splitlines() if part.strip()), "(no message)")
    return line if len(line) <= limit else line[:limit - 3] + "..."


if __name__ == "__main__":
    sys.exit(main())
