"""The private parts of CPython's multiprocessing that batchctl leans on (`batchctl.run.mpinternals`),
each exercised, so a Python release that changes one fails here first; and the /dev/shm sweep."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from multiprocessing.pool import Pool
from multiprocessing.queues import SimpleQueue
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from batchctl.records import Task, TaskOutput, WorkItem
from batchctl.run.mpinternals import (
    QuietPool,
    ResultQueue,
    pool_workers,
    reimporting_main,
    semaphores_named_after,
    shut_down_pool,
)
from batchctl.run.processes import mp_context, start_forkserver, sweep_dead_builds
from batchctl.run.ring import SampleRing

SHM = Path("/dev/shm")


@pytest.fixture(autouse=True, scope="module")
def forkserver_as_batchctl_starts_it() -> None:
    """The fork server these tests share with later in-process builds of the same pytest run,
    started the way a build starts it (BLAS limited to one thread in it), not bare by a Pool."""
    start_forkserver()


def _hold(lock: Any, ready: Any) -> None:
    lock.acquire()
    ready.set()
    time.sleep(60)


def _ends_within(pool: Pool, seconds: float) -> bool:
    done = threading.Event()
    threading.Thread(target=lambda: (shut_down_pool(pool), pool.join(), done.set()), daemon=True).start()
    return done.wait(seconds)


def test_pool_workers_are_the_pools_processes() -> None:
    pool = mp_context().Pool(2)
    try:
        pids = set(pool.map(_pid, range(8)))
        assert pids <= {proc.pid for proc in pool_workers(pool)} and len(pool_workers(pool)) == 2
    finally:
        assert _ends_within(pool, 20)


def _pid(_: int) -> int:
    time.sleep(0.01)
    return os.getpid()


def test_a_quiet_pools_worker_handler_wakes_for_changes_not_for_results(monkeypatch: pytest.MonkeyPatch) -> None:
    """QuietPool's worker-handler thread sleeps while results flow (a Pool's own woke ~10 times
    per result here, ~5,000 times in all), yet still replaces a worker that died."""
    wakes = []
    wait_for_updates = Pool._wait_for_updates  # type: ignore[attr-defined]

    def counted(*args: Any, **kwargs: Any) -> None:
        wakes.append(time.monotonic())
        wait_for_updates(*args, **kwargs)

    # the handler thread runs Pool._handle_workers, which calls Pool._wait_for_updates
    monkeypatch.setattr(Pool, "_wait_for_updates", staticmethod(counted))
    pool = QuietPool(2, context=mp_context())
    try:
        for _ in pool.imap_unordered(_pause, range(500)):
            sum(range(2000))  # the parent's own work on each result, as a build's
        assert len(wakes) <= 3
        before = {proc.pid for proc in pool_workers(pool)}
        pool.apply_async(os._exit, (1,))  # a worker dies (its task is lost, as the pipeline expects)
        deadline = time.monotonic() + 30
        while len(before & {proc.pid for proc in pool_workers(pool)}) != 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(before & {proc.pid for proc in pool_workers(pool)}) == 1, "the dead worker was not replaced"
        assert len(pool.map(_pid, range(20))) == 20 and len(pool_workers(pool)) == 2
    finally:
        assert _ends_within(pool, 20)


@pytest.mark.parametrize("quiet", [True, False])
def test_a_pool_worker_whose_parent_is_gone_leaves_without_a_traceback(
    quiet: bool, capfd: pytest.CaptureFixture[str]
) -> None:
    """A result nobody will read any more (the parent was killed) ends a ResultQueue's writer at
    once and quietly; through a plain SimpleQueue the same put raises BrokenPipeError, and the
    child prints its traceback on the terminal. (A spawned child, so it writes to this test's
    stderr.)"""
    ctx = multiprocessing.get_context("spawn")
    queue: SimpleQueue[Any] = ResultQueue(ctx=ctx) if quiet else ctx.SimpleQueue()
    closed = ctx.Event()
    child = ctx.Process(target=_put_unread, args=(queue, closed))
    child.start()
    queue._reader.close()  # type: ignore[attr-defined]  # the parent's end of the results pipe: gone
    closed.set()
    child.join(30)
    err = capfd.readouterr().err
    assert child.exitcode == 1
    assert ("Traceback" in err) is not quiet, err


def _put_unread(queue: Any, closed: Any) -> None:
    queue._reader.close()  # as a pool worker does: only the parent reads results
    closed.wait(30)
    queue.put(("job", 0, (True, [(0, 1, None)])))


def test_a_quiet_pools_workers_send_their_results_through_a_result_queue() -> None:
    pool = QuietPool(1, context=mp_context())
    try:
        assert isinstance(pool._outqueue, ResultQueue)  # what its workers put to
        assert pool.map(_pid, range(3)) == [pool_workers(pool)[0].pid] * 3  # and results come through it
    finally:
        assert _ends_within(pool, 20)


def _pause(_: int) -> bytes:
    time.sleep(0.002)
    return bytes(200)


def test_a_child_knows_it_is_re_running_the_main_script(tmp_path: Path) -> None:
    """`reimporting_main` is true while a new child runs its parent's script again, only then."""
    script = tmp_path / "main.py"
    script.write_text(
        "import multiprocessing\n"
        "from batchctl.run.mpinternals import reimporting_main\n"
        "print(__name__, reimporting_main(), flush=True)\n"
        "def child():\n"
        "    print('child', reimporting_main(), flush=True)\n"
        "if __name__ == '__main__':\n"
        "    process = multiprocessing.get_context('forkserver').Process(target=child)\n"
        "    process.start()\n"
        "    process.join()\n"
    )
    result = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=60)
    assert result.stdout.splitlines() == ["__main__ False", "__mp_main__ True", "child False"], result.stderr
    assert not reimporting_main()


def test_the_main_script_children_run_again(tmp_path: Path) -> None:
    """The file multiprocessing has each child run again: a script's own path (a relative one from
    where the program started), none for `-m` or `-c`, a file that is not there for standard input."""
    script = tmp_path / "main.py"
    script.write_text(
        "from batchctl.run.mpinternals import main_script_for_children\nprint(main_script_for_children())\n"
    )
    code = script.read_text()

    def run(*args: str, stdin: str | None = None) -> str:
        result = subprocess.run([sys.executable, *args], input=stdin, capture_output=True, text=True, cwd=tmp_path)
        return result.stdout.strip()

    assert run("main.py") == str(script)
    assert run(str(script)) == str(script)
    assert run("-m", "main") == "None"
    assert run("-c", code) == "None"
    assert run("-", stdin=code) == str(tmp_path / "<stdin>")


def test_shut_down_survives_a_process_killed_holding_the_result_lock() -> None:
    """Pool.terminate() waits for ever for a queue lock a killed process held; ours does not."""
    ctx = mp_context()
    pool = ctx.Pool(2)
    ready = ctx.Event()
    holder = ctx.Process(target=_hold, args=(pool._outqueue._wlock, ready))  # type: ignore[attr-defined]
    holder.start()
    assert ready.wait(30)
    holder.kill()
    holder.join()
    assert _ends_within(pool, 20), "the pool's teardown hung on the dead process's lock"
    assert not any(proc.is_alive() for proc in pool_workers(pool))


def test_shut_down_survives_a_dead_worker_handler(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a group SIGTERM did to the fork server: the worker-handler thread dies starting a
    replacement, never sends the task handler its sentinel, and terminate() waited for ever."""
    pool = mp_context().Pool(2)
    handler = pool._worker_handler  # type: ignore[attr-defined]

    def broken(*args: object, **kwargs: object) -> None:
        raise BrokenPipeError("the fork server is gone")

    monkeypatch.setattr(threading, "excepthook", lambda args: None)  # its traceback is expected
    monkeypatch.setattr(Pool, "_repopulate_pool_static", staticmethod(broken))
    pool_workers(pool)[0].kill()
    handler.join(10)
    assert not handler.is_alive()
    assert _ends_within(pool, 20), "the pool's teardown hung without its worker handler"
    assert not any(proc.is_alive() for proc in pool_workers(pool))


def test_semaphores_carry_the_builds_pid_and_then_the_callers_naming_again() -> None:
    with semaphores_named_after(os.getpid()):
        lock = mp_context().Lock()
    name = lock._semlock.name  # type: ignore[attr-defined]
    assert name.startswith(f"/batchctl-{os.getpid()}-")
    assert (SHM / f"sem{name.replace('/', '.')}").exists()
    after = mp_context().Lock()._semlock.name  # type: ignore[attr-defined]
    assert not after.startswith("/batchctl-")


def _write_through_ring(ring: SampleRing, rows: int) -> None:
    task = Task(0, WorkItem("a.npy", 0, 1, 0))
    message = ring.put(0, [TaskOutput([(task.sent(), rows)], {"x": np.arange(rows, dtype=np.int32)})])
    assert message is not None
    ring.close()


def test_the_ring_reaches_a_child_by_fd_with_no_name() -> None:
    ctx = mp_context()
    ring = SampleRing(ctx, 2, slot_bytes=2**20)
    child = ctx.Process(target=_write_through_ring, args=(ring, 5))
    child.start()
    child.join(30)
    assert child.exitcode == 0
    assert os.readlink(f"/proc/self/fd/{ring._fd}").startswith("/memfd:batchctl-ring")  # a memfd: no path at all
    view = np.ndarray((5,), np.int32, ring._buffer(), 0)
    assert view.tolist() == [0, 1, 2, 3, 4]
    del view
    ring.close()


def test_sweep_removes_only_dead_builds_names() -> None:
    gone = mp_context().Process(target=time.sleep, args=(0,))
    gone.start()
    gone.join()
    tag = uuid.uuid4().hex[:8]
    dead = SHM / f"sem.batchctl-{gone.pid}-{tag}"
    live = SHM / f"sem.batchctl-{os.getpid()}-{tag}"
    other = SHM / f"sem.other-{gone.pid}-{tag}"
    for path in (dead, live, other):
        path.write_bytes(b"")
    try:
        removed = sweep_dead_builds()
        assert dead.name in removed and not dead.exists()
        assert live.exists() and other.exists()
    finally:
        for path in (dead, live, other):
            path.unlink(missing_ok=True)


_FORKSERVER_FOLDER = """
import multiprocessing, os, sys
from multiprocessing import util
from batchctl.run.processes import start_forkserver
start_forkserver()
print(util.get_temp_dir())  # the folder multiprocessing uses: the one batchctl made
print(multiprocessing.get_context("forkserver").Process(target=os.getpid).start() or "started")
"""


def test_the_fork_servers_folder_is_named_after_the_process_and_removed_at_exit(tmp_path: Path) -> None:
    temp = Path(tempfile.mkdtemp(prefix="bt", dir="/tmp"))  # short: the socket's path lies in it
    try:
        result = subprocess.run(
            [sys.executable, "-c", _FORKSERVER_FOLDER], capture_output=True, text=True, timeout=60,
            env={**os.environ, "TMPDIR": str(temp)},
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        folder = Path(result.stdout.splitlines()[0])
        assert folder.parent == temp and folder.name.startswith("pymp-batchctl-"), folder
        assert list(temp.iterdir()) == []  # removed as the process exited (no pymp-* either)
    finally:
        shutil.rmtree(temp, ignore_errors=True)


def _pickled_flag(_: object) -> None:
    pass


class _Probe:
    """Records, as it is pickled, whether it is going to a child that is starting."""

    seen: list[bool] = []

    def __getstate__(self) -> dict[str, object]:
        from batchctl.run.mpinternals import pickled_for_a_child

        _Probe.seen.append(pickled_for_a_child())
        return {}


def test_an_object_knows_whether_it_is_pickled_for_a_starting_child() -> None:
    import pickle

    _Probe.seen.clear()
    pickle.dumps(_Probe())  # a copy
    child = mp_context().Process(target=_pickled_flag, args=(_Probe(),))  # sent to a child as it starts
    child.start()
    child.join(30)
    assert child.exitcode == 0 and _Probe.seen == [False, True]
