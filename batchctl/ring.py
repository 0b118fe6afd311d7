"""The sample ring: shared-memory slots that carry samples from the workers to the collator.

Pickling a chunk's arrays through a pipe costs a copy through the kernel on each side (~250 MB/s,
shared/FACTS.md), and py-spy showed the collator's reads as its largest cost. Instead a worker
copies its columns into its own slot of one shared-memory segment and sends only a small
`InRing` through the pipe; the collator copies the rows straight into its shard and frees the slot.

Ring slot k belongs to whichever worker holds `WorkerSlots` slot k, so workers share no lock; a
semaphore per slot says the collator is done with it. A worker that dies may die holding its
slot, so the parent retires the slot of every lost worker (`WorkerSlots.release`): a retired slot
is never written again. A worker without a usable slot, or with output too big for one, sends
through the pipe as before; nothing is lost either way, it is only slower.

The segment is named per run. The parent unlinks it on every way out; multiprocessing's resource
tracker does if the parent alone is killed; the next build of the same OUTPUT does if the whole
process group was (its name is recorded with the build's semaphores).
"""

from __future__ import annotations

import _posixshmem
import contextlib
import os
import secrets
from dataclasses import dataclass
from multiprocessing import shared_memory
from multiprocessing.context import BaseContext
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from batchctl.workers import Task, TaskOutput

SLOT_BYTES = 32 * 2**20  # one chunk's output; only the pages a chunk fills are ever touched
MIN_SLOT_BYTES = 2**20
ALIGN = 64
SHM_DIR = "/dev/shm"
PREFIX = "batchctl-ring-"


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
    outputs: list[tuple[list[tuple[Task, int]], list[ColumnRef]]]


class SampleRing:
    """One shared-memory segment of `count` slots of `slot_bytes` each, attached lazily in each
    process that uses it (the object itself travels to the workers and the collator by pickle)."""

    def __init__(self, ctx: BaseContext, count: int, slot_bytes: int) -> None:
        self.count = count
        self.slot_bytes = slot_bytes
        self.name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        self.free = [ctx.Semaphore(1) for _ in range(count)]
        self._shm: shared_memory.SharedMemory | None = shared_memory.SharedMemory(
            self.name, create=True, size=count * slot_bytes
        )

    @classmethod
    def create(cls, ctx: BaseContext, count: int) -> SampleRing | None:
        """A ring that fits in the free space of /dev/shm (Docker gives it 64 MiB by default, and
        touching a page past a full tmpfs kills the process with SIGBUS), or None: use the pipe."""
        try:
            stat = os.statvfs(SHM_DIR)
        except OSError:
            return None
        fits = stat.f_bavail * stat.f_frsize // 2 // count // MIN_SLOT_BYTES * MIN_SLOT_BYTES
        slot_bytes = min(SLOT_BYTES, fits)
        if slot_bytes < MIN_SLOT_BYTES:
            return None
        return cls(ctx, count, slot_bytes)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_shm": None}

    def _buffer(self) -> memoryview:
        if self._shm is None:
            self._shm = shared_memory.SharedMemory(self.name)
        buf = self._shm.buf
        assert buf is not None
        return buf

    def put(self, slot: int, outputs: list[TaskOutput]) -> InRing | None:
        """Copy `outputs` into `slot` once the collator is done with its last contents; None when
        they do not fit (or hold Python objects): send them through the pipe then."""
        layout: list[tuple[list[tuple[Task, int]], list[ColumnRef]]] = []
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
        self.free[slot].acquire()
        for output, (_, refs) in zip(outputs, layout, strict=True):
            for ref in refs:
                self._view(slot, ref)[...] = output.columns[ref.name]
        return InRing(slot, layout)

    def outputs(self, message: InRing) -> list[TaskOutput]:
        """The outputs of a message, their columns viewing the slot (valid until `release`)."""
        from batchctl.workers import TaskOutput

        return [
            TaskOutput(parts, {ref.name: self._view(message.slot, ref) for ref in refs})
            for parts, refs in message.outputs
        ]

    def release(self, message: InRing) -> None:
        self.free[message.slot].release()

    def _view(self, slot: int, ref: ColumnRef) -> np.ndarray:
        return np.ndarray(ref.shape, np.dtype(ref.dtype), self._buffer(), slot * self.slot_bytes + ref.offset)

    def semaphores(self) -> list[Any]:
        return list(self.free)

    def close(self) -> None:
        """Unmap in this process (a process exiting unmaps anyway); views must be gone."""
        if self._shm is not None:
            with contextlib.suppress(BufferError):
                self._shm.close()

    def unlink(self) -> None:
        """Remove the segment (the parent, which created it, once every child is gone)."""
        if self._shm is not None:
            self.close()
            with contextlib.suppress(FileNotFoundError):
                self._shm.unlink()


def unlink_segment(name: str) -> None:
    """Remove the segment a dead build left (not through `SharedMemory`, whose unlink would ask
    this process's resource tracker to forget a name it never knew)."""
    with contextlib.suppress(FileNotFoundError):
        _posixshmem.shm_unlink(f"/{name}")
