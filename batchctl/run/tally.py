"""Counting a build's results and keeping its error budget, the same for either engine: each
finished task counts its file and samples, each skipped file is one error in the report, and
the build fails the moment the errors pass `--max-errors` (`--strict`: the first). Without a
budget, a build that skipped more than half of its files fails before it publishes
(`check_mostly_skipped`): a dataset of the few files left is not what anyone asked for, and one
reason is usually to blame."""

from __future__ import annotations

import re
from collections import Counter

from batchctl.errors import BuildFailed
from batchctl.progress import Progress
from batchctl.records import Rejected, TaskResult
from batchctl.report import BuildReport, FileError
from batchctl.store import storage

MOSTLY_SKIPPED = 0.5  # of the build's files: more skipped fails a build given no --max-errors


class Tally:
    def __init__(self, report: BuildReport, progress: Progress, max_errors: int | None) -> None:
        self.report, self.progress, self.max_errors = report, progress, max_errors
        self.new_samples = 0  # samples preprocessed by this run (a rejected output's taken back)
        self.files = 0  # the build's files, all of them (set once they are found)

    def result(self, result: TaskResult) -> None:
        """A worker finished a task (a file, or a part of a big one)."""
        if result.task.first == 0:
            self.report.processed += 1  # files, not parts: a file's first part counts it
        self.new_samples += result.samples
        if result.error is not None:  # (a URL's failed fetch is tried again by the next run, as a lost worker's file)
            relpath = result.task.item.relpath
            self.error(relpath, result.error, retry=result.transient or storage.is_url(relpath))

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

    def check_mostly_skipped(self) -> None:
        """Fail a build given no --max-errors that skipped more than half of its files, naming
        how many and the commonest reason (numbers aside: shapes differ from file to file)."""
        errors = self.report.errors
        if self.max_errors is not None or len(errors) <= self.files * MOSTLY_SKIPPED:
            return
        kinds = Counter(re.sub(r"\d+", "N", error.error) for error in errors)
        kind, count = kinds.most_common(1)[0]
        example = next(error for error in errors if re.sub(r"\d+", "N", error.error) == kind)
        raise BuildFailed(
            f"most files were skipped ({len(errors)} of {self.files}), {count} of them for one reason, as "
            f"{example.source}: {example.error}; pass --max-errors N to publish the rest anyway "
            "(outputs that vary in length: pad them, docs/preprocessors.md)",
            self.report,
        )
