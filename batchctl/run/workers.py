"""Preprocessing workers: the pool, bounded dispatch, and the task that runs in each worker.

Workers hand their samples straight to the collator, one message per chunk of tasks: through
their slot of the shared-memory ring (`batchctl.run.ring`) with a small message on the
collator's queue, or pickled through that queue when the ring cannot take them. To the parent a
chunk of tasks returns only `Done` tuples (task, samples sent, error), so sample arrays never
pass through the parent, and a slow collator slows the workers down instead of filling memory (a
worker waits for its slot to be free). No exception crosses the pool: a failing file becomes a
`Done` with its error text.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from multiprocessing.context import BaseContext
from multiprocessing.pool import Pool
from multiprocessing.queues import SimpleQueue
from typing import Any

import numpy as np

from batchctl.preprocess import resolve
from batchctl.records import Done, SentTask, Task, TaskOutput
from batchctl.run.mpinternals import QuietPool
from batchctl.run.processes import alive, init_child
from batchctl.run.ring import SampleRing, Sent
from batchctl.run.rows import preprocess_file
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
HELD_POLL_S = 0.02  # how often a feed held back by the reorder window looks again

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


def run_chunk(tasks: list[SentTask]) -> list[Done]:
    """Preprocess a chunk of tasks and send their outputs to the collator in one message; to the
    parent, each task's `Done` (its Task stays with the parent: a tuple pickles in a fraction of
    the time, which counts for tiny files).

    The slot names the task being worked on until the message is sent, so a worker killed at any
    point is charged to one file; the parent hands the rest of the chunk out again.
    """
    slots: WorkerSlots = _worker["slots"]
    slot: int = _worker["slot"]
    preprocessor, options, source = _worker["preprocessor"], _worker["options"], _worker["source"]
    done: list[Done] = []
    outputs = OutputRuns()
    try:
        for task in tasks:
            slots.begin(slot, task[0])
            columns = preprocess_file(task, preprocessor, options, source)
            if isinstance(columns, str):
                done.append((task[0], 0, columns))
            else:
                done.append((task[0], outputs.add(task, columns), None))
        _send(tuple(task[0] for task in tasks), outputs.merged())  # rows or not: the collator places the chunk
    finally:
        slots.end(slot)
    return done


def _send(tasks: tuple[int, ...], outputs: list[TaskOutput]) -> None:
    """Through this worker's ring slot where it can, else pickled through the pipe."""
    ring: SampleRing | None = _worker["ring"]
    slot = _worker["slot"]
    message = None
    if outputs and ring is not None and _worker["slots"].ring_usable(slot):
        message = ring.put(slot, outputs)
    _worker["outbox"].put(Sent(tasks, outputs if message is None else message))


class OutputRuns:
    """A chunk's outputs gathered into runs of files whose fields have the same row shapes and
    dtypes, each run sent as one `TaskOutput` (one block per field for the collator to copy)."""

    def __init__(self) -> None:
        self.runs: list[tuple[list[tuple[SentTask, int]], list[dict[str, np.ndarray]]]] = []
        self._spec: list[tuple[str, tuple[tuple[int, ...], np.dtype[Any], bool]]] = []

    def add(self, task: SentTask, columns: dict[str, np.ndarray]) -> int:
        """Add one task's columns; its number of rows (none: nothing of it is left to send)."""
        rows = len(next(iter(columns.values())))
        if rows == 0:  # an interrupted run already wrote all of it
            return 0
        spec = [(name, _row_spec(column)) for name, column in columns.items()]
        if not self.runs or spec != self._spec:
            self.runs.append(([], []))
            self._spec = spec
        parts, pieces = self.runs[-1]
        parts.append((task, rows))
        pieces.append(columns)
        return rows

    def merged(self) -> list[TaskOutput]:
        return [
            TaskOutput(parts, pieces[0] if len(pieces) == 1 else _concatenated(pieces)) for parts, pieces in self.runs
        ]


def _row_spec(column: np.ndarray) -> tuple[tuple[int, ...], np.dtype[Any], bool]:
    """What a file's rows of a field must share with the others of a run: their shape and dtype,
    or a ragged field's (its column holds arrays of rows, which agree within one file) all but
    the first dimension, so that a file of (n, 2) rows beside (n,) ones is checked on its own."""
    if column.dtype == object:
        return column[0].shape[1:], column[0].dtype, True
    return column.shape[1:], column.dtype, False


def _concatenated(pieces: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {name: np.concatenate([piece[name] for piece in pieces]) for name in pieces[0]}


class BoundedFeed:
    """Feeds a pool chunks of tasks, at most `window` chunks ahead of the results consumed, and
    nothing new while the collator holds `reorder_bytes` or more of early chunks (`held()`).

    `Pool.imap_unordered` pulls its input eagerly; this iterator blocks the pool's feeder thread
    on a condition until a result is consumed, so memory stays flat. The oldest chunk not yet
    finished (the one the collator waits for) is always handed out: a chunk lost with its worker
    and queued again (`retry`) goes first. It ends only on `stop()`.
    """

    def __init__(
        self, chunks: list[list[Task]], window: int, held: Callable[[], int] = lambda: 0, reorder_bytes: int = 0
    ) -> None:
        self._todo = deque(enumerate(chunks))
        self._window = window
        self._held, self._reorder_bytes = held, reorder_bytes
        self._in_flight = 0
        self._unfinished = set(range(len(chunks)))
        self._stopped = False
        self._changed = threading.Condition()

    def __iter__(self) -> Iterator[list[SentTask]]:
        while True:
            with self._changed:
                while not (self._stopped or self._may_dispatch()):
                    # held back by the collator's holdings, which change in another process: look again soon
                    self._changed.wait(HELD_POLL_S if self._held_back() else None)
                if self._stopped:
                    return
                _, chunk = self._todo.popleft()
                self._in_flight += 1
            yield [task.sent() for task in chunk]

    def _may_dispatch(self) -> bool:
        if not self._todo or self._in_flight >= self._window:
            return False
        if not self._reorder_bytes or self._todo[0][0] <= min(self._unfinished, default=0):
            return True
        return self._held() < self._reorder_bytes

    def _held_back(self) -> bool:
        return bool(self._todo) and self._in_flight < self._window

    def consumed(self, position: int) -> None:
        """The results of the chunk at `position` (in the dispatch order) are in."""
        with self._changed:
            self._in_flight -= 1
            self._unfinished.discard(position)
            self._changed.notify()

    def retry(self, position: int, tasks: list[Task]) -> None:
        """The chunk at `position` was lost with its worker: free its place and queue `tasks` of it
        again, first."""
        with self._changed:
            self._in_flight -= 1
            if tasks:
                self._todo.appendleft((position, tasks))
            else:
                self._unfinished.discard(position)
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
