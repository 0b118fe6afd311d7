"""Run the processes of one build: the preprocessing pool, the collator, and their shutdown.

The parent feeds the pool a bounded window of tasks, consumes `imap_unordered` results in
completion order, and watches over the children: a worker killed by the kernel or a dead
collator fails the build cleanly instead of hanging (a plain Pool waits forever for a lost task).
On SIGINT/SIGTERM, or any failure, `_abort` terminates every child and drops queued data.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import signal
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchctl.collate import CollatorConfig, Crashed, End, Event, Finished, Rejected, ShardWritten, run_collator
from batchctl.preprocess import Preprocessor
from batchctl.progress import Progress
from batchctl.workers import BoundedFeed, Task, TaskResult, dead_workers, mp_context, run_task, start_pool

HEALTH_CHECK_S = 1.0  # how long a blocking wait lasts before the children are checked on
TASKS_PER_WORKER = 4  # tasks in flight per worker: enough to keep it busy, few enough to stay small
QUEUE_PER_WORKER = 2  # task outputs waiting for the collator, per worker


class Signalled(BaseException):
    """Raised in the main thread by SIGINT/SIGTERM; a BaseException so no `except Exception` eats it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class PipelineError(Exception):
    """A fatal problem: a child died, the collator failed, too many errors."""


@contextmanager
def signals_raise() -> Iterator[None]:
    """Turn SIGINT and SIGTERM into `Signalled` for the duration (main thread only)."""

    def handler(signum: int, frame: object) -> None:
        raise Signalled(signum)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


@dataclass
class PipelineConfig:
    preprocessor: Preprocessor
    options: Mapping[str, Any]
    source: Path
    workers: int
    collator: CollatorConfig


class Pipeline:
    """One run of pool + collator over a list of tasks; callbacks receive results and events."""

    def __init__(
        self,
        config: PipelineConfig,
        progress: Progress,
        on_result: Callable[[TaskResult], None],
        on_rejected: Callable[[Rejected], None],
    ) -> None:
        self.config = config
        self.progress = progress
        self.on_result = on_result
        self.on_rejected = on_rejected
        self.ctx = mp_context()
        self.inbox: Any = self.ctx.Queue(maxsize=QUEUE_PER_WORKER * config.workers)
        self.events: Any = self.ctx.Queue()
        self.collator: Any = None
        self.pool: Any = None
        self.feed: BoundedFeed | None = None
        self.seen_workers: dict[int, Any] = {}

    def run(self, tasks: list[Task]) -> Finished:
        try:
            return self._run(tasks)
        except BaseException:
            self._abort()
            raise

    def _run(self, tasks: list[Task]) -> Finished:
        cfg = self.config
        self.collator = self.ctx.Process(
            target=run_collator, args=(cfg.collator, self.inbox, self.events), name="batchctl-collator"
        )
        self.collator.start()
        outputs = 0
        if tasks:
            self.pool = start_pool(self.ctx, cfg.workers, cfg.preprocessor.name, cfg.options, cfg.source, self.inbox)
            self.feed = BoundedFeed(tasks, TASKS_PER_WORKER * cfg.workers)
            results = self.pool.imap_unordered(run_task, self.feed)
            for _ in range(len(tasks)):
                result = self._next_result(results)
                self.feed.consumed()
                outputs += result.samples > 0
                self.progress.file_done()
                self.on_result(result)
                self._drain_events()
            self.pool.close()
            self.pool.join()
        self.inbox.put(End(outputs))
        return self._wait_finished()

    def _next_result(self, results: Any) -> TaskResult:
        while True:
            try:
                result: TaskResult = results.next(timeout=HEALTH_CHECK_S)
                return result
            except mp.TimeoutError:
                self._drain_events()
                self._check_children()

    def _check_children(self) -> None:
        if self.pool is not None:
            dead = dead_workers(self.pool, self.seen_workers)
            if dead:
                pid, code = dead[0]
                raise PipelineError(
                    f"a preprocessing worker (pid {pid}) died with {_exit_text(code)}, losing the file it "
                    "was working on; rerun the same command to resume"
                )
        if not self.collator.is_alive():
            self._drain_events()
            raise PipelineError(
                f"the collator process died with {_exit_text(self.collator.exitcode)}; rerun the same command to resume"
            )

    def _drain_events(self, block: bool = False) -> Finished | None:
        while True:
            try:
                event: Event = self.events.get(block=block, timeout=HEALTH_CHECK_S if block else None)
            except queue.Empty:
                return None
            if isinstance(event, ShardWritten):
                batch = self.config.collator.batch_size
                self.progress.batches_written(-(-event.rows // batch))
            elif isinstance(event, Rejected):
                self.on_rejected(event)
            elif isinstance(event, Crashed):
                raise PipelineError(event.message)
            elif isinstance(event, Finished):
                return event

    def _wait_finished(self) -> Finished:
        while True:
            finished = self._drain_events(block=True)
            if finished is None and not self.collator.is_alive():
                finished = self._drain_events(block=True)  # what it sent just before exiting
            if finished is not None:
                self.collator.join()
                return finished
            self._check_children()

    def _abort(self) -> None:
        """End every child now; queued data is dropped (what was journaled stays for resume)."""
        previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            if self.feed is not None:
                self.feed.stop()
            if self.pool is not None:
                self.pool.terminate()
            if self.collator is not None and self.collator.is_alive():
                self.collator.terminate()
                self.collator.join(5)
                if self.collator.is_alive():
                    self.collator.kill()
                    self.collator.join()
            for q in (self.inbox, self.events):
                q.cancel_join_thread()
                q.close()
            if self.pool is not None:
                self.pool.join()
        finally:
            for sig, old in previous.items():
                signal.signal(sig, old)


def _exit_text(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"
