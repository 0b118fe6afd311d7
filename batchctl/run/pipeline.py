"""Run the processes of one build: the preprocessing pool, the collator, and their shutdown.

The parent feeds the pool a bounded window of tasks, consumes `imap_unordered` results in
completion order, and watches over the children: a plain Pool waits forever for the task of a
worker the kernel killed, so the parent notices the death, records that file as an error and
goes on (the pool has already replaced the worker); a worker past --timeout is killed the same
way; a dead collator fails the build cleanly.
On SIGINT/SIGTERM, or any failure, `_abort` kills the workers (what they were on is done again
by the next run), has the collator write and journal every sample it received, and drops the rest.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import signal
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from batchctl.errors import PipelineError
from batchctl.preprocess import Preprocessor
from batchctl.progress import Progress
from batchctl.records import (
    BatchWritten,
    Crashed,
    Done,
    End,
    Event,
    Finished,
    JournalLines,
    Lost,
    Rejected,
    Stop,
    Stopped,
    Task,
    TaskResult,
)
from batchctl.run.mpinternals import pool_workers, shut_down_pool
from batchctl.run.processes import (
    REIMPORTED_MAIN_EXIT,
    REIMPORTED_MAIN_TEXT,
    mp_context,
    signals_deferred,
    signals_ignored,
)
from batchctl.run.reorder import WINDOW_BYTES
from batchctl.run.ring import SampleRing
from batchctl.run.signals import check_signalled
from batchctl.run.tally import Tally
from batchctl.run.workers import BoundedFeed, WorkerSlots, chunked, run_chunk, start_pool
from batchctl.run.writeplan import CollatorConfig, Outcome
from batchctl.store.journal import Line, resolve
from batchctl.store.storage import SourceRoot

HEALTH_CHECK_S = 1.0  # how long a blocking wait lasts before the children are checked on
STOP_WAIT_S = 3.0  # how long a stopping collator may take to write its last batch
CHUNKS_PER_WORKER = 3  # chunks in flight per worker: enough to keep it busy, few enough to stay small


def _collator_main(*args: Any) -> None:
    """The collator process's entry: it alone needs the codecs (the fork server preloads them), so
    the parent never imports them to name the target."""
    from batchctl.run.collate import run_collator

    run_collator(*args)


@dataclass
class PipelineConfig:
    preprocessor: Preprocessor
    options: Mapping[str, Any]
    source: SourceRoot
    workers: int
    timeout: float | None
    collator: CollatorConfig


class Pipeline:
    """One run of pool + collator over a list of tasks; the tally counts results and errors."""

    def __init__(self, config: PipelineConfig, progress: Progress, tally: Tally) -> None:
        self.config = config
        self.progress = progress
        self.tally = tally
        self.ctx = mp_context()
        # A SimpleQueue writes in the caller's thread: when a worker's put returns, its samples
        # are in the pipe. (A Queue's feeder thread would still be writing when the worker starts
        # its next file; a worker killed then leaves a torn message and the write lock held.)
        # The pipe bounds it: a put blocks while the collator is behind.
        self.inbox: Any = self.ctx.SimpleQueue()
        self.events: Any = self.ctx.Queue()
        self.control, self.control_end = self.ctx.Pipe(duplex=False)  # the parent's Stop to the collator
        self.collator: Any = None
        self.pool: Any = None
        self.feed: BoundedFeed | None = None
        self.slots = WorkerSlots(self.ctx, 2 * config.workers + 8)
        self.ring = SampleRing.create(self.ctx, self.slots.count)
        self.held = self.ctx.Value("q", 0, lock=False)  # bytes of early chunks the collator holds
        self.pending: dict[int, Task] = {}
        self.chunk_of: dict[int, list[Task]] = {}
        self.position_of: dict[int, int] = {}  # task index -> its chunk's place in the dispatch order
        self.journaled: list[Line] = []  # what the collator journaled, as it says (JournalLines)
        self.seen_workers: dict[int, Any] = {}
        self.timed_out: set[int] = set()
        self.lost_workers = 0
        self.last_check = time.monotonic()
        # when the first chunk could go to a worker, and when the last result came (monotonic)
        self.dispatching: float | None = None
        self.last_result: float | None = None

    def run(self, tasks: list[Task]) -> Outcome:
        """Preprocess `tasks` into the staging dataset; what was made: the collator's `Finished`
        and the journal it continued (the parent reads none of it back)."""
        try:
            finished = self._run(tasks)
        except BaseException:
            self._abort()
            raise
        finally:  # every child is gone by now
            if self.ring is not None:
                self.ring.close()
        kept = self.config.collator.resume.lines()  # what the journal held when the collator started
        return Outcome(finished, resolve([*kept, *self.journaled], self.config.collator.batch_size))

    def _run(self, tasks: list[Task]) -> Finished:
        cfg = self.config  # the fork server runs: the builder started it (`start_forkserver`)
        with signals_deferred():
            self.collator = self.ctx.Process(
                target=_collator_main,
                args=(cfg.collator, self.inbox, self.control, self.events, self.ring, self.held),
                name="batchctl-collator",
            )
            self.collator.start()
        if tasks:
            self.pending = {task.index: task for task in tasks}
            with signals_deferred():
                self.pool = start_pool(
                    self.ctx,
                    cfg.workers,
                    cfg.preprocessor.name,
                    cfg.options,
                    cfg.source,
                    self.inbox,
                    self.slots,
                    self.ring,
                )
            self._remember_workers()
            chunks = chunked(tasks, cfg.workers)
            self.chunk_of = {task.index: chunk for chunk in chunks for task in chunk}
            self.position_of = {task.index: n for n, chunk in enumerate(chunks) for task in chunk}
            held = self.held
            self.feed = BoundedFeed(chunks, CHUNKS_PER_WORKER * cfg.workers, lambda: int(held.value), WINDOW_BYTES)
            results = self.pool.imap_unordered(run_chunk, self.feed)
            self.dispatching = time.monotonic()
            while self.pending:
                chunk_results = self._next_results(results)
                if chunk_results is not None:
                    self.feed.consumed(self.position_of[chunk_results[0][0]])
                    self._chunk_done(chunk_results)
                self._drain_events()
            self.last_result = time.monotonic()
            self.feed.stop()
        self.inbox.put(End())  # after every worker's output: puts are complete when results return
        finished = self._wait_finished()
        if self.pool is not None:
            if self.lost_workers:  # the pool still counts the lost tasks and would wait for them
                shut_down_pool(self.pool)
            else:
                self.pool.close()
            self.pool.join()
        return finished

    def _chunk_done(self, chunk_results: list[Done]) -> None:
        """A chunk's results, less tasks no longer pending (already accounted for as lost)."""
        results = [
            TaskResult(task, samples, error)
            for index, samples, error in chunk_results
            if (task := self.pending.pop(index, None)) is not None
        ]
        self.progress.files_done(len(results))
        for result in results:
            self.tally.result(result)

    def _done(self, result: TaskResult) -> None:
        self.progress.files_done()
        self.tally.result(result)

    def _next_results(self, results: Any) -> list[Done] | None:
        """The results of the next chunk, or None after a lost task was accounted for instead."""
        while True:
            check_signalled()
            if time.monotonic() - self.last_check >= HEALTH_CHECK_S and self._check_children():
                return None
            try:
                chunk_results: list[Done] = results.next(timeout=HEALTH_CHECK_S)
                return chunk_results
            except mp.TimeoutError:
                self._drain_events()

    def _check_children(self) -> bool:
        """Fail on a dead collator; turn a dead or timed-out worker's task into that file's error.
        True when a lost task was accounted for."""
        self.last_check = time.monotonic()
        if not self.collator.is_alive():
            self._drain_events()
            if self.collator.exitcode == REIMPORTED_MAIN_EXIT:
                raise PipelineError(REIMPORTED_MAIN_TEXT)
            raise PipelineError(
                f"the collator process died with {_exit_text(self.collator.exitcode)}; rerun the same command to resume"
            )
        if self.pool is None:
            return False
        timeout = self.config.timeout
        for pid, _index, running_s in self.slots.running():
            if timeout is not None and running_s > timeout and pid not in self.timed_out:
                self.timed_out.add(pid)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        accounted = False
        self._remember_workers()
        for pid in self.slots.vanished():
            self.lost_workers += 1
            task = self.pending.pop(self.slots.release(pid), None)
            proc = self.seen_workers.pop(pid, None)
            code = None if proc is None else proc.exitcode
            if task is None:
                continue
            self._retry_rest_of_chunk(task)
            if pid in self.timed_out:
                reason = f"timed out after {timeout:g} s (--timeout); its worker was killed"
            else:
                reason = f"the worker process preprocessing it died ({_exit_text(code)})"
            self._done(TaskResult(task, 0, reason, transient=True))
            accounted = True
        return accounted

    def _retry_rest_of_chunk(self, lost: Task) -> None:
        """The dead worker's chunk sent nothing: hand its other tasks out again, and tell the
        collator the lost task sends no rows (it places chunks in dispatch order)."""
        assert self.feed is not None
        rest = [task for task in self.chunk_of.pop(lost.index, []) if task.index in self.pending]
        for task in rest:
            self.chunk_of[task.index] = rest
        self.feed.retry(self.position_of[lost.index], rest)
        with contextlib.suppress(OSError):
            self.control_end.send(Lost((lost.index,)))

    def _drain_events(self, block: bool = False) -> Finished | Stopped | None:
        while True:
            try:
                event: Event = self.events.get(block=block, timeout=HEALTH_CHECK_S if block else None)
            except queue.Empty:
                return None
            if isinstance(event, BatchWritten):
                self.progress.batches_written(1, event.rows)
            elif isinstance(event, JournalLines):
                self.journaled.extend(event.lines)
            elif isinstance(event, Rejected):
                self.tally.rejected(event)
            elif isinstance(event, Crashed):
                raise PipelineError(event.message)
            elif isinstance(event, (Finished, Stopped)):
                return event

    def _wait_finished(self) -> Finished:
        while True:
            check_signalled()
            finished = self._drain_events(block=True)
            if finished is None and not self.collator.is_alive():
                finished = self._drain_events(block=True)  # what it sent just before exiting
            if isinstance(finished, Finished):
                self.collator.join()
                return finished
            if not self.collator.is_alive():
                self._check_children()

    def _abort(self) -> None:
        """End every child now: the workers are killed (what they were preprocessing is done
        again by the next run), the collator writes and journals every sample it received, and
        whatever else is queued is dropped."""
        with signals_ignored():
            if self.feed is not None:
                self.feed.stop()
            if self.pool is not None:
                shut_down_pool(self.pool)
            if self.collator is not None and self.collator.is_alive():
                self._stop_collator()
            self.events.cancel_join_thread()
            self.events.close()
            self.inbox.close()

    def _stop_collator(self) -> None:
        """Ask the collator to stop, wait for it a few seconds, then kill it (it ignores SIGTERM)."""
        with contextlib.suppress(OSError):
            self.control_end.send(Stop())
        deadline = time.monotonic() + STOP_WAIT_S
        try:
            # its last events may fail the build too (--max-errors): the first failure is the one
            # raised, and the abort goes on regardless
            with contextlib.suppress(Exception):
                while self.collator.is_alive() and time.monotonic() < deadline:
                    if isinstance(self._drain_events(block=True), Stopped):
                        break
        finally:
            self.collator.join(max(0.0, deadline - time.monotonic()))
            if self.collator.is_alive():
                self.collator.kill()
                self.collator.join(5)

    def _remember_workers(self) -> None:
        """Keep the pool's worker processes, whose exit codes say how a vanished worker died."""
        assert self.pool is not None
        for proc in pool_workers(self.pool):
            self.seen_workers.setdefault(proc.pid, proc)


def _exit_text(code: int | None) -> str:
    if code is None:
        return "killed"
    if code is not None and code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"
