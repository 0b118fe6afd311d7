"""Preprocessing workers: the pool, bounded dispatch, and the task that runs in each worker.

Workers hand their samples straight to the collator's bounded queue and return only a small
`TaskResult` to the parent, so sample arrays are pickled once, not twice, and a slow collator
slows the workers down instead of filling memory. No exception crosses the pool: a failing file
becomes a `TaskResult` with its error text.
"""

from __future__ import annotations

import multiprocessing as mp
import signal
import threading
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from multiprocessing.context import BaseContext
from multiprocessing.pool import Pool
from multiprocessing.queues import Queue
from pathlib import Path
from typing import Any

from batchctl.discover import WorkItem
from batchctl.preprocess import Preprocessor, Sample, resolve


@dataclass(frozen=True)
class Task:
    """One unit of work: a file (later, a part of one) and what the collator needs to place it."""

    item: WorkItem
    skip: int = 0  # samples of this file already written by an interrupted run


@dataclass(frozen=True)
class TaskOutput:
    """What a worker sends the collator: all samples of one task, in order, in one message."""

    task: Task
    samples: list[Sample]


@dataclass(frozen=True)
class TaskResult:
    """What a worker returns to the parent: how many samples it sent, or why it failed."""

    task: Task
    samples: int
    error: str | None = None


def mp_context() -> BaseContext:
    """forkserver, not fork: the parent may already run zarr's event-loop thread and tqdm's
    monitor thread, and forking a process with live threads can deadlock the child. Workers are
    forked from a clean server process that preloaded the heavy imports, so they start fast."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["batchctl.workers", "batchctl.collate", "numpy", "PIL.Image"])
    return ctx


def ignore_interrupts() -> None:
    """Children leave SIGINT to the parent (Ctrl-C hits the whole process group) and die on SIGTERM."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


_worker: dict[str, Any] = {}


def init_worker(preprocess: str, options: Mapping[str, Any], source: Path, outbox: Queue[Any]) -> None:
    ignore_interrupts()
    _worker.update(preprocessor=resolve(preprocess), options=dict(options), source=source, outbox=outbox)


def describe_error(exc: BaseException) -> str:
    """A one-line reason: the OS's words for OS errors, else the exception's own message."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def run_task(task: Task) -> TaskResult:
    preprocessor: Preprocessor = _worker["preprocessor"]
    path = _worker["source"] / task.item.relpath
    try:
        samples = list(preprocessor.samples(path, _worker["options"]))
    except Exception as exc:  # noqa: BLE001 - any failure of one file is that file's error
        return TaskResult(task, 0, describe_error(exc).replace(f" '{path}'", "").replace(str(path), task.item.relpath))
    if not samples:
        return TaskResult(task, 0, "the preprocessor produced no samples")
    if task.skip:
        samples = samples[task.skip :]
    if samples:
        _worker["outbox"].put(TaskOutput(task, samples))
    return TaskResult(task, len(samples))


class BoundedFeed:
    """Feeds a pool at most `window` tasks ahead of the results consumed.

    `Pool.imap_unordered` pulls its whole input eagerly; this iterator blocks the pool's feeder
    thread on a semaphore that each consumed result releases, so memory stays flat.
    """

    def __init__(self, tasks: Iterable[Task], window: int) -> None:
        self._tasks = tasks
        self._slots = threading.Semaphore(window)
        self._stopped = False

    def __iter__(self) -> Iterator[Task]:
        for task in self._tasks:
            self._slots.acquire()
            if self._stopped:
                return
            yield task

    def consumed(self) -> None:
        self._slots.release()

    def stop(self) -> None:
        """Stop feeding, waking the feeder thread if it waits for a slot."""
        self._stopped = True
        self._slots.release()


def start_pool(
    ctx: BaseContext, workers: int, preprocess: str, options: Mapping[str, Any], source: Path, outbox: Queue[Any]
) -> Pool:
    return ctx.Pool(workers, initializer=init_worker, initargs=(preprocess, options, source, outbox))


def dead_workers(pool: Pool, seen: dict[int, Any]) -> list[tuple[int, int]]:
    """(pid, exit code) of pool workers that died; the pool replaces them silently, so remember
    every process it ever had in `seen`."""
    for proc in pool._pool:  # type: ignore[attr-defined]
        seen.setdefault(proc.pid, proc)
    return [(pid, proc.exitcode) for pid, proc in seen.items() if proc.exitcode not in (None, 0)]
