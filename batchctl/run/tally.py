"""Counting a build's results and keeping its error budget, the same for either engine: each
finished task counts its file and samples, each skipped file is one error in the report, and
the build fails the moment the errors pass `--max-errors` (`--strict`: the first)."""

from __future__ import annotations

from batchctl.errors import BuildFailed
from batchctl.progress import Progress
from batchctl.records import Rejected, TaskResult
from batchctl.report import BuildReport, FileError


class Tally:
    def __init__(self, report: BuildReport, progress: Progress, max_errors: int | None) -> None:
        self.report, self.progress, self.max_errors = report, progress, max_errors
        self.new_samples = 0  # samples preprocessed by this run (a rejected output's taken back)

    def result(self, result: TaskResult) -> None:
        """A worker finished a task (a file, or a part of a big one)."""
        if result.task.first == 0:
            self.report.processed += 1  # files, not parts: a file's first part counts it
        self.new_samples += result.samples
        if result.error is not None:
            self.error(result.task.item.relpath, result.error, retry=result.transient)

    def rejected(self, event: Rejected) -> None:
        """The collator refused a file's samples (they do not fit the dataset's schema)."""
        self.new_samples -= event.samples
        self.error(event.source, event.error)

    def error(self, relpath: str, reason: str, retry: bool = False) -> None:
        """A file skipped: reported, and counted against the budget. `retry`: the next build
        tries it again (its worker was lost, not the file bad)."""
        self.report.errors.append(FileError(relpath, reason, retry))
        self.progress.error(relpath, reason)
        limit = self.max_errors
        if limit == 0:
            raise BuildFailed(f"{relpath} was skipped ({reason}); --strict (--max-errors 0) allows none", self.report)
        if limit is not None and len(self.report.errors) > limit:
            raise BuildFailed(f"more than {limit} files were skipped with errors (--max-errors {limit})", self.report)
