"""The records that travel between the stages of a build: a file found, a task, its output and
its result, rows carried over by an incremental build, the collator's messages to and from the
parent, and one way to say why something failed. Every stage imports
these; this module imports no other part of batchctl (and neither zarr: the parent of a build
never needs it to speak with the collator)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

# WorkItem, Task and TaskResult are made once per file, so they are plain dataclasses, values by
# convention: a frozen one takes 0.5 us to create against 0.15 (its __init__ goes through
# object.__setattr__), which counts for tiny files. Nothing hashes them.


@dataclass
class WorkItem:
    """One input file: its path relative to SOURCE (with `/`), its label and its stat stamp."""

    relpath: str
    label: int
    size: int
    mtime_ns: int
    values: tuple[tuple[str, str, Any], ...] = ()  # its metadata row's fields: (name, dtype, value)


# A metadata field's dtype as it travels in `WorkItem.values`: a NumPy dtype's name; `text:W`, a
# text field of W-byte rows; or `ragged:DTYPE:D1,D2`, a ragged field's rows (DTYPE, trailing dims)
def ragged_dtype(dtype: str, trailing: tuple[int, ...]) -> str:
    return f"ragged:{dtype}:{','.join(map(str, trailing))}"


def parse_ragged_dtype(spelled: str) -> tuple[str, tuple[int, ...]]:
    """`ragged_dtype`'s (dtype, trailing dims) back."""
    _, dtype, trailing = spelled.split(":")
    return dtype, tuple(int(n) for n in trailing.split(",") if n)


# A task as it travels to a worker and, with its rows, on to the collator: (index, relpath,
# label, size, mtime_ns, part, skip, values), the fields of `Task` and its `WorkItem`. A plain tuple pickles
# and unpickles in 0.25 us where the two dataclasses take 2 (measured), and every task makes both
# trips: for tiny files that was ~4 us of a file's overhead.
SentTask = tuple[int, str, int, int, int, "tuple[int, int] | None", int, "tuple[tuple[str, str, Any], ...]"]


@dataclass
class Task:
    """One unit of work: a file (later, a part of one) and what the collator needs to place it."""

    index: int
    item: WorkItem
    part: tuple[int, int] | None = None  # a range of the file's samples, for big files
    skip: int = 0  # samples of this task already written by an interrupted run

    @property
    def first(self) -> int:
        """The file's sample number (`source_index`) of this task's first sample."""
        return self.part[0] if self.part else 0

    def sent(self) -> SentTask:
        item = self.item
        return (self.index, item.relpath, item.label, item.size, item.mtime_ns, self.part, self.skip, item.values)


def sent_start(task: SentTask) -> int:
    """The file's sample number (`source_index`) of the first row sent for `task`."""
    part, skip = task[5], task[6]
    return (part[0] if part else 0) + skip


@dataclass(frozen=True)
class TaskOutput:
    """The samples of one or more tasks, stacked field by field (row i of each column is sample i),
    so the collator copies whole blocks instead of looping over samples or tiny files.
    `parts` lists each task with its number of rows, in row order."""

    parts: list[tuple[SentTask, int]]
    columns: dict[str, np.ndarray]

    @property
    def rows(self) -> int:
        return len(next(iter(self.columns.values())))


@dataclass
class TaskResult:
    """What a worker returns to the parent: how many samples it sent, or why it failed."""

    task: Task
    samples: int
    error: str | None = None
    transient: bool = False  # the error was the worker's fate (killed, timed out), not the file's


def describe_error(exc: BaseException) -> str:
    """A one-line reason: the OS's words for OS errors, else the exception's own message."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


Done = tuple[int, int, str | None]  # (task index, samples sent, error): a TaskResult as it travels
PathKey = tuple[str, int]  # (relpath, first sample of the part): one part of one file


@dataclass(frozen=True)
class CarryRun:
    """Rows of one part of an unchanged file, in a shard being rewritten: rows `start` to
    `start + rows` of old shard `shard`, holding samples `index` onwards of the part that starts
    at sample `first` of the file."""

    shard: int
    start: int
    rows: int
    item: WorkItem
    first: int
    index: int

    @property
    def key(self) -> PathKey:
        return (self.item.relpath, self.first)


# The messages between the collator and the parent.


@dataclass(frozen=True)
class End:
    """Sent by the parent once all results are in; every task output is ahead of it in the pipe."""


@dataclass(frozen=True)
class BatchWritten:
    rows: int


@dataclass(frozen=True)
class JournalLines:
    """Lines the collator appended to the journal (`batchctl.store.journal.Line`s: this module
    imports no other): the parent folds them into what the build made, never reading it back."""

    lines: tuple[Any, ...]


@dataclass(frozen=True)
class Rejected:
    source: str
    error: str
    samples: int


@dataclass(frozen=True)
class Finished:
    samples: int
    shards: int
    shard_batches: int
    schema: dict[str, dict[str, Any]]
    fsync_s: float = 0.0  # the collator's time making its shard files durable (fsync; a URL's PUT of each)
    wait_s: float = 0.0  # the collator's time waiting for its writer threads


@dataclass(frozen=True)
class Stopped:
    """The collator wrote and journaled every sample it had received, then stopped."""

    samples: int


@dataclass(frozen=True)
class Crashed:
    message: str


Event = BatchWritten | JournalLines | Rejected | Finished | Stopped | Crashed


@dataclass(frozen=True)
class Stop:
    """Sent by the parent on the control pipe: write what you have, journal it, exit."""


@dataclass(frozen=True)
class Lost:
    """Sent by the parent on the control pipe: these tasks will send no rows (their worker died
    or was killed past --timeout), so the chunks after them need not wait."""

    tasks: tuple[int, ...]
