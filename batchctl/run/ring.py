"""The sample ring: shared-memory slots that carry samples from the workers to the collator.

Pickling a chunk's arrays through a pipe costs a copy through the kernel on each side (measured
~230-300 MB/s on Python 3.11), and py-spy showed the collator's reads as its largest cost. Instead
a worker copies its columns into its own slot of one shared-memory segment and sends only a small
`InRing` through the pipe; the collator's copy thread copies the rows straight into their batch
and frees the slot.

Ring slots 2k and 2k+1 belong to whichever worker holds `WorkerSlots` slot k, so workers share
no lock; a semaphore per slot says the collator is done with it. Two, so that a chunk arriving
before its turn (`Placement`) can wait in its slot while its worker fills the other, instead of
being copied out on the collator's main thread to free the worker (a quarter of a near-free
build's chunks came early with 2 workers, and their copies into fresh memory were 13% of that
thread's samples in py-spy). A worker that dies may die holding its slots, so the parent retires
the slots of every lost worker (`WorkerSlots.release`): a retired slot is never written again. A
worker without a usable slot, or with output too big for one, sends through the pipe as before;
nothing is lost either way, it is only slower.

The segment has no name: it is a memfd, handed to each child as it starts, so the kernel frees
it with the last process that maps it, however the build ends. Being outside /dev/shm, it is not
bound by a small /dev/shm either (Docker's is 64 MiB); only the pages a chunk fills are touched.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from dataclasses import dataclass
from multiprocessing.context import BaseContext
from typing import Any

import numpy as np

from batchctl.records import SentTask, TaskOutput
from batchctl.run.mpinternals import dup_fd_for_child

SLOT_BYTES = 32 * 2**20  # one chunk's output; only the pages a chunk fills are ever touched
SLOTS_PER_WORKER = 2  # worker slot k owns ring slots 2k and 2k+1 (`other_free` pairs them so)
ALIGN = 64


@dataclass(frozen=True)
class ColumnRef:
    """Where one column of an output lies in a slot."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int


@dataclass(frozen=True)
class InRing:
    """A worker's message for outputs it put in ring slot `slot`: each output's parts and columns."""

    slot: int
    outputs: list[tuple[list[tuple[SentTask, int]], list[ColumnRef]]]


@dataclass(frozen=True)
class Sent:
    """A worker's message to the collator for one chunk: the indices of all its tasks (rows or
    not: the collator places chunks in dispatch order) and their outputs, in the ring or pickled."""

    tasks: tuple[int, ...]
    body: InRing | list[TaskOutput]


class SampleRing:
    """One anonymous shared-memory segment of two slots of `slot_bytes` for each of `workers`
    worker slots; the object travels to the workers and the collator as they start, each mapping
    the segment lazily."""

    def __init__(self, ctx: BaseContext, workers: int, slot_bytes: int = SLOT_BYTES) -> None:
        self.count = workers * SLOTS_PER_WORKER
        self.slot_bytes = slot_bytes
        self.free = [ctx.Semaphore(1) for _ in range(self.count)]
        self._fd = os.memfd_create("batchctl-ring", os.MFD_CLOEXEC)
        os.ftruncate(self._fd, self.count * slot_bytes)
        self._map: mmap.mmap | None = None
        self._last: dict[int, int] = {}  # a worker slot's ring slot sent in last (in that worker)

    @classmethod
    def create(cls, ctx: BaseContext, workers: int) -> SampleRing | None:
        """A ring, or None where the system has no memfd: the samples go through the pipe then."""
        if not hasattr(os, "memfd_create"):
            return None
        try:
            return cls(ctx, workers)
        except OSError:
            return None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_fd": dup_fd_for_child(self._fd), "_map": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _fd=state["_fd"].detach())

    def _buffer(self) -> mmap.mmap:
        if self._map is None:
            self._map = mmap.mmap(self._fd, self.count * self.slot_bytes)
        return self._map

    def put(self, slot: int, outputs: list[TaskOutput]) -> InRing | None:
        """Copy `outputs` into a ring slot of worker slot `slot` the collator is done with; None
        when they do not fit (or hold Python objects): send them through the pipe then."""
        layout: list[tuple[list[tuple[SentTask, int]], list[ColumnRef]]] = []
        offset = 0
        for output in outputs:
            refs = []
            for name, column in output.columns.items():
                if column.dtype.hasobject:
                    return None
                refs.append(ColumnRef(name, column.dtype.str, column.shape, offset))
                offset += -(-column.nbytes // ALIGN) * ALIGN
            layout.append((output.parts, refs))
        if offset > self.slot_bytes:
            return None
        taken = self._take(slot)
        for output, (_, refs) in zip(outputs, layout, strict=True):
            for ref in refs:
                self._view(taken, ref)[...] = output.columns[ref.name]
        self._last[slot] = taken
        return InRing(taken, layout)

    def _take(self, slot: int) -> int:
        """A ring slot of worker slot `slot` that the collator is done with. The collator keeps
        at most one of the two (an early chunk, kept only while the other is free), and that one
        is older than the one sent last: when neither is free, the one sent last is being placed
        or copied out, and is waited for."""
        pair = (slot * SLOTS_PER_WORKER, slot * SLOTS_PER_WORKER + 1)
        for ring_slot in pair:
            if self.free[ring_slot].acquire(block=False):
                return ring_slot
        last = self._last.get(slot, pair[0])
        self.free[last].acquire()
        return last

    def other_free(self, ring_slot: int) -> bool:
        """Whether the other ring slot of `ring_slot`'s worker is free: while it is, a chunk kept
        in this one does not hold its worker up."""
        return bool(self.free[ring_slot ^ 1].get_value())

    def outputs(self, message: InRing) -> list[TaskOutput]:
        """The outputs of a message, their columns viewing the slot (valid until `release`)."""
        return [
            TaskOutput(parts, {ref.name: self._view(message.slot, ref) for ref in refs})
            for parts, refs in message.outputs
        ]

    def release(self, message: InRing) -> None:
        self.free[message.slot].release()

    def _view(self, slot: int, ref: ColumnRef) -> np.ndarray:
        return np.ndarray(ref.shape, np.dtype(ref.dtype), self._buffer(), slot * self.slot_bytes + ref.offset)

    def close(self) -> None:
        """Unmap and close in this process (a process exiting does both anyway); views must be gone."""
        if self._map is not None:
            with contextlib.suppress(BufferError):
                self._map.close()
                self._map = None
        if self._map is None and self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
