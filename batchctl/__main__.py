"""`python -m batchctl` and the `batchctl` console script."""

import atexit
import contextlib
import gc
import os
import signal
import sys
import threading

from batchctl.run.signals import Signalled, quiet_unraisable_signals, raise_signalled, signalled_in


def builds_locally(args: list[str]) -> bool:
    """Whether the command is, by the look of it, a build on this machine's processes. Its fork
    server is then started before anything else: the server's preloads (numpy, Pillow, numcodecs:
    ~0.15 s) run on another core while this process imports the CLI, parses the options and plans,
    instead of after. Should the build not need it after all (a usage error, OUTPUT up to date),
    that cost another core's time only, and the server dies with this process."""
    if not args or args[0] != "build" or {"--help", "-h"} & set(args):
        return False
    return not any(
        arg == "--engine=dask" or (arg == "--engine" and following == "dask")
        for arg, following in zip(args, [*args[1:], ""], strict=True)
    )


def main() -> None:
    # First of all, so that a SIGINT or SIGTERM at any moment ends the command through one path
    # (exit 130/143, no traceback); the build turns it into an orderly stop of its processes.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, raise_signalled)
    quiet_unraisable_signals()
    # The cyclic collector's default thresholds (700 allocations) had it walk the build's
    # per-file records (found, planned, in flight) again and again: ~2 us of CPU a tiny file.
    # This process is the CLI's own, so it collects far less often (as mypy's does); a build
    # called from Python leaves the caller's settings alone.
    gc.set_threshold(100_000, 50, 100)
    try:
        if builds_locally(sys.argv[1:]):
            from batchctl.run.processes import limit_library_threads, start_forkserver

            limit_library_threads()  # before this process imports numpy
            start_forkserver()
        from batchctl.cli import run
    except (Signalled, Exception) as exc:  # a signal while still importing (perhaps wrapped)
        signalled = signalled_in(exc)
        if signalled is None:
            raise
        sys.exit(128 + signalled.signum)
    try:
        run()
    except SystemExit as done:
        exit_now(done.code)


def exit_now(code: object) -> None:
    """End the command as the interpreter would (other threads joined, atexit handlers run:
    multiprocessing's unlinks the build's semaphores; output flushed), minus tearing down every
    module and object, which took ~40 ms after a build: 1/10 of a small one. A string code is
    printed, as `sys.exit` does. (`atexit._run_exitfuncs` is private, and tested with the CLI.)"""
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    if isinstance(code, str):
        print(code, file=sys.stderr)
    status = code if isinstance(code, int) else (0 if code is None else 1)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a reader gone (`| head`), or a stream closed
            stream.flush()
    os._exit(status)


if __name__ == "__main__":
    main()
