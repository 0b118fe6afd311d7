"""Progress display: tqdm bars on a terminal, a short log line every few seconds otherwise.

The library reports progress through this small interface and never prints by itself; the CLI
hands `build()` a `ConsoleProgress`.
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from tqdm import tqdm

# tqdm is imported only to draw bars on a terminal: its import (~20 ms, most of it reading package
# metadata) is not worth paying under cron, systemd or a pipe, nor with --quiet.

LOG_INTERVAL_S = 5.0
SAME_REASON_LISTED = 3  # files named per skip reason before the rest are counted


class Progress:
    """Silent progress: the default for code that calls `build()`."""

    def start(self, tasks: int, batches_done: int, split: bool = False, carried: int = 0) -> None:
        """`tasks` files to preprocess (parts of files when `split`), `batches_done` kept from before,
        `carried` rows an incremental build reads from the last build and writes again."""

    def files_done(self, count: int = 1) -> None: ...

    def batches_written(self, batches: int, rows: int = 0) -> None: ...

    def error(self, source: str, reason: str) -> None: ...

    def info(self, text: str) -> None: ...

    def close(self) -> None: ...


class ConsoleProgress(Progress):
    def __init__(self, quiet: bool = False, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self.quiet = quiet
        self.bars = not quiet and self.stream.isatty()
        self.files: tqdm | None = None
        self.batches: tqdm | None = None
        self.total = self.done = self.batch_count = 0
        self.rows_expected = self.rows_written = 0  # rows this run writes: carried, and at least one a file
        self.unit = "file"
        self.started = self.last_log = time.monotonic()
        self.reasons: dict[str, list[Any]] = {}  # reason -> [files skipped for it, the first]

    def start(self, tasks: int, batches_done: int, split: bool = False, carried: int = 0) -> None:
        self.total, self.batch_count, self.unit = tasks, batches_done, "part" if split else "file"
        self.rows_expected = carried + tasks if carried else 0  # only an incremental build carries rows
        self.started = self.last_log = time.monotonic()
        if self.bars:
            from tqdm import tqdm

            self.files = tqdm(total=tasks, desc="preprocess", unit=self.unit, file=self.stream, dynamic_ncols=True)
            if self.rows_expected:  # carrying is most of an incremental build's work: counted in rows
                self.batches = tqdm(
                    total=self.rows_expected, desc="write", unit="row", file=self.stream, dynamic_ncols=True
                )
            else:
                self.batches = tqdm(
                    initial=batches_done, desc="write", unit="batch", file=self.stream, dynamic_ncols=True
                )

    def files_done(self, count: int = 1) -> None:
        self.done += count
        if self.files is not None:
            self.files.update(count)
        else:
            self._maybe_log()

    def batches_written(self, batches: int, rows: int = 0) -> None:
        self.batch_count += batches
        self.rows_written += rows
        if self.batches is not None:
            self.batches.update(rows if self.rows_expected else batches)
        elif self.rows_expected:
            self._maybe_log()

    def _maybe_log(self) -> None:
        now = time.monotonic()
        if self.quiet or now - self.last_log < LOG_INTERVAL_S:
            return
        self.last_log = now
        elapsed = max(now - self.started, 1e-9)
        rate = self.done / elapsed
        eta = (self.total - self.done) / rate if rate else 0.0 if self.done >= self.total else float("inf")
        written = f"{self.batch_count} batches written"
        if self.rows_expected:  # the carried rows too: the slower of the two says when it ends
            row_rate = self.rows_written / elapsed
            left = max(self.rows_expected - self.rows_written, 0)
            eta = max(eta, left / row_rate if row_rate else float("inf"))
            written = f"{self.rows_written}/{self.rows_expected} rows written ({row_rate:.0f}/s)"
        self._write(f"batchctl: {self.done}/{self.total} {self.unit}s ({rate:.1f}/s), {written}, ETA {eta:.0f} s")

    def error(self, source: str, reason: str) -> None:
        """One line per skipped file, but a reason shared by many files (a plugin's bug, a wrong
        --option) is listed for its first few and then counted, in one line at the end."""
        tally = self.reasons.setdefault(reason, [0, source])
        tally[0] += 1
        if tally[0] <= SAME_REASON_LISTED:
            self._write(f"skipped {source}: {reason}")
        elif tally[0] == SAME_REASON_LISTED + 1:
            self._write(f"skipping more files for the same reason; counted at the end ({reason})")

    def _reason_counts(self) -> None:
        for reason, (count, first) in self.reasons.items():
            if count > SAME_REASON_LISTED:
                self._write(f"skipped {count} files: {reason} (the first {first}); --report FILE lists them all")
        self.reasons.clear()

    def info(self, text: str) -> None:
        if not self.quiet:
            self._write(text)

    def _write(self, text: str) -> None:
        if self.files is not None:
            self.files.write(text, file=self.stream)
        else:
            print(text, file=self.stream, flush=True)

    def close(self) -> None:
        for bar in (self.files, self.batches):
            if bar is not None:
                bar.close()
        self.files = self.batches = None
        self._reason_counts()
