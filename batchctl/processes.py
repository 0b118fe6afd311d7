"""How batchctl starts its child processes, and the signal rules they follow.

Kept free of heavy imports so the command line can start the fork server first of all, and its
imports (numpy, Pillow, zarr) overlap the parent's own.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import signal
import threading
from collections.abc import Iterator
from multiprocessing import forkserver
from multiprocessing.context import ForkServerContext
from pathlib import Path

PRELOAD = ["batchctl.workers", "batchctl.collate", "numpy", "PIL.Image"]


def mp_context() -> ForkServerContext:
    """forkserver, not fork: the parent may already run zarr's event-loop thread and tqdm's
    monitor thread, and forking a process with live threads can deadlock the child. Workers are
    forked from a clean server process that preloaded the heavy imports, so they start fast."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def start_forkserver() -> None:
    """Start the fork server with SIGINT ignored, a disposition it inherits: a Ctrl-C reaching
    the process group while it imports its preloads would otherwise print a KeyboardInterrupt
    traceback from it (its own code ignores SIGINT only once the imports are done). The parent
    ignores SIGINT only for the few milliseconds of the spawn. (Not SIGTERM: a child must die of
    `terminate()` even before its initializer has run.)"""
    mp_context()
    if threading.current_thread() is not threading.main_thread():
        forkserver.ensure_running()
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        forkserver.ensure_running()
    finally:
        signal.signal(signal.SIGINT, previous)


def init_child(title: str) -> None:
    """Children leave SIGINT to the parent (Ctrl-C hits the whole process group), die on SIGTERM,
    and name themselves so `ps`/`top` show what they are."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    with contextlib.suppress(OSError):
        Path("/proc/self/comm").write_text(title[:15])


@contextlib.contextmanager
def signals_ignored() -> Iterator[None]:
    """SIGINT and SIGTERM ignored for the duration (only the main thread may set handlers).

    By a handler that does nothing, not SIG_IGN: a process spawned meanwhile (multiprocessing
    starts a new fork server if the group's SIGTERM killed the old one) would inherit SIG_IGN,
    and its children would then survive `terminate()`."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, _ignore) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _ignore(signum: int, frame: object) -> None:
    """A signal that arrives while `signals_ignored` holds: dropped."""
