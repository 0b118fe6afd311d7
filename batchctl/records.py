"""The records that travel between the stages of a build: a file found, a task, its output and
its result, and one way to say why something failed. Every stage imports these; this module
imports no other part of batchctl."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class WorkItem:
    """One input file: its path relative to SOURCE (with `/`), its label and its stat stamp."""

    relpath: str
    label: int
    size: int
    mtime_ns: int


@dataclass(frozen=True)
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


@dataclass(frozen=True)
class TaskOutput:
    """The samples of one or more tasks, stacked field by field (row i of each column is sample i),
    so the collator copies whole blocks instead of looping over samples or tiny files.
    `parts` lists each task with its number of rows, in row order."""

    parts: list[tuple[Task, int]]
    columns: dict[str, np.ndarray]

    @property
    def rows(self) -> int:
        return len(next(iter(self.columns.values())))


@dataclass(frozen=True)
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
