"""Placing rows in dispatch order: the collator's reorder window.

Workers finish chunks in any order (`imap_unordered`), but a dataset's rows must not depend on
which worker was quicker: each chunk's rows are placed where the chunk stands in the dispatch
order (the seeded shuffle of the files, or path order). A chunk that arrives early is held until
every task before it is placed; a task lost with its worker is settled without rows by the
parent (`Lost`). The bytes held are bounded by the parent: it dispatches nothing new while the
window is full (`batchctl.run.workers.BoundedFeed`), so a slow file stalls placement, then the
workers, never memory.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Generic, TypeVar

T = TypeVar("T")

WINDOW_BYTES = 128 * 2**20  # early arrivals the collator holds, at most (plus the chunks already in flight)


class Reorder(Generic[T]):
    """Task indices 0, 1, 2, ... placed in order. A message covers the tasks of one chunk (sorted;
    a chunk handed out again after its worker died lacks the lost task)."""

    def __init__(self) -> None:
        self.next = 0  # the first task not yet placed
        self.bytes = 0  # held
        self._held: dict[int, tuple[Sequence[int], T, int]] = {}  # first task -> (tasks, body, bytes)
        self._lost: set[int] = set()

    def stale(self, tasks: Sequence[int]) -> bool:
        """Already placed or already held: a second copy of a chunk (its worker died after sending)."""
        return tasks[0] < self.next or tasks[0] in self._held

    def due(self, tasks: Sequence[int]) -> bool:
        """Everything before these tasks is placed: place them now."""
        self._skip_lost()
        return tasks[0] == self.next

    def placed(self, tasks: Sequence[int]) -> None:
        self.next = max(self.next, tasks[-1] + 1)
        self._lost = {task for task in self._lost if task >= self.next}
        self._skip_lost()

    def hold(self, tasks: Sequence[int], body: T, nbytes: int) -> None:
        self._held[tasks[0]] = (tasks, body, nbytes)
        self.bytes += nbytes

    def lost(self, tasks: Iterable[int]) -> None:
        """Tasks that will never send rows (their worker died, or ran past --timeout)."""
        self._lost.update(task for task in tasks if task >= self.next)
        self._skip_lost()

    def take_due(self) -> tuple[Sequence[int], T] | None:
        """The held chunk that is due now, if any (`placed` once it is)."""
        self._skip_lost()
        entry = self._held.pop(self.next, None)
        if entry is None:
            return None
        tasks, body, nbytes = entry
        self.bytes -= nbytes
        return tasks, body

    def take_all(self) -> list[tuple[Sequence[int], T]]:
        """Whatever is still held, in order (at the end every task has arrived: nothing is)."""
        entries = [self._held.pop(first) for first in sorted(self._held)]
        self.bytes = 0
        return [(tasks, body) for tasks, body, _ in entries]

    def _skip_lost(self) -> None:
        while self.next in self._lost:
            self._lost.discard(self.next)
            self.next += 1
