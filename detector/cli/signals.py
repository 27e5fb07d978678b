"""How a command ends when its terminal or its pipe does: Ctrl-C, SIGTERM, a closed pipe, a full disk.

Ctrl-C and SIGTERM: the first asks the command to stop, the second ends the process at once. The first
signal is the polite one: the daemon finishes its last send, diagnose abandons a hung NVML call or
nvidia-smi and exits 130. If that still takes too long for the person at the keyboard, a second Ctrl-C
(or SIGTERM) kills the child process groups gpu-npd started and exits on the spot.

Output that cannot be written ends a command as it ends a Unix tool, never in a traceback (`ended_well`,
which every command runs under): a reader that went away (`gpu-npd checks | head -1`) ends it quietly
with 141, what a shell reports for a tool SIGPIPE ended; a full disk (`> /dev/full`) is one line on
stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import atexit
import errno
import os
import signal
import sys
import threading
from typing import IO, Any, Callable

from detector.backends.children import LIVE_GROUPS

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
EXIT_INTERRUPTED = 128 + signal.SIGINT           # 130
EXIT_PIPE_CLOSED = 128 + signal.SIGPIPE          # 141
EXIT_CANNOT_WRITE = 2                            # as any other error the person must fix
# Errors that say the output's destination is full or broken, not that the command went wrong.
_CANNOT_WRITE = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO})


class Interrupted(KeyboardInterrupt):
    """A stop signal reached a one-shot command; it exits 128 + the signal's number."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.exit_code = 128 + signum


def raise_interrupted(signum: int) -> None:
    raise Interrupted(signum)


def on_stop_signals(first: Callable[[int], None] = raise_interrupted) -> dict[int, Any]:
    """Install the handlers (main thread only); returns the ones they replace, for `restore`.
    `first(signum)` runs on the first stop signal."""
    received: list[int] = []

    def handler(signum: int, _frame: object) -> None:
        if received:
            LIVE_GROUPS.kill_all()
            os._exit(128 + signum)           # no cleanup left to wait for: the person asked twice
        received.append(signum)
        first(signum)

    return {signum: signal.signal(signum, handler) for signum in STOP_SIGNALS}


def restore(previous: dict[int, Any]) -> None:
    for signum, handler in previous.items():
        signal.signal(signum, handler)


def ended_well(command: Callable[[], int]) -> int:
    """Run `command` (a whole CLI command) and return its exit code, or the one its output's end calls for.

    Python ignores SIGPIPE, so a closed pipe is a BrokenPipeError at the next write; a full disk is an
    OSError at the write or, for buffered output, at the flush. Stdout is flushed here, so both are met
    while the exit code can still say so, not in the interpreter's last flush (an "Exception ignored"
    traceback). Ctrl-C anywhere (while parsing, importing, or in a command without handlers) exits 130."""
    try:
        try:
            code = command()
        except SystemExit:               # --help, --version: what argparse wrote is flushed here too
            sys.stdout.flush()
            raise
        finally:
            _spare_stdin()
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        _discard_stdout()
        return EXIT_PIPE_CLOSED
    except KeyboardInterrupt as e:
        return e.exit_code if isinstance(e, Interrupted) else EXIT_INTERRUPTED
    except OSError as e:
        if e.errno not in _CANNOT_WRITE:
            raise
        _discard_stdout()
        _say(f"gpu-npd: error: cannot write output: {e.strerror or e}")
        return EXIT_CANNOT_WRITE


class Parser(argparse.ArgumentParser):
    """argparse's parser, save that help, usage or a version it cannot write reaches `ended_well` (argparse
    drops the OSError, so `gpu-npd --help > /dev/full` would exit 0 having said nothing). Its subcommands'
    parsers are of its class."""

    def _print_message(self, message: str, file: IO[str] | None = None) -> None:
        if message:
            (file or sys.stderr).write(message)


def _spare_stdin() -> None:
    """Leave stdin unclosed at exit while a thread the command started may still read it: a check abandoned
    mid-read (`journalctl -k | gpu-npd diagnose --kernel-log -`, then Ctrl-C or the check's timeout) holds
    its lock, and the interpreter closing it at shutdown would abort ("Fatal Python error: could not acquire
    lock"). Only the process's own stdin, and only at its exit (atexit runs before that close)."""
    others = [t for t in threading.enumerate() if t is not threading.current_thread() and t.is_alive()]
    if others and sys.stdin is not None and sys.stdin is sys.__stdin__:
        atexit.unregister(_forget_stdin)         # once, however many commands ran
        atexit.register(_forget_stdin)


def _forget_stdin() -> None:
    sys.stdin = sys.__stdin__ = None


def _discard_stdout() -> None:
    """Point file descriptor 1 at /dev/null, so what is still buffered goes nowhere at exit instead of
    failing again (Python's documented advice on SIGPIPE). Only the process's own stdout: a stand-in (a
    test's capture) has no pipe to close."""
    if sys.stdout is None or sys.stdout is not sys.__stdout__:
        return
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, sys.stdout.fileno())
        finally:
            os.close(devnull)
    except (OSError, ValueError):
        pass


def _say(line: str) -> None:
    """One line on stderr, unless stderr cannot take it either: there is nowhere left to say it."""
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass
