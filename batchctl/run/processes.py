"""How batchctl starts its child processes, who handles signals, and how nothing outlives a build.

The rules, for every way a job is stopped (Ctrl-C and `systemctl stop`/`docker stop`/`timeout`
signal the whole process group or cgroup; the OOM killer picks one process):
- Only the parent acts on SIGINT and SIGTERM. The fork server and the collator ignore both, so a
  signal to the group cannot kill a helper the parent still needs to end the build cleanly;
  a worker ignores SIGINT and dies of SIGTERM (the pool notices, like any lost worker).
- Every child dies with its parent: the fork server gets SIGKILL when the batchctl process dies
  (`PR_SET_PDEATHSIG`), and each worker and the collator when the fork server dies, so a SIGKILL
  of the parent alone leaves no orphan. multiprocessing's resource tracker then sees its last
  client gone, unlinks the build's semaphores and exits.
- multiprocessing's temporary folder (for the fork server's socket) goes with the parent however
  it ends: at exit, or, after a SIGKILL of the parent alone, removed by the fork server as it dies
  (its death signal is `PARENT_DIED`, caught). What a SIGKILL of the whole group leaves in
  /dev/shm (the semaphores; the sample ring has no name) and in the temporary folder carries the
  dead parent's pid, and any later build sweeps it (`sweep_dead_builds`).

Kept free of heavy imports: the `batchctl build` command starts the fork server before it even
parses its options (`batchctl.__main__`), and a build called from Python as soon as it knows there
is work; the server's preloads (numpy, Pillow, numcodecs for the collator) run alongside the
parent's own imports and planning.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import multiprocessing as mp
import os
import re
import shutil
import signal
import stat
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from multiprocessing.context import ForkServerContext
from pathlib import Path
from typing import Any

from batchctl.errors import UsageError
from batchctl.run.signals import Signalled, note_signal, quiet_unraisable_signals, raise_signalled

# batchctl.run.forkserver_init first: it sets up the fork server before the heavy imports.
PRELOAD = [
    "batchctl.run.forkserver_init",
    "batchctl.run.workers",
    "batchctl.run.collate",
    "numpy",
    "numcodecs",  # the collator's codecs: the modules that use them import them only when they do
    "PIL.Image",
]
STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}
PR_SET_PDEATHSIG = 1
PARENT_DIED = signal.SIGUSR2  # the fork server's death signal: it removes the temporary folder, then exits
TEMP_DIR_ENV = "BATCHCTL_FORKSERVER_TEMP"  # the folder, for the fork server as it starts (and only it)
# A build runs one process per core already: a BLAS, OpenMP or Rayon (tokenizers') thread pool
# in each would only oversubscribe the cores; and OpenBLAS's, started by `import numpy`, spins
# ~40 ms of CPU in each process that imports it (a 10-image build: 0.28 s with it, 0.24 s
# without). One thread each, unless the user set a number.
LIBRARY_THREADS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "RAYON_NUM_THREADS")
# The exit code of a child that found itself re-running the caller's script up to its `build()`
# call (`leave_if_reimporting_main`); the parent turns it into a one-line error.
REIMPORTED_MAIN_EXIT = 86
REIMPORTED_MAIN_TEXT = (
    "the script calling batchctl.build() runs it again in every process the build starts (multiprocessing "
    'imports the main script in each); put the call under `if __name__ == "__main__":`'
)
# The resource tracker outlives a parent killed outright (SIGKILL, the OOM killer) and unlinks the
# build's semaphores then, as it should, but warns on stderr that they "appear to be leaked" (two
# lines after every such kill, `tests/stress.py`): it is started with that warning ignored.
TRACKER_WARNINGS = "ignore::UserWarning:multiprocessing.resource_tracker"
SHM_DIR = Path("/dev/shm")
# /dev/shm names batchctl creates (its semaphores), with the pid of the build's parent
DEAD_BUILD_NAME = re.compile(r"^sem\.batchctl-(\d+)-")
# multiprocessing's temporary folder of a build (Python's own is pymp-*), with the pid of its parent
TEMP_PREFIX = "pymp-batchctl-"
DEAD_TEMP_NAME = re.compile(rf"^{TEMP_PREFIX}(\d+)-")
SOCKET_PATH_MAX = 107  # bytes of a Unix socket's path on Linux

_server_pid: int | None = None  # in the fork server and the children it forks: the server's pid


def mp_context() -> ForkServerContext:
    """forkserver, not fork: the parent may already run zarr's event-loop thread and tqdm's
    monitor thread, and forking a process with live threads can deadlock the child. Workers are
    forked from a clean server process that preloaded the heavy imports, so they start fast."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def start_forkserver() -> None:
    """Start the fork server (if it is not running) with SIGINT and SIGTERM blocked in this
    thread: the server inherits the mask and sets up its own dispositions before unblocking
    (`become_forkserver`), and a signal for this process meanwhile waits instead of being lost."""
    from batchctl.run import mpinternals  # (multiprocessing.pool: kept off the CLI's start-up path)

    mp_context()
    # The resource tracker first: starting it unblocks SIGINT/SIGTERM in this thread when done
    # (its own block and unblock), which would leave the fork server started unprotected.
    warnings = os.environ.get("PYTHONWARNINGS")
    os.environ["PYTHONWARNINGS"] = f"{warnings},{TRACKER_WARNINGS}" if warnings else TRACKER_WARNINGS
    try:
        mpinternals.ensure_resource_tracker()
    finally:
        if warnings is None:
            del os.environ["PYTHONWARNINGS"]
        else:
            os.environ["PYTHONWARNINGS"] = warnings
    name_temp_dir()
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    added = limit_library_threads()  # for the server and its children, not for a calling program
    folder = mpinternals.temp_dir()
    if folder is not None and os.path.basename(folder).startswith(f"{TEMP_PREFIX}{os.getpid()}-"):
        os.environ[TEMP_DIR_ENV] = folder
        added.append(TEMP_DIR_ENV)
    try:
        mpinternals.ensure_forkserver()
    finally:
        for name in added:
            os.environ.pop(name, None)
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def name_temp_dir() -> None:
    """Make multiprocessing's temporary folder (the fork server's socket lives there) ourselves,
    `pymp-batchctl-PID-*` in the temporary folder, unless this process has one already: Python
    removes its own `pymp-*` at exit only, so every `kill -9` left one; this one is removed at
    exit too, and a later build sweeps a dead build's (`sweep_dead_builds`)."""
    from batchctl.run import mpinternals

    prefix = f"{TEMP_PREFIX}{os.getpid()}-"
    # the socket's path (FOLDER/listener-XXXXXXXX) must fit a Unix socket address: else Python's own
    if mpinternals.temp_dir() is not None or len(tempfile.gettempdir()) + len(prefix) + 27 > SOCKET_PATH_MAX:
        return
    folder = tempfile.mkdtemp(prefix=prefix)
    mpinternals.set_temp_dir(folder)
    atexit.register(shutil.rmtree, folder, True)


def limit_library_threads() -> list[str]:
    """Ask BLAS and OpenMP for one thread in this process and the ones it starts from now on, where
    the user has not set a number (`LIBRARY_THREADS`); the names set."""
    added = [name for name in LIBRARY_THREADS if name not in os.environ]
    os.environ.update(dict.fromkeys(added, "1"))
    return added


def refuse_main_children_cannot_run() -> None:
    """Every child starts by running the caller's main script again from its file: a program
    read from standard input (`python - <<EOF`) has none, and each child would fail to start."""
    from batchctl.run.mpinternals import main_script_for_children

    script = main_script_for_children()
    if script is not None and not os.path.isfile(script):
        raise UsageError(
            f"a build cannot start its processes from a program read from standard input: each runs the "
            f"main script again, and {script} is not a file; save the program to a file and run that"
        )


def leave_if_reimporting_main() -> None:
    """In a build's child that is re-running the caller's script (`build()` called at its top
    level): exit at once, quietly, instead of starting a build from every worker; the parent sees
    its collator end with `REIMPORTED_MAIN_EXIT` and says why."""
    from batchctl.run.mpinternals import reimporting_main  # (multiprocessing.pool: kept off the CLI's start-up path)

    if reimporting_main():
        os._exit(REIMPORTED_MAIN_EXIT)


def become_forkserver() -> None:
    """Run in the fork server as it starts (its first preload): leave SIGINT/SIGTERM to the
    parent, and die with it. (Should the parent be dead already, the server exits by itself: its
    only other reason to live, the parent's end of its 'alive' pipe, is closed.)"""
    global _server_pid
    _server_pid = os.getpid()
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    folder = os.environ.pop(TEMP_DIR_ENV, None)
    if folder is None:
        die_with_parent()
        return
    atexit.register(shutil.rmtree, folder, True)  # (the parent gone, the server ends at its pipe's EOF)

    def parent_died(signum: int, frame: object) -> None:
        shutil.rmtree(folder, True)
        os._exit(1)

    signal.signal(PARENT_DIED, parent_died)
    die_with_parent(PARENT_DIED)
    match = DEAD_TEMP_NAME.match(os.path.basename(folder))
    if match is not None and os.getppid() != int(match.group(1)):  # the parent died before the request
        parent_died(PARENT_DIED, None)


def die_with_parent(signum: int = signal.SIGKILL) -> None:
    """Ask the kernel for `signum` when the parent dies (Linux; elsewhere nothing)."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0)


def init_child(title: str, on_sigterm: signal.Handlers = signal.SIG_IGN) -> None:
    """Set up a worker or the collator: SIGINT to the parent, SIGTERM as asked, die with the fork
    server (checked after asking, in case it died first), and a name `ps` and `top` show."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, on_sigterm)
    signal.signal(PARENT_DIED, signal.SIG_DFL)  # (the fork server's handler: not a child's)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    if _server_pid is not None:
        die_with_parent()
        if os.getppid() != _server_pid:
            os._exit(1)
    with contextlib.suppress(OSError):
        Path("/proc/self/comm").write_text(title[:15])


def sweep_dead_builds() -> list[str]:
    """Unlink the /dev/shm names of builds whose parent process is gone (a SIGKILL of a whole
    process group kills the resource tracker too, which would have unlinked them), and remove
    their temporary folders (`name_temp_dir`). Only names with batchctl's own prefix, owned by
    this user; the names removed."""
    removed = _sweep_temp_dirs()
    with contextlib.suppress(OSError):
        for entry in os.scandir(SHM_DIR):
            match = DEAD_BUILD_NAME.match(entry.name)
            if match is None or alive(int(match.group(1))):
                continue
            with contextlib.suppress(OSError):
                if entry.stat(follow_symlinks=False).st_uid == os.getuid():
                    os.unlink(entry.path)
                    removed.append(entry.name)
    return removed


def _sweep_temp_dirs() -> list[str]:
    removed = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(tempfile.gettempdir()):
            match = DEAD_TEMP_NAME.match(entry.name)
            if match is None or alive(int(match.group(1))):
                continue
            with contextlib.suppress(OSError):
                st = entry.stat(follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid():
                    shutil.rmtree(entry.path)
                    removed.append(entry.name)
    return removed


def alive(pid: int) -> bool:
    """Whether process `pid` exists (another user's counts too)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def _stop_signals_handled_by(handler: Callable[[int, Any], None]) -> Iterator[None]:
    """SIGINT and SIGTERM go to `handler` for the duration, then back to what they were. Only
    the main thread may set handlers: elsewhere (build() called from a thread) nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


@contextlib.contextmanager
def signals_raise() -> Iterator[None]:
    """Turn SIGINT and SIGTERM into `Signalled` for the duration (one raised in a finalizer is
    not reported: `quiet_unraisable_signals`); the handlers and the unraisable hook are the
    caller's again afterwards."""
    hook = sys.unraisablehook
    quiet_unraisable_signals()
    try:
        with _stop_signals_handled_by(raise_signalled):
            yield
    finally:
        sys.unraisablehook = hook


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """SIGINT and SIGTERM held back until the block ends, then raised as `Signalled`: a child
    being started must be known to the abort before the parent unwinds."""
    caught: list[int] = []

    def hold(signum: int, frame: object) -> None:
        caught.append(signum)
        note_signal(signum)

    with _stop_signals_handled_by(hold):
        yield
    if caught:
        raise Signalled(caught[0])


def signals_ignored() -> contextlib.AbstractContextManager[None]:
    """SIGINT and SIGTERM dropped for the duration: an abort under way, or a publish that must not
    stop half-way."""
    return _stop_signals_handled_by(_ignore)


def _ignore(signum: int, frame: object) -> None:
    """A signal that arrives while `signals_ignored` holds: dropped."""
