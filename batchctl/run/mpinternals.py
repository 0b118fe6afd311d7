"""Every use of a private part of CPython's multiprocessing, in one place (tested with 3.11 in
`tests/test_mpinternals.py`, so a Python release that changes one fails CI, not users' builds).

Why each is needed:
- `Pool._pool`: the worker processes. A worker killed by the kernel takes its task with it; its
  exit code says how it died. On an abort every worker is killed with SIGKILL: `Pool.terminate()`
  sends SIGTERM, which a worker that has not yet run its initializer ignores (it inherits the fork
  server's dispositions), and would then wait for it for ever.
- `Pool._worker_handler`, `Pool._change_notifier`, `Pool._taskqueue`: on an abort the pool must
  stop replacing the workers being killed; and when its worker-handler thread died (it cannot
  start a worker once the fork server is gone), the task handler never gets its sentinel and
  `terminate()` would wait for it for ever (measured: 5 hangs in 9 group SIGTERMs).
- `Pool._inqueue._rlock`, `Pool._outqueue._wlock`: a worker killed while holding one leaves it
  taken, and `terminate()` takes both.
- `process.current_process()._config["semprefix"]`: names the POSIX semaphores a build creates
  after its own pid, so a later build can tell a dead build's leftovers from a live one's.
- `process.current_process()._config["tempdir"]`: the folder multiprocessing makes at first use
  (`pymp-*`, for the fork server's socket) and removes at exit, never after a `kill -9`: batchctl
  makes it itself, named after the build's process, so a later build sweeps a dead one's.
- `reduction.DupFd`: hands the sample ring's memfd to a child as it is started (no name at all).
- `SimpleQueue._reader`: the collator waits on its inbox and its control pipe at once
  (`multiprocessing.connection.wait`), so a stop request never waits behind a busy inbox.
- `Pool._get_sentinels`: what the worker-handler thread wakes for besides its workers' exits
  (`QuietPool`).
- `Pool._setup_queues`: the pool's results pipe is a `ResultQueue`, whose workers leave quietly
  once the parent is gone (`QuietPool`).
- `process.ORIGINAL_DIR`: where a child looks for the parent's main script, when its path is
  relative (`main_script_for_children`).
- `forkserver.ensure_running`, `resource_tracker.ensure_running` (undocumented): start the
  fork server and the resource tracker at a moment batchctl picks, with the stop signals blocked
  (`batchctl.run.processes.start_forkserver`), not at the first process started.
  (The one other private CPython use is `atexit._run_exitfuncs`, in `batchctl.__main__`: the
  CLI runs the exit functions, then `os._exit`s; importing this module there would cost every
  command its `multiprocessing.pool` import.)
- `context.get_spawning_popen` (undocumented): whether an object is being pickled to start a
  child (a DataLoader worker, spawned) or copied for another reason (`batchctl.torch`: a worker
  shares the stream's epoch, a copy gets its own).
- `current_process()._inheriting`: set while a new child re-runs the parent's main script
  (multiprocessing does, to find what the script defines); a script that calls `build()` outside
  `if __name__ == "__main__":` would start a build in every child (`reimporting_main`).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Iterator
from multiprocessing import context, forkserver, process, reduction, resource_tracker
from multiprocessing.pool import TERMINATE, Pool
from multiprocessing.queues import SimpleQueue
from typing import Any

LOCK_WAIT_S = 0.5
SHUTDOWN_S = 5.0


def ensure_resource_tracker() -> None:
    resource_tracker.ensure_running()


def ensure_forkserver() -> None:
    forkserver.ensure_running()


class ResultQueue(SimpleQueue[Any]):
    """A pool's results pipe. A worker whose parent is gone (a SIGKILL, the OOM killer) cannot
    deliver its result: CPython's pool worker then sends the error instead, fails the same way,
    and prints both tracebacks on the terminal the build ran in (2 of 40 SIGKILLs of the parent
    half a second into a build, `tests/stress.py`). A worker here leaves quietly instead: the
    fork server, and with it every worker, is ending anyway."""

    def put(self, obj: Any) -> None:
        try:
            super().put(obj)
        except (BrokenPipeError, ConnectionResetError):  # nobody reads the pipe any more
            os._exit(1)


class QuietPool(Pool):
    """A Pool whose worker-handler thread wakes only when a worker exits or the pool's state
    changes (closed, terminated, no task left). CPython's also wakes whenever a result waits in
    the results pipe, and loops until the result-handler thread has read it: ~50 us of CPU per
    photo with 2 workers (1% of a worker's time, on the cores the workers need). Its results
    pipe is a `ResultQueue`."""

    def _get_sentinels(self) -> list[Any]:
        return [self._change_notifier._reader]  # type: ignore[attr-defined]

    def _setup_queues(self) -> None:
        self._inqueue = self._ctx.SimpleQueue()  # type: ignore[attr-defined]
        self._outqueue = ResultQueue(ctx=self._ctx)  # type: ignore[attr-defined]
        self._quick_put = self._inqueue._writer.send
        self._quick_get = self._outqueue._reader.recv  # type: ignore[attr-defined]


def pool_workers(pool: Pool) -> list[Any]:
    """The pool's current worker `Process` objects."""
    return list(pool._pool)  # type: ignore[attr-defined]


def shut_down_pool(pool: Pool) -> None:
    """End a pool now, from any state, without waiting for ever: no worker is replaced any more,
    every worker is killed, locks dead workers held are freed, then `terminate()` runs with a
    deadline (its threads are daemons: one that never returns does not keep the process alive)."""
    handler: threading.Thread = pool._worker_handler  # type: ignore[attr-defined]
    handler._state = TERMINATE  # type: ignore[attr-defined]
    with contextlib.suppress(OSError, ValueError):
        pool._change_notifier.put(None)  # type: ignore[attr-defined]  # wake it to see the state
    handler.join(SHUTDOWN_S)
    workers = pool_workers(pool)
    for proc in workers:
        with contextlib.suppress(OSError, ValueError):
            proc.kill()
    for proc in workers:
        with contextlib.suppress(ValueError, AssertionError):
            proc.join(LOCK_WAIT_S)
    for lock in (pool._inqueue._rlock, pool._outqueue._wlock):  # type: ignore[attr-defined]
        free_lock_of_dead(lock)
    pool._taskqueue.put(None)  # type: ignore[attr-defined]  # the sentinel a dead worker handler never sent
    ender = threading.Thread(target=pool.terminate, name="batchctl-pool-end", daemon=True)
    ender.start()
    ender.join(SHUTDOWN_S)


def free_lock_of_dead(lock: Any) -> None:
    """A lock still taken once every process that could hold it is dead: release it for them."""
    if lock.acquire(timeout=LOCK_WAIT_S):
        lock.release()
    else:
        with contextlib.suppress(ValueError):
            lock.release()


@contextlib.contextmanager
def semaphores_named_after(pid: int) -> Iterator[None]:
    """Semaphores created in the block are named `/batchctl-PID-XXXXXXXX` (`/dev/shm/sem.batchctl-...`);
    after it, as before (a program that called `build()` gets its own naming back)."""
    config = process.current_process()._config  # type: ignore[attr-defined]
    previous = config.get("semprefix")
    config["semprefix"] = f"/batchctl-{pid}"
    try:
        yield
    finally:
        if previous is None:
            config.pop("semprefix", None)
        else:
            config["semprefix"] = previous


def pickled_for_a_child() -> bool:
    """Whether the object being pickled now is sent to a child process as it starts."""
    return context.get_spawning_popen() is not None


def temp_dir() -> str | None:
    """multiprocessing's temporary folder for this process, if it made one or was given one."""
    return process.current_process()._config.get("tempdir")  # type: ignore[attr-defined,no-any-return]


def set_temp_dir(folder: str) -> None:
    process.current_process()._config["tempdir"] = folder  # type: ignore[attr-defined]


def main_script_for_children() -> str | None:
    """The file each new child runs again as the parent's main script (as `spawn` decides it),
    or None when children run none (a `-m` module, `-c`, an interactive session)."""
    main = sys.modules.get("__main__")
    if main is None or getattr(getattr(main, "__spec__", None), "name", None) is not None:
        return None
    path = getattr(main, "__file__", None)
    if path is None:
        return None
    original = process.ORIGINAL_DIR  # type: ignore[attr-defined]
    return os.path.normpath(path if os.path.isabs(path) else os.path.join(original or "", path))


def reimporting_main() -> bool:
    """Whether this process is a new child still re-running its parent's main script."""
    return bool(getattr(process.current_process(), "_inheriting", False))


def queue_reader(queue: Any) -> Any:
    """The receiving `Connection` of a `SimpleQueue`, for `multiprocessing.connection.wait`."""
    return queue._reader


def dup_fd_for_child(fd: int) -> Any:
    """A picklable handle for `fd`, valid while a child process is being started (its arguments)."""
    return reduction.DupFd(fd)
