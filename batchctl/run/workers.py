"""Preprocessing workers: the pool, bounded dispatch, and the task that runs in each worker.

Workers hand their samples straight to the collator, through their slot of the shared-memory
ring (`batchctl.run.ring`) with a small message on the collator's queue, and return only a small
`TaskResult` to the parent, so sample arrays are never pickled, and a slow collator slows the
workers down instead of filling memory (a worker waits for its slot to be free). No exception
crosses the pool: a failing file becomes a `TaskResult` with its error text.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import deque
from collections.abc import Iterator, Mapping
from multiprocessing.context import BaseContext
from multiprocessing.pool import Pool
from multiprocessing.queues import SimpleQueue
from pathlib import Path
from typing import Any

import numpy as np

from batchctl.preprocess import Preprocessor, resolve
from batchctl.records import Done, Task, TaskOutput, TaskResult, describe_error
from batchctl.run.mpinternals import QuietPool
from batchctl.run.processes import alive, init_child
from batchctl.run.ring import SampleRing
from batchctl.store.storage import SourceRoot


class WorkerSlots:
    """Which task each worker is running and since when, in shared memory.

    A worker killed by the kernel takes its task with it and a plain Pool never says which; this
    table lets the parent name the lost file (and kill a worker stuck past --timeout).
    Each slot holds (pid, task index or -1, start time in ms of CLOCK_MONOTONIC, ring retired):
    slot k also owns ring slot k (`SampleRing`), retired once a holder of slot k has died.
    """

    FIELDS = 4

    def __init__(self, ctx: BaseContext, count: int) -> None:
        self.count = count
        self.lock = ctx.Lock()
        self.table = ctx.Array("q", count * self.FIELDS, lock=False)

    def _row(self, slot: int) -> list[int]:
        return list(self.table[slot * self.FIELDS : (slot + 1) * self.FIELDS])

    def claim(self, pid: int) -> int:
        """A free slot, one whose ring slot is still usable if there is one."""
        with self.lock:
            free = [slot for slot in range(self.count) if self._row(slot)[0] == 0]
            if not free:
                return -1
            slot = min(free, key=lambda slot: self._row(slot)[3])
            self.table[slot * self.FIELDS : slot * self.FIELDS + 3] = [pid, -1, 0]
            return slot

    def begin(self, slot: int, task_index: int) -> None:
        if slot >= 0:
            self.table[slot * self.FIELDS + 2] = _now_ms()
            self.table[slot * self.FIELDS + 1] = task_index

    def end(self, slot: int) -> None:
        if slot >= 0:
            self.table[slot * self.FIELDS + 1] = -1

    def ring_usable(self, slot: int) -> bool:
        return slot >= 0 and self.table[slot * self.FIELDS + 3] == 0

    def running(self) -> list[tuple[int, int, float]]:
        """(pid, task index, seconds running) of every busy worker."""
        now = _now_ms()
        rows = [self._row(slot) for slot in range(self.count)]
        return [(pid, index, (now - start) / 1000) for pid, index, start, _ in rows if pid and index >= 0]

    def vanished(self) -> list[int]:
        """Pids of slot holders that no longer exist (killed, and reaped by the pool)."""
        pids = [self._row(slot)[0] for slot in range(self.count)]
        return [pid for pid in pids if pid and not alive(pid)]

    def release(self, pid: int) -> int:
        """Free the slot of a dead worker and retire its ring slot (it may have died holding it);
        the task index it was running, or -1."""
        with self.lock:
            for slot in range(self.count):
                if self._row(slot)[0] == pid:
                    index = self._row(slot)[1]
                    self.table[slot * self.FIELDS : (slot + 1) * self.FIELDS] = [0, -1, 0, 1]
                    return int(index)
        return -1


def _now_ms() -> int:
    return time.monotonic_ns() // 1_000_000


CHUNK_BYTES = 2 * 2**20  # input bytes in one chunk, at most (a big file's part is a chunk of its own)
MAX_CHUNK_TASKS = 256
MIN_CHUNKS_PER_WORKER = 16

_worker: dict[str, Any] = {}


def init_worker(
    preprocess: str,
    options: Mapping[str, Any],
    source: SourceRoot,
    outbox: SimpleQueue[Any],
    slots: WorkerSlots,
    ring: SampleRing | None,
) -> None:
    init_child("batchctl-worker", on_sigterm=signal.SIG_DFL)  # a worker killed alone is a lost worker
    _worker.update(slots=slots, slot=slots.claim(os.getpid()), ring=ring)
    _worker.update(preprocessor=resolve(preprocess), options=dict(options), source=source, outbox=outbox)


def run_chunk(tasks: list[Task]) -> list[Done]:
    """Preprocess a chunk of tasks and send their outputs to the collator in one message; to the
    parent, each task's `Done` (its Task stays with the parent: a tuple pickles in a fraction of
    the time, which counts for tiny files).

    The slot names the task being worked on until the message is sent, so a worker killed at any
    point is charged to one file; the parent hands the rest of the chunk out again.
    """
    slots: WorkerSlots = _worker["slots"]
    results, outputs = [], []
    try:
        for task in tasks:
            slots.begin(_worker["slot"], task.index)
            result, output = _preprocess(task)
            results.append((task.index, result.samples, result.error))
            if output is not None:
                outputs.append(output)
        if outputs:
            _send(merge_outputs(outputs))
    finally:
        slots.end(_worker["slot"])
    return results


def _send(outputs: list[TaskOutput]) -> None:
    """Through this worker's ring slot where it can, else pickled through the pipe."""
    ring: SampleRing | None = _worker["ring"]
    slot = _worker["slot"]
    message = ring.put(slot, outputs) if ring is not None and _worker["slots"].ring_usable(slot) else None
    _worker["outbox"].put(outputs if message is None else message)


def merge_outputs(outputs: list[TaskOutput]) -> list[TaskOutput]:
    """Runs of outputs whose fields have the same row shapes and dtypes, each merged into one."""
    runs: list[list[TaskOutput]] = []
    for output in outputs:
        if runs and _row_specs(runs[-1][0]) == _row_specs(output):
            runs[-1].append(output)
        else:
            runs.append([output])
    return [
        run[0]
        if len(run) == 1
        else TaskOutput(
            [part for output in run for part in output.parts],
            {name: np.concatenate([output.columns[name] for output in run]) for name in run[0].columns},
        )
        for run in runs
    ]


def _row_specs(output: TaskOutput) -> dict[str, tuple[tuple[int, ...], np.dtype[Any]]]:
    return {name: (column.shape[1:], column.dtype) for name, column in output.columns.items()}


def _preprocess(task: Task) -> tuple[TaskResult, TaskOutput | None]:
    return preprocess_task(task, _worker["preprocessor"], _worker["options"], _worker["source"])


def preprocess_task(
    task: Task, preprocessor: Preprocessor, options: Mapping[str, Any], source: SourceRoot
) -> tuple[TaskResult, TaskOutput | None]:
    """One file (or part of one): its rows, or the one-line reason it is skipped."""
    path: Path | str = task.item.relpath
    try:
        with source.local_file(task.item.relpath) as path:
            columns = preprocessor.columns(path, options, task.part)
    except Exception as exc:  # noqa: BLE001 - any failure of one file is that file's error
        reason = describe_error(exc).replace(f" '{path}'", "").replace(str(path), task.item.relpath)
        return TaskResult(task, 0, reason), None
    if task.skip:
        columns = {name: column[task.skip :] for name, column in columns.items()}
    output = TaskOutput([(task, len(next(iter(columns.values()))))], columns)
    if output.rows == 0:  # an interrupted run already wrote all of it
        return TaskResult(task, 0), None
    return TaskResult(task, output.rows), output


class BoundedFeed:
    """Feeds a pool chunks of tasks, at most `window` chunks ahead of the results consumed.

    `Pool.imap_unordered` pulls its input eagerly; this iterator blocks the pool's feeder thread
    on a condition until a result is consumed, so memory stays flat. It ends only on `stop()`,
    so tasks of a lost worker can still be handed out again (`retry`).
    """

    def __init__(self, chunks: list[list[Task]], window: int) -> None:
        self._todo = deque(chunks)
        self._window = window
        self._in_flight = 0
        self._stopped = False
        self._changed = threading.Condition()

    def __iter__(self) -> Iterator[list[Task]]:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._stopped or (self._todo and self._in_flight < self._window))
                if self._stopped:
                    return
                chunk = self._todo.popleft()
                self._in_flight += 1
            yield chunk

    def consumed(self) -> None:
        with self._changed:
            self._in_flight -= 1
            self._changed.notify()

    def retry(self, tasks: list[Task]) -> None:
        """A chunk was lost with its worker: free its place and queue `tasks` of it again."""
        with self._changed:
            self._in_flight -= 1
            if tasks:
                self._todo.appendleft(tasks)
            self._changed.notify()

    def stop(self) -> None:
        with self._changed:
            self._stopped = True
            self._changed.notify_all()


def chunked(tasks: list[Task], workers: int) -> list[list[Task]]:
    """Chunks of tasks: many per chunk for tiny files (per-task overhead dominates), one or a few
    for big ones, and enough chunks that every worker gets many."""
    per_chunk = max(1, min(MAX_CHUNK_TASKS, len(tasks) // (workers * MIN_CHUNKS_PER_WORKER)))
    chunks: list[list[Task]] = []
    current: list[Task] = []
    size = 0
    for task in tasks:
        current.append(task)
        size += task.item.size if task.part is None else CHUNK_BYTES
        if len(current) >= per_chunk or size >= CHUNK_BYTES:
            chunks.append(current)
            current, size = [], 0
    if current:
        chunks.append(current)
    return chunks


def start_pool(
    ctx: BaseContext,
    workers: int,
    preprocess: str,
    options: Mapping[str, Any],
    source: SourceRoot,
    outbox: SimpleQueue[Any],
    slots: WorkerSlots,
    ring: SampleRing | None,
) -> Pool:
    return QuietPool(
        workers, initializer=init_worker, initargs=(preprocess, options, source, outbox, slots, ring), context=ctx
    )
